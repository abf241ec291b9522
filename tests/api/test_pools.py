"""Pools over HTTP and through their services: DESIGN.md "Shared limits" (pools)."""

import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection
from django.utils import timezone

from coordination.models import Event, Pool, PoolLease
from coordination.services.pools import pool_acquire, pool_lease_release, pool_put, pools_settle_due
from coordination.services.runs import run_cancel, run_create
from tests.conftest import err, make_client

# Long-polls read through other connections: the data must be committed.
pytestmark = pytest.mark.django_db(transaction=True)


def later(delay_s, fn):
    """Run ``fn`` in a thread after ``delay_s``; return the thread."""

    def target():
        try:
            time.sleep(delay_s)
            fn()
        finally:
            connection.close()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def run(api):
    return api.post("/v1/runs", {}, format="json").json()


@pytest.fixture
def gpu(api):
    response = api.put("/v1/pools/gpu", {"capacity": 3}, format="json")
    assert response.status_code == 201, response.content
    return response.json()


def acquire(api, run, units=1, **extra):
    return api.post("/v1/pools/gpu/leases", {"runId": run["id"], "units": units, **extra}, format="json")


def test_put_creates_then_changes_the_pool(api):
    created = api.put("/v1/pools/gpu", {"capacity": 4}, format="json")
    assert created.status_code == 201 and created["Location"] == "/v1/pools/gpu"
    assert created.json() == {"name": "gpu", "capacity": 4, "inUse": 0, "waiting": 0}
    changed = api.put("/v1/pools/gpu", {"capacity": 2}, format="json")
    assert changed.status_code == 200 and changed.json()["capacity"] == 2
    assert api.get("/v1/pools/gpu").json() == {"name": "gpu", "capacity": 2, "inUse": 0, "waiting": 0}
    err(api.put("/v1/pools/gpu", {"capacity": 0}, format="json"), 400, "VALIDATION_ERROR")


def test_put_needs_resource_config(project):
    writer = make_client(project, permissions=["coordination_write", "coordination_read"])
    err(writer.put("/v1/pools/gpu", {"capacity": 1}, format="json"), 403, "PERMISSION_DENIED")


def test_acquire_grants_a_lease_and_release_hands_it_back(api, run, gpu):
    response = acquire(api, run, units=2, leaseTtlMs=5000)
    assert response.status_code == 201, response.content
    lease = response.json()
    assert (lease["pool"], lease["runId"], lease["units"], lease["state"]) == ("gpu", run["id"], 2, "HELD")
    assert lease["expiresAt"]
    assert api.get("/v1/pools/gpu").json()["inUse"] == 2
    renewed = api.post(f"/v1/pool-leases/{lease['leaseId']}/renew", {"leaseTtlMs": 60000}, format="json")
    assert renewed.status_code == 200 and renewed.json()["expiresAt"] > lease["expiresAt"]
    released = api.post(f"/v1/pool-leases/{lease['leaseId']}/release")
    assert released.status_code == 200 and released.json()["state"] == "RELEASED"
    again = api.post(f"/v1/pool-leases/{lease['leaseId']}/release")
    assert again.status_code == 200 and again.json()["state"] == "RELEASED"  # idempotent
    assert api.get("/v1/pools/gpu").json()["inUse"] == 0
    err(api.post(f"/v1/pool-leases/{lease['leaseId']}/renew", {}, format="json"), 409, "LEASE_LOST")
    events = Event.objects.filter(subject_id=lease["leaseId"]).order_by("id")
    assert [(e.type, e.data["pool"], e.data["units"]) for e in events] == [
        ("pool.acquired", "gpu", 2),
        ("pool.released", "gpu", 2),
    ]


def test_exhausted_answers_its_details_without_counting_itself(api, run, gpu):
    assert acquire(api, run, units=3).status_code == 201
    error = err(acquire(api, run, units=1), 409, "POOL_EXHAUSTED")
    assert error["details"] == {"capacity": 3, "inUse": 3, "waiting": 0}
    assert Event.objects.filter(type="pool.exhausted").count() == 1


def test_more_units_than_capacity_is_a_validation_error(api, run, gpu):
    err(acquire(api, run, units=4), 400, "VALIDATION_ERROR")
    err(acquire(api, run, units=0), 400, "VALIDATION_ERROR")
    err(api.post("/v1/pools/nope/leases", {"runId": run["id"]}, format="json"), 404, "NOT_FOUND")


def test_waiters_are_granted_in_arrival_order_without_overtaking(project):
    """A small request behind a large one waits, even when it would fit."""
    pool, _ = pool_put(project_id=project.id, name="gpu", capacity=3)
    run = run_create(project_id=project.id)

    def ask(units):
        return pool_acquire(project_id=project.id, name="gpu", run_id=run.id, units=units, wait_ms=30000).lease

    first = ask(2)
    big = ask(2)  # does not fit (2 + 2 > 3): waits
    small = ask(1)  # would fit, but the big one arrived first: waits too
    assert (first.state, big.state, small.state) == ("HELD", "WAITING", "WAITING")
    refused = pool_acquire(project_id=project.id, name="gpu", run_id=run.id, units=1)
    assert refused.refusal.code == "POOL_EXHAUSTED"
    assert refused.refusal.details == {"capacity": 3, "inUse": 2, "waiting": 2}
    pool_lease_release(project_id=project.id, lease_id=first.id)
    # The release grants the head (2 units) and then the next that fits (1 unit): 3 of 3.
    states = {lease.id: lease.state for lease in PoolLease.objects.all()}
    assert (states[big.id], states[small.id]) == ("HELD", "HELD")
    assert Pool.objects.get(id=pool.id).in_use == 3
    acquired = Event.objects.filter(type="pool.acquired").order_by("id").values_list("subject_id", flat=True)
    assert list(acquired) == [str(first.id), str(big.id), str(small.id)]


def test_the_head_waiter_blocks_until_it_fits(project):
    pool_put(project_id=project.id, name="gpu", capacity=3)
    run = run_create(project_id=project.id)
    held = [
        pool_acquire(project_id=project.id, name="gpu", run_id=run.id, units=1, wait_ms=30000).lease for _ in range(3)
    ]
    big = pool_acquire(project_id=project.id, name="gpu", run_id=run.id, units=3, wait_ms=30000).lease
    small = pool_acquire(project_id=project.id, name="gpu", run_id=run.id, units=1, wait_ms=30000).lease
    pool_lease_release(project_id=project.id, lease_id=held[0].id)
    assert PoolLease.objects.get(id=small.id).state == "WAITING"  # 1 free, but the big one is first
    pool_lease_release(project_id=project.id, lease_id=held[1].id)
    pool_lease_release(project_id=project.id, lease_id=held[2].id)
    assert PoolLease.objects.get(id=big.id).state == "HELD"
    assert PoolLease.objects.get(id=small.id).state == "WAITING"


def test_an_expired_lease_frees_its_units_and_the_sweep_grants_the_next_waiter(project):
    pool, _ = pool_put(project_id=project.id, name="gpu", capacity=1)
    run = run_create(project_id=project.id)
    held = pool_acquire(project_id=project.id, name="gpu", run_id=run.id, lease_ttl_ms=100).lease
    waiter = pool_acquire(project_id=project.id, name="gpu", run_id=run.id, wait_ms=30000).lease
    assert waiter.state == "WAITING"
    assert pools_settle_due(now=timezone.now() + timedelta(seconds=1)) == 1
    assert PoolLease.objects.get(id=held.id).state == "EXPIRED"
    assert PoolLease.objects.get(id=waiter.id).state == "HELD"
    assert Pool.objects.get(id=pool.id).in_use == 1
    assert Event.objects.filter(type="pool.expired", subject_id=str(held.id), data__units=1).count() == 1
    assert pools_settle_due(now=timezone.now() + timedelta(seconds=1)) == 0  # nothing else due


def test_an_expired_lease_never_counts_even_before_the_sweep(api, run, gpu, project):
    first = acquire(api, run, units=3, leaseTtlMs=100).json()
    time.sleep(0.2)
    assert api.get("/v1/pools/gpu").json()["inUse"] == 0
    second = acquire(api, run, units=3)
    assert second.status_code == 201, second.content  # the acquire expired the first itself
    assert PoolLease.objects.get(id=first["leaseId"]).state == "EXPIRED"
    err(api.post(f"/v1/pool-leases/{first['leaseId']}/renew", {}, format="json"), 409, "LEASE_LOST")


def test_after_cancel_acquire_and_renew_get_the_runs_code_and_release_works(api, run, gpu):
    lease = acquire(api, run, units=2).json()
    api.post(f"/v1/runs/{run['id']}/cancel", {}, format="json")
    err(acquire(api, run), 409, "SCOPE_CANCELLED")
    err(api.post(f"/v1/pool-leases/{lease['leaseId']}/renew", {}, format="json"), 409, "SCOPE_CANCELLED")
    assert api.get("/v1/pools/gpu").json()["inUse"] == 2  # a cancel frees nothing by itself
    released = api.post(f"/v1/pool-leases/{lease['leaseId']}/release")
    assert released.status_code == 200 and released.json()["state"] == "RELEASED"
    assert api.get("/v1/pools/gpu").json()["inUse"] == 0


def test_a_waiter_is_answered_at_once_when_its_run_is_cancelled(api, run, gpu, project):
    acquire(api, run, units=3)
    child = api.post(f"/v1/runs/{run['id']}/children", {}, format="json").json()
    canceller = later(0.3, lambda: run_cancel(run_id=run["id"], project_id=project.id))
    started = time.monotonic()
    response = acquire(api, child, waitMs=20000)
    canceller.join()
    err(response, 409, "SCOPE_CANCELLED")
    assert time.monotonic() - started < 15  # answered by the cancel, not by the timeout
    assert PoolLease.objects.get(run_id=child["id"]).state == "CANCELLED"
    assert api.get("/v1/pools/gpu").json()["waiting"] == 0


def test_a_cancelled_waiter_lets_the_one_behind_it_through(project):
    pool_put(project_id=project.id, name="gpu", capacity=2)
    doomed_run = run_create(project_id=project.id)
    other_run = run_create(project_id=project.id)
    pool_acquire(project_id=project.id, name="gpu", run_id=other_run.id, units=1)
    doomed = pool_acquire(project_id=project.id, name="gpu", run_id=doomed_run.id, units=2, wait_ms=30000).lease
    behind = pool_acquire(project_id=project.id, name="gpu", run_id=other_run.id, units=1, wait_ms=30000).lease
    run_cancel(run_id=doomed_run.id, project_id=project.id)
    assert PoolLease.objects.get(id=doomed.id).state == "CANCELLED"
    assert PoolLease.objects.get(id=behind.id).state == "HELD"


def test_wait_is_woken_by_a_release_from_another_connection(api, run, gpu, project):
    held = acquire(api, run, units=3).json()
    releaser = later(0.3, lambda: pool_lease_release(project_id=project.id, lease_id=held["leaseId"]))
    response = acquire(api, run, units=2, waitMs=20000)
    releaser.join()
    assert response.status_code == 201, response.content
    assert response.json()["state"] == "HELD"


def test_wait_times_out_with_pool_exhausted_and_leaves_the_queue(api, run, gpu):
    acquire(api, run, units=3)
    error = err(acquire(api, run, units=1, waitMs=300), 409, "POOL_EXHAUSTED")
    assert error["details"] == {"capacity": 3, "inUse": 3, "waiting": 0}
    assert PoolLease.objects.filter(state="TIMED_OUT").count() == 1
    assert api.get("/v1/pools/gpu").json()["waiting"] == 0


def test_a_key_makes_acquire_idempotent(api, run, gpu):
    first = acquire(api, run, units=2, key="job-1")
    assert first.status_code == 201
    again = acquire(api, run, units=2, key="job-1")
    assert again.status_code == 200 and again.json()["leaseId"] == first.json()["leaseId"]
    err(acquire(api, run, units=1, key="job-1"), 409, "KEY_CONFLICT")
    assert api.get("/v1/pools/gpu").json()["inUse"] == 2
    api.post(f"/v1/pool-leases/{first.json()['leaseId']}/release")
    fresh = acquire(api, run, units=2, key="job-1")  # released: the key starts a new lease
    assert fresh.status_code == 201 and fresh.json()["leaseId"] != first.json()["leaseId"]


def test_another_projects_pool_and_lease_are_not_found(api, other_api, run, gpu):
    lease = acquire(api, run).json()
    other_run = other_api.post("/v1/runs", {}, format="json").json()
    err(other_api.post("/v1/pools/gpu/leases", {"runId": other_run["id"]}, format="json"), 404, "NOT_FOUND")
    err(other_api.get("/v1/pools/gpu"), 404, "NOT_FOUND")
    err(other_api.post(f"/v1/pool-leases/{lease['leaseId']}/release"), 404, "NOT_FOUND")
    err(other_api.post(f"/v1/pool-leases/{lease['leaseId']}/renew", {}, format="json"), 404, "NOT_FOUND")
    err(api.post("/v1/pools/gpu/leases", {"runId": other_run["id"]}, format="json"), 404, "NOT_FOUND")


def test_a_run_bound_key_uses_only_runs_in_its_subtree(api, project, gpu):
    scoped = run_create(project_id=project.id)
    sibling = run_create(project_id=project.id)
    bound = make_client(project, run_id=scoped.id)
    mine = bound.post("/v1/pools/gpu/leases", {"runId": str(scoped.id)}, format="json")
    assert mine.status_code == 201
    err(bound.post("/v1/pools/gpu/leases", {"runId": str(sibling.id)}, format="json"), 404, "NOT_FOUND")
    theirs = api.post("/v1/pools/gpu/leases", {"runId": str(sibling.id)}, format="json").json()
    err(bound.post(f"/v1/pool-leases/{theirs['leaseId']}/release"), 404, "NOT_FOUND")
    assert bound.post(f"/v1/pool-leases/{mine.json()['leaseId']}/release").status_code == 200


def test_pool_names_are_checked_like_mailbox_names(api, run):
    err(api.put("/v1/pools/bad%20name", {"capacity": 1}, format="json"), 400, "VALIDATION_ERROR")
    err(api.get("/v1/pools/%00"), 404, "NOT_FOUND")
    err(api.post("/v1/pools/%00/leases", {"runId": run["id"]}, format="json"), 404, "NOT_FOUND")


def test_a_waiter_under_a_run_past_its_deadline_is_answered_with_deadline_exceeded(api, gpu, project):
    holder = api.post("/v1/runs", {}, format="json").json()
    acquire(api, holder, units=3)
    deadline = (datetime.now(UTC) + timedelta(seconds=1)).isoformat()
    late = api.post("/v1/runs", {"deadline": deadline}, format="json").json()
    started = time.monotonic()
    err(acquire(api, late, waitMs=20000), 409, "DEADLINE_EXCEEDED")  # no sweep needed
    assert time.monotonic() - started < 15
    assert PoolLease.objects.get(run_id=late["id"]).state == "CANCELLED"
