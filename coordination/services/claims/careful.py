"""The careful paths: each claim operation as ORM steps, in the house lock order.

They run on SQLite, with ``RUNSTATE_FAST_PATHS = False``, and whenever a single statement
(``statements``) touches no row: they then decide the exact answer (``LEASE_LOST``, the
run's refusal code, a takeover, ...). Both paths write the same rows and the same events
(``tests/coordination/test_claim_paths_state_machine.py``).
"""

import uuid
from datetime import datetime, timedelta

from django.db import transaction
from django.utils import timezone

from coordination.domain import exceptions
from coordination.domain.states import TASK_TERMINAL, TaskState
from coordination.models import Mailbox, Task
from coordination.services import dispatch, task_transitions
from coordination.services.claims.claim import Claim, claimed_event_data, parse_claim_id
from coordination.services.claims.leases import (
    CLAIMABLE,
    RUN_DEADLINE_AHEAD,
    TAKEOVER_DUE,
    claim_holds,
    lease_expired,
    takeover_due,
)
from coordination.services.events import event_for, events_record_many
from coordination.services.groups import LockedGroup
from coordination.services.locking import run_chain_lock_active
from coordination.services.retry import retrying
from coordination.services.tasks import after_change, lock_task, record, run_refusal


@transaction.atomic
def task_claim(
    *,
    project_id: uuid.UUID,
    mailbox: Mailbox,
    run_id: uuid.UUID,
    worker_id: str,
    lease_ttl_ms: int | None,
    max_claims: int,
) -> list[Claim]:
    """Claim up to ``max_claims`` tasks of ``run_id``, expired leases taken over first (``operations.task_claim``)."""
    # Claiming is new work: hold the chain so a cancel waits for us or refuses us.
    run_chain_lock_active(run_id, project_id=project_id)
    now = timezone.now()
    in_run = Task.objects.filter(mailbox=mailbox, run_id=run_id)
    # SKIP LOCKED: a row another claimer holds is theirs; we never wait for it.
    expired = list(
        in_run.filter(TAKEOVER_DUE.q(now)).order_by("lease_expires_at").select_for_update(skip_locked=True)[:max_claims]
    )
    events = [event for task in expired for event in lease_expired(task, now)]
    candidates = list(
        in_run.filter(CLAIMABLE.q(now))
        .order_by("-priority", "created_at")
        .select_for_update(skip_locked=True)[:max_claims]
    )
    lease_until = now + timedelta(milliseconds=lease_ttl_ms or mailbox.lease_ttl_ms)
    task_transitions.claim_many(candidates, now=now, lease_until=lease_until, worker_id=worker_id)
    claims = []
    for task in candidates:
        claims.append(Claim(task, task.attempts, lease_until))
        events.append(event_for(task, "task.claimed", **claimed_event_data(task, worker_id)))
    events_record_many(events)
    return claims


@transaction.atomic
def task_claim_by_id(
    *,
    project_id: uuid.UUID,
    task_id: uuid.UUID,
    worker_id: str,
    lease_ttl_ms: int | None,
    mailbox_id: uuid.UUID | None,
) -> Claim | None:
    """Claim one task by id (see ``operations.task_claim_by_id``): its expired lease taken over first."""
    rows = Task.objects.filter(id=task_id, project_id=project_id)
    if mailbox_id is not None:
        rows = rows.filter(mailbox_id=mailbox_id)
    run_id = rows.values_list("run_id", flat=True).first()
    if run_id is None:
        raise exceptions.NotFound("Task not found.", taskId=str(task_id))
    # Claiming is new work: hold the chain so a cancel waits for us or refuses us.
    run_chain_lock_active(run_id, project_id=project_id)
    # Wait for the row rather than skip it: a duplicate delivery then sees the first claim.
    task = Task.objects.select_for_update(of=("self",)).select_related("mailbox").get(id=task_id)
    now = timezone.now()
    events = lease_expired(task, now) if takeover_due(task, now) else []
    claim = None
    if CLAIMABLE(task, now):
        lease_until = now + timedelta(milliseconds=lease_ttl_ms or task.mailbox.lease_ttl_ms)
        task_transitions.claim(task, now=now, lease_until=lease_until, worker_id=worker_id)
        events.append(event_for(task, "task.claimed", **claimed_event_data(task, worker_id)))
        claim = Claim(task, task.attempts, task.lease_expires_at, lease_ttl_ms or task.mailbox.lease_ttl_ms)
    events_record_many(events)
    return claim


def _locked_claim(project_id: uuid.UUID, claim_id: str, *, now: datetime) -> tuple[Task, LockedGroup | None]:
    """Lock the claim's task (group first) and return it if the claim still holds it; else raise.

    A claim is lost when another attempt took the task over, the task left its held
    states, the lease expired, or a cooperative cancel's grace elapsed. When the run is
    inactive, its refusal code wins over ``LEASE_LOST`` (DESIGN.md "Precise points").
    """
    task_id, attempt = parse_claim_id(claim_id)
    try:
        # The row lock serializes us with claimers, sweeps, cascades and group decisions.
        task, locked_group = lock_task(project_id, task_id)
    except exceptions.NotFound:
        raise exceptions.NotFound("Claim not found.", claimId=str(claim_id)) from None
    held = claim_holds(task, attempt, now)
    # A cancel or complete of the run ends its held tasks in the same transaction, so a
    # held task's run can only be inactive through a deadline: skip the chain read then.
    if held and RUN_DEADLINE_AHEAD(task, now):
        return task, locked_group
    refusal = run_refusal(task, now)
    if refusal is not None:
        raise refusal
    if not held:
        raise exceptions.LeaseLost(claimId=str(claim_id), taskId=str(task.id), state=task.state)
    return task, locked_group


@retrying
@transaction.atomic
def claim_renew(*, project_id: uuid.UUID, claim_id: str, lease_ttl_ms: int | None) -> Claim:
    """Extend the claim's lease (the row locked)."""
    now = timezone.now()
    task, _ = _locked_claim(project_id, claim_id, now=now)
    task.lease_expires_at = now + timedelta(milliseconds=lease_ttl_ms or task.mailbox.lease_ttl_ms)
    task.last_renewed_at = now
    task.save(update_fields=["lease_expires_at", "last_renewed_at"])
    return Claim(task, task.attempts, task.lease_expires_at)


@retrying
@transaction.atomic
def claim_complete(*, project_id: uuid.UUID, claim_id: str, outcome: object) -> Task:
    """Record the handler's result (the row locked, its group re-evaluated)."""
    now = timezone.now()
    task, locked_group = _locked_claim(project_id, claim_id, now=now)
    task_transitions.complete(task, now=now, outcome=outcome)
    if task.state == TaskState.CANCELLED:
        record(task, "task.cancelled", reason=task.cancel_reason, cause="handler_returned")
    else:
        record(task, "task.succeeded", attempt=task.attempts)
    after_change(task, locked_group, now)
    return task


@retrying
@transaction.atomic
def claim_fail(*, project_id: uuid.UUID, claim_id: str, error: object, retry: bool, retry_delay_ms: int) -> Task:
    """Record a failure: requeued or ``FAILED`` (the row locked, its group re-evaluated)."""
    now = timezone.now()
    task, locked_group = _locked_claim(project_id, claim_id, now=now)
    available_at = now + timedelta(milliseconds=retry_delay_ms)
    task_transitions.fail(task, now=now, error=error, retry=retry, available_at=available_at)
    if task.state == TaskState.QUEUED:
        record(task, "task.requeued", cause="retry", attempt=task.attempts, error=error)
        dispatch.work_requeued(task)
        return task
    record(task, "task.failed", error=error, attempt=task.attempts)
    after_change(task, locked_group, now)
    return task


@retrying
@transaction.atomic
def claim_release(*, project_id: uuid.UUID, claim_id: str) -> Task:
    """Hand the task back, or answer a finished one unchanged (the row locked)."""
    task_id, attempt = parse_claim_id(claim_id)
    try:
        task, locked_group = lock_task(project_id, task_id)
    except exceptions.NotFound:
        raise exceptions.NotFound("Claim not found.", claimId=str(claim_id)) from None
    if task.attempts != attempt or task.state == TaskState.QUEUED:
        raise exceptions.LeaseLost(claimId=str(claim_id), taskId=str(task.id), state=task.state)
    if task.state in TASK_TERMINAL:
        return task
    now = timezone.now()
    task_transitions.release(task, now=now)
    if task.state == TaskState.CANCELLED:
        record(task, "task.cancelled", reason=task.cancel_reason, cause="released")
    else:
        record(task, "task.requeued", cause="released", attempt=task.attempts)
        dispatch.work_requeued(task)
    after_change(task, locked_group, now)
    return task
