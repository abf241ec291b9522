"""Claiming one specific task (``task_claim_by_id``) and re-waking unclaimed work (``tasks_rewake_unclaimed``).

A Celery worker woken for a task claims exactly that task: the claim decides whether a
delivery does anything, so duplicates, finished tasks and inactive runs are harmless.
"""

from datetime import UTC, datetime, timedelta

import pytest

from coordination.domain import exceptions
from coordination.models import Event, Run, Task
from coordination.services.claims import claim_complete, claim_fail, claim_id_for, claim_renew, task_claim_by_id
from coordination.services.groups import group_create, group_submit, group_verdict
from coordination.services.keys import project_ensure
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.runs import run_cancel, run_complete, run_create
from coordination.services.sweeps import tasks_rewake_unclaimed
from coordination.services.tasks import task_cancel, task_submit

pytestmark = pytest.mark.django_db


@pytest.fixture
def project():
    return project_ensure(name="byid")


@pytest.fixture
def jobs(project):
    mailbox, _ = mailbox_ensure(project_id=project.id, name="jobs", mode="WORK", lease_ttl_ms=5000)
    return mailbox


@pytest.fixture
def run(project):
    return run_create(project_id=project.id)


def submit(project, jobs, run, **extra):
    task, _ = task_submit(project_id=project.id, mailbox=jobs, run_id=run.id, input={"n": 1}, **extra)
    return task


def claim(project, task, **extra):
    return task_claim_by_id(project_id=project.id, task_id=task.id, worker_id="w1", **extra)


def past(seconds: float = 1) -> datetime:
    return datetime.now(UTC) - timedelta(seconds=seconds)


def test_claims_the_queued_task_under_the_mailbox_lease(project, jobs, run):
    task = submit(project, jobs, run)
    got = claim(project, task)
    assert (got.task.id, got.attempt) == (task.id, 1)
    task.refresh_from_db()
    assert (task.state, task.attempts, task.worker_id) == ("RUNNING", 1, "w1")
    assert 4 < (task.lease_expires_at - task.started_at).total_seconds() <= 5
    event = Event.objects.get(type="task.claimed", subject_id=str(task.id))
    assert event.data == {"attempt": 1, "workerId": "w1", "claimId": claim_id_for(task.id, 1)}


def test_an_explicit_lease_ttl_wins(project, jobs, run):
    got = claim(project, submit(project, jobs, run), lease_ttl_ms=60_000)
    assert (got.lease_expires_at - datetime.now(UTC)).total_seconds() > 50


def test_a_duplicate_delivery_claims_nothing(project, jobs, run):
    task = submit(project, jobs, run)
    assert claim(project, task) is not None
    assert claim(project, task) is None
    assert Task.objects.get(id=task.id).attempts == 1
    assert Event.objects.filter(type="task.claimed", subject_id=str(task.id)).count() == 1


@pytest.mark.parametrize("end", ["complete", "fail", "cancel"])
def test_a_finished_task_is_never_claimed(project, jobs, run, end):
    task = submit(project, jobs, run)
    if end == "cancel":
        task_cancel(project_id=project.id, task_id=task.id)
    else:
        got = claim(project, task)
        if end == "complete":
            claim_complete(project_id=project.id, claim_id=got.claim_id, outcome=1)
        else:
            claim_fail(project_id=project.id, claim_id=got.claim_id, error="x")
    state = Task.objects.get(id=task.id).state
    assert claim(project, task) is None
    assert Task.objects.get(id=task.id).state == state


def test_an_inactive_run_refuses_with_its_code(project, jobs, run):
    cancelled = submit(project, jobs, run)
    run_cancel(run_id=run.id, project_id=project.id)
    with pytest.raises(exceptions.ScopeCancelled):
        claim(project, cancelled)
    other = run_create(project_id=project.id)
    completed = submit(project, jobs, other)
    run_complete(run_id=other.id, project_id=project.id)
    with pytest.raises(exceptions.ScopeCompleted):
        claim(project, completed)
    late = run_create(project_id=project.id, deadline=datetime.now(UTC) + timedelta(hours=1))
    queued = submit(project, jobs, late)
    Run.objects.filter(id=late.id).update(deadline=past())
    with pytest.raises(exceptions.DeadlineExceeded):
        claim(project, queued)
    assert Task.objects.get(id=queued.id).state == "QUEUED"


def test_another_projects_or_mailboxs_task_is_not_found(project, jobs, run):
    task = submit(project, jobs, run)
    other = project_ensure(name="byid-other")
    with pytest.raises(exceptions.NotFound):
        task_claim_by_id(project_id=other.id, task_id=task.id)
    elsewhere, _ = mailbox_ensure(project_id=project.id, name="elsewhere", mode="WORK")
    with pytest.raises(exceptions.NotFound):
        task_claim_by_id(project_id=project.id, task_id=task.id, mailbox_id=elsewhere.id)
    assert task_claim_by_id(project_id=project.id, task_id=task.id, mailbox_id=jobs.id) is not None


def test_a_task_not_yet_available_or_past_its_expiry_is_not_claimed(project, jobs, run):
    delayed = submit(project, jobs, run)
    got = claim(project, delayed)
    claim_fail(project_id=project.id, claim_id=got.claim_id, error="x", retry=True, retry_delay_ms=60_000)
    assert claim(project, delayed) is None
    expiring = submit(project, jobs, run, expires_at=datetime.now(UTC) + timedelta(hours=1))
    Task.objects.filter(id=expiring.id).update(expires_at=past())
    assert claim(project, expiring) is None


def test_an_expired_lease_is_taken_over_and_the_stale_claim_is_fenced(project, jobs, run):
    task = submit(project, jobs, run)
    stale = claim(project, task)
    assert claim(project, task) is None  # the lease still holds
    Task.objects.filter(id=task.id).update(lease_expires_at=past())
    fresh = claim(project, task)
    assert fresh.attempt == 2
    assert Event.objects.get(type="task.requeued", subject_id=str(task.id)).data["cause"] == "lease_expired"
    with pytest.raises(exceptions.LeaseLost):
        claim_complete(project_id=project.id, claim_id=stale.claim_id, outcome="late")
    assert claim_complete(project_id=project.id, claim_id=fresh.claim_id, outcome="ok").state == "SUCCEEDED"


def test_a_takeover_with_attempts_spent_fails_the_task(project, jobs, run):
    task = submit(project, jobs, run, max_attempts=1)
    claim(project, task)
    Task.objects.filter(id=task.id).update(lease_expires_at=past())
    assert claim(project, task) is None
    task.refresh_from_db()
    assert (task.state, task.error["code"]) == ("FAILED", "lease_expired")


def test_a_cancellation_in_progress_is_left_to_the_sweep(project, jobs, run):
    task = submit(project, jobs, run)
    claim(project, task)
    task_cancel(project_id=project.id, task_id=task.id, grace_ms=0)
    Task.objects.filter(id=task.id).update(lease_expires_at=past())
    assert claim(project, task) is None
    assert Task.objects.get(id=task.id).state == "CANCELLATION_REQUESTED"


def test_a_group_member_is_claimed_on_its_gate_and_counts_for_the_group(project, jobs, run):
    group = group_create(project_id=project.id, mailbox_name="jobs", condition="FIRST_ACCEPTED", parent_scope_id=run.id)
    member, _, _ = group_submit(project_id=project.id, group_id=group.id, input={"m": 1})
    other, _, _ = group_submit(project_id=project.id, group_id=group.id, input={"m": 2})
    got = claim(project, member)
    assert got.task.run_id == group.scope_id
    claim_complete(project_id=project.id, claim_id=got.claim_id, outcome="draft")
    result = group_verdict(project_id=project.id, group_id=group.id, task_id=member.id, verdict="ACCEPTED")
    assert result.group.state == "FINALIZED"
    # The finalized group cancelled its gate: the loser's delivery is refused with that code.
    with pytest.raises(exceptions.ScopeCancelled):
        claim(project, other)


def test_a_group_member_whose_takeover_would_end_it_is_left_to_the_sweep(project, jobs, run):
    group = group_create(project_id=project.id, mailbox_name="jobs", condition="ALL_TERMINAL", parent_scope_id=run.id)
    member, _, _ = group_submit(project_id=project.id, group_id=group.id, input={}, max_attempts=1)
    claim(project, member)
    Task.objects.filter(id=member.id).update(lease_expires_at=past())
    assert claim(project, member) is None
    assert Task.objects.get(id=member.id).state == "RUNNING"


def test_renewal_reports_a_cancellation_request(project, jobs, run):
    task = submit(project, jobs, run)
    got = claim(project, task)
    task_cancel(project_id=project.id, task_id=task.id)
    renewed = claim_renew(project_id=project.id, claim_id=got.claim_id)
    assert renewed.task.state == "CANCELLATION_REQUESTED"


# Re-waking work whose message may be lost ------------------------------------------------


def test_rewake_moves_long_unclaimed_tasks_of_the_given_mailboxes_only(project, jobs, run):
    other, _ = mailbox_ensure(project_id=project.id, name="other", mode="WORK")
    stale = submit(project, jobs, run)
    fresh = submit(project, jobs, run)
    elsewhere, _ = task_submit(project_id=project.id, mailbox=other, run_id=run.id, input={})
    running = submit(project, jobs, run)
    claim(project, running)
    Task.objects.filter(id__in=[stale.id, elsewhere.id, running.id]).update(available_at=past(120))

    assert tasks_rewake_unclaimed(mailbox_ids=[jobs.id], unclaimed_for=timedelta(seconds=60)) == 1
    stale.refresh_from_db()
    assert (datetime.now(UTC) - stale.available_at).total_seconds() < 5
    assert Task.objects.get(id=fresh.id).available_at == fresh.available_at
    assert Task.objects.get(id=elsewhere.id).available_at < past(60)
    # At most once per interval: the task now looks freshly available.
    assert tasks_rewake_unclaimed(mailbox_ids=[jobs.id], unclaimed_for=timedelta(seconds=60)) == 0
    assert claim(project, stale) is not None
