"""The event table partitioned by day on PostgreSQL (issue 30 item 3).

Migration 0016 converts an existing table; beat creates the next days' partitions and
retention drops whole expired days (``coordination/services/event_partitions.py``). The
cursor, the horizon and the event queries keep their guarantees and their index use.
SQLite keeps a plain table and the row-by-row retention.
"""

import random
import threading
import time
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from django.db import connection, transaction
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

from coordination.models import Event
from coordination.reads.selectors import Visibility, event_cursor, event_feed, event_feed_head, event_head, event_list
from coordination.services import event_partitions
from coordination.services.event_partitions import (
    DEFAULT_PARTITION,
    event_partition_days,
    event_partition_drop_expired,
    event_partitions_create_ahead,
    partition_name,
)
from coordination.services.events import (
    EVENT_COLUMNS,
    event_record,
    event_row,
    event_written_here,
    events_prune,
    events_record_many,
)
from coordination.services.keys import project_ensure
from coordination.services.runs import run_create
from tests.concurrency.util import read_events_until, rounds, run_in_threads
from workers.tasks import prune_events

BEFORE = ("coordination", "0015_project_staff_groups")
AFTER = ("coordination", "0016_event_partitions")

postgres_only = pytest.mark.postgres_only


def _today():
    return timezone.now().astimezone(UTC).date()


def _noon(day) -> datetime:
    return datetime(day.year, day.month, day.day, 12, tzinfo=UTC)


def _sql(statement: str, params=()) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return cursor.fetchall() if cursor.description else []


def _partition_of_each_event() -> dict[int, str]:
    return dict(_sql("SELECT id, tableoid::regclass::text FROM coordination_event"))


def _insert_events(project_id, rows: list[tuple[int, datetime]], run=None) -> None:
    """Insert events with the given ``(txid, created_at)`` directly, as a past writer would have."""
    with connection.cursor() as cursor:
        cursor.executemany(
            "INSERT INTO coordination_event (txid, project_id, type, run_id, run_path, subject_id, data, created_at) "
            "VALUES (%s, %s, 'test.event', %s, %s, '', '{}', %s)",
            [(txid, project_id, run.id if run else None, run.path if run else "", at) for txid, at in rows],
        )


def _visible_txid_bound() -> int:
    """The snapshot's xmin: every txid below it reads as committed, so events carrying one are
    inside the horizon. A fresh cluster's counter is only in the thousands."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint")
        return cursor.fetchone()[0]


def _event(project_id, subject_id, created_at) -> Event:
    event = event_row(
        project_id=project_id, type="test.event", run_id=None, run_path="", subject_id=subject_id, data={}
    )
    event.created_at = created_at
    return event


def _read_all(visibility, after=None, limit=7) -> tuple[list[int], str]:
    seen, cursor = [], after
    while True:
        events, cursor = event_list(visibility, after=cursor, limit=limit)
        if not events:
            return seen, cursor
        seen += [e.id for e in events]


def _cursor_order(project_id) -> list[int]:
    return list(Event.objects.filter(project_id=project_id).order_by("txid", "id").values_list("id", flat=True))


@pytest.fixture
def drop_new_partitions(db):
    """Drop, after the test, the day partitions it created (DDL outlives the test's flush)."""
    if connection.vendor != "postgresql":
        yield
        return
    before = set(event_partition_days())
    yield
    connection.close()
    for day in set(event_partition_days()) - before:
        _sql(f"DROP TABLE IF EXISTS {partition_name(day)}")


def _migrate(target) -> None:
    executor = MigrationExecutor(connection)
    executor.migrate([target])


def _migrate_to_latest() -> None:
    """Apply every migration again: the rest of the session, and the servers it started, expect
    the schema of the last one, not of 0016."""
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())
    assert MigrationExecutor(connection).migration_plan(executor.loader.graph.leaf_nodes()) == []


# The migration ----------------------------------------------------------------------------


@postgres_only
@pytest.mark.django_db(transaction=True)
def test_the_migration_converts_a_table_holding_events_and_back(drop_new_partitions):
    """Events written across several days before 0016 are all there after it, each in its day's
    partition, with their ids; the sequence continues; the cursor order is the same; and
    unapplying 0016 gives the plain table back with the same rows."""
    project = project_ensure(name="partitions-migration")
    _migrate(BEFORE)
    try:
        assert _sql("SELECT relkind FROM pg_class WHERE oid = 'coordination_event'::regclass") == [("r",)]
        today = _today()
        # Txids interleave the days: cursor order is not day order.
        rng = random.Random(30)
        rows = [(1000 + n, _noon(today - timedelta(days=rng.randrange(5))) + timedelta(minutes=n)) for n in range(200)]
        # One just before midnight and one just after: two partitions, neighbours in cursor order.
        midnight = datetime(today.year, today.month, today.day, tzinfo=UTC)
        rows += [(1200, midnight - timedelta(microseconds=1)), (1201, midnight)]
        _insert_events(project.id, rows)
        before = _sql(
            "SELECT id, txid, project_id, type, run_id, run_path, subject_id, data::text, created_at "
            "FROM coordination_event ORDER BY id"
        )
        order_before = _cursor_order(project.id)
        last_id = max(row[0] for row in before)

        _migrate(AFTER)

        assert _sql("SELECT relkind FROM pg_class WHERE oid = 'coordination_event'::regclass") == [("p",)]
        after = _sql(
            "SELECT id, txid, project_id, type, run_id, run_path, subject_id, data::text, created_at "
            "FROM coordination_event ORDER BY id"
        )
        assert after == before
        partitions = _partition_of_each_event()
        for event_id, *_, created_at in after:
            assert partitions[event_id] == partition_name(created_at.astimezone(UTC).date())
        assert _cursor_order(project.id) == order_before
        visibility = Visibility(project_id=project.id)
        assert _read_all(visibility)[0] == order_before
        # The sequence continues after the copied ids.
        with transaction.atomic():
            run_create(project_id=project.id)
        assert Event.objects.filter(project=project).order_by("-id").first().id > last_id
        # The parent has the indexes, the foreign key and the notify trigger again.
        indexes = {row[0] for row in _sql("SELECT indexname FROM pg_indexes WHERE tablename = 'coordination_event'")}
        assert {"coordination_event_pkey", "event_project_cursor", "event_run_path_prefix"} <= indexes
        assert _sql(
            "SELECT count(*) FROM pg_constraint WHERE conrelid = 'coordination_event'::regclass AND contype = 'f'"
        ) == [(1,)]
        assert _sql(
            "SELECT tgname FROM pg_trigger WHERE tgrelid = 'coordination_event'::regclass AND NOT tgisinternal"
        ) == [("runstate_events_notify",)]
        # Today's and the days ahead exist, and the DEFAULT partition.
        days = event_partition_days()
        assert all(today + timedelta(days=n) in days for n in range(4))
        assert _sql("SELECT to_regclass(%s) IS NOT NULL", [DEFAULT_PARTITION]) == [(True,)]

        count, order_partitioned = Event.objects.count(), _cursor_order(project.id)
        _migrate(BEFORE)
        assert _sql("SELECT relkind FROM pg_class WHERE oid = 'coordination_event'::regclass") == [("r",)]
        assert Event.objects.count() == count
        assert _cursor_order(project.id) == order_partitioned
        with transaction.atomic():
            run_create(project_id=project.id)
        assert Event.objects.count() == count + 1
    finally:
        _migrate_to_latest()
    assert _sql("SELECT relkind FROM pg_class WHERE oid = 'coordination_event'::regclass") == [("p",)]


# The cursor across partitions ---------------------------------------------------------------

WRITERS = 8
WRITES_PER_WRITER = 25


@postgres_only
@pytest.mark.django_db(transaction=True)
def test_the_cursor_skips_no_event_across_a_partition_boundary(drop_new_partitions):
    """8 writers commit out of id order, their events spread over three partitions (a day long
    gone falls in the DEFAULT one, today's last instant, tomorrow's first): a reader paging the
    whole time ends with every event once."""
    project = project_ensure(name="partitions-cursor")
    visibility = Visibility(project_id=project.id)
    today = _today()
    midnight = datetime(today.year, today.month, today.day, tzinfo=UTC) + timedelta(days=1)
    instants = [midnight - timedelta(days=1000), midnight - timedelta(microseconds=1), midnight]
    done = threading.Event()

    def writer():
        rng = random.Random()
        for n in range(WRITES_PER_WRITER):
            with transaction.atomic():
                event = event_row(
                    project_id=project.id, type="test.event", run_id=None, run_path="", subject_id=n, data={}
                )
                event.created_at = rng.choice(instants)
                events_record_many([event])
                time.sleep(rng.uniform(0, 0.01))

    def reader():
        return read_events_until(done, visibility)

    def writers_then_signal():
        run_in_threads([writer] * WRITERS)
        done.set()

    _, seen = run_in_threads([writers_then_signal, reader], timeout=300)
    committed = _cursor_order(project.id)
    assert len(committed) == WRITERS * WRITES_PER_WRITER
    assert set(_partition_of_each_event().values()) == {
        DEFAULT_PARTITION,
        partition_name(today),
        partition_name(today + timedelta(days=1)),
    }
    assert len(seen) == len(set(seen)), "an event was read twice"
    assert seen == committed


# Partitions ahead ----------------------------------------------------------------------------


@postgres_only
@pytest.mark.django_db(transaction=True)
def test_partitions_are_created_ahead_once_when_two_creators_race(drop_new_partitions):
    """Two beat ticks creating the same days at once: every day gets one partition, no error."""
    base = _today() + timedelta(days=400)
    for n in range(rounds(postgresql=10, sqlite=1)):
        start = base + timedelta(days=10 * n)
        created = run_in_threads([lambda start=start: event_partitions_create_ahead(days=3, today=start)] * 2)
        assert sorted(created) == [0, 4]
        days = event_partition_days()
        for offset in range(4):
            assert days.count(start + timedelta(days=offset)) == 1
        assert event_partitions_create_ahead(days=3, today=start) == 0
    # A partition created ahead is shaped like one the migration made: the parent's indexes
    # and foreign key, adopted as its own copies.
    name = partition_name(base)
    parents = _sql("SELECT count(*) FROM pg_index WHERE indrelid = 'coordination_event'::regclass")
    assert parents[0][0] >= 3  # the primary key, event_project_cursor, event_held_by
    assert (
        _sql(
            "SELECT count(*) FROM pg_index x JOIN pg_inherits i ON i.inhrelid = x.indexrelid "
            "WHERE x.indrelid = %s::regclass",
            [name],
        )
        == parents
    )
    assert _sql(
        "SELECT contype, conparentid <> 0 FROM pg_constraint WHERE conrelid = %s::regclass ORDER BY contype", [name]
    ) == [("f", True), ("p", True)]


@postgres_only
@pytest.mark.django_db(transaction=True)
def test_a_new_partition_takes_the_rows_of_its_day_out_of_the_default_partition(drop_new_partitions):
    """An event whose day had no partition yet waited in the DEFAULT partition; creating the
    day moves it in, with its id, and a reader still finds it once."""
    project = project_ensure(name="partitions-default")
    day = _today() + timedelta(days=300)
    _insert_events(project.id, [(10, _noon(day)), (11, _noon(day) + timedelta(hours=1))])
    ids = _cursor_order(project.id)
    assert set(_partition_of_each_event().values()) == {DEFAULT_PARTITION}
    assert event_partitions_create_ahead(days=0, today=day) == 1
    assert _partition_of_each_event() == dict.fromkeys(ids, partition_name(day))
    assert _read_all(Visibility(project_id=project.id))[0] == ids


@postgres_only
@pytest.mark.django_db(transaction=True)
def test_events_keep_flowing_while_the_next_days_partitions_are_created(drop_new_partitions):
    """Writers commit events (run creations) while another thread creates partitions, day
    after day: every write succeeds, and a reader finds every event once."""
    project = project_ensure(name="partitions-flow")
    visibility = Visibility(project_id=project.id)
    base = _today() + timedelta(days=500)
    done = threading.Event()
    created = []

    def writer():
        count = 0
        while not done.is_set():
            run_create(project_id=project.id)
            count += 1
        return count

    def creator():
        try:
            for n in range(rounds(postgresql=15, sqlite=1)):
                created.append(event_partitions_create_ahead(days=1, today=base + timedelta(days=2 * n)))
                time.sleep(0.01)
        finally:
            done.set()

    counts = run_in_threads([writer, writer, writer, creator], timeout=300)
    assert sum(created) == 2 * len(created)
    assert sum(counts[:3]) == Event.objects.filter(project=project, type="run.created").count()
    seen, _ = _read_all(visibility, limit=50)
    assert seen == _cursor_order(project.id)


# Retention -----------------------------------------------------------------------------------


@postgres_only
@pytest.mark.django_db(transaction=True)
def test_retention_drops_only_whole_expired_days_and_a_reader_keeps_its_place(settings, drop_new_partitions):
    """With 7 days of retention, the partitions whose day ended before the cutoff are dropped,
    the one the cutoff falls in is kept whole, the DEFAULT partition's expired rows are
    deleted, and a reader that had read part of the log continues with every kept event after
    its cursor, once, in order."""
    settings.RUNSTATE_EVENT_RETENTION_DAYS = 7
    project = project_ensure(name="partitions-retention")
    visibility = Visibility(project_id=project.id)
    today = _today()
    first = today - timedelta(days=12)
    event_partitions_create_ahead(days=11, today=first)
    rng = random.Random(7)
    # Every day from 12 days ago to today, 20 events each at random instants; and 10 in the
    # DEFAULT partition, 40 days old. Txids shuffle the days, so cursor order mixes them.
    instants = [
        datetime(day.year, day.month, day.day, tzinfo=UTC) + timedelta(seconds=rng.randrange(86400))
        for day in (first + timedelta(days=n) for n in range(13))
        for _ in range(20)
    ]
    instants = [at for at in instants if at < timezone.now()]
    instants += [timezone.now() - timedelta(days=40, seconds=n) for n in range(10)]
    txids = rng.sample(range(1, _visible_txid_bound()), len(instants))
    _insert_events(project.id, list(zip(txids, instants, strict=True)))
    assert DEFAULT_PARTITION in set(_partition_of_each_event().values())

    # A reader has read the first third of the log in cursor order.
    order = _cursor_order(project.id)
    events, cursor = event_list(visibility, after=None, limit=len(order) // 3)
    assert [e.id for e in events] == order[: len(order) // 3]

    cutoff = timezone.now() - timedelta(days=7)
    expired_days = [d for d in event_partition_days() if _noon(d) + timedelta(hours=12) <= cutoff]
    assert len(expired_days) >= 4

    dropped_while_reading = []

    def reader():
        seen, position = [], cursor
        while True:
            finished = bool(dropped_while_reading)
            page, position = event_list(visibility, after=position, limit=5)
            if not page and finished:
                return seen
            seen += [e.id for e in page]
            if not page:
                time.sleep(0.001)

    def pruner():
        time.sleep(0.01)
        dropped_while_reading.append(prune_events())

    seen, _ = run_in_threads([reader, pruner], timeout=300)

    kept_days = set(event_partition_days())
    assert not kept_days & set(expired_days)
    assert cutoff.date() in kept_days
    kept = {event.id: event.created_at for event in Event.objects.filter(project=project).only("id", "created_at")}
    # An event is pruned exactly when its day ended by the cutoff (the DEFAULT partition's by its own instant).
    for txid, at in zip(txids, instants, strict=True):
        day_end = datetime(at.year, at.month, at.day, tzinfo=UTC) + timedelta(days=1)
        row = Event.objects.filter(project=project, txid=txid).first()
        if day_end <= cutoff:
            assert row is None, f"an event of {at.date()} outlived its day's retention"
        else:
            assert row is not None, f"an event of {at.date()} was pruned before its time"
    assert min(kept.values()) >= datetime.combine(cutoff.date(), datetime.min.time(), tzinfo=UTC)
    # The reader that started from its cursor saw each kept event after it, once, in order; it
    # may also have read expired ones before they were dropped (as with row deletes).
    after_cursor = [event_id for event_id in order[len(order) // 3 :] if event_id in kept]
    assert len(seen) == len(set(seen))
    assert [event_id for event_id in seen if event_id in kept] == after_cursor
    # Nothing is left to prune.
    assert events_prune() == 0


@postgres_only
@pytest.mark.django_db(transaction=True)
def test_a_drop_that_cannot_have_its_lock_in_time_gives_up_until_the_next_tick(settings, drop_new_partitions):
    """A transaction holding the event table (here a reader, as a pg_dump would) keeps the drop
    from its lock: the drop gives up after ``lock_timeout`` instead of queueing every event
    writer behind it, writers carry on, and the next tick drops the day."""
    settings.RUNSTATE_EVENT_RETENTION_DAYS = 7
    project = project_ensure(name="partitions-lock")
    old_day = _today() - timedelta(days=30)
    assert event_partitions_create_ahead(days=0, today=old_day) == 1
    _insert_events(project.id, [(5, _noon(old_day))])
    s = connection.settings_dict
    with psycopg.connect(
        host=s["HOST"] or "127.0.0.1",
        port=s["PORT"] or 5432,
        user=s["USER"] or None,
        password=s.get("PASSWORD") or None,
        dbname=s["NAME"],
    ) as other:
        other.execute("SELECT count(*) FROM coordination_event")
        try:
            assert event_partition_drop_expired() == 0
            assert old_day in event_partition_days()
            run_create(project_id=project.id)
        finally:
            other.rollback()
    assert event_partition_drop_expired() == 1
    assert old_day not in event_partition_days()
    assert Event.objects.filter(project=project).values_list("type", flat=True).get() == "run.created"


@pytest.mark.django_db(transaction=True)
def test_retention_deletes_expired_rows_on_a_plain_table(settings):
    """SQLite keeps the plain table: retention deletes the rows older than the cutoff."""
    if connection.vendor == "postgresql":
        pytest.skip("PostgreSQL's event table is partitioned; the test above covers it")
    settings.RUNSTATE_EVENT_RETENTION_DAYS = 7
    project = project_ensure(name="plain-retention")
    now = timezone.now()
    with transaction.atomic():
        events = []
        for age in (1, 6, 8, 30):
            event = event_row(
                project_id=project.id, type="test.event", run_id=None, run_path="", subject_id=age, data={}
            )
            event.created_at = now - timedelta(days=age)
            events.append(event)
        events_record_many(events)
    assert event_partitions_create_ahead() == 0
    assert prune_events() == 2
    assert sorted(int(s) for s in Event.objects.values_list("subject_id", flat=True)) == [1, 6]


# Index use -------------------------------------------------------------------------------------

BIG_DAYS = 3
PROJECTS = 20
EVENTS_PER_PROJECT_DAY = 1500


# A plan node that reads a partition through an index (a bitmap heap scan reads the rows its
# bitmap index scans found): anything but a Seq Scan of the whole partition.
INDEX_READS = ("Index Scan", "Index Only Scan", "Bitmap Heap Scan")


def _plan_nodes(plan: dict):
    yield plan
    for child in plan.get("Plans", []):
        yield from _plan_nodes(child)


@postgres_only
@pytest.mark.django_db(transaction=True)
def test_the_event_queries_use_each_partitions_index(drop_new_partitions):
    """EXPLAIN of the cursor list (with and without a run filter), the head and the stream's
    feed: each big partition is read through its own copy of an event index, never scanned
    whole."""
    today = _today()
    run_project = project_ensure(name="partitions-plan")
    projects = [run_project.id] + [project_ensure(name=f"partitions-plan-{n}").id for n in range(PROJECTS - 1)]
    run = run_create(project_id=run_project.id)
    big = [partition_name(today + timedelta(days=n)) for n in range(BIG_DAYS)]
    with connection.cursor() as cursor:
        for n in range(BIG_DAYS):
            start = datetime(today.year, today.month, today.day, tzinfo=UTC) + timedelta(days=n)
            cursor.execute(
                f"INSERT INTO coordination_event ({EVENT_COLUMNS}) "
                "SELECT %s + g, (%s::uuid[])[1 + g %% %s], 'test.event', "
                "CASE WHEN g %% 50 = 0 THEN %s::uuid END, CASE WHEN g %% 50 = 0 THEN %s ELSE '' END, "
                "'', '{}', %s + make_interval(secs => g %% 86000) FROM generate_series(1, %s) g",
                [
                    1000 + n * 10**6,
                    projects,
                    PROJECTS,
                    run.id,
                    run.path,
                    start,
                    PROJECTS * EVENTS_PER_PROJECT_DAY,
                ],
            )
        cursor.execute("ANALYZE coordination_event")
    for name in big:
        assert _sql(f"SELECT count(*) FROM {name}")[0][0] >= PROJECTS * EVENTS_PER_PROJECT_DAY
    cursor_index = dict(
        _sql(
            "SELECT t.relname, c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "JOIN pg_index x ON x.indexrelid = c.oid JOIN pg_class t ON t.oid = x.indrelid "
            "WHERE i.inhparent = 'event_project_cursor'::regclass"
        )
    )
    # Each partition's copies of the parent's indexes.
    partition_indexes = {
        name: {row[0] for row in _sql("SELECT indexname FROM pg_indexes WHERE tablename = %s", [name])} for name in big
    }

    visibility = Visibility(project_id=run_project.id)
    middle = Event.objects.filter(project_id=run_project.id, created_at__gte=timezone.now()).order_by("txid")[500]
    queries = {
        "the cursor list": lambda: event_list(visibility, after=event_cursor(middle), limit=100),
        "the list from the start": lambda: event_list(visibility, after=None, limit=100),
        "the run filter": lambda: event_list(visibility, after=None, run_id=run.id, limit=100),
        "the head": lambda: event_head(visibility),
        "the feed": lambda: event_feed((middle.txid, middle.id), 100, projects[:3]),
        "the feed's head": lambda: event_feed_head(run_project.id),
        "an event this transaction wrote": lambda: _written_here(run),
    }
    for what, call in queries.items():
        statements = []

        def record(execute, sql, params, many, context, statements=statements):
            statements.append((sql, params))
            return execute(sql, params, many, context)

        with connection.execute_wrapper(record):
            call()
        statements = [
            (sql, params) for sql, params in statements if '"coordination_event"' in sql and sql.startswith("SELECT")
        ]
        assert statements, what
        for sql, params in statements:
            plan = _sql("EXPLAIN (FORMAT JSON) " + sql, params)[0][0][0]["Plan"]
            scans = {}
            for node in _plan_nodes(plan):
                if node.get("Relation Name") in big:
                    scans.setdefault(node["Relation Name"], []).append(node)
            assert set(scans) == set(big), f"{what}: {plan}"
            for name, nodes in scans.items():
                for node in nodes:
                    assert node["Node Type"] in INDEX_READS, f"{what} on {name}: {node}"
                    used = [node] if node["Node Type"] != "Bitmap Heap Scan" else list(_plan_nodes(node))[1:]
                    for index_node in used:
                        if "Index Name" in index_node:
                            assert index_node["Index Name"] in partition_indexes[name], f"{what} on {name}: {node}"
                used = {n.get("Index Name") for node in nodes for n in _plan_nodes(node)}
                assert cursor_index[name] in used, f"{what} does not use {name}'s event_project_cursor: {nodes}"


def _written_here(run) -> None:
    """A rerun names its source in the ``task.submitted`` event its own submit just wrote."""
    with transaction.atomic():
        event_record(project_id=run.project_id, type="test.written-here", run=run, subject_id=run.id, data={"note": 1})
        assert event_written_here(project_id=run.project_id, type="test.written-here", subject_id=run.id).data == {
            "note": 1
        }


def test_event_partitions_do_nothing_on_sqlite(db):
    """SQLite keeps a plain table: no partition to create, and ``is_partitioned`` says so."""
    if connection.vendor == "postgresql":
        assert event_partitions.is_partitioned()
    else:
        assert not event_partitions.is_partitioned()
        assert event_partitions_create_ahead() == 0
        assert event_partitions.event_partition_drop_expired() == 0
