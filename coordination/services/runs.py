"""Runs: create, child, cancel, complete. The only writer of ``Run.stored_state``."""

import uuid
from datetime import datetime

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from coordination.domain import exceptions
from coordination.domain.states import RunState
from coordination.models import Run
from coordination.models.runs import MAX_DEPTH
from coordination.plumbing.tracing import NO_TRACE, TraceContext, annotate, span
from coordination.services import dispatch
from coordination.services.cascade import SubtreeEnd, subtree_end
from coordination.services.events import event_record, events_mark, events_written_since
from coordination.services.locking import LockMode, run_chain_lock, run_chain_lock_active
from coordination.services.retry import retrying

MAX_CHILD_LIMIT = 1_000_000


def _validate_run_fields(*, deadline: datetime | None, child_limit: int | None, now: datetime) -> int:
    errors: dict[str, str] = {}
    if deadline is not None and deadline <= now:
        errors["deadline"] = "must be in the future"
    if child_limit is not None and not 0 <= child_limit <= MAX_CHILD_LIMIT:
        errors["childLimit"] = f"must be between 0 and {MAX_CHILD_LIMIT}"
    if errors:
        raise exceptions.ValidationFailed("Invalid run.", **errors)
    return settings.RUNSTATE_DEFAULT_CHILD_LIMIT if child_limit is None else child_limit


@transaction.atomic
def run_create(
    *,
    project_id: uuid.UUID,
    parent_id: uuid.UUID | None = None,
    name: str = "",
    deadline: datetime | None = None,
    child_limit: int | None = None,
) -> Run:
    """Create a root run, or a child of ``parent_id`` while the parent's chain is active.

    The parent is locked ``FOR NO KEY UPDATE`` (its ancestors ``FOR KEY SHARE``) so that
    ``childLimit`` holds under concurrent creates and a concurrent cancel of any run in the
    chain either sees this child in its cascade or refuses it.
    """
    now = timezone.now()
    limit = _validate_run_fields(deadline=deadline, child_limit=child_limit, now=now)
    run = Run(project_id=project_id, name=name, deadline=deadline, child_limit=limit, created_at=now)
    run_id = run.id
    if parent_id is None:
        run.path = Run.path_for(run_id)
        run.depth = 0
    else:
        chain = run_chain_lock_active(parent_id, project_id=project_id, target_mode=LockMode.NO_KEY_UPDATE)
        parent = chain[-1]
        if parent.depth + 1 >= MAX_DEPTH:
            raise exceptions.ValidationFailed(f"Runs nest at most {MAX_DEPTH} deep.", parentId=str(parent.id))
        # We hold the parent's row lock, so no other create can interleave between the
        # check and the increment.
        if parent.child_count >= parent.child_limit:
            raise exceptions.ChildLimitReached(runId=str(parent.id), childLimit=parent.child_limit)
        Run.objects.filter(id=parent.id).update(child_count=F("child_count") + 1)
        run.parent_id = parent.id
        run.path = Run.path_for(run_id, parent.path)
        run.depth = parent.depth + 1
    run.save(force_insert=True)
    if deadline is not None:
        # Sweep the subtree at the deadline itself, not at the next periodic sweep.
        dispatch.run_deadline_due(run.id, deadline)
    event_record(
        project_id=project_id,
        type="run.created",
        run=run,
        subject_id=run.id,
        data={"parentId": str(parent_id) if parent_id else None, "name": name},
    )
    return run


def run_end(
    *,
    run_id: uuid.UUID,
    project_id: uuid.UUID,
    state: RunState,
    reason: str | None,
    locked_chain: list[Run] | None = None,
) -> Run:
    """End a run (cancel or complete) and its subtree inside the caller's transaction.

    Takes the run chain's locks itself (already held locks are simply kept), so a group
    finalizing its gate may call it with the gate chain already locked; it then passes that
    chain (``run_chain_lock(..., target_mode=UPDATE)`` of this run, in this transaction) as
    ``locked_chain`` and saves the two statements of locking it again.
    """
    # FOR UPDATE on the run conflicts with the FOR KEY SHARE that every creator of new
    # work under it holds: we wait for them to commit, and our cascade below sees their rows.
    if locked_chain is not None and locked_chain[-1].id == run_id:
        chain = locked_chain
    else:
        chain = run_chain_lock(run_id, project_id=project_id, target_mode=LockMode.UPDATE)
    run = chain[-1]
    if run.stored_state == state:
        return run
    if run.stored_state != RunState.ACTIVE:
        raise (
            exceptions.ScopeCompleted(runId=str(run.id))
            if run.stored_state == RunState.COMPLETED
            else exceptions.ScopeCancelled(runId=str(run.id))
        )
    now = timezone.now()
    run.stored_state = state
    run.ended_at = now
    run.cancel_reason = reason if state == RunState.CANCELLED else None
    run.save(update_fields=["stored_state", "ended_at", "cancel_reason"])
    subtree_end(SubtreeEnd(run=run, state=state, reason=reason, now=now))
    event_type = "run.cancelled" if state == RunState.CANCELLED else "run.completed"
    event_record(project_id=project_id, type=event_type, run=run, subject_id=run.id, data={"reason": reason})
    return run


def _run_end_traced(
    *, run_id: uuid.UUID, project_id: uuid.UUID, state: RunState, reason: str | None, trace: TraceContext
) -> Run:
    """End a run as ``run_end`` does, in a span (child of ``trace``) that counts what the cascade ended.

    The counts are the events the cascade wrote, by type (``runstate.cascade.task.cancelled``...);
    they are read only when the span records.
    """
    verb = "cancel" if state == RunState.CANCELLED else "complete"
    with span(f"{verb} run", parent=trace, run_id=run_id, reason=reason) as current:
        mark = events_mark() if current is not None else 0
        run = run_end(run_id=run_id, project_id=project_id, state=state, reason=reason)
        if current is not None:
            written = events_written_since(project_id=project_id, mark=mark)
            annotate(current, **{f"cascade.{type}": count for type, count in written.items()})
        return run


@retrying
@transaction.atomic
def run_cancel(
    *, run_id: uuid.UUID, project_id: uuid.UUID, reason: str | None = None, trace: TraceContext = NO_TRACE
) -> Run:
    """Cancel a run and, in the same transaction, end all work in its subtree.

    Idempotent on a cancelled run; ``SCOPE_COMPLETED`` on a completed one. ``trace`` is the
    caller's W3C context: the cancel's span (when this process traces) is its child.
    """
    return _run_end_traced(run_id=run_id, project_id=project_id, state=RunState.CANCELLED, reason=reason, trace=trace)


@retrying
@transaction.atomic
def run_complete(*, run_id: uuid.UUID, project_id: uuid.UUID, trace: TraceContext = NO_TRACE) -> Run:
    """Complete a run and, in the same transaction, end all work in its subtree.

    Idempotent on a completed run; ``SCOPE_CANCELLED`` on a cancelled one.
    """
    return _run_end_traced(run_id=run_id, project_id=project_id, state=RunState.COMPLETED, reason=None, trace=trace)


# The deadline sweep ----------------------------------------------------------------------


@transaction.atomic
def run_sweep_deadline(*, run_id: uuid.UUID) -> bool:
    """End the work below a run whose deadline passed; return whether it did anything.

    New work was refused from the deadline on (computed at read time); this makes it
    final: groups under the run finalize ``FAILURE``/``deadline`` first, then unfinished
    tasks expire and timers, barriers and queued messages are cancelled. The run's own
    ``storedState`` does not change.
    """
    project_id = Run.objects.filter(id=run_id).values_list("project_id", flat=True).first()
    if project_id is None:
        return False
    # FOR UPDATE, like a cancel: creators still holding the chain finish first.
    chain = run_chain_lock(run_id, project_id=project_id, target_mode=LockMode.UPDATE)
    run = chain[-1]
    now = timezone.now()
    if run.deadline is None or run.deadline > now or run.deadline_swept_at is not None:
        return False
    subtree_end(SubtreeEnd(run=run, state=None, reason="deadline", now=now))
    run.deadline_swept_at = now
    run.save(update_fields=["deadline_swept_at"])
    event_record(
        project_id=project_id,
        type="run.deadline_exceeded",
        run=run,
        subject_id=run.id,
        data={"deadline": run.deadline.isoformat()},
    )
    return True


def runs_sweep_deadlines(*, now: datetime | None = None, batch_size: int = 100) -> int:
    """Sweep runs past their deadline, one short transaction each; return how many were swept."""
    now = now or timezone.now()
    due = list(
        Run.objects.filter(deadline__lte=now, deadline_swept_at__isnull=True)
        .order_by("deadline")
        .values_list("id", flat=True)[:batch_size]
    )
    return sum(run_sweep_deadline(run_id=run_id) for run_id in due)
