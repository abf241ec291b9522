"""Tasks: submit (one or many), cancel, and the end of a run's subtree.

``Task.state`` is written only through ``task_transitions``; this module (cancels, the
cascade), ``claims`` (the lease operations) and ``sweeps`` (lease expiry, ``expiresAt``)
decide when, and share the locking and event helpers here. On PostgreSQL the hot
operations are single guarded statements (see ``claims``); everything else, and every case
those statements decline, takes the careful ORM path that locks rows in the house order.
"""

import json
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import IntegrityError, transaction
from django.utils import timezone

from coordination.domain import exceptions
from coordination.domain.ids import path_ids
from coordination.domain.states import TASK_TERMINAL, MailboxMode, TaskState
from coordination.models import Mailbox, Run, Task, TaskGroup
from coordination.plumbing.tracing import NO_TRACE, TraceContext
from coordination.services import dispatch, sql, task_transitions
from coordination.services.cascade import SubtreeEnd, cascade_step
from coordination.services.events import event_for, event_insert_sql, events_record_many
from coordination.services.groups import LockedGroup, group_evaluate, group_lock, group_submit
from coordination.services.locking import CHAIN_ACTIVE_SQL, CHAIN_KEY_SHARE_CTE, chain_refusal, run_chain_lock_active
from coordination.services.mailboxes import validate_max_attempts
from coordination.services.retry import GroupMembershipChanged, retrying
from coordination.services.sql import fast_paths_enabled
from coordination.services.task_insert import task_insert


def record(task: Task, type: str, **data) -> None:
    """Write the event of a change to ``task``, inside the change's transaction."""
    events_record_many([event_for(task, type, **data)])


def run_refusal(task: Task, now: datetime) -> exceptions.Conflict | None:
    """Return what the task's run chain answers to work on it now (None when active)."""
    chain = list(Run.objects.filter(id__in=path_ids(task.run_path)).order_by("depth"))
    return chain_refusal(chain, now)


# Submit ----------------------------------------------------------------------------------


MAX_SUBMIT_BATCH = 1000


@dataclass(frozen=True)
class TaskSpec:
    """One task of a batch submit (``tasks_submit_many``)."""

    input: object
    key: str | None = None
    priority: int = 0
    max_attempts: int | None = None
    expires_at: datetime | None = None


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
    trace: TraceContext = NO_TRACE,
) -> tuple[Task, bool]:
    """Submit a task; return it and whether it was created.

    The same ``key`` with the same input returns the existing task; with another input it
    is ``KEY_CONFLICT``. A task submitted to a group's gate in the group's mailbox is a
    member of that group, so it is submitted through the group. On PostgreSQL one statement
    locks the chain, inserts the task and its event; when it inserts nothing (an inactive
    chain, a group's gate, a key already used) the careful path answers. ``trace`` is the
    submitter's W3C context, stored on the task (a resubmit answers the first one's task).
    """
    spec = TaskSpec(input=input, key=key, priority=priority, max_attempts=max_attempts, expires_at=expires_at)
    now = timezone.now()
    if not fast_paths_enabled():
        _validate_submit(mailbox, [spec], now)
    else:
        task, wake = submit_prepared(
            project_id=project_id, mailbox=mailbox, run_id=run_id, spec=spec, now=now, trace=trace
        )
        if submitted(task, sql.fetch(*submit_statement(task, mailbox, now))):
            dispatch.work_wake_on_commit(wake)
            return task, True
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
            trace=trace,
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
        trace=trace,
    )


@transaction.atomic
def tasks_submit_many(
    *,
    project_id: uuid.UUID,
    mailbox: Mailbox,
    run_id: uuid.UUID,
    items: list[TaskSpec],
    label: str = "items",
    trace: TraceContext = NO_TRACE,
) -> list[tuple[Task, bool]]:
    """Submit up to ``MAX_SUBMIT_BATCH`` tasks in one transaction, all or nothing; answer each as ``task_submit``.

    One invalid item refuses the whole batch (``VALIDATION_ERROR`` whose details name the item,
    ``<label>.<index>.<field>``, and give its ``index``), and so does one key used before with
    another input (``KEY_CONFLICT``). On PostgreSQL the chain is locked once and the tasks and
    their events are inserted by one statement (``unnest`` arrays, keys through ``ON CONFLICT``).
    Every task of the batch stores ``trace``, the submitter's context.
    """
    now = timezone.now()
    _validate_batch(mailbox, items, now, label)
    gated = TaskGroup.objects.filter(scope_id=run_id, mailbox=mailbox).exists()
    if not fast_paths_enabled() or gated:
        answers = []
        with dispatch.work_wakes_batched():
            for index, spec in enumerate(items):
                with _item(label, index):
                    answers.append(
                        task_submit(project_id=project_id, mailbox=mailbox, run_id=run_id, trace=trace, **vars(spec))
                    )
        return answers
    chain = run_chain_lock_active(run_id, project_id=project_id)
    tasks, wakes = _accepted(project_id, mailbox, run_id, items, now, trace, label)
    inserted = _insert_many(tasks, mailbox, chain, now)
    dispatch.work_accepted_on_commit([wake for task, wake in zip(tasks, wakes, strict=True) if task.id in inserted])
    answers = []
    for index, task in enumerate(tasks):
        if task.id in inserted:
            answers.append((task, True))
            continue
        # Not inserted: its key was taken, by an earlier submit or an earlier item of this batch.
        with _item(label, index):
            existing = _task_with_key(mailbox, run_id, task.key, task.input) if task.key is not None else None
        if existing is None:
            raise AssertionError(f"task {index} of a batch was neither inserted nor found by its key")
        answers.append((existing, False))
    return answers


def _validate_batch(mailbox: Mailbox, items: list[TaskSpec], now: datetime, label: str) -> None:
    if not 1 <= len(items) <= MAX_SUBMIT_BATCH:
        limit = f"must hold between 1 and {MAX_SUBMIT_BATCH} tasks"
        raise exceptions.ValidationFailed("Invalid batch.", **{label: limit})
    _validate_submit(mailbox, items, now, label)


def _accepted(
    project_id: uuid.UUID,
    mailbox: Mailbox,
    run_id: uuid.UUID,
    items: list[TaskSpec],
    now: datetime,
    trace: TraceContext,
    label: str,
) -> tuple[list[Task], list]:
    """Build a batch's new tasks (unsaved), each accepted (``dispatch.work_accept``); return them and the wake-ups."""
    tasks = [_new_task(project_id, mailbox, run_id, spec, now, trace) for spec in items]
    wakes = []
    for index, task in enumerate(tasks):
        with _item(label, index):
            wakes.append(dispatch.work_accept(task, mailbox))
    return tasks, wakes


def _validate_submit(mailbox: Mailbox, items: list[TaskSpec], now: datetime, label: str = "items") -> None:
    if mailbox.mode != MailboxMode.WORK:
        raise exceptions.MailboxModeConflict(f"Mailbox '{mailbox.name}' holds messages, not tasks.")
    for index, spec in enumerate(items):
        with _item(label, index if len(items) > 1 else None):
            validate_max_attempts(spec.max_attempts)
            if spec.expires_at is not None and spec.expires_at <= now:
                raise exceptions.ValidationFailed("Invalid task.", expiresAt="must be in the future")


@contextmanager
def _item(label: str, index: int | None):
    """Name the batch item a ``ValidationFailed`` or ``KeyConflict`` is about (``items.3.maxAttempts``)."""
    try:
        yield
    except (exceptions.ValidationFailed, exceptions.KeyConflict) as error:
        if index is None:
            raise
        details = {f"{label}.{index}.{name}": value for name, value in error.details.items()}
        raise type(error)(f"Item {index}: {error.message}", index=index, **details) from None


def _new_task(
    project_id: uuid.UUID, mailbox: Mailbox, run_id: uuid.UUID, spec: TaskSpec, now: datetime, trace: TraceContext
) -> Task:
    """Build (not save) a new queued task; ``run_path`` and ``run_deadline`` come from the insert."""
    return Task(
        project_id=project_id,
        mailbox=mailbox,
        run_id=run_id,
        key=spec.key,
        input=spec.input,
        priority=spec.priority,
        max_attempts=spec.max_attempts or mailbox.max_attempts,
        expires_at=spec.expires_at,
        created_at=now,
        available_at=now,
        traceparent=trace.traceparent,
        tracestate=trace.tracestate,
    )


# The insert of the submit fast path (one task) and of a batch whose chain is already locked.
# The single form locks the run chain FOR KEY SHARE, root first, in the statement itself, and
# inserts only when the chain is active and the run has no group gated on this mailbox (a
# gated submit joins the group: careful path). Keys resolve through ON CONFLICT DO NOTHING:
# a task not inserted is answered by the careful path (idempotent resubmit or KEY_CONFLICT).
# The single form takes scalars, not arrays: PostgreSQL then finds its generic plan as cheap
# as a custom one and stops planning it on every call (an unnest of arrays it cannot size
# keeps it on custom plans, half of the statement's server time).
_SUBMIT_CHAIN = f"""{CHAIN_KEY_SHARE_CTE}, gate AS (
    SELECT {CHAIN_ACTIVE_SQL}
        AND NOT EXISTS (
            SELECT 1 FROM coordination_taskgroup g WHERE g.scope_id = %(run_id)s AND g.mailbox_id = %(mailbox_id)s
        ) AS open,
        min(deadline) AS run_deadline,
        max(path) AS run_path  -- the deepest: every ancestor's path is a prefix of it
    FROM chain
), items AS (
    SELECT %(id)s::uuid AS id, %(input)s::text AS input, %(key)s::text AS key, %(priority)s::int AS priority,
        %(max_attempts)s::int AS max_attempts, %(expires_at)s::timestamptz AS expires_at, 1 AS n
)"""
# The batch form of the single statement (the API's hot path runs it on its own connection,
# each statement its own transaction): it locks the chain as the single form does and inserts
# every task or none. A key used before or twice in the batch inserts nothing (the careful
# path answers: idempotent resubmits, KEY_CONFLICT), and it has no ON CONFLICT clause: a key
# taken by a concurrent submit after the check fails the whole statement (unique violation),
# which writes nothing either.
_SUBMIT_CHAIN_MANY = f"""{CHAIN_KEY_SHARE_CTE}, items AS (
    SELECT * FROM unnest(
        %(ids)s::uuid[], %(inputs)s::text[], %(keys)s::text[], %(priorities)s::int[],
        %(max_attempts)s::int[], %(expires_at)s::timestamptz[]
    ) WITH ORDINALITY AS i(id, input, key, priority, max_attempts, expires_at, n)
), gate AS (
    SELECT {CHAIN_ACTIVE_SQL}
        AND NOT EXISTS (
            SELECT 1 FROM coordination_taskgroup g WHERE g.scope_id = %(run_id)s AND g.mailbox_id = %(mailbox_id)s
        )
        AND NOT EXISTS (
            SELECT 1 FROM coordination_task t
            WHERE t.mailbox_id = %(mailbox_id)s AND t.run_id = %(run_id)s
                AND t.key IN (SELECT key FROM items WHERE key IS NOT NULL)
        )
        AND (SELECT count(key) = count(DISTINCT key) FROM items) AS open,
        min(deadline) AS run_deadline,
        max(path) AS run_path
    FROM chain
)"""
_SUBMIT_LOCKED = """
gate AS (
    SELECT TRUE AS open, %(run_deadline)s::timestamptz AS run_deadline, %(run_path)s::text AS run_path
), items AS (
    SELECT * FROM unnest(
        %(ids)s::uuid[], %(inputs)s::text[], %(keys)s::text[], %(priorities)s::int[],
        %(max_attempts)s::int[], %(expires_at)s::timestamptz[]
    ) WITH ORDINALITY AS i(id, input, key, priority, max_attempts, expires_at, n)
)"""


_ON_KEY_CONFLICT = "ON CONFLICT (mailbox_id, run_id, key) WHERE key IS NOT NULL DO NOTHING"


def _submit_sql(prelude: str, on_conflict: str = _ON_KEY_CONFLICT) -> str:
    return f"""
WITH {prelude}, done AS (
    INSERT INTO coordination_task (
        id, project_id, mailbox_id, run_id, run_path, run_deadline, key, input, state, attempts,
        max_attempts, priority, created_at, available_at, expires_at, worker_id, traceparent, tracestate
    )
    SELECT i.id, %(project_id)s, %(mailbox_id)s, %(run_id)s, gate.run_path, gate.run_deadline, i.key, i.input::jsonb,
        {sql.literal(TaskState.QUEUED)}, 0, i.max_attempts, i.priority, %(now)s, %(now)s, i.expires_at, '',
        %(traceparent)s, %(tracestate)s
    FROM items i, gate
    WHERE gate.open
    ORDER BY i.n
    {on_conflict}
    RETURNING id, project_id, run_id, run_path, run_deadline, key
), events AS (
    {
        event_insert_sql(
            "done",
            type_sql="'task.submitted'",
            data_sql="jsonb_build_object('mailbox', %(mailbox_name)s::text, 'key', key, 'groupId', NULL)",
        )
    }
)
SELECT id, run_path, run_deadline FROM done
"""


SUBMIT_SQL = _submit_sql(_SUBMIT_CHAIN)
SUBMIT_MANY_SQL = _submit_sql(_SUBMIT_LOCKED)
SUBMIT_BATCH_SQL = _submit_sql(_SUBMIT_CHAIN_MANY, on_conflict="")


def submit_statement(task: Task, mailbox: Mailbox, now: datetime) -> tuple[str, dict]:
    """Return the statement that inserts ``task`` (``SUBMIT_SQL``) and its parameters.

    Whoever runs it (``task_submit`` here, the API's hot path on its own connection) passes
    its rows to ``submitted``; no rows leave the answer to the careful path.
    """
    params = {
        **_common_params(task, mailbox, now),
        "id": task.id,
        "input": json.dumps(task.input),
        "key": task.key,
        "priority": task.priority,
        "max_attempts": task.max_attempts,
        "expires_at": task.expires_at,
    }
    return SUBMIT_SQL, params


def submitted(task: Task, rows: list[tuple]) -> bool:
    """Fill in ``task``'s run fields from ``submit_statement``'s rows; return whether it was inserted."""
    if not rows:
        return False
    _, task.run_path, task.run_deadline = rows[0]
    return True


def submit_prepared(
    *,
    project_id: uuid.UUID,
    mailbox: Mailbox,
    run_id: uuid.UUID,
    spec: TaskSpec,
    now: datetime,
    trace: TraceContext = NO_TRACE,
) -> tuple[Task, object]:
    """Check a submit and build its new task (unsaved, with ``trace``); return it and the wake-up to send after."""
    _validate_submit(mailbox, [spec], now)
    task = _new_task(project_id, mailbox, run_id, spec, now, trace)
    return task, dispatch.work_accept(task, mailbox)


def submit_many_prepared(
    *,
    project_id: uuid.UUID,
    mailbox: Mailbox,
    run_id: uuid.UUID,
    items: list[TaskSpec],
    now: datetime,
    label: str = "items",
    trace: TraceContext = NO_TRACE,
) -> tuple[list[Task], list]:
    """Check a batch submit as ``tasks_submit_many`` does and build its tasks; return them and their wake-ups."""
    _validate_batch(mailbox, items, now, label)
    return _accepted(project_id, mailbox, run_id, items, now, trace, label)


def submit_many_statement(tasks: list[Task], mailbox: Mailbox, now: datetime) -> tuple[str, dict]:
    """Return the one statement that inserts all of ``tasks`` or none (``SUBMIT_BATCH_SQL``) and its parameters.

    Its rows go to ``submitted_many``; no rows leave the batch to the careful path
    (``tasks_submit_many``), and so does a unique violation (a key taken meanwhile).
    """
    return SUBMIT_BATCH_SQL, {**_common_params(tasks[0], mailbox, now), **_many_params(tasks)}


def submitted_many(tasks: list[Task], rows: list[tuple]) -> bool:
    """Fill in ``tasks``' run fields from ``submit_many_statement``'s rows; return whether they were inserted."""
    if len(rows) != len(tasks):
        return False
    _, run_path, run_deadline = rows[0]
    for task in tasks:
        task.run_path, task.run_deadline = run_path, run_deadline
    return True


def _many_params(tasks: list[Task]) -> dict:
    return {
        "ids": [task.id for task in tasks],
        "inputs": [json.dumps(task.input) for task in tasks],
        "keys": [task.key for task in tasks],
        "priorities": [task.priority for task in tasks],
        "max_attempts": [task.max_attempts for task in tasks],
        "expires_at": [task.expires_at for task in tasks],
    }


def _insert_many(tasks: list[Task], mailbox: Mailbox, chain: list[Run], now: datetime) -> set[uuid.UUID]:
    """Run ``SUBMIT_MANY_SQL`` under ``chain``'s locks; fill in the run fields; return the inserted ids."""
    run = chain[-1]
    run_deadline = min((r.deadline for r in chain if r.deadline is not None), default=None)
    rows = sql.fetch(
        SUBMIT_MANY_SQL,
        {
            **_common_params(tasks[0], mailbox, now),
            "run_path": run.path,
            "run_deadline": run_deadline,
            **_many_params(tasks),
        },
    )
    for task in tasks:
        task.run_path, task.run_deadline = run.path, run_deadline
    return {row[0] for row in rows}


def _common_params(task: Task, mailbox: Mailbox, now: datetime) -> dict:
    return {
        "project_id": task.project_id,
        "mailbox_id": mailbox.id,
        "mailbox_name": mailbox.name,
        "run_id": task.run_id,
        "now": now,
        # One context per submit: a batch's tasks share their submitter's.
        "traceparent": task.traceparent,
        "tracestate": task.tracestate,
    }


@transaction.atomic
def _task_submit(
    *, project_id, mailbox, run_id, input, key, priority, max_attempts, expires_at, trace
) -> tuple[Task, bool]:
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
                trace=trace,
            )
    except IntegrityError:
        # A concurrent submit with the same key won; answer as an idempotent resubmit.
        existing = _task_with_key(mailbox, run_id, key, input) if key is not None else None
        if existing is None:
            raise
        return existing, False
    return task, True


def _task_with_key(mailbox: Mailbox, run_id: uuid.UUID, key: str, input: object) -> Task | None:
    """Return the task submitted before with ``key`` (None if none), sending its wake-up again while it is queued."""
    existing = Task.objects.filter(mailbox=mailbox, run_id=run_id, key=key).first()
    if existing is not None:
        if existing.input != input:
            raise exceptions.KeyConflict(key=key, taskId=str(existing.id))
        dispatch.work_resubmitted(existing)
    return existing


# Locking one task, its group first -------------------------------------------------------


def lock_task(project_id: uuid.UUID | None, task_id: uuid.UUID) -> tuple[Task, LockedGroup | None]:
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


def after_change(task: Task, locked_group: LockedGroup | None, now: datetime) -> None:
    """Re-evaluate the task's group when the change may have decided it."""
    if locked_group is not None and task.state in TASK_TERMINAL:
        group_evaluate(locked_group, now)


# Cooperative cancellation ----------------------------------------------------------------


@retrying
@transaction.atomic
def task_cancel(
    *, project_id: uuid.UUID, task_id: uuid.UUID, reason: str | None = None, grace_ms: int | None = None
) -> Task:
    """Cancel one task: a queued one at once, a running one cooperatively.

    A running task becomes ``CANCELLATION_REQUESTED``; its worker learns it from its claim
    watch at once (the event names it), or at the latest on its next renewal. With
    ``grace_ms``, the server records ``CANCELLED`` once the grace has passed and the claim is
    lost from then on. A finished task, or a repeated request, is answered
    unchanged.
    """
    if grace_ms is not None and grace_ms < 0:
        raise exceptions.ValidationFailed("Invalid grace.", graceMs="must be >= 0")
    task, locked_group = lock_task(project_id, task_id)
    now = timezone.now()
    if task.state == TaskState.QUEUED:
        task_transitions.cancel_queued(task, now=now, reason=reason)
        record(task, "task.cancelled", reason=reason, cause="cancel_requested")
    elif task.state == TaskState.RUNNING:
        grace_until = now + timedelta(milliseconds=grace_ms) if grace_ms is not None else None
        task_transitions.request_cancellation(task, now=now, reason=reason, grace_until=grace_until)
        record(
            task,
            "task.cancellation_requested",
            reason=reason,
            graceMs=grace_ms,
            **task_transitions.held_event_data(task),
        )
    after_change(task, locked_group, now)
    return task


# Run cascade -----------------------------------------------------------------------------


@cascade_step
def tasks_cancel_subtree(end: SubtreeEnd) -> None:
    """End every unfinished task of the subtree, running ones included, in id order.

    ``CANCELLED`` when the run was cancelled or completed, ``EXPIRED`` when its deadline passed.
    On PostgreSQL one statement locks, ends and records them all, whatever their number.
    """
    task_transitions.end_subtree(end)
