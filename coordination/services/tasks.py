"""Tasks and claims: submit, claim, renew, complete, fail, release, cancel, expire.

The only writer of ``Task.state``. A claim is ``(task id, attempt)``; every claim operation
locks the task row and checks that fence before changing anything, so a stale worker
(its lease taken over, its task cancelled) changes nothing and hears ``LEASE_LOST`` or the
run's own refusal code.
"""

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import IntegrityError, transaction
from django.db.models import F, Q
from django.db.models.functions import Coalesce
from django.utils import timezone

from coordination import exceptions
from coordination.models import Event, Mailbox, Run, Task, TaskGroup
from coordination.services.cascade import SubtreeEnd
from coordination.services.events import events_record_many
from coordination.services.groups import (
    GroupMembershipChanged,
    LockedGroup,
    group_evaluate,
    group_lock,
    group_submit,
    retrying,
)
from coordination.services.locking import chain_refusal, run_chain_lock_active
from coordination.services.mailboxes import validate_lease_ttl_ms, validate_max_attempts
from coordination.states import TASK_HELD, TASK_TERMINAL, TASK_UNFINISHED, MailboxMode, TaskState

MAX_CLAIMS_PER_CALL = 100
CASCADE_CHUNK = 2000


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
    return f"c_{task_id.hex}_{attempt}"


def parse_claim_id(claim_id: str) -> tuple[uuid.UUID, int]:
    """Split a claim id into task id and attempt; a malformed one is ``NOT_FOUND``."""
    try:
        prefix, task_hex, attempt = str(claim_id).split("_")
        if prefix != "c":
            raise ValueError(prefix)
        return uuid.UUID(hex=task_hex), int(attempt)
    except ValueError:
        raise exceptions.NotFound("Claim not found.", claimId=str(claim_id)) from None


def _event(task: Task, type: str, **data) -> Event:
    return Event(
        project_id=task.project_id,
        type=type,
        run_id=task.run_id,
        run_path=task.run_path,
        subject_id=str(task.id),
        data=data,
        created_at=timezone.now(),
    )


def _record(task: Task, type: str, **data) -> None:
    events_record_many([_event(task, type, **data)])


def _run_refusal(task: Task, now: datetime) -> exceptions.Conflict | None:
    chain = list(Run.objects.filter(id__in=[uuid.UUID(p) for p in task.run_path.split("/") if p]).order_by("depth"))
    return chain_refusal(chain, now)


# Submit ----------------------------------------------------------------------------------


def task_submit(
    *,
    project_id: uuid.UUID,
    mailbox: Mailbox,
    run_id: uuid.UUID,
    input: object,
    key: str | None = None,
    priority: int = 0,
    max_attempts: int | None = None,
    expires_at: datetime | None = None,
) -> tuple[Task, bool]:
    """Submit a task; return it and whether it was created.

    The same ``key`` with the same input returns the existing task; with another input it
    is ``KEY_CONFLICT``. A task submitted to a group's gate in the group's mailbox is a
    member of that group, so it is submitted through the group.
    """
    if mailbox.mode != MailboxMode.WORK:
        raise exceptions.MailboxModeConflict(f"Mailbox '{mailbox.name}' holds messages, not tasks.")
    validate_max_attempts(max_attempts)
    now = timezone.now()
    if expires_at is not None and expires_at <= now:
        raise exceptions.ValidationFailed("Invalid task.", expiresAt="must be in the future")
    gated = TaskGroup.objects.filter(scope_id=run_id, mailbox=mailbox).values_list("id", flat=True).first()
    if gated is not None:
        task, created, _ = group_submit(
            project_id=project_id,
            group_id=gated,
            input=input,
            key=key,
            priority=priority,
            max_attempts=max_attempts,
            expires_at=expires_at,
        )
        return task, created
    return _task_submit(
        project_id=project_id,
        mailbox=mailbox,
        run_id=run_id,
        input=input,
        key=key,
        priority=priority,
        max_attempts=max_attempts,
        expires_at=expires_at,
    )


@transaction.atomic
def _task_submit(*, project_id, mailbox, run_id, input, key, priority, max_attempts, expires_at) -> tuple[Task, bool]:
    if key is not None:
        existing = _task_with_key(mailbox, run_id, key, input)
        if existing is not None:
            return existing, False
    chain = run_chain_lock_active(run_id, project_id=project_id)
    try:
        with transaction.atomic():
            task = task_insert(
                project_id=project_id,
                mailbox=mailbox,
                chain=chain,
                input=input,
                key=key,
                priority=priority,
                max_attempts=max_attempts,
                expires_at=expires_at,
            )
    except IntegrityError:
        # A concurrent submit with the same key won; answer as an idempotent resubmit.
        existing = _task_with_key(mailbox, run_id, key, input) if key is not None else None
        if existing is None:
            raise
        return existing, False
    return task, True


def task_insert(
    *,
    project_id: uuid.UUID,
    mailbox: Mailbox,
    chain: list[Run],
    input: object,
    key: str | None = None,
    priority: int = 0,
    max_attempts: int | None = None,
    expires_at: datetime | None = None,
    group: TaskGroup | None = None,
    now: datetime | None = None,
) -> Task:
    """Insert a task on the last run of ``chain``, whose locks the caller holds, and its event."""
    now = now or timezone.now()
    run = chain[-1]
    task = Task(
        project_id=project_id,
        mailbox=mailbox,
        run_id=run.id,
        run_path=run.path,
        run_deadline=min((r.deadline for r in chain if r.deadline is not None), default=None),
        key=key,
        input=input,
        priority=priority,
        max_attempts=max_attempts or mailbox.max_attempts,
        expires_at=expires_at,
        group=group,
        created_at=now,
        available_at=now,
    )
    _celery_accept(task, mailbox)
    task.save(force_insert=True)
    _record(task, "task.submitted", mailbox=mailbox.name, key=key, groupId=str(group.id) if group else None)
    return task


def _celery_accept(task: Task, mailbox: Mailbox) -> None:
    """Validate a new task of a mailbox bound to a decorated Celery task; wake a worker after commit.

    Every submit (API, SDK, ``task.submit``, group members) inserts here, so this is the one
    place. Unbound mailboxes cost an in-memory lookup; the message is never sent inside this
    transaction (``workers.dispatch``).
    """
    from workers.dispatch import dispatch_submitted_on_commit

    dispatch_submitted_on_commit(task, mailbox)


def _celery_wake(task: Task) -> None:
    """Wake a Celery worker after commit for a task that went back to ``QUEUED`` in a bound mailbox."""
    from workers.dispatch import dispatch_requeued_on_commit

    dispatch_requeued_on_commit(task)


def _task_with_key(mailbox: Mailbox, run_id: uuid.UUID, key: str, input: object) -> Task | None:
    existing = Task.objects.filter(mailbox=mailbox, run_id=run_id, key=key).first()
    if existing is not None and existing.input != input:
        raise exceptions.KeyConflict(key=key, taskId=str(existing.id))
    return existing


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
    events = [event for task in expired for event in _lease_expired(task, now)]
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
        events.append(_event(task, "task.claimed", attempt=task.attempts, workerId=worker_id))
    events_record_many(events)
    return claims


def _lease_expired(task: Task, now: datetime) -> list[Event]:
    """Settle a locked held task whose lease ran out (or whose cancel grace passed)."""
    task.lease_expires_at = None
    task.worker_id = ""
    if task.state == TaskState.CANCELLATION_REQUESTED:
        task.state = TaskState.CANCELLED
        task.finished_at = now
        task.save(update_fields=["state", "finished_at", "lease_expires_at", "worker_id"])
        return [_event(task, "task.cancelled", reason=task.cancel_reason, cause="cancellation_finalized")]
    if task.attempts < task.max_attempts:
        task.state = TaskState.QUEUED
        task.available_at = now
        task.save(update_fields=["state", "available_at", "lease_expires_at", "worker_id"])
        # A crashed Celery worker's message is gone: send the task out again.
        _celery_wake(task)
        return [_event(task, "task.requeued", cause="lease_expired", attempt=task.attempts)]
    task.state = TaskState.FAILED
    task.error = {"code": "lease_expired", "message": "The lease expired with no attempts left."}
    task.finished_at = now
    task.save(update_fields=["state", "error", "finished_at", "lease_expires_at", "worker_id"])
    return [_event(task, "task.failed", error=task.error)]


def _takeover_due(task: Task, now: datetime) -> bool:
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
    events = _lease_expired(task, now) if _takeover_due(task, now) else []
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
        events.append(_event(task, "task.claimed", attempt=task.attempts, workerId=worker_id))
        claim = Claim(task, task.attempts, task.lease_expires_at)
    events_record_many(events)
    return claim


# Locking one task, its group first -------------------------------------------------------


def _lock_task(project_id: uuid.UUID | None, task_id: uuid.UUID) -> tuple[Task, LockedGroup | None]:
    """Lock a task row, and first its group (gate chain, group) when it is a member.

    The task's group is read before any lock (house order: group before task); if it
    changed by the time the task is locked, the transaction starts over.
    """
    rows = Task.objects.filter(id=task_id)
    if project_id is not None:
        rows = rows.filter(project_id=project_id)
    found = rows.values_list("group_id", flat=True)[:1]
    if not found:
        raise exceptions.NotFound("Task not found.", taskId=str(task_id))
    group_id = found[0]
    locked_group = group_lock(group_id=group_id) if group_id is not None else None
    task = Task.objects.select_for_update(of=("self",)).select_related("mailbox").get(id=task_id)
    if task.group_id != group_id:
        raise GroupMembershipChanged(str(task_id))
    return task, locked_group


def _after_change(task: Task, locked_group: LockedGroup | None, now: datetime) -> None:
    """Re-evaluate the task's group when the change may have decided it."""
    if locked_group is not None and task.state in TASK_TERMINAL:
        group_evaluate(locked_group, now)


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
        task, locked_group = _lock_task(project_id, task_id)
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
    refusal = _run_refusal(task, now)
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
        event = _event(task, "task.cancelled", reason=task.cancel_reason, cause="handler_returned")
    else:
        task.state = TaskState.SUCCEEDED
        event = _event(task, "task.succeeded", attempt=task.attempts)
    task.save(update_fields=["state", "outcome", "finished_at", "lease_expires_at"])
    events_record_many([event])
    _after_change(task, locked_group, now)
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
        _record(task, "task.requeued", cause="retry", attempt=task.attempts, error=error)
        _celery_wake(task)
        return task
    task.state = TaskState.FAILED
    task.finished_at = now
    task.save(update_fields=["state", "error", "finished_at", "lease_expires_at", "worker_id"])
    _record(task, "task.failed", error=error, attempt=task.attempts)
    _after_change(task, locked_group, now)
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
        task, locked_group = _lock_task(project_id, task_id)
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
        _record(task, "task.cancelled", reason=task.cancel_reason, cause="released")
    else:
        task.state = TaskState.QUEUED
        task.available_at = now
        task.save(update_fields=["state", "available_at", "lease_expires_at", "worker_id"])
        _record(task, "task.requeued", cause="released", attempt=task.attempts)
        _celery_wake(task)
    _after_change(task, locked_group, now)
    return task


# Cooperative cancellation ----------------------------------------------------------------


@retrying
@transaction.atomic
def task_cancel(
    *, project_id: uuid.UUID, task_id: uuid.UUID, reason: str | None = None, grace_ms: int | None = None
) -> Task:
    """Cancel one task: a queued one at once, a running one cooperatively.

    A running task becomes ``CANCELLATION_REQUESTED``; its worker learns it on the next
    renewal. With ``grace_ms``, the server records ``CANCELLED`` once the grace has passed
    and the claim is lost from then on. A finished task, or a repeated request, is answered
    unchanged.
    """
    if grace_ms is not None and grace_ms < 0:
        raise exceptions.ValidationFailed("Invalid grace.", graceMs="must be >= 0")
    task, locked_group = _lock_task(project_id, task_id)
    now = timezone.now()
    if task.state == TaskState.QUEUED:
        task.state = TaskState.CANCELLED
        task.cancel_reason = reason
        task.finished_at = now
        task.save(update_fields=["state", "cancel_reason", "finished_at"])
        _record(task, "task.cancelled", reason=reason, cause="cancel_requested")
    elif task.state == TaskState.RUNNING:
        task.state = TaskState.CANCELLATION_REQUESTED
        task.cancel_reason = reason
        task.cancel_requested_at = now
        task.cancel_grace_until = now + timedelta(milliseconds=grace_ms) if grace_ms is not None else None
        task.save(update_fields=["state", "cancel_reason", "cancel_requested_at", "cancel_grace_until"])
        _record(task, "task.cancellation_requested", reason=reason, graceMs=grace_ms)
    _after_change(task, locked_group, now)
    return task


def tasks_cancel_group_members(*, group_id: uuid.UUID, reason: str, now: datetime) -> None:
    """Cancel a finalizing group's unfinished members wherever they live (group already locked)."""
    members = list(Task.objects.filter(group_id=group_id, state__in=TASK_UNFINISHED).order_by("id").select_for_update())
    if not members:
        return
    Task.objects.filter(id__in=[t.id for t in members]).update(
        state=TaskState.CANCELLED, finished_at=now, cancel_reason=reason, lease_expires_at=None, worker_id=""
    )
    events_record_many([_event(task, "task.cancelled", reason=reason, cause="group_finalized") for task in members])


# Sweeps: one small batch per transaction, skipping rows another sweeper holds --------------


def tasks_settle_expired_leases(*, now: datetime | None = None, batch_size: int = 500) -> int:
    """Settle held tasks whose lease expired or whose cancel grace passed; return how many.

    Plain tasks go in one batch transaction; group members one at a time, each locking its
    group first.
    """
    now = now or timezone.now()
    due = Q(lease_expires_at__lte=now) | Q(cancel_grace_until__lte=now)
    settled = _settle_plain_batch(due, now, batch_size)
    member_ids = list(
        Task.objects.filter(state__in=TASK_HELD, group__isnull=False)
        .filter(due)
        .values_list("id", flat=True)[:batch_size]
    )
    for task_id in member_ids:
        settled += _settle_member(task_id, now)
    return settled


@transaction.atomic
def _settle_plain_batch(due: Q, now: datetime, batch_size: int) -> int:
    tasks = list(
        Task.objects.filter(state__in=TASK_HELD, group__isnull=True)
        .filter(due)
        .order_by("id")
        .select_for_update(skip_locked=True)[:batch_size]
    )
    events_record_many([event for task in tasks for event in _lease_expired(task, now)])
    return len(tasks)


@retrying
@transaction.atomic
def _settle_member(task_id: uuid.UUID, now: datetime) -> int:
    task, locked_group = _lock_task(None, task_id)
    lease_due = task.lease_expires_at is not None and task.lease_expires_at <= now
    grace_due = task.cancel_grace_until is not None and task.cancel_grace_until <= now
    if task.state not in TASK_HELD or not (lease_due or grace_due):
        return 0  # another sweeper or the worker got there first
    events_record_many(_lease_expired(task, now))
    _after_change(task, locked_group, now)
    return 1


@transaction.atomic
def tasks_rewake_unclaimed(
    *, mailbox_ids: list[uuid.UUID], unclaimed_for: timedelta, now: datetime | None = None, batch_size: int = 500
) -> int:
    """Wake workers again for queued tasks of ``mailbox_ids`` left unclaimed that long; return how many.

    Their Celery message may be lost (the broker was down at submit, or a killed worker held
    it unacknowledged). ``available_at`` moves to now, so a task is announced again at most
    once per ``unclaimed_for``; a duplicate message is harmless (the claim decides).
    """
    now = now or timezone.now()
    tasks = list(
        Task.objects.filter(mailbox_id__in=mailbox_ids, state=TaskState.QUEUED, available_at__lte=now - unclaimed_for)
        .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now))
        .order_by("available_at")
        .select_for_update(skip_locked=True)[:batch_size]
    )
    if tasks:
        Task.objects.filter(id__in=[t.id for t in tasks]).update(available_at=now)
    for task in tasks:
        task.available_at = now
        _celery_wake(task)
    return len(tasks)


def tasks_expire_queued(*, now: datetime | None = None, batch_size: int = 500) -> int:
    """Expire queued tasks past their ``expiresAt``; return how many."""
    now = now or timezone.now()
    expired = _expire_plain_batch(now, batch_size)
    member_ids = list(
        Task.objects.filter(state=TaskState.QUEUED, expires_at__lte=now, group__isnull=False).values_list(
            "id", flat=True
        )[:batch_size]
    )
    for task_id in member_ids:
        expired += _expire_member(task_id, now)
    return expired


@transaction.atomic
def _expire_plain_batch(now: datetime, batch_size: int) -> int:
    due = list(
        Task.objects.filter(state=TaskState.QUEUED, expires_at__lte=now, group__isnull=True)
        .order_by("id")
        .select_for_update(skip_locked=True)[:batch_size]
    )
    if due:
        Task.objects.filter(id__in=[t.id for t in due]).update(state=TaskState.EXPIRED, finished_at=now)
    events_record_many([_event(task, "task.expired", cause="expires_at") for task in due])
    return len(due)


@retrying
@transaction.atomic
def _expire_member(task_id: uuid.UUID, now: datetime) -> int:
    task, locked_group = _lock_task(None, task_id)
    if task.state != TaskState.QUEUED or task.expires_at is None or task.expires_at > now:
        return 0
    task.state = TaskState.EXPIRED
    task.finished_at = now
    task.save(update_fields=["state", "finished_at"])
    _record(task, "task.expired", cause="expires_at")
    _after_change(task, locked_group, now)
    return 1


# Run cascade -----------------------------------------------------------------------------


def tasks_cancel_subtree(end: SubtreeEnd) -> None:
    """End every unfinished task of the subtree, running ones included, in id order.

    ``CANCELLED`` when the run was cancelled or completed, ``EXPIRED`` when its deadline passed.
    """
    final_state = TaskState.EXPIRED if end.by_deadline else TaskState.CANCELLED
    event_type = "task.expired" if end.by_deadline else "task.cancelled"
    rows = list(
        Task.objects.filter(run_path__startswith=end.path_prefix, state__in=TASK_UNFINISHED)
        .order_by("id")
        .select_for_update()
        .values_list("id", "project_id", "run_id", "run_path")
    )
    for start in range(0, len(rows), CASCADE_CHUNK):
        chunk = rows[start : start + CASCADE_CHUNK]
        Task.objects.filter(id__in=[row[0] for row in chunk]).update(
            state=final_state,
            finished_at=end.now,
            cancel_reason=end.reason,
            lease_expires_at=None,
            worker_id="",
        )
        events_record_many(
            [
                Event(
                    project_id=project_id,
                    type=event_type,
                    run_id=run_id,
                    run_path=run_path,
                    subject_id=str(task_id),
                    data={"reason": end.reason, "cause": end.cause},
                    created_at=end.now,
                )
                for task_id, project_id, run_id, run_path in chunk
            ]
        )
