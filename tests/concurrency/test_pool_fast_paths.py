"""Pool acquire and release fast paths on PostgreSQL: one statement each, and the same answers as the careful path.

The agreement test plays one script of acquisitions, releases, waits, expiries and cancels
with the fast paths on and off, and compares every answer, every lease row, the pool's
counters and every event (ids and times aside). After each step the pool's ``waiting``
counter must equal its WAITING rows.
"""

import time
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from coordination.domain import exceptions
from coordination.models import Event, Pool, PoolLease
from coordination.services.keys import project_ensure
from coordination.services.pools import pool_acquire, pool_lease_release, pool_lease_renew, pool_put, pool_wait_end
from coordination.services.runs import run_cancel, run_create
from tests.concurrency.test_pool_races import replay
from tests.concurrency.util import run_in_threads

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]


def statements(queries) -> list[str]:
    return [q["sql"].split()[0].upper() for q in queries.captured_queries]


def test_acquire_and_release_are_one_statement_each():
    project = project_ensure(name="pools-fast")
    run = run_create(project_id=project.id)
    pool, _ = pool_put(project_id=project.id, name="gpu", capacity=2)
    with CaptureQueriesContext(connection) as acquire_sql:
        lease = pool_acquire(project_id=project.id, name="gpu", run_id=run.id, units=2, lease_ttl_ms=5000).lease
    before = timezone.now()
    with CaptureQueriesContext(connection) as renew_sql:
        renewed = pool_lease_renew(project_id=project.id, lease_id=lease.id, lease_ttl_ms=7000)
    after = timezone.now()
    with CaptureQueriesContext(connection) as release_sql:
        released = pool_lease_release(project_id=project.id, lease_id=lease.id)
    assert statements(acquire_sql) == ["WITH"], acquire_sql.captured_queries
    assert statements(renew_sql) == ["WITH"], renew_sql.captured_queries
    assert renewed.lease_ttl_ms == 7000 and renewed.state == "HELD"
    assert before + timedelta(seconds=7) <= renewed.expires_at <= after + timedelta(seconds=7)
    assert statements(release_sql) == ["WITH"], release_sql.captured_queries
    assert (lease.state, lease.units, lease.arrival, lease.run_path) == ("HELD", 2, 1, run.path)
    assert lease.expires_at - lease.granted_at == timedelta(milliseconds=5000)
    assert released.state == "RELEASED" and released.ended_at is not None
    events = Event.objects.filter(subject_id=str(lease.id)).order_by("id")
    assert [(e.type, e.data, e.run_id) for e in events] == [
        ("pool.acquired", {"pool": "gpu", "units": 2}, run.id),
        ("pool.released", {"pool": "gpu", "units": 2}, run.id),
    ]
    stored = Pool.objects.get(id=pool.id)
    assert (stored.in_use, stored.arrivals, stored.waiting) == (0, 1, 0)


class Script:
    """Plays the agreement script on a fresh project and records what it saw, ids replaced by arrivals."""

    def __init__(self, name: str):
        self.project = project_ensure(name=name)
        self.root = run_create(project_id=self.project.id)
        self.trace: list[tuple] = []
        self.runs = {self.root.id: "root"}
        self.pool, _ = pool_put(project_id=self.project.id, name="gpu", capacity=3)

    def child(self, label: str):
        run = run_create(project_id=self.project.id, parent_id=self.root.id)
        self.runs[run.id] = label
        return run

    def lease_view(self, lease: PoolLease) -> tuple:
        # A granted lease runs out its ttl after its grant (the script ages one lease by hand).
        on_time = None
        if lease.granted_at and lease.state != "EXPIRED":
            on_time = lease.expires_at - lease.granted_at == timedelta(milliseconds=lease.lease_ttl_ms)
        return (lease.arrival, self.runs[lease.run_id], lease.state, lease.units, lease.key, on_time)

    def check_counter(self, step: str) -> None:
        pool = Pool.objects.get(id=self.pool.id)
        rows = PoolLease.objects.filter(pool=pool, state="WAITING").count()
        assert pool.waiting == rows, f"after {step}: waiting {pool.waiting}, rows {rows}"

    def acquire(self, step: str, run=None, **kwargs) -> PoolLease | None:
        kwargs.setdefault("name", "gpu")
        kwargs.setdefault("lease_ttl_ms", 60_000)
        try:
            acquired = pool_acquire(project_id=self.project.id, run_id=(run or self.root).id, **kwargs)
        except exceptions.CoordinationError as error:
            self.trace.append((step, "raised", error.code))
            self.check_counter(step)
            return None
        if acquired.refusal is not None:
            self.trace.append((step, "refused", acquired.refusal.code, acquired.refusal.details))
            self.check_counter(step)
            return None
        self.trace.append((step, "lease", self.lease_view(acquired.lease), acquired.created))
        self.check_counter(step)
        return acquired.lease

    def renew(self, step: str, lease: PoolLease, ttl: int | None = None) -> None:
        try:
            renewed = pool_lease_renew(project_id=self.project.id, lease_id=lease.id, lease_ttl_ms=ttl)
        except exceptions.CoordinationError as error:
            self.trace.append((step, "raised", error.code))
            return
        self.trace.append((step, "renewed", renewed.arrival, renewed.state, renewed.lease_ttl_ms))

    def release(self, step: str, lease: PoolLease) -> None:
        released = pool_lease_release(project_id=self.project.id, lease_id=lease.id)
        self.trace.append((step, "released", released.arrival, released.state, released.ended_at is not None))
        self.check_counter(step)

    def play(self) -> None:
        a = self.acquire("a", units=1)
        b = self.acquire("b", units=2)
        self.acquire("full", units=1)
        w = self.acquire("w queued", units=2, wait_ms=30_000)
        self.release("release a, w still does not fit", a)
        self.acquire("room but w waits first", units=1)
        self.release("release b grants w", b)
        self.release("release a again", a)
        c = self.acquire("c", units=1)
        self.renew("renew c", c)
        self.renew("renew c, new ttl", c, ttl=90_000)
        self.renew("renew c, bad ttl", c, ttl=0)
        self.renew("renew released a", a)
        doomed = self.child("doomed")
        run_cancel(project_id=self.project.id, run_id=doomed.id)
        self.acquire("under a cancelled run", run=doomed, units=1)
        self.acquire("unknown pool", name="nope", units=1)
        self.acquire("more than capacity", units=4)
        self.acquire("bad name", name="bad\x00name", units=1)
        self.release("release c", c)
        held_by_doomed = self.child("held by doomed")
        h = self.acquire("h", run=held_by_doomed, units=1)
        run_cancel(project_id=self.project.id, run_id=held_by_doomed.id)
        self.renew("renew under a cancelled run", h)
        self.release("release h under a cancelled run", h)
        k = self.acquire("keyed", units=1, key="k")
        self.acquire("keyed again", units=1, key="k")
        self.acquire("keyed, other units", units=2, key="k")
        PoolLease.objects.filter(id=w.id).update(expires_at=timezone.now() - timedelta(seconds=1))
        e = self.acquire("w expired but still counted", units=2)
        self.release("release expired w", w)
        self.release("release e", e)
        z = self.acquire("z", units=2)
        x = self.acquire("x queued", units=1, wait_ms=30_000)
        self.release("release waiting x", x)
        self.release("release z", z)
        z = self.acquire("z again", units=2)
        y = self.acquire("y queued", units=1, wait_ms=30_000)
        ended = pool_wait_end(lease_id=y.id)
        self.trace.append(("y wait ends", ended.refusal.code, ended.refusal.details))
        self.check_counter("y wait ends")
        gone = self.child("gone")
        self.acquire("queued under gone", run=gone, units=1, wait_ms=30_000)
        run_cancel(project_id=self.project.id, run_id=gone.id)
        self.check_counter("gone cancelled")
        self.release("release z again", z)
        self.release("release k", k)
        self.acquire("all of it", units=3)

    def rows(self) -> list[tuple]:
        leases = PoolLease.objects.filter(pool=self.pool).order_by("arrival")
        return [(*self.lease_view(lease), lease.ended_at is not None) for lease in leases]

    def events(self) -> list[tuple]:
        arrival = {str(lease.id): lease.arrival for lease in PoolLease.objects.filter(pool=self.pool)}
        arrival[str(self.pool.id)] = "pool"
        events = Event.objects.filter(project_id=self.project.id, type__startswith="pool.").order_by("id")
        return [(e.type, arrival[e.subject_id], self.runs[e.run_id], e.data) for e in events]

    def counters(self) -> tuple:
        pool = Pool.objects.get(id=self.pool.id)
        return pool.capacity, pool.in_use, pool.arrivals, pool.waiting


def test_fast_and_careful_paths_agree_on_answers_rows_and_events(settings):
    played = {}
    for fast in (True, False):
        settings.RUNSTATE_FAST_PATHS = fast
        script = Script(name=f"pools-{'fast' if fast else 'careful'}")
        script.play()
        played[fast] = script
    fast, careful = played[True], played[False]
    assert fast.trace == careful.trace
    assert fast.rows() == careful.rows()
    assert fast.events() == careful.events()
    assert fast.counters() == careful.counters()
    assert fast.counters()[1:4:2] == (3, 0)  # in use, waiting
    # The script went through both paths: plain grants and releases were single statements.
    assert ("a", "lease", (1, "root", "HELD", 1, "", True), True) in fast.trace


def test_fast_acquires_racing_a_cancel_grant_nothing_once_the_cancel_committed_20_rounds():
    project = project_ensure(name="pools-fast")
    pool, _ = pool_put(project_id=project.id, name="gpu", capacity=1_000_000)
    root = run_create(project_id=project.id)
    for _ in range(20):
        child = run_create(project_id=project.id, parent_id=root.id)

        def cancel(child=child):
            time.sleep(0.003)
            run_cancel(project_id=project.id, run_id=child.id)

        def taker(child=child):
            granted = []
            for _ in range(10):
                try:
                    granted.append(pool_acquire(project_id=project.id, name="gpu", run_id=child.id).lease.id)
                except exceptions.ScopeCancelled:
                    pass
                finally:
                    connection.close()
            return granted

        results = run_in_threads([cancel, taker, taker])
        cancelled_at = Event.objects.get(type="run.cancelled", run_id=child.id).id
        granted = [lease_id for result in results[1:] for lease_id in result]
        for lease_id in granted:
            assert Event.objects.get(type="pool.acquired", subject_id=str(lease_id)).id < cancelled_at
        for lease_id in granted:
            pool_lease_release(project_id=project.id, lease_id=lease_id)  # allowed after the cancel
    replay(pool)
    stored = Pool.objects.get(id=pool.id)
    assert (stored.in_use, stored.waiting) == (0, 0)


def test_fast_and_careful_paths_mixed_keep_the_counters_exact_30_rounds():
    """Plain (fast) and queued or keyed (careful) requests on one small pool, 8 threads at once."""
    project = project_ensure(name="pools-fast")
    run = run_create(project_id=project.id)
    pool, _ = pool_put(project_id=project.id, name="gpu", capacity=2)

    def worker(n: int):
        try:
            for round_ in range(30):
                kwargs = {"wait_ms": 200} if n % 2 else {}
                if n % 4 == 3:
                    kwargs["key"] = f"k{n}-{round_}"
                acquired = pool_acquire(project_id=project.id, name="gpu", run_id=run.id, **kwargs)
                lease = acquired.lease
                if lease is not None and lease.state == "WAITING":
                    deadline = time.monotonic() + 5
                    while PoolLease.objects.get(id=lease.id).state == "WAITING" and time.monotonic() < deadline:
                        time.sleep(0.005)
                    lease = pool_wait_end(lease_id=lease.id).lease
                if lease is not None:
                    pool_lease_release(project_id=project.id, lease_id=lease.id)
        finally:
            connection.close()

    run_in_threads([lambda n=n: worker(n) for n in range(8)])
    replay(pool)
    stored = Pool.objects.get(id=pool.id)
    assert (stored.in_use, stored.waiting) == (0, 0)
    assert PoolLease.objects.filter(pool=pool, state__in=["WAITING", "HELD"]).count() == 0
    assert Event.objects.filter(type="pool.acquired", data__pool="gpu", project_id=project.id).count() > 0
