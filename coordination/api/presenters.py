"""Domain objects as API dicts (camelCase keys, RFC 3339 UTC times, string ids)."""

from datetime import UTC, datetime

from coordination.domain.exceptions import CoordinationError
from coordination.domain.states import TaskState
from coordination.models import Barrier, Event, GroupMember, Mailbox, Message, Run, Task, TaskGroup, Timer
from coordination.reads.selectors import EffectiveState, event_cursor, mailbox_names
from coordination.services.claims import Claim
from coordination.services.messages import Delivery


def iso(value: datetime | None) -> str | None:
    """Format a time as RFC 3339 in UTC with a ``Z``."""
    if value is None:
        return None
    # isoformat, not strftime: "%Y" leaves a year before 1000 unpadded ("1-01-01"), not RFC 3339.
    return value.astimezone(UTC).replace(tzinfo=None).isoformat(timespec="microseconds") + "Z"


def present_run(run: Run, effective: EffectiveState) -> dict:
    """Return the API shape of a run."""
    return {
        "id": str(run.id),
        "name": run.name,
        "parentId": str(run.parent_id) if run.parent_id else None,
        "storedState": run.stored_state,
        "effective": effective.effective,
        "inactiveReason": effective.reason,
        "inactiveRunId": str(effective.cause_run_id) if effective.cause_run_id else None,
        "deadline": iso(run.deadline),
        "childLimit": run.child_limit,
        "createdAt": iso(run.created_at),
        "endedAt": iso(run.ended_at),
        "cancelReason": run.cancel_reason,
    }


# Event data that tells what the whole project holds of a pool: a key bound to a run reads the
# event under its own run, without the figures of the runs beside it (issue 25).
PROJECT_WIDE_EVENT_DATA = {"pool.exhausted": frozenset({"inUse", "waiting"})}


def present_event(event: Event, *, bound: bool = False) -> dict:
    """Return the API shape of an event; ``bound``: as a key bound to a run may read it."""
    data = event.data
    hidden = PROJECT_WIDE_EVENT_DATA.get(event.type)
    if hidden and bound:
        data = {key: value for key, value in data.items() if key not in hidden}
    return {
        "id": event_cursor(event),
        "type": event.type,
        "runId": str(event.run_id) if event.run_id else None,
        "subjectId": event.subject_id,
        "data": data,
        "createdAt": iso(event.created_at),
    }


def present_mailbox(mailbox: Mailbox) -> dict:
    """Return the API shape of a mailbox."""
    return {
        "name": mailbox.name,
        "mode": mailbox.mode,
        "leaseTtlMs": mailbox.lease_ttl_ms,
        "maxAttempts": mailbox.max_attempts,
        "createdAt": iso(mailbox.created_at),
    }


def _mailbox_name(task: Task) -> str:
    """Return the task's mailbox name: from the loaded mailbox, else from the names already read."""
    if Task.mailbox.is_cached(task):
        return task.mailbox.name
    return mailbox_names([task])[task.mailbox_id]


def present_task(task: Task, mailbox_name: str | None = None) -> dict:
    """Return the API shape of a task."""
    return {
        "id": str(task.id),
        "mailbox": mailbox_name or _mailbox_name(task),
        "runId": str(task.run_id),
        "key": task.key,
        "input": task.input,
        "state": task.state,
        "outcome": task.outcome,
        "error": task.error,
        "attempts": task.attempts,
        "maxAttempts": task.max_attempts,
        "priority": task.priority,
        "groupId": str(task.group_id) if task.group_id else None,
        "createdAt": iso(task.created_at),
        "startedAt": iso(task.started_at),
        "finishedAt": iso(task.finished_at),
        "expiresAt": iso(task.expires_at),
        "cancelReason": task.cancel_reason,
        "workerId": task.worker_id or None,
        "leaseExpiresAt": iso(task.lease_expires_at),
        "rerunOf": str(task.rerun_of_id) if task.rerun_of_id else None,
    }


def present_claim(claim: Claim, mailbox_name: str | None = None) -> dict:
    """Return the API shape of a claim."""
    return {
        "claimId": claim.claim_id,
        "attempt": claim.attempt,
        "leaseExpiresAt": iso(claim.lease_expires_at),
        "cancellationRequested": claim.task.state == TaskState.CANCELLATION_REQUESTED,
        "task": present_task(claim.task, mailbox_name),
        # The submitter's W3C trace context: the worker's span is its child.
        "traceparent": claim.task.traceparent or None,
        "tracestate": claim.task.tracestate or None,
    }


def present_message(message: Message, mailbox_name: str | None = None) -> dict:
    """Return the API shape of a message."""
    return {
        "id": str(message.id),
        "mailbox": mailbox_name or message.mailbox.name,
        "runId": str(message.run_id),
        "key": message.key,
        "body": message.body,
        "state": message.state,
        "attempts": message.attempts,
        "createdAt": iso(message.created_at),
        "visibleAt": iso(message.visible_at),
        "finishedAt": iso(message.finished_at),
        "deadLetterReason": message.dead_letter_reason,
    }


def present_delivery(delivery: Delivery) -> dict:
    """Return the API shape of a delivery."""
    return {
        "deliveryId": delivery.delivery_id,
        "messageId": str(delivery.message.id),
        "body": delivery.message.body,
        "attempt": delivery.attempt,
        "visibleUntil": iso(delivery.visible_until),
        "traceparent": delivery.message.traceparent or None,
        "tracestate": delivery.message.tracestate or None,
    }


def present_group(group: TaskGroup, members: list[tuple] | None = None) -> dict:
    """Return the API shape of a group, with every member (one query for them, unless ``members`` are given).

    ``members``: ``(task_id, key, state, verdict, late, verdict_at)`` in member id order, as
    ``selectors.group_from_wait_row`` gives them.
    """
    if members is None:
        members = list(
            GroupMember.objects.filter(group=group)
            .order_by("id")
            .values_list("task_id", "task__key", "task__state", "verdict", "late", "verdict_at")
        )
    shapes = [
        {
            "taskId": str(task_id),
            "key": key,
            "state": state,
            "verdict": verdict,
            "late": late,
            "verdictAt": iso(verdict_at),
        }
        for task_id, key, state, verdict, late, verdict_at in members
    ]
    return {
        "id": str(group.id),
        "name": group.name,
        "scopeId": str(group.scope_id),
        "parentScopeId": str(group.parent_scope_id) if group.parent_scope_id else None,
        "mailbox": group.mailbox.name,
        "condition": group.condition,
        "threshold": group.threshold,
        "expectedMembers": group.expected_members,
        "deadline": iso(group.deadline),
        "state": group.state,
        "outcome": group.outcome,
        "outcomeReason": group.outcome_reason,
        "createdAt": iso(group.created_at),
        "closedAt": iso(group.closed_at),
        "finalizedAt": iso(group.finalized_at),
        "members": shapes,
    }


def present_decision(group: TaskGroup) -> dict:
    """Return ``{state, outcome, outcomeReason}`` of a group."""
    return {"state": group.state, "outcome": group.outcome, "outcomeReason": group.outcome_reason}


def present_barrier(barrier: Barrier) -> dict:
    """Return the API shape of a barrier."""
    return {
        "id": str(barrier.id),
        "runId": str(barrier.run_id),
        "name": barrier.name,
        "target": barrier.target,
        "epoch": barrier.epoch,
        "arrivals": barrier.arrivals,
        "state": barrier.state,
        "releasedAt": iso(barrier.released_at),
        "createdAt": iso(barrier.created_at),
    }


def present_timer(timer: Timer) -> dict:
    """Return the API shape of a timer."""
    return {
        "id": str(timer.id),
        "runId": str(timer.run_id),
        "state": timer.state,
        "fireAt": iso(timer.fire_at),
        "firedAt": iso(timer.fired_at),
        "acknowledgedAt": iso(timer.acknowledged_at),
        "createdAt": iso(timer.created_at),
    }


# Batches of claim operations (``POST /v1/claims/complete`` and ``/renew``): the DRF views and
# the hot path answer each item with these, from the service's per-item answers.


def _refused_item(claim_id: str, error: CoordinationError) -> dict:
    return {"claimId": claim_id, "ok": False, "error": {"code": error.code, "message": error.message}}


def batch_tasks(answers: list[tuple[str, object]]) -> list[Task]:
    """Return the tasks of a batch's answers that succeeded (a ``Task`` or a ``Claim``'s): their names are needed."""
    return [
        answer.task if isinstance(answer, Claim) else answer
        for _, answer in answers
        if not isinstance(answer, CoordinationError)
    ]


def present_completed_batch(answers: list[tuple[str, Task | CoordinationError]], names: dict) -> dict:
    """Return the answer to a batch complete: each ``(claimId, task or error)`` in order; ``names`` by mailbox id."""
    return {
        "results": [
            _refused_item(claim_id, answer)
            if isinstance(answer, CoordinationError)
            else {"claimId": claim_id, "ok": True, "task": present_task(answer, names[answer.mailbox_id])}
            for claim_id, answer in answers
        ]
    }


def present_renewed_batch(answers: list[tuple[str, Claim | CoordinationError]], names: dict) -> dict:
    """Return the answer to a batch renew: each ``(claimId, claim or error)`` in order; ``names`` by mailbox id."""
    return {
        "results": [
            _refused_item(claim_id, answer)
            if isinstance(answer, CoordinationError)
            else {"claimId": claim_id, "ok": True, "claim": present_claim(answer, names[answer.task.mailbox_id])}
            for claim_id, answer in answers
        ]
    }


def present_submitted_batch(answers: list[tuple[Task, bool]], mailbox_name: str) -> tuple[dict, int]:
    """Return the body and status of a batch submit: 201 when a task was created, 200 when each was a resubmit."""
    created = any(was_created for _, was_created in answers)
    return {"tasks": [present_task(task, mailbox_name) for task, _ in answers]}, 201 if created else 200
