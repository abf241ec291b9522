"""A cursor reader never skips or repeats an event, even when commits land out of id order.

On PostgreSQL the horizon is bounded by the transactions running in runstate's own database:
one still running there holds the readers back, one in another database of the same cluster
does not.
"""

import random
import threading
import time

import psycopg
import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from coordination.models import Event
from coordination.reads.selectors import (
    EVENT_HORIZON_NOW_SQL,
    EVENT_HORIZON_TRIES,
    Visibility,
    event_head,
    event_horizon,
    event_list,
)
from coordination.services.keys import project_ensure
from coordination.services.runs import run_create
from tests.concurrency.util import read_events_until, run_in_threads

WRITERS = 8
WRITES_PER_WRITER = 25


@pytest.mark.django_db(transaction=True)
def test_reader_sees_every_event_exactly_once_with_8_concurrent_writers():
    """8 writers commit events with random delays between insert and commit.

    Ids are taken at insert time, so commits land out of id order; a reader paging with the
    cursor the whole time must end with exactly the set of committed events, in cursor order,
    with no duplicate and no gap.
    """
    project = project_ensure(name="events")
    visibility = Visibility(project_id=project.id)
    done = threading.Event()

    def writer():
        rng = random.Random()
        for _ in range(WRITES_PER_WRITER):
            with transaction.atomic():
                run_create(project_id=project.id)
                # Hold the transaction open after the event got its id, so later ids commit first.
                time.sleep(rng.uniform(0, 0.01))

    def reader():
        return read_events_until(done, visibility)

    def writers_then_signal():
        run_in_threads([writer] * WRITERS)
        done.set()

    _, seen = run_in_threads([writers_then_signal, reader], timeout=300)
    committed = list(Event.objects.filter(project=project).values_list("id", flat=True))
    assert len(committed) == WRITERS * WRITES_PER_WRITER
    assert len(seen) == len(set(seen)), "an event was read twice"
    assert set(seen) == set(committed), f"missed {len(set(committed) - set(seen))} events"


def _connect(dbname: str) -> psycopg.Connection:
    """Open a connection of its own (not Django's) to ``dbname`` on the test database's server."""
    s = connection.settings_dict
    return psycopg.connect(
        host=s["HOST"] or "127.0.0.1",
        port=s["PORT"] or 5432,
        user=s["USER"] or None,
        password=s.get("PASSWORD") or None,
        dbname=dbname,
    )


def _cluster_xmin() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint")
        return cursor.fetchone()[0]


FOREIGN_ROUNDS = 20
# A reader may be held back for one read by a transaction of another database that ended
# between its snapshot and its look at pg_stat_activity (it then counts, which only delays):
# every check below reads again a bounded number of times.
READS = 100


def _read_until(visibility, cursor, predicate):
    """Read after ``cursor`` until ``predicate(events)`` holds (at most READS reads); return the last read."""
    for _ in range(READS):
        events, next_cursor = event_list(visibility, after=cursor, limit=100)
        if predicate(events):
            return events, next_cursor
        time.sleep(0.01)
    return events, next_cursor


def _head_reaches(visibility, cursor) -> bool:
    for _ in range(READS):
        if event_head(visibility) == cursor:
            return True
        time.sleep(0.01)
    return False


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
def test_events_flow_while_a_writing_transaction_of_another_database_stays_open():
    """A transaction that wrote in another database of the cluster holds the cluster's xmin back.

    While it stays open, every event runstate commits reaches a reader that pages with the
    cursor, and ``event_head``; the reader sees each exactly once, in commit order.
    """
    project = project_ensure(name="events-foreign")
    visibility = Visibility(project_id=project.id)
    with _connect("postgres") as foreign:
        foreign.execute("CREATE TEMPORARY TABLE runstate_foreign_writer (x int)")
        foreign.execute("INSERT INTO runstate_foreign_writer VALUES (1)")
        foreign_xid = foreign.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()[0]
        try:
            # The old horizon, the cluster-wide xmin, is held back by the foreign writer.
            assert _cluster_xmin() <= foreign_xid
            seen, cursor = [], None
            for _ in range(FOREIGN_ROUNDS):
                run = run_create(project_id=project.id)
                events, cursor = _read_until(visibility, cursor, bool)
                assert [(e.type, e.subject_id) for e in events] == [("run.created", str(run.id))]
                assert _head_reaches(visibility, cursor)
                seen += [e.id for e in events]
                time.sleep(0.05)
            assert foreign.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
            assert _cluster_xmin() <= foreign_xid, "the foreign transaction stayed open throughout"
        finally:
            foreign.rollback()
    committed = list(Event.objects.filter(project=project).order_by("txid", "id").values_list("id", flat=True))
    assert seen == committed


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
def test_a_transaction_still_running_in_this_database_holds_the_readers_back():
    """An event written after an older transaction of runstate's database began waits for it to end.

    The older transaction may still write an event with its smaller txid: a reader that moved
    past the newer event would skip that one.
    """
    project = project_ensure(name="events-local")
    visibility = Visibility(project_id=project.id)
    with _connect(connection.settings_dict["NAME"]) as local:
        local.execute("SELECT pg_current_xact_id()")  # an xid, as a writer's first write gives
        try:
            run = run_create(project_id=project.id)
            event = Event.objects.get(project=project, type="run.created", subject_id=str(run.id))
            assert event.id not in [e.id for e in event_list(visibility, after=None, limit=1000)[0]]
            assert int(event_head(visibility).split("-")[0]) < event.txid
        finally:
            local.commit()
    events, _ = _read_until(visibility, None, lambda events: event.id in [e.id for e in events])
    assert event.id in [e.id for e in events]


def _horizon_now(cursor) -> tuple[int, bool]:
    cursor.execute(EVENT_HORIZON_NOW_SQL)
    return cursor.fetchone()


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
def test_a_horizon_held_by_a_transaction_that_ended_after_the_snapshot_is_read_again():
    """A transaction running at the reader's snapshot and ended before its look at pg_stat_activity
    cannot be attributed, so it holds the horizon; the read says it has ended, and a fresh
    statement (``event_horizon``) is no longer held by it.

    The window between the two looks is forced: the reader's snapshot is frozen (REPEATABLE
    READ, taken by a first statement) while the other transaction runs, which then commits
    before the reader's first look at pg_stat_activity.
    """
    project = project_ensure(name="events-ended")
    visibility = Visibility(project_id=project.id)
    with _connect("postgres") as foreign:
        foreign_xid = foreign.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()[0]
        run = run_create(project_id=project.id)  # committed after the foreign transaction got its id
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            cursor.execute("SELECT 1")  # the snapshot: the foreign transaction is running in it
            foreign.commit()
            horizon, ended = _horizon_now(cursor)
            assert horizon <= foreign_xid, "an ended transaction the snapshot saw running still counts"
            if horizon == foreign_xid:  # (an older one, of any database, may hold it further back)
                assert ended
            # Frozen snapshot: every read is held alike; the reader stops after its tries.
            with CaptureQueriesContext(connection) as reads:
                assert event_horizon() == horizon
            assert len(reads) == EVENT_HORIZON_TRIES
    # Each statement its own snapshot: the ended transaction holds nothing back.
    assert event_horizon() > foreign_xid
    events, _ = event_list(visibility, after=None, limit=10)
    assert [e.subject_id for e in events] == [str(run.id)]
