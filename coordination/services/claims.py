"""Claims: hand queued tasks out under a lease, and the operations fenced by the claim.

A claim is ``(task id, attempt)``. Every operation on it is fenced: a stale worker (its
lease taken over, its task cancelled) changes nothing and hears ``LEASE_LOST`` or the
run's own refusal code.
"""

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import F, Q
from django.db.models.functions import Coalesce
from django.utils import timezone

from coordination import exceptions
from coordination.ids import fence_id, parse_fence_id
from coordination.models import Event, Mailbox, Task
from coordination.services import dispatch
from coordination.services.events import event_for, events_record_many
from coordination.services.groups import LockedGroup
from coordination.services.locking import run_chain_lock_active
from coordination.services.mailboxes import validate_lease_ttl_ms
from coordination.services.retry import retrying
from coordination.services.tasks import after_change, lock_task, record, run_refusal
from coordination.states import TASK_HELD, TASK_TERMINAL, MailboxMode, TaskState

MAX_CLAIMS_PER_CALL = 100


@dataclass(frozen=True)
class Claim:
    """A task handed to a worker under a lease: ``claim_id`` fences every later operation."""

    task: Task
    attempt: int
    lease_expires_at: datetime

    @property
    def claim_id(self) -> str:
        """Return the opaque claim id."""
        return claim_id_for(self.task.id, self.attempt)


def claim_id_for(task_id: uuid.UUID, attempt: int) -> str:
    """Return the claim id of ``attempt`` on ``task_id``."""
    return fence_id("c", task_id, attempt)


def parse_claim_id(claim_id: str) -> tuple[uuid.UUID, int]:
    """Split a claim id into task id and attempt; a malformed one is ``NOT_FOUND``."""
    try:
        return parse_fence_id("c", claim_id)
    except ValueError:
        raise exceptions.NotFound("Claim not found.", claimId=str(claim_id)) from None


# Claim -----------------------------------------------------------------------------------


@transaction.atomic
def task_claim(
    *,
    project_id: uuid.UUID,
    mailbox: Mailbox,
    run_id: uuid.UUID,
    worker_id: str = "",
    lease_ttl_ms: int | None = None,
    max_claims: int = 1,
) -> list[Claim]:
    """Claim up to ``max_claims`` tasks of exactly ``run_id``, highest priority then oldest.

    Expired leases of the run are taken over first (their tasks go back to the queue, or
    fail when their attempts are spent), so crash takeover never waits for a sweep. A group
    member whose takeover would end it is left to the sweep, which locks its group first.
    """
    if mailbox.mode != MailboxMode.WORK:
        raise exceptions.MailboxModeConflict(f"Mailbox '{mailbox.name}' holds messages, not tasks.")
    validate_lease_ttl_ms(lease_ttl_ms)
    if not 1 <= max_claims <= MAX_CLAIMS_PER_CALL:
        raise exceptions.ValidationFailed("Invalid max.", max=f"must be between 1 and {MAX_CLAIMS_PER_CALL}")
    # Claiming is new work: hold the chain so a cancel waits for us or refuses us.
    run_chain_lock_active(run_id, project_id=project_id)
    now = timezone.now()
    in_run = Task.objects.filter(mailbox=mailbox, run_id=run_id)
    # SKIP LOCKED: a row another claimer holds is theirs; we never wait for it.
    expired = list(
        in_run.filter(state=TaskState.RUNNING, lease_expires_at__lte=now)
        .filter(Q(group__isnull=True) | Q(attempts__lt=F("max_attempts")))
        .filter(Q(cancel_grace_until__isnull=True))
        .order_by("lease_expires_at")
        .select_for_update(skip_locked=True)[:max_claims]
    )
    events = [event for task in expired for event in lease_expired(task, now)]
    candidates = list(
        in_run.filter(state=TaskState.QUEUED, available_at__lte=now)
        .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now))
        .order_by("-priority", "created_at")
        .select_for_update(skip_locked=True)[:max_claims]
    )
    lease_until = now + timedelta(milliseconds=lease_ttl_ms or mailbox.lease_ttl_ms)
    if candidates:
        Task.objects.filter(id__in=[t.id for t in candidates]).update(
            state=TaskState.RUNNING,
            attempts=F("attempts") + 1,
            lease_expires_at=lease_until,
            worker_id=worker_id,
            started_at=Coalesce(F("started_at"), now),
        )
    claims = []
    for task in candidates:
        task.state = TaskState.RUNNING
        task.attempts += 1
        task.lease_expires_at = lease_until
        task.worker_id = worker_id
        task.started_at = task.started_at or now
        claims.append(Claim(task, task.attempts, lease_until))
        events.append(event_for(task, "task.claimed", attempt=task.attempts, workerId=worker_id))
    events_record_many(events)
    return claims


def lease_expired(task: Task, now: datetime) -> list[Event]:
    """Settle a locked held task whose lease ran out (or whose cancel grace passed)."""
    task.lease_expires_at = None
    task.worker_id = ""
    if task.state == TaskState.CANCELLATION_REQUESTED:
        task.state = TaskState.CANCELLED
        task.finished_at = now
        task.save(update_fields=["state", "finished_at", "lease_expires_at", "worker_id"])
        return [event_for(task, "task.cancelled", reason=task.cancel_reason, cause="cancellation_finalized")]
    if task.attempts < task.max_attempts:
        task.state = TaskState.QUEUED
        task.available_at = now
        task.save(update_fields=["state", "available_at", "lease_expires_at", "worker_id"])
        # A crashed Celery worker's message is gone: send the task out again.
        dispatch.work_requeued(task)
        return [event_for(task, "task.requeued", cause="lease_expired", attempt=task.attempts)]
    task.state = TaskState.FAILED
    task.error = {"code": "lease_expired", "message": "The lease expired with no attempts left."}
    task.finished_at = now
    task.save(update_fields=["state", "error", "finished_at", "lease_expires_at", "worker_id"])
    return [event_for(task, "task.failed", error=task.error)]


def takeover_due(task: Task, now: datetime) -> bool:
    """Whether a claimer may take over ``task``'s expired lease itself (the same rule as ``task_claim``)."""
    return (
        task.state == TaskState.RUNNING
        and task.lease_expires_at is not None
        and task.lease_expires_at <= now
        and task.cancel_grace_until is None
        and (task.group_id is None or task.attempts < task.max_attempts)
    )


@transaction.atomic
def task_claim_by_id(
    *,
    project_id: uuid.UUID,
    task_id: uuid.UUID,
    worker_id: str = "",
    lease_ttl_ms: int | None = None,
    mailbox_id: uuid.UUID | None = None,
) -> Claim | None:
    """Claim one specific task under a lease; return None when it is not claimable now.

    A Celery worker woken for this task calls it, and the claim decides: a duplicate
    message, a task another worker holds, a finished one, one not yet available (retry
    delay) or past its ``expiresAt`` answers None. An expired lease is taken over first, as
    ``task_claim`` does. An inactive run refuses with its own code. ``mailbox_id`` given,
    a task of another mailbox is ``NOT_FOUND``.
    """
    validate_lease_ttl_ms(lease_ttl_ms)
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
    claimable = (
        task.state == TaskState.QUEUED
        and task.available_at <= now
        and (task.expires_at is None or task.expires_at > now)
    )
    claim = None
    if claimable:
        task.state = TaskState.RUNNING
        task.attempts += 1
        task.lease_expires_at = now + timedelta(milliseconds=lease_ttl_ms or task.mailbox.lease_ttl_ms)
        task.worker_id = worker_id
        task.started_at = task.started_at or now
        task.save(update_fields=["state", "attempts", "lease_expires_at", "worker_id", "started_at"])
        events.append(event_for(task, "task.claimed", attempt=task.attempts, workerId=worker_id))
        claim = Claim(task, task.attempts, task.lease_expires_at)
    events_record_many(events)
    return claim


# Operations on a claim -------------------------------------------------------------------


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
    held = (
        task.attempts == attempt
        and task.state in TASK_HELD
        and task.lease_expires_at is not None
        and task.lease_expires_at > now
        and (task.cancel_grace_until is None or task.cancel_grace_until > now)
    )
    # A cancel or complete of the run ends its held tasks in the same transaction, so a
    # held task's run can only be inactive through a deadline: skip the chain read then.
    if held and (task.run_deadline is None or task.run_deadline > now):
        return task, locked_group
    refusal = run_refusal(task, now)
    if refusal is not None:
        raise refusal
    if not held:
        raise exceptions.LeaseLost(claimId=str(claim_id), taskId=str(task.id), state=task.state)
    return task, locked_group


@retrying
@transaction.atomic
def claim_renew(*, project_id: uuid.UUID, claim_id: str, lease_ttl_ms: int | None = None) -> Claim:
    """Extend the claim's lease; the answer tells whether cancellation was requested."""
    validate_lease_ttl_ms(lease_ttl_ms)
    now = timezone.now()
    task, _ = _locked_claim(project_id, claim_id, now=now)
    task.lease_expires_at = now + timedelta(milliseconds=lease_ttl_ms or task.mailbox.lease_ttl_ms)
    task.save(update_fields=["lease_expires_at"])
    return Claim(task, task.attempts, task.lease_expires_at)


@retrying
@transaction.atomic
def claim_complete(*, project_id: uuid.UUID, claim_id: str, outcome: object) -> Task:
    """Record the handler's result: ``SUCCEEDED``, or ``CANCELLED`` if cancellation was requested."""
    now = timezone.now()
    task, locked_group = _locked_claim(project_id, claim_id, now=now)
    task.outcome = outcome
    task.finished_at = now
    task.lease_expires_at = None
    if task.state == TaskState.CANCELLATION_REQUESTED:
        task.state = TaskState.CANCELLED
        event = event_for(task, "task.cancelled", reason=task.cancel_reason, cause="handler_returned")
    else:
        task.state = TaskState.SUCCEEDED
        event = event_for(task, "task.succeeded", attempt=task.attempts)
    task.save(update_fields=["state", "outcome", "finished_at", "lease_expires_at"])
    events_record_many([event])
    after_change(task, locked_group, now)
    return task


@retrying
@transaction.atomic
def claim_fail(
    *, project_id: uuid.UUID, claim_id: str, error: object, retry: bool = False, retry_delay_ms: int = 0
) -> Task:
    """Record a failure: back to the queue while attempts remain and ``retry`` is set, else ``FAILED``.

    After a cancellation request a failure is final and never rewritten as a cancellation.
    """
    if retry_delay_ms < 0:
        raise exceptions.ValidationFailed("Invalid retry delay.", retryDelayMs="must be >= 0")
    now = timezone.now()
    task, locked_group = _locked_claim(project_id, claim_id, now=now)
    task.error = error
    task.lease_expires_at = None
    task.worker_id = ""
    if retry and task.state == TaskState.RUNNING and task.attempts < task.max_attempts:
        task.state = TaskState.QUEUED
        task.available_at = now + timedelta(milliseconds=retry_delay_ms)
        task.save(update_fields=["state", "error", "available_at", "lease_expires_at", "worker_id"])
        record(task, "task.requeued", cause="retry", attempt=task.attempts, error=error)
        dispatch.work_requeued(task)
        return task
    task.state = TaskState.FAILED
    task.finished_at = now
    task.save(update_fields=["state", "error", "finished_at", "lease_expires_at", "worker_id"])
    record(task, "task.failed", error=error, attempt=task.attempts)
    after_change(task, locked_group, now)
    return task


@retrying
@transaction.atomic
def claim_release(*, project_id: uuid.UUID, claim_id: str) -> Task:
    """Hand the task back: to the queue, or ``CANCELLED`` if cancellation was requested.

    Works on an inactive run too: after its run was cancelled the task is already
    ``CANCELLED`` and the release answers it unchanged.
    """
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
    task.lease_expires_at = None
    task.worker_id = ""
    if task.state == TaskState.CANCELLATION_REQUESTED:
        task.state = TaskState.CANCELLED
        task.finished_at = now
        task.save(update_fields=["state", "finished_at", "lease_expires_at", "worker_id"])
        record(task, "task.cancelled", reason=task.cancel_reason, cause="released")
    else:
        task.state = TaskState.QUEUED
        task.available_at = now
        task.save(update_fields=["state", "available_at", "lease_expires_at", "worker_id"])
        record(task, "task.requeued", cause="released", attempt=task.attempts)
        dispatch.work_requeued(task)
    after_change(task, locked_group, now)
    return task
