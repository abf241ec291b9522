"""The flush after a transactional test: what it empties, and a lost deadlock tried again.

Django's flush (``TransactionTestCase._fixture_teardown``) truncates every table of every
model, then runs ``post_migrate``, which writes the content types and permissions back: about
140 ms on an idle machine and several times that on a loaded one, after each of the suite's
~900 transactional tests. On PostgreSQL ``flush_written_tables`` leaves the database as that
flush does in one statement: every table of a model is locked as ``TRUNCATE`` would lock it,
the ones that hold rows are emptied (deleted from, or truncated with ``CASCADE`` when they
hold many: ``_empty_tables_sql``), and the content types and permissions, which
``post_migrate`` would write back as they were, are kept. When a test changed those (their
row counts differ from the ones the session started with), Django's whole flush runs
instead. SQLite keeps Django's flush (tens of ms).

``flush_retrying_deadlocks`` wraps either: a server a test started (the session's uvicorn for
the SDK tests) can still be finishing a statement its client abandoned, such as a long-poll's
read, when the flush begins: its transaction holds one table and asks for another that the
flush already holds while the flush waits for the first, and PostgreSQL aborts the flush.
The late transaction then ends, and the flush tried again empties the tables it wrote too.
"""

import functools

from django.core.management.base import CommandError
from django.db import DatabaseError, connections

# How many times a transactional test's teardown flush is tried when it loses a deadlock.
FLUSH_TRIES = 5
# Written by post_migrate from the migrations alone: kept by the flush unless a test changed them.
STATIC_TABLES = ("django_content_type", "auth_permission")
# A table holding this many rows is truncated by the flush; one holding fewer, deleted from.
TRUNCATE_FROM_ROWS = 1000


def lost_a_deadlock(error: BaseException | None) -> bool:
    """Whether ``error``, or an error it was raised from, is PostgreSQL's ``deadlock detected`` (40P01)."""
    while error is not None:
        if getattr(error, "sqlstate", None) == "40P01":
            return True
        error = error.__cause__ or error.__context__
    return False


def flush_retrying_deadlocks(teardown):
    """Wrap a teardown flush (``TransactionTestCase._fixture_teardown``) to retry a lost deadlock."""

    @functools.wraps(teardown)
    def retrying(self):
        for attempt in range(1, FLUSH_TRIES + 1):
            try:
                return teardown(self)
            except (CommandError, DatabaseError) as error:
                if attempt == FLUSH_TRIES or not lost_a_deadlock(error):
                    raise

    return retrying


def _static_counts(cursor) -> tuple[int, ...]:
    cursor.execute("SELECT " + ", ".join(f'(SELECT count(*) FROM "{table}")' for table in STATIC_TABLES))
    return tuple(cursor.fetchone())


@functools.cache
def _empty_tables_sql(tables: tuple[str, ...], truncate_from_rows: int) -> str:
    """One statement: lock ``tables`` as TRUNCATE does, truncate the big ones, delete from the rest.

    TRUNCATE gives each table and index a new file (and unlinks the old at commit): ~0.5 s
    for a test's few written tables on a loaded machine, ~25 ms as DELETEs. A table holding
    ``truncate_from_rows`` rows or more is truncated all the same, so that no dead rows
    pile up behind a test that wrote many; the truncates go first, before any DELETE has
    queued a foreign-key check (TRUNCATE refuses a table with pending trigger events), and
    the deleted rows' foreign keys (Django's are deferrable) are checked at the end.
    """
    names = ", ".join(f'"{table}"' for table in tables)
    array = ", ".join(f"'{table}'" for table in tables)
    return f"""
DO $flush$
DECLARE
    name text;
    big text[] := '{{}}';
    small text[] := '{{}}';
    rows bigint;
BEGIN
    LOCK TABLE {names} IN ACCESS EXCLUSIVE MODE;
    FOREACH name IN ARRAY ARRAY[{array}] LOOP
        EXECUTE format('SELECT count(*) FROM (SELECT FROM %I LIMIT {truncate_from_rows}) s', name) INTO rows;
        IF rows >= {truncate_from_rows} THEN
            big := big || name;
        ELSIF rows > 0 THEN
            small := small || name;
        END IF;
    END LOOP;
    IF cardinality(big) > 0 THEN
        EXECUTE 'TRUNCATE ' || (SELECT string_agg(format('%I', b), ', ') FROM unnest(big) b) || ' CASCADE';
    END IF;
    SET CONSTRAINTS ALL DEFERRED;
    FOREACH name IN ARRAY small LOOP
        EXECUTE format('DELETE FROM %I', name);
    END LOOP;
END
$flush$"""


class WrittenTablesFlush:
    """Empty what a test wrote on PostgreSQL as Django's flush would, without rewriting what it would write back."""

    def __init__(self) -> None:
        self._static: dict[str, tuple[int, ...]] = {}

    def remember(self, alias: str) -> None:
        """Record the content types and permissions the migrated database starts with (PostgreSQL only)."""
        if connections[alias].vendor != "postgresql":  # Django's own flush runs there (see __call__)
            return
        with connections[alias].cursor() as cursor:
            self._static[alias] = _static_counts(cursor)

    def __call__(self, alias: str) -> bool:
        """Flush the database ``alias``; return False (nothing done) where Django's flush must run."""
        connection = connections[alias]
        if connection.vendor != "postgresql" or alias not in self._static:
            return False
        with connection.cursor() as cursor:
            if _static_counts(cursor) != self._static[alias]:
                return False
            tables = connection.introspection.django_table_names(only_existing=True, include_views=False)
            kept = [table for table in tables if table not in STATIC_TABLES]
            cursor.execute(_empty_tables_sql(tuple(sorted(kept)), TRUNCATE_FROM_ROWS))
        return True


flush_written_tables = WrittenTablesFlush()


def written_tables_first(teardown):
    """Wrap ``TransactionTestCase._fixture_teardown``: ``flush_written_tables`` where it can, else ``teardown``.

    Django's flush still runs for a test that limits the apps (``available_apps``) or restores
    serialized data (``serialized_rollback``), as its teardown then differs.
    """

    @functools.wraps(teardown)
    def flush(self):
        if self.available_apps is not None or self.serialized_rollback:
            return teardown(self)
        if not all([flush_written_tables(alias) for alias in self._databases_names(include_mirrors=False)]):
            return teardown(self)
        return None

    return flush
