"""The event log's daily partitions on PostgreSQL: created ahead, dropped by retention.

Migration 0016 makes ``coordination_event`` a table partitioned by range of ``created_at``,
one partition per UTC day named ``coordination_event_pYYYYMMDD``, plus a DEFAULT partition
(``coordination_event_default``) so an insert never fails: an event whose day has no
partition yet (beat stopped for longer than the days created ahead, a clock far off) lands
there. On SQLite the table stays plain and none of this runs.

- ``event_partitions_create_ahead`` creates today's and the next
  ``RUNSTATE_EVENT_PARTITIONS_AHEAD_DAYS`` days' partitions that are missing. A day's rows
  already in the DEFAULT partition are moved into its new partition in the same transaction.
- ``event_partition_drop_expired`` drops one partition whose whole day is older than
  ``RUNSTATE_EVENT_RETENTION_DAYS``; ``event_default_prune`` deletes, in a batch, the rows
  of the DEFAULT partition that are older than that.

Both run from the beat task ``runstate.prune_events`` (``workers/tasks.py``), hourly.

Locks, always in this order: the transaction advisory lock ``PARTITION_LOCK`` (so two beat
ticks, or a creator and a dropper, never interleave their DDL); when creating, the project
table (the new partition's foreign key); then the DEFAULT partition; then the parent table.
Creating a partition is ``CREATE TABLE`` then ``ATTACH PARTITION``, which takes only SHARE
UPDATE EXCLUSIVE on the parent, so event writers and readers carry on; it holds the DEFAULT
partition (ACCESS EXCLUSIVE) for the moment it takes to check it is empty of the day's rows.
Dropping a partition takes ACCESS EXCLUSIVE on the parent: every statement on the event
table waits for the drop (a catalog change), and the drop waits for every transaction that
has touched the table. ``lock_timeout`` (``DDL_LOCK_TIMEOUT``) bounds both waits: a drop or
creation that cannot have its locks in time gives up and is retried at the next tick, rather
than queueing every event writer behind a long transaction.
"""

import logging
import re
from datetime import UTC, date, datetime, time, timedelta

from django.conf import settings
from django.db import OperationalError, connection, transaction
from django.utils import timezone

from coordination.models import Event

log = logging.getLogger(__name__)

PARENT = "coordination_event"
DEFAULT_PARTITION = "coordination_event_default"
_DAY_NAME = re.compile(r"^coordination_event_p(\d{8})$")

# pg_advisory_xact_lock(int, int): runstate's class ('rs' in ASCII), then this lock's number.
# The two-int key space never meets the bigint one the run locks use (services/locking.py).
PARTITION_LOCK = (0x7273, 1)
DDL_LOCK_TIMEOUT = "2s"
# SQLSTATE lock_not_available: lock_timeout ran out.
_LOCK_NOT_AVAILABLE = "55P03"


def partition_name(day: date) -> str:
    """Return the name of ``day``'s partition (a UTC day)."""
    return f"{PARENT}_p{day:%Y%m%d}"


def day_bounds(day: date) -> tuple[str, str]:
    """Return ``day``'s range as timestamptz literals: from its UTC midnight to the next."""
    start = datetime.combine(day, time.min, tzinfo=UTC)
    return start.isoformat(), (start + timedelta(days=1)).isoformat()


def partition_of_sql(day: date) -> str:
    """Return the SQL creating ``day``'s partition with ``PARTITION OF`` (the migration, nothing running)."""
    start, end = day_bounds(day)
    return f"CREATE TABLE {partition_name(day)} PARTITION OF {PARENT} FOR VALUES FROM ('{start}') TO ('{end}')"


def is_partitioned() -> bool:
    """Return whether the event table is partitioned (PostgreSQL after migration 0016)."""
    if connection.vendor != "postgresql":
        return False
    with connection.cursor() as cursor:
        cursor.execute("SELECT relkind FROM pg_class WHERE oid = to_regclass(%s)", [PARENT])
        row = cursor.fetchone()
    return row is not None and row[0] == "p"


def event_partition_days() -> list[date]:
    """Return the days that have a partition, oldest first (the DEFAULT partition is not one)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = to_regclass(%s)",
            [PARENT],
        )
        names = [row[0] for row in cursor.fetchall()]
    days = []
    for name in names:
        match = _DAY_NAME.match(name)
        if match:
            days.append(datetime.strptime(match.group(1), "%Y%m%d").date())
    return sorted(days)


def _lock(cursor) -> None:
    cursor.execute(f"SET LOCAL lock_timeout = '{DDL_LOCK_TIMEOUT}'")
    cursor.execute("SELECT pg_advisory_xact_lock(%s, %s)", list(PARTITION_LOCK))


def _lock_timed_out(error: OperationalError) -> bool:
    return getattr(error.__cause__, "sqlstate", None) == _LOCK_NOT_AVAILABLE


def _create_partition(cursor, day: date) -> None:
    """Create and attach ``day``'s partition, moving in the rows the DEFAULT partition holds for it."""
    name = partition_name(day)
    start, end = day_bounds(day)
    # The table first, complete with the parent's indexes and foreign keys (the attach then
    # adopts them instead of building them while it holds the DEFAULT partition), and a
    # check of its range so the attach need not scan it. (DDL takes no bound parameters:
    # the bounds are literals made from a date.)
    cursor.execute(f"CREATE TABLE {name} (LIKE {PARENT} INCLUDING DEFAULTS INCLUDING INDEXES)")
    cursor.execute(
        "SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conrelid = %s::regclass AND contype = 'f'",
        [PARENT],
    )
    for number, (definition,) in enumerate(cursor.fetchall()):
        cursor.execute(f"ALTER TABLE {name} ADD CONSTRAINT {name}_fk{number} {definition}")
        # Checked at once: a deferred check of the rows moved in below would still be pending
        # at the attach, which PostgreSQL refuses.
        cursor.execute(f"SET CONSTRAINTS {name}_fk{number} IMMEDIATE")
    cursor.execute(
        f"ALTER TABLE {name} ADD CONSTRAINT {name}_range CHECK (created_at >= '{start}' AND created_at < '{end}')"
    )
    # Then the DEFAULT partition: no event of the day can land there between the move and
    # the attach (which checks it holds none). Readers of the event table wait on it from
    # here to the commit: a move of the day's rows, if any, and the attach.
    cursor.execute(f"LOCK TABLE {DEFAULT_PARTITION} IN ACCESS EXCLUSIVE MODE")
    columns = ", ".join(field.column for field in Event._meta.concrete_fields)
    cursor.execute(
        f"WITH moved AS (DELETE FROM {DEFAULT_PARTITION} WHERE created_at >= %s AND created_at < %s "
        f"RETURNING {columns}) INSERT INTO {name} ({columns}) SELECT {columns} FROM moved",
        [start, end],
    )
    if cursor.rowcount:
        log.warning("moved %s events of %s from the default partition into %s", cursor.rowcount, day, name)
    cursor.execute(f"ALTER TABLE {PARENT} ATTACH PARTITION {name} FOR VALUES FROM ('{start}') TO ('{end}')")
    cursor.execute(f"ALTER TABLE {name} DROP CONSTRAINT {name}_range")


def event_partitions_create_ahead(*, days: int | None = None, today: date | None = None) -> int:
    """Create the missing partitions of today and the next ``days`` days (UTC); return how many.

    Idempotent, and safe when two callers race: they take ``PARTITION_LOCK`` in turn and the
    second finds the partitions there. Does nothing on SQLite or on a plain table.
    """
    if not is_partitioned():
        return 0
    days = settings.RUNSTATE_EVENT_PARTITIONS_AHEAD_DAYS if days is None else days
    today = today or timezone.now().astimezone(UTC).date()
    created = 0
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            _lock(cursor)
            existing = set(event_partition_days())
            for offset in range(days + 1):
                day = today + timedelta(days=offset)
                if day not in existing:
                    _create_partition(cursor, day)
                    created += 1
    except OperationalError as error:
        if not _lock_timed_out(error):
            raise
        log.warning("event partitions not created ahead (lock timeout); the next tick tries again")
        return 0
    return created


def retention_cutoff() -> datetime:
    """Return the instant before which events are past ``RUNSTATE_EVENT_RETENTION_DAYS``."""
    return timezone.now() - timedelta(days=settings.RUNSTATE_EVENT_RETENTION_DAYS)


def event_partition_drop_expired(*, cutoff: datetime | None = None) -> int:
    """Drop the oldest partition whose whole day is before the retention cutoff; return 1, or 0 if none.

    A partition is dropped only when its day *ends* at or before the cutoff, so every row it
    holds is one the row-by-row retention would have deleted: an event is kept at least
    ``RUNSTATE_EVENT_RETENTION_DAYS`` and at most a day longer.
    """
    if not is_partitioned():
        return 0
    cutoff = cutoff or retention_cutoff()
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            _lock(cursor)
            for day in event_partition_days():
                if datetime.combine(day + timedelta(days=1), time.min, tzinfo=UTC) <= cutoff:
                    cursor.execute(f"DROP TABLE {partition_name(day)}")
                    return 1
                break
    except OperationalError as error:
        if not _lock_timed_out(error):
            raise
        log.warning("an expired event partition was not dropped (lock timeout); the next tick tries again")
    return 0


def event_default_prune(*, cutoff: datetime | None = None, batch_size: int = 5000) -> int:
    """Delete one batch of the DEFAULT partition's rows older than the retention cutoff; return how many."""
    cutoff = cutoff or retention_cutoff()
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            f"DELETE FROM {DEFAULT_PARTITION} WHERE ctid = ANY(ARRAY("
            f"SELECT ctid FROM {DEFAULT_PARTITION} WHERE created_at < %s LIMIT %s))",
            [cutoff, batch_size],
        )
        return cursor.rowcount
