"""Writing events, always inside the transaction of the change they describe."""

from typing import Any

from django.db import connection, transaction
from django.db.models import Count, Func, IntegerField, Max, Value
from django.utils import timezone

from coordination.models import Event, Run
from coordination.services import event_partitions


class CurrentTxid(Func):
    """The id of the current transaction on PostgreSQL; 0 on SQLite (writers are serialized)."""

    output_field = IntegerField()
    template = "0"

    def as_postgresql(self, compiler, connection, **extra_context):  # noqa: D102
        return "pg_current_xact_id()::text::bigint", []


# From this many events on, ``events_record_many`` reads the txid in a statement of its own.
READ_TXID_ONCE_FROM = 8


def event_row(*, project_id, type: str, run_id, run_path: str, subject_id: object, data: dict) -> Event:
    """Build (not save) one event row; ``events_record_many`` writes a list of them."""
    return Event(
        project_id=project_id,
        type=type,
        run_id=run_id,
        run_path=run_path,
        subject_id=str(subject_id),
        data=data,
        created_at=timezone.now(),
    )


def event_for(subject, type: str, /, **data) -> Event:
    """Build the event row of a change to ``subject``: a task, message, barrier or timer on a run."""
    return event_row(
        project_id=subject.project_id,
        type=type,
        run_id=subject.run_id,
        run_path=subject.run_path,
        subject_id=subject.id,
        data=data,
    )


# The columns of an event row, and the txid expression every SQL statement writes events with.
EVENT_COLUMNS = "txid, project_id, type, run_id, run_path, subject_id, data, created_at"
TXID_SQL = "pg_current_xact_id()::text::bigint"


def event_insert_sql(source: str, *, type_sql: str, data_sql: str, created_at_sql: str = "%(now)s") -> str:
    """Return SQL inserting one event per row of ``source`` (a CTE over task-like rows), PostgreSQL.

    ``source`` rows carry ``id``, ``project_id``, ``run_id`` and ``run_path``; ``type_sql`` and
    ``data_sql`` are expressions over them. Used as a data-modifying CTE, so the change and its
    events are one statement.
    """
    return (
        f"INSERT INTO coordination_event ({EVENT_COLUMNS}) "
        f"SELECT {TXID_SQL}, project_id, {type_sql}, run_id, run_path, id::text, {data_sql}, {created_at_sql} "
        f"FROM {source}"
    )


def event_record(
    *,
    project_id,
    type: str,
    run: Run | None,
    subject_id: object = "",
    data: dict[str, Any] | None = None,
) -> Event:
    """Append one event; call it inside the transaction that makes the change."""
    if not connection.in_atomic_block:
        raise RuntimeError("events must be written inside the transaction of their change")
    event = Event(
        txid=CurrentTxid() if connection.vendor == "postgresql" else Value(0),
        project_id=project_id,
        type=type,
        run_id=run.id if run is not None else None,
        run_path=run.path if run is not None else "",
        subject_id=str(subject_id),
        data=data or {},
        created_at=timezone.now(),
    )
    event.save(force_insert=True)
    return event


def events_record_many(events: list[Event]) -> None:
    """Append many prepared events in one statement, inside the change's transaction."""
    if not events:
        return
    if not connection.in_atomic_block:
        raise RuntimeError("events must be written inside the transaction of their change")
    txid: object = 0
    if connection.vendor == "postgresql":
        if len(events) < READ_TXID_ONCE_FROM:
            # A few events (the common case: one per operation): the expression in the insert
            # costs no extra round trip.
            txid = CurrentTxid()
        else:
            # One transaction, one txid: read it once rather than as an expression on every
            # row, which Django compiles row by row (two thirds of the cost of 1,000 events).
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_current_xact_id()::text::bigint")
                txid = cursor.fetchone()[0]
    for event in events:
        event.txid = txid
    Event.objects.bulk_create(events)


def events_mark() -> int:
    """Return the newest event's id (0 when none), from which ``events_written_since`` counts."""
    return Event.objects.aggregate(newest=Max("id"))["newest"] or 0


def events_written_since(*, project_id, mark: int) -> dict[str, int]:
    """Count, by type, the events of ``project_id`` this transaction wrote after ``events_mark`` gave ``mark``.

    On PostgreSQL the transaction's id tells its events from concurrent ones; SQLite has
    one writer at a time.
    """
    rows = Event.objects.filter(project_id=project_id, id__gt=mark)
    if connection.vendor == "postgresql":
        rows = rows.filter(txid=CurrentTxid())
    return dict(rows.order_by().values("type").annotate(count=Count("id")).values_list("type", "count"))


def event_written_here(*, project_id, type: str, subject_id: object) -> Event:
    """Return the event of ``type`` about ``subject_id`` that this transaction wrote.

    On PostgreSQL the transaction's id leads to it through each partition's cursor index
    (``project_id, txid``), where the subject alone would read the whole log.
    """
    rows = Event.objects.filter(project_id=project_id, type=type, subject_id=str(subject_id))
    if connection.vendor == "postgresql":
        rows = rows.filter(txid=CurrentTxid())
    return rows.get()


def events_prune(*, batch_size: int = 5000) -> int:
    """Prune one step of events older than ``RUNSTATE_EVENT_RETENTION_DAYS``; return its size, 0 when done.

    On a partitioned event table (PostgreSQL, ``services/event_partitions.py``) a step drops
    one whole expired day's partition (counted 1), or else deletes a batch of the DEFAULT
    partition's expired rows. On SQLite it deletes a batch of expired rows.
    """
    if event_partitions.is_partitioned():
        return event_partitions.event_partition_drop_expired() or event_partitions.event_default_prune(
            batch_size=batch_size
        )
    cutoff = event_partitions.retention_cutoff()
    with transaction.atomic():
        ids = list(Event.objects.filter(created_at__lt=cutoff).order_by("id").values_list("id", flat=True)[:batch_size])
        if ids:
            Event.objects.filter(id__in=ids).delete()
    return len(ids)
