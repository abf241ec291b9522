"""Stuck cancellations: the ``runstate_cancellation_*`` metrics and the dashboard's panel (issue 20).

A handler that ignores its signal is played by a loop that keeps renewing its claim after
the cancel request; time is only ever waited for as "past" conditions.
"""

import datetime as dt
import re
import time

import pytest
from django.utils import timezone

from coordination.domain.states import TaskState
from coordination.models import Task
from coordination.reads.stuck_cancellations import MAINTENANCE, SIGNAL_USE, stuck_cancellations
from coordination.services.claims import claim_complete, claim_renew, task_claim
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.runs import run_create
from coordination.services.tasks import task_cancel, task_submit
from tests.operator.test_dashboard import PANELS, text_of
from tests.operator.test_metrics import scrape, value
from tests.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

# Long enough that a scrape or a panel read fits between two renewals on a busy machine.
LEASE_TTL_MS = 3000
STUCK = "runstate_cancellation_stuck_tasks"
OLDEST = "runstate_cancellation_requested_oldest_seconds"


@pytest.fixture
def jobs(project):
    mailbox, _ = mailbox_ensure(project_id=project.id, name="jobs", mode="WORK")
    return mailbox


def claimed(project, mailbox, worker_id="w-stubborn", lease_ttl_ms=LEASE_TTL_MS):
    run = run_create(project_id=project.id)
    task_submit(project_id=project.id, mailbox=mailbox, run_id=run.id, input={})
    (claim,) = task_claim(
        project_id=project.id, mailbox=mailbox, run_id=run.id, worker_id=worker_id, lease_ttl_ms=lease_ttl_ms
    )
    return claim


def renew_while_ignoring_the_signal(project, claim, until) -> None:
    """Renew the claim every ~TTL/10, as a worker whose handler does not stop, until ``until()``."""
    for _ in range(1000):
        renewed = claim_renew(project_id=project.id, claim_id=claim.claim_id, lease_ttl_ms=LEASE_TTL_MS)
        if until(renewed):
            return
        time.sleep(LEASE_TTL_MS / 10_000)
    raise AssertionError("the condition never held")


def renew(project, claim) -> None:
    """Renew once more, so the lease holds through the next read (the worker renews all along)."""
    claim_renew(project_id=project.id, claim_id=claim.claim_id, lease_ttl_ms=LEASE_TTL_MS)


def test_a_handler_that_ignores_its_signal_is_counted_and_listed_until_it_returns(anon, admin_client, project, jobs):
    claim = claimed(project, jobs)
    cancelled = task_cancel(project_id=project.id, task_id=claim.task.id, reason="enough")
    assert cancelled.state == TaskState.CANCELLATION_REQUESTED and cancelled.cancel_requested_at is not None
    requested_at = cancelled.cancel_requested_at

    # The worker keeps renewing (so it is told, renewal after renewal) and never returns.
    def past_its_ttl(renewed) -> bool:
        assert renewed.task.state == TaskState.CANCELLATION_REQUESTED
        return timezone.now() > requested_at + dt.timedelta(milliseconds=LEASE_TTL_MS)

    renew_while_ignoring_the_signal(project, claim, until=past_its_ttl)

    [stuck] = stuck_cancellations(timezone.now(), project.id)
    assert (stuck.task.id, stuck.cause, stuck.lease_ttl) == (
        claim.task.id,
        SIGNAL_USE,
        dt.timedelta(milliseconds=LEASE_TTL_MS),
    )
    renew(project, claim)
    samples = scrape(anon)
    assert value(samples, STUCK, project=project.name, mailbox="jobs") == 1
    assert value(samples, OLDEST, project=project.name, mailbox="jobs") >= LEASE_TTL_MS / 1000
    renew(project, claim)
    panel = text_of(admin_client.get(PANELS).json()["panels"]["stuck"])
    assert "w-stubborn" in panel and "jobs" in panel and SIGNAL_USE in panel
    # The last renewal's age and the lease's expiry, still ahead.
    assert re.search(r"[\d.]+ s ago [\d.]+ s ago in [\d.]+ s 3\.0 s", panel), panel

    renew(project, claim)

    # The handler returns at last: the task ends CANCELLED and nothing is stuck any more.
    assert claim_complete(project_id=project.id, claim_id=claim.claim_id, outcome=None).state == TaskState.CANCELLED
    samples = scrape(anon)
    assert value(samples, STUCK, project=project.name, mailbox="jobs") == 0
    assert value(samples, OLDEST, project=project.name, mailbox="jobs") == 0
    assert "No cancellation is stuck" in admin_client.get(PANELS).json()["panels"]["stuck"]


def test_a_lease_run_out_without_the_sweep_is_maintenance(anon, admin_client, project, jobs):
    claim = claimed(project, jobs, worker_id="w-gone")
    task_cancel(project_id=project.id, task_id=claim.task.id)
    # The worker is gone and no sweep runs here: once the lease has run out, the task stays
    # CANCELLATION_REQUESTED until the lease sweep records it. It is stuck once its request is
    # a lease TTL old, which comes after the lease (claimed, then cancelled) by as long as the
    # cancel came after the claim: wait for both, not only for the lease.
    task = Task.objects.get(id=claim.task.id)
    stuck_from = max(task.lease_expires_at, task.cancel_requested_at + dt.timedelta(milliseconds=LEASE_TTL_MS))
    wait_until(lambda: timezone.now() > stuck_from, what="the lease to run out and the request to be a TTL old")
    [stuck] = stuck_cancellations(timezone.now(), project.id)
    assert stuck.cause == MAINTENANCE
    assert value(scrape(anon), STUCK, project=project.name, mailbox="jobs") == 1
    panel = text_of(admin_client.get(PANELS).json()["panels"]["stuck"])
    assert "w-gone" in panel and MAINTENANCE in panel and "expired" in panel


def test_a_request_younger_than_a_long_lease_is_waiting_not_stuck(anon, project, jobs):
    mailbox_ensure(project_id=project.id, name="idle", mode="WORK")
    claim = claimed(project, jobs, lease_ttl_ms=3_600_000)
    task_cancel(project_id=project.id, task_id=claim.task.id)
    samples = scrape(anon)
    assert value(samples, STUCK, project=project.name, mailbox="jobs") == 0
    assert value(samples, OLDEST, project=project.name, mailbox="jobs") > 0
    # Every WORK mailbox has both series, 0 when nothing waits.
    assert (OLDEST, (("mailbox", "idle"), ("project", project.name))) in samples
    assert value(samples, OLDEST, project=project.name, mailbox="idle") == 0
    assert stuck_cancellations(timezone.now(), project.id) == []
