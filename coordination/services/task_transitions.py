"""The only writer of ``Task.state``: every transition of a task, as an ORM step and as SQL.

House rule: one writer per status field. Claims, cancels, sweeps and the cascade decide
*when* a task changes (under its row lock, in the house lock order); this module says *what*
each change writes. The ORM functions change a task the caller has locked and save it; the
``*_SET_SQL`` fragments are the same changes for the single statements of the fast paths
(``UPDATE coordination_task t SET ...``). Events stay with the callers, which know why the
change happened. ``tests/coordination/services/test_status_writers.py`` fails when another
module writes ``Task.state``.
"""

import uuid
from datetime import datetime

from django.db import connection
from django.db.models import F
from django.db.models.functions import Coalesce

from coordination.domain.ids import claim_id_for, claim_id_sql
from coordination.domain.states import TASK_HELD, TASK_UNFINISHED, TaskState
from coordination.models import Event, Task
from coordination.services.cascade import END_EVENT_DATA_SQL, SubtreeEnd, subtree_rows_end
from coordination.services.events import events_record_many
from coordination.services.sql import in_list, literal

CASCADE_CHUNK = 2000

LEASE_EXPIRED_ERROR = {"code": "lease_expired", "message": "The lease expired with no attempts left."}

_QUEUED, _RUNNING = literal(TaskState.QUEUED), literal(TaskState.RUNNING)
_CANCELLATION_REQUESTED, _CANCELLED = literal(TaskState.CANCELLATION_REQUESTED), literal(TaskState.CANCELLED)


# The retry rule: a failure goes back to the queue only while ``retry`` is asked, the task is
# RUNNING (after a cancellation request a failure is final) and attempts remain. The Python
# test and its SQL, side by side.
def requeue_allowed(task: Task, retry: bool) -> bool:
    """Tell whether a failure of ``task`` goes back to the queue."""
    return retry and task.state == TaskState.RUNNING and task.attempts < task.max_attempts


REQUEUE_SQL = f"(%(retry)s AND t.state = {_RUNNING} AND t.attempts < t.max_attempts)"


# SQL: the SET lists of the single statements (the task row is ``t``) --------------------------

# A claim; the statement adds ``lease_expires_at``, which each claim computes its own way.
CLAIM_SET_SQL = f"""state = {_RUNNING}, attempts = t.attempts + 1, last_renewed_at = %(now)s,
        worker_id = %(worker_id)s, started_at = coalesce(t.started_at, %(now)s)"""

COMPLETE_SET_SQL = f"""
    state = CASE WHEN t.state = {_CANCELLATION_REQUESTED} THEN {_CANCELLED} ELSE {literal(TaskState.SUCCEEDED)} END,
    finished_at = %(now)s, lease_expires_at = NULL"""

FAIL_SET_SQL = f"""state = CASE WHEN {REQUEUE_SQL} THEN {_QUEUED} ELSE {literal(TaskState.FAILED)} END,
        available_at = CASE WHEN {REQUEUE_SQL} THEN %(available_at)s ELSE t.available_at END,
        finished_at = CASE WHEN {REQUEUE_SQL} THEN t.finished_at ELSE %(now)s END,
        error = %(error)s, lease_expires_at = NULL, worker_id = ''"""

RELEASE_SET_SQL = f"""state = CASE WHEN t.state = {_CANCELLATION_REQUESTED} THEN {_CANCELLED} ELSE {_QUEUED} END,
        finished_at = CASE WHEN t.state = {_CANCELLATION_REQUESTED} THEN %(now)s ELSE t.finished_at END,
        available_at = CASE WHEN t.state = {_CANCELLATION_REQUESTED} THEN t.available_at ELSE %(now)s END,
        lease_expires_at = NULL, worker_id = ''"""

CANCEL_SET_SQL = (
    f"state = {_CANCELLED}, finished_at = %(now)s, cancel_reason = %(reason)s, lease_expires_at = NULL, worker_id = ''"
)

# The tasks an end of their run or group stops: queued or held.
UNFINISHED_SQL = in_list(TASK_UNFINISHED)


# The claim a change ended or asked to stop, named in its event --------------------------------
#
# A change a worker did not make itself (a task or run cancel, a group decided, a deadline, a
# lease that ran out) names the claim it stops and the worker holding it, ``heldBy`` and
# ``claimId`` in the event's data: ``GET /v1/claims/watch`` sends each worker the events that
# name it (``api/views/watch.py``), and only those events carry ``heldBy`` (the event table
# indexes them apart: ``event_held_by``).


def held_event_data(task: Task) -> dict[str, str]:
    """Return ``{"heldBy", "claimId"}`` for ``task`` as it was before the change, if a worker held it; else ``{}``."""
    if task.state in TASK_HELD and task.worker_id:
        return {"heldBy": task.worker_id, "claimId": claim_id_for(task.id, task.attempts)}
    return {}


def held_event_data_sql(was: str) -> str:
    """Return ``held_event_data`` as a jsonb expression over ``was``, the task's row before the change."""
    claim_id = claim_id_sql(f"{was}.id", f"{was}.attempts")
    return (
        f"CASE WHEN {was}.state IN {in_list(TASK_HELD)} AND {was}.worker_id <> '' "
        f"THEN jsonb_build_object('heldBy', {was}.worker_id, 'claimId', {claim_id}) "
        "ELSE '{}'::jsonb END"
    )


# The columns of a task row ``held_event_data_sql`` reads (a locking subquery keeps them).
HELD_COLUMNS = "state, worker_id, attempts"


# ORM: one function per transition, on a task the caller has locked -------------------------


def _claimed(task: Task, *, now: datetime, lease_until: datetime, worker_id: str) -> None:
    task.state = TaskState.RUNNING
    task.attempts += 1
    task.lease_expires_at = lease_until
    task.last_renewed_at = now
    task.worker_id = worker_id
    task.started_at = task.started_at or now


def claim(task: Task, *, now: datetime, lease_until: datetime, worker_id: str) -> None:
    """Claim: QUEUED -> RUNNING under a new attempt and lease."""
    _claimed(task, now=now, lease_until=lease_until, worker_id=worker_id)
    task.save(update_fields=["state", "attempts", "lease_expires_at", "last_renewed_at", "worker_id", "started_at"])


def claim_many(tasks: list[Task], *, now: datetime, lease_until: datetime, worker_id: str) -> None:
    """Claim: QUEUED -> RUNNING for every task of ``tasks`` (locked), in one update."""
    if not tasks:
        return
    Task.objects.filter(id__in=[t.id for t in tasks]).update(
        state=TaskState.RUNNING,
        attempts=F("attempts") + 1,
        lease_expires_at=lease_until,
        last_renewed_at=now,
        worker_id=worker_id,
        started_at=Coalesce(F("started_at"), now),
    )
    for task in tasks:
        _claimed(task, now=now, lease_until=lease_until, worker_id=worker_id)


def complete(task: Task, *, now: datetime, outcome: object) -> None:
    """Complete: held -> SUCCEEDED, or CANCELLED when cancellation was requested."""
    task.outcome = outcome
    task.finished_at = now
    task.lease_expires_at = None
    cancelled = task.state == TaskState.CANCELLATION_REQUESTED
    task.state = TaskState.CANCELLED if cancelled else TaskState.SUCCEEDED
    task.save(update_fields=["state", "outcome", "finished_at", "lease_expires_at"])


def fail(
    task: Task, *, now: datetime, error: object, retry: bool = False, available_at: datetime | None = None
) -> None:
    """Fail: held -> QUEUED (at ``available_at``) when ``requeue_allowed``, else FAILED."""
    requeue = requeue_allowed(task, retry)
    task.error = error
    task.lease_expires_at = None
    task.worker_id = ""
    if requeue:
        task.state = TaskState.QUEUED
        task.available_at = available_at or now
        task.save(update_fields=["state", "error", "available_at", "lease_expires_at", "worker_id"])
        return
    task.state = TaskState.FAILED
    task.finished_at = now
    task.save(update_fields=["state", "error", "finished_at", "lease_expires_at", "worker_id"])


def release(task: Task, *, now: datetime) -> None:
    """Release: held -> QUEUED (available now), or CANCELLED when cancellation was requested; the lease is freed."""
    task.lease_expires_at = None
    task.worker_id = ""
    if task.state == TaskState.CANCELLATION_REQUESTED:
        task.state = TaskState.CANCELLED
        task.finished_at = now
        task.save(update_fields=["state", "finished_at", "lease_expires_at", "worker_id"])
        return
    task.state = TaskState.QUEUED
    task.available_at = now
    task.save(update_fields=["state", "available_at", "lease_expires_at", "worker_id"])


def cancel_queued(task: Task, *, now: datetime, reason: str | None) -> None:
    """Cancel: QUEUED -> CANCELLED."""
    task.state = TaskState.CANCELLED
    task.cancel_reason = reason
    task.finished_at = now
    task.save(update_fields=["state", "cancel_reason", "finished_at"])


def request_cancellation(task: Task, *, now: datetime, reason: str | None, grace_until: datetime | None) -> None:
    """Request cancellation: RUNNING -> CANCELLATION_REQUESTED; with ``grace_until``, the claim is lost from then on."""
    task.state = TaskState.CANCELLATION_REQUESTED
    task.cancel_reason = reason
    task.cancel_requested_at = now
    task.cancel_grace_until = grace_until
    task.save(update_fields=["state", "cancel_reason", "cancel_requested_at", "cancel_grace_until"])


def cancel_many(task_ids: list[uuid.UUID], *, now: datetime, reason: str) -> None:
    """Cancel: unfinished -> CANCELLED for the tasks ``task_ids`` (locked), in one update."""
    Task.objects.filter(id__in=task_ids).update(
        state=TaskState.CANCELLED, finished_at=now, cancel_reason=reason, lease_expires_at=None, worker_id=""
    )


def expire(task: Task, *, now: datetime) -> None:
    """Expire: QUEUED -> EXPIRED (past its ``expiresAt``)."""
    task.state = TaskState.EXPIRED
    task.finished_at = now
    task.save(update_fields=["state", "finished_at"])


def expire_many(task_ids: list[uuid.UUID], *, now: datetime) -> None:
    """Expire: QUEUED -> EXPIRED for the tasks ``task_ids`` (locked), in one update."""
    Task.objects.filter(id__in=task_ids).update(state=TaskState.EXPIRED, finished_at=now)


def end_subtree(end: SubtreeEnd) -> None:
    """End: unfinished -> CANCELLED (the run was cancelled or completed) or EXPIRED (its deadline passed), in id order.

    On PostgreSQL one statement locks, ends and records them all, whatever their number.
    """
    final_state = TaskState.EXPIRED if end.by_deadline else TaskState.CANCELLED
    event_type = "task.expired" if end.by_deadline else "task.cancelled"
    if connection.vendor == "postgresql":
        subtree_rows_end(
            end,
            Task,
            states=sorted(TASK_UNFINISHED),
            final_state=final_state,
            event_type=event_type,
            also_set="finished_at = %(now)s, cancel_reason = %(reason)s, lease_expires_at = NULL, worker_id = ''",
            locked_columns=HELD_COLUMNS,
            data_sql=f"{END_EVENT_DATA_SQL} || {held_event_data_sql('was')}",
        )
        return
    tasks = list(
        Task.objects.filter(run_path__startswith=end.path_prefix, state__in=TASK_UNFINISHED)
        .order_by("id")
        .select_for_update()
        .only("id", "project_id", "run_id", "run_path", *HELD_COLUMNS.split(", "))
    )
    for start in range(0, len(tasks), CASCADE_CHUNK):
        chunk = tasks[start : start + CASCADE_CHUNK]
        Task.objects.filter(id__in=[task.id for task in chunk]).update(
            state=final_state,
            finished_at=end.now,
            cancel_reason=end.reason,
            lease_expires_at=None,
            worker_id="",
        )
        events_record_many(
            [
                Event(
                    project_id=task.project_id,
                    type=event_type,
                    run_id=task.run_id,
                    run_path=task.run_path,
                    subject_id=str(task.id),
                    data={"reason": end.reason, "cause": end.cause, **held_event_data(task)},
                    created_at=end.now,
                )
                for task in chunk
            ]
        )
