"""Issue 25, finding 3: a key bound to a run keeps to its subtree.

Mailboxes, pools and quotas belong to the project, not to a run: a bound key may use them for
runs of its subtree, but configuring them is refused with ``PERMISSION_DENIED`` and nothing
changes; a pool read counts only the subtree's leases, a quota read (whose level is the whole
project's use) is refused.
"""

import pytest

from coordination.models import PoolLease
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.pools import pool_acquire, pool_put
from coordination.services.quotas import quota_put
from coordination.services.runs import run_create
from tests.conftest import err, make_client, project_settings

pytestmark = pytest.mark.django_db


@pytest.fixture
def tree(project):
    """A job with two agents; ``bound`` is a key (every permission) bound to agent ``mine``."""
    job = run_create(project_id=project.id)
    mine = run_create(project_id=project.id, parent_id=job.id)
    theirs = run_create(project_id=project.id, parent_id=job.id)
    below = run_create(project_id=project.id, parent_id=mine.id)
    return {"job": job, "mine": mine, "theirs": theirs, "below": below, "bound": make_client(project, run_id=mine.id)}


def test_a_bound_key_cannot_configure_project_wide_limits_or_mailboxes(project, tree):
    mailbox_ensure(project_id=project.id, name="jobs", mode="WORK", lease_ttl_ms=30_000, max_attempts=5)
    pool_put(project_id=project.id, name="gpu", capacity=4)
    quota_put(project_id=project.id, name="openai", limit=600, period_ms=60_000)
    before = project_settings(project.id)
    bound = tree["bound"]
    for path, body in [
        # The attack of the issue: shrink what every sibling run shares.
        ("/v1/mailboxes/jobs", {"mode": "WORK", "leaseTtlMs": 1000, "maxAttempts": 1}),
        ("/v1/pools/gpu", {"capacity": 1}),
        ("/v1/quotas/openai", {"limit": 1, "periodMs": 86_400_000}),
        # Creating a new one is project-wide configuration too.
        ("/v1/mailboxes/fresh", {"mode": "QUEUE"}),
        ("/v1/pools/fresh", {"capacity": 1}),
        ("/v1/quotas/fresh", {"limit": 1, "periodMs": 1000}),
        # An ensure that would change nothing is refused all the same (no probing of settings).
        ("/v1/mailboxes/jobs", {"mode": "WORK"}),
    ]:
        error = err(bound.put(path, body, format="json"), 403, "PERMISSION_DENIED")
        assert "bound to a run" in error["message"], error
    assert project_settings(project.id) == before, "a refused configuration changed a project-wide setting"


def test_a_bound_key_is_refused_before_its_body_is_validated(tree):
    """The refusal does not depend on the body: a bound key learns nothing about names or shapes."""
    err(tree["bound"].put("/v1/pools/gpu", {"capacity": "lots"}, format="json"), 403, "PERMISSION_DENIED")
    err(tree["bound"].put("/v1/quotas/openai", {}, format="json"), 403, "PERMISSION_DENIED")


def test_an_unbound_key_still_configures(api, tree):
    assert api.put("/v1/pools/gpu", {"capacity": 2}, format="json").status_code == 201
    assert api.put("/v1/quotas/openai", {"limit": 5, "periodMs": 1000}, format="json").status_code == 201
    assert api.put("/v1/mailboxes/jobs", {"mode": "WORK"}, format="json").status_code == 201


def test_a_bound_keys_pool_read_counts_only_its_subtree(project, api, tree):
    pool_put(project_id=project.id, name="gpu", capacity=4)
    pool_acquire(project_id=project.id, name="gpu", run_id=tree["theirs"].id, units=2)
    pool_acquire(project_id=project.id, name="gpu", run_id=tree["job"].id, units=1)
    pool_acquire(project_id=project.id, name="gpu", run_id=tree["below"].id, units=1)
    pool_acquire(project_id=project.id, name="gpu", run_id=tree["theirs"].id, units=1, wait_ms=30_000)  # waits
    assert api.get("/v1/pools/gpu").json() == {"name": "gpu", "capacity": 4, "inUse": 4, "waiting": 1}
    assert tree["bound"].get("/v1/pools/gpu").json() == {"name": "gpu", "capacity": 4, "inUse": 1, "waiting": 0}
    pool_acquire(project_id=project.id, name="gpu", run_id=tree["mine"].id, units=1, wait_ms=30_000)  # waits too
    assert tree["bound"].get("/v1/pools/gpu").json() == {"name": "gpu", "capacity": 4, "inUse": 1, "waiting": 1}
    assert PoolLease.objects.filter(state="WAITING").count() == 2


def test_a_bound_keys_quota_read_is_refused(project, api, tree):
    """A token bucket's level is everybody's use at once: there is no subtree share to show."""
    quota_put(project_id=project.id, name="openai", limit=10, period_ms=60_000)
    assert api.get("/v1/quotas/openai").status_code == 200
    err(tree["bound"].get("/v1/quotas/openai"), 403, "PERMISSION_DENIED")
    # Not a hint that it exists: an unknown quota is refused the same way.
    err(tree["bound"].get("/v1/quotas/nowhere"), 403, "PERMISSION_DENIED")


def test_a_bound_key_still_reads_a_mailbox_it_works_on(project, tree):
    """Workers read their mailbox's lease TTL before claiming: configuration, not usage."""
    mailbox_ensure(project_id=project.id, name="jobs", mode="WORK", lease_ttl_ms=30_000)
    assert tree["bound"].get("/v1/mailboxes/jobs").json()["leaseTtlMs"] == 30_000


@pytest.mark.django_db(transaction=True)  # claims, acquisitions and takes read through other connections
def test_a_bound_key_still_uses_mailboxes_pools_and_quotas_for_its_subtree(project, tree):
    mailbox_ensure(project_id=project.id, name="jobs", mode="WORK")
    pool_put(project_id=project.id, name="gpu", capacity=1)
    quota_put(project_id=project.id, name="openai", limit=10, period_ms=60_000)
    bound, below = tree["bound"], str(tree["below"].id)
    assert bound.post("/v1/mailboxes/jobs/tasks", {"runId": below, "input": {}}, format="json").status_code == 201
    claims = bound.post("/v1/mailboxes/jobs/claims", {"runId": below}, format="json").json()["claims"]
    assert len(claims) == 1
    lease = bound.post("/v1/pools/gpu/leases", {"runId": below}, format="json")
    assert lease.status_code == 201, lease.content
    take = bound.post("/v1/quotas/openai/take", {"runId": below}, format="json")
    assert take.status_code == 200 and take.json()["granted"] is True, take.content
    err(bound.post("/v1/quotas/openai/take", {"runId": str(tree["theirs"].id)}, format="json"), 404, "NOT_FOUND")


@pytest.mark.django_db(transaction=True)  # the acquisition reads through another connection
def test_a_bound_keys_pool_refusal_counts_only_its_subtree(project, api, tree):
    """``POOL_EXHAUSTED``'s details are the pool read's figures: the subtree's, for a bound key."""
    pool_put(project_id=project.id, name="gpu", capacity=2)
    pool_acquire(project_id=project.id, name="gpu", run_id=tree["theirs"].id, units=2)
    refused = err(
        tree["bound"].post("/v1/pools/gpu/leases", {"runId": str(tree["mine"].id)}, format="json"),
        409,
        "POOL_EXHAUSTED",
    )
    assert refused["details"] == {"capacity": 2, "inUse": 0, "waiting": 0}
    unbound = err(
        api.post("/v1/pools/gpu/leases", {"runId": str(tree["mine"].id)}, format="json"), 409, "POOL_EXHAUSTED"
    )
    assert unbound["details"] == {"capacity": 2, "inUse": 2, "waiting": 0}


@pytest.mark.django_db(transaction=True)  # the acquisition and the event reads go through other connections
def test_a_bound_key_reads_its_pool_refusal_events_without_the_projects_figures(project, api, tree):
    """``pool.exhausted`` records the whole pool's ``inUse``/``waiting``: not shown to a bound key.

    The event is written once, for every reader; a bound key reads it under its own run with
    ``capacity`` and ``units`` (what it asked) but without the figures of the sibling runs.
    """
    pool_put(project_id=project.id, name="gpu", capacity=1)
    pool_acquire(project_id=project.id, name="gpu", run_id=tree["theirs"].id, units=1)
    bound, mine = tree["bound"], str(tree["mine"].id)
    err(bound.post("/v1/pools/gpu/leases", {"runId": mine}, format="json"), 409, "POOL_EXHAUSTED")
    (seen,) = bound.get(f"/v1/events?types=pool.exhausted&runId={mine}").json()["events"]
    assert seen["data"] == {"pool": "gpu", "units": 1, "capacity": 1}
    (full,) = api.get(f"/v1/events?types=pool.exhausted&runId={mine}").json()["events"]
    assert full["data"] == {"pool": "gpu", "units": 1, "capacity": 1, "inUse": 1, "waiting": 0}
