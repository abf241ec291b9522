"""Rerun: submit a finished task again, as a new task linked to the old one by ``rerun_of``.

A rerun is a submit (``tasks.task_submit``), not a second way in: the new task goes to the
old one's mailbox and run, and is refused exactly as a submit there would be (the run's
code, ``GROUP_CLOSED`` through the group). What carries over from the old task: its input
(unless a new one is given), ``priority`` and ``maxAttempts``. What does not: ``expiresAt``
(a deadline for the old task's queueing, usually past), attempts, outcome, error and the
cancel fields. The lease TTL is the mailbox's, so it is the same for both.

A rerun is the same work, so it continues the old task's trace: the new task stores the old
one's ``traceparent``/``tracestate`` (when this process traces, those of a ``send`` span that
is their child), and its worker's ``process`` span joins that trace. The rerun request's own
context is a link of that span when it is in another trace (``tracing.work_trace``).
"""

import uuid

from django.db import transaction

from coordination.domain import exceptions
from coordination.domain.states import TASK_TERMINAL
from coordination.models import Task
from coordination.plumbing.tracing import NO_TRACE, TraceContext, annotate, send_span, work_trace
from coordination.services.events import event_written_here
from coordination.services.groups import group_join, joining_chain_lock
from coordination.services.tasks import task_submit

# ``input`` not given: rerun with the old task's input (``None`` is a valid JSON input).
OLD_INPUT = object()


@transaction.atomic
def task_rerun(
    *,
    project_id: uuid.UUID,
    task_id: uuid.UUID,
    key: str | None = None,
    input: object = OLD_INPUT,
    trace: TraceContext = NO_TRACE,
) -> tuple[Task, bool]:
    """Submit a finished task again; return the new task and whether it was created.

    The old task must be terminal (``INVALID_STATE``). A ``key`` makes the rerun idempotent
    like a submit's key: the same key and input answer the rerun made with them; a key
    already used with another input, or by a task that is not a rerun of this one, is
    ``KEY_CONFLICT``. A group member is rerun into the same group while it is open, counted
    as a member joining then; a closed or finalized group answers ``GROUP_CLOSED``.

    ``trace`` is the caller's W3C context; the new task continues the old task's trace
    (see the module's doc), or the caller's when the old task stored none.
    """
    # No lock on the old task: a terminal task never changes state again, and its mailbox,
    # run, input and group are fixed once it joined one, so this read stays true.
    old = Task.objects.select_related("mailbox").filter(project_id=project_id, id=task_id).first()
    if old is None:
        raise exceptions.NotFound("Task not found.", taskId=str(task_id))
    if old.state not in TASK_TERMINAL:
        raise exceptions.InvalidState("Only a finished task can be rerun.", taskId=str(old.id), state=old.state)
    new_input = old.input if input is OLD_INPUT else input
    # The submit answers every refusal a submit there would get, in its order: the run's
    # code first, then the group's (a member on its group's gate is submitted through the
    # group, which locks the gate chain, then the group).
    if old.group_id is not None:
        # The rerun joins the old task's group (below, or by its submit on the gate): its run
        # chain is locked as the join locks it, before the submit locks it again.
        joining_chain_lock(project_id=project_id, group_id=old.group_id, run_path=old.run_path)
    parent, links = work_trace(TraceContext(old.traceparent, old.tracestate), trace)
    with send_span(old.mailbox.name, parent, links=links, run_id=old.run_id, rerun_of=old.id) as (current, stored):
        task, created = task_submit(
            project_id=project_id,
            mailbox=old.mailbox,
            run_id=old.run_id,
            input=new_input,
            key=key,
            priority=old.priority,
            max_attempts=old.max_attempts,
            trace=stored,
        )
        annotate(current, task_id=task.id, group_id=task.group_id)
    if not created:
        if task.rerun_of_id != old.id:
            message = "The key is used by a task that is not a rerun of this one."
            raise exceptions.KeyConflict(message, key=key, taskId=str(task.id))
        return task, False
    # The new task is not visible to anyone before we commit, so linking it here is atomic
    # with its submit.
    task.rerun_of = old
    Task.objects.filter(id=task.id).update(rerun_of=old)
    # The submit wrote the task's event as any submit's: name the source in it too, before
    # anyone can read it (readers see events only once this transaction commits).
    submitted = event_written_here(project_id=project_id, type="task.submitted", subject_id=task.id)
    submitted.data = {**submitted.data, "rerunOf": str(old.id)}
    submitted.save(update_fields=["data"])
    if old.group_id is not None and task.group_id != old.group_id:
        # A member that joined from another run: the rerun joins the same group in this
        # transaction (the group's lock comes after the task's run chain, as in a submit on
        # a gate), or the whole rerun is refused (GROUP_CLOSED, GROUP_FULL).
        task, _ = group_join(project_id=project_id, group_id=old.group_id, task_id=task.id)
    return task, True
