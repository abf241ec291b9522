"""The flush after a transactional test: it empties what Django's flush empties, and survives a deadlock.

``tests/conftest.py`` replaces Django's teardown flush on PostgreSQL by one that empties only
the tables a test wrote (``tests/flush.py``, ``flush_written_tables``: deleting few rows,
truncating many), which must leave the database as Django's does, and wraps both
(``flush_retrying_deadlocks``): a flush that PostgreSQL aborts as a deadlock's victim is
tried again, and any other error propagates at once.
"""

import re
import threading

import psycopg
import pytest
from django.contrib.auth.models import Permission
from django.contrib.contenttypes.models import ContentType
from django.core.management import call_command
from django.core.management.base import CommandError
from django.core.management.color import no_style
from django.core.management.sql import sql_flush
from django.db import OperationalError, connection

from coordination.models import Project
from tests import flush
from tests.flush import FLUSH_TRIES, STATIC_TABLES, flush_retrying_deadlocks, flush_written_tables, lost_a_deadlock
from tests.workers.live import test_database_url as database_url

# The flush's backend checks for a deadlock this long after it starts to wait; the other
# session, which closes the circle, only checks after a minute, so the flush is the victim
# as long as the circle closes within this (the other session closes it as soon as it sees
# the flush wait).
FLUSH_DEADLOCK_TIMEOUT = "5s"


def deadlock_error() -> CommandError:
    """A CommandError raised from PostgreSQL's deadlock, as ``manage.py flush`` raises it."""
    try:
        try:
            raise psycopg.errors.DeadlockDetected("deadlock detected")
        except psycopg.Error as cause:
            raise OperationalError("deadlock detected") from cause
    except OperationalError as wrapped:
        try:
            raise CommandError("Database test_postgres couldn't be flushed.") from wrapped
        except CommandError as error:
            return error


def test_a_flush_that_lost_a_deadlock_is_tried_again_and_other_errors_are_not():
    calls = []

    def flaky(_self):
        calls.append("flush")
        if len(calls) < 3:
            raise deadlock_error()
        return "flushed"

    assert flush_retrying_deadlocks(flaky)(None) == "flushed"
    assert calls == ["flush"] * 3

    def always_deadlocked(_self):
        calls.append("again")
        raise deadlock_error()

    calls.clear()
    with pytest.raises(CommandError):
        flush_retrying_deadlocks(always_deadlocked)(None)
    assert calls == ["again"] * FLUSH_TRIES

    def broken(_self):
        calls.append("broken")
        raise CommandError("Database test_postgres couldn't be flushed.") from OperationalError("disk full")

    calls.clear()
    with pytest.raises(CommandError):
        flush_retrying_deadlocks(broken)(None)
    assert calls == ["broken"]
    assert lost_a_deadlock(deadlock_error()) and not lost_a_deadlock(CommandError("other"))


def truncate_order() -> list[str]:
    (statement,) = sql_flush(no_style(), connection, allow_cascade=False)
    return re.findall(r'"([^"]+)"', statement.split(";")[0])


def waits_on_a_lock(monitor: psycopg.Connection, pid: int) -> bool:
    row = monitor.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone()
    return row is not None and row[0] == "Lock"


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
def test_a_flush_caught_in_a_deadlock_by_a_late_transaction_is_its_victim_and_succeeds_when_tried_again():
    Project.objects.create(name="left-behind")
    tables = truncate_order()
    first, last = tables[0], tables[-1]
    with connection.cursor() as cursor:
        cursor.execute(f"SET deadlock_timeout = '{FLUSH_DEADLOCK_TIMEOUT}'")
    flush_pid = connection.connection.info.backend_pid
    late_error: list[BaseException] = []
    holding = threading.Event()

    def late_transaction() -> None:
        """Hold the flush's last table, wait for the flush to wait on it, then ask for its first."""
        try:
            with psycopg.connect(database_url()) as late, psycopg.connect(database_url()) as monitor:
                monitor.autocommit = True
                late.execute("SET deadlock_timeout = '60s'")
                late.execute(f'LOCK TABLE "{last}" IN ROW SHARE MODE')
                holding.set()
                while not waits_on_a_lock(monitor, flush_pid):
                    monitor.execute("SELECT pg_sleep(0.01)")
                late.execute(f'LOCK TABLE "{first}" IN ROW SHARE MODE')  # the circle closes
        except BaseException as error:  # noqa: BLE001 - reported by the test
            late_error.append(error)

    tries = []

    def flush(_self):
        tries.append(len(tries) + 1)
        call_command("flush", verbosity=0, interactive=False)

    late = threading.Thread(target=late_transaction)
    late.start()
    assert holding.wait(60), late_error
    try:
        flush_retrying_deadlocks(flush)(None)
    finally:
        late.join(60)
        with connection.cursor() as cursor:
            cursor.execute("RESET deadlock_timeout")
    assert late_error == []
    assert tries == [1, 2], "the first flush was the deadlock's victim, the second emptied the tables"
    assert not Project.objects.filter(name="left-behind").exists()


def rows_by_table() -> dict[str, int]:
    tables = connection.introspection.django_table_names(only_existing=True, include_views=False)
    with connection.cursor() as cursor:
        return {table: _count(cursor, table) for table in tables}


def _count(cursor, table: str) -> int:
    cursor.execute(f'SELECT count(*) FROM "{table}"')
    return cursor.fetchone()[0]


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
def test_the_written_tables_flush_leaves_the_database_as_djangos_flush_does():
    from coordination.services.keys import ALL_PERMISSIONS, api_key_create, project_ensure
    from coordination.services.runs import run_create

    project = project_ensure(name="flushed")
    api_key_create(project_id=project.id, permissions=list(ALL_PERMISSIONS))
    run_create(project_id=project.id, name="r")
    Permission.objects.create(codename="temporary", name="t", content_type=ContentType.objects.first())
    with connection.cursor() as cursor:
        # A test that changed a content type or a permission is flushed by Django's flush.
        assert flush_written_tables("default") is False
        cursor.execute("DELETE FROM auth_permission WHERE codename = 'temporary'")
    before = rows_by_table()
    assert before["coordination_project"] and before["coordination_run"] and before["coordination_apikey"]

    assert flush_written_tables("default") is True
    after = rows_by_table()
    # What Django's flush leaves: every table empty, but what post_migrate writes back as it was.
    assert {table: n for table, n in after.items() if n} == {table: before[table] for table in STATIC_TABLES}
    call_command("flush", verbosity=0, interactive=False)
    assert rows_by_table() == after


def filenode(table: str) -> int:
    """The table's file: TRUNCATE gives it a new one, DELETE keeps it."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_relation_filenode(%s::regclass)", [table])
        return cursor.fetchone()[0]


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
def test_the_flush_deletes_from_a_table_of_few_rows_and_truncates_one_of_many(monkeypatch):
    from coordination.services.keys import project_ensure
    from coordination.services.runs import run_create

    monkeypatch.setattr(flush, "TRUNCATE_FROM_ROWS", 3)
    project = project_ensure(name="few-and-many")
    for n in range(3):  # three runs: "many"; one project: "few"
        run_create(project_id=project.id, name=f"r{n}")
    few, many = filenode("coordination_project"), filenode("coordination_run")

    assert flush_written_tables("default") is True
    assert {table: n for table, n in rows_by_table().items() if n and table not in STATIC_TABLES} == {}
    assert filenode("coordination_project") == few, "a table of few rows is deleted from"
    assert filenode("coordination_run") != many, "a table of many rows is truncated"
