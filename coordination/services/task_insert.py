"""The careful insert of one task under its locked run chain, and its ``task.submitted`` event.

Shared by a plain submit (``tasks``) and a group member's (``groups.group_submit``), below
both: the group service decides membership and the task service routes a submit on a
group's gate to the group, so neither may own the insert they both make.
"""

import uuid
from datetime import datetime

from django.utils import timezone

from coordination.models import Mailbox, Run, Task, TaskGroup
from coordination.plumbing.tracing import NO_TRACE, TraceContext
from coordination.services import dispatch
from coordination.services.events import event_for, events_record_many


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
    trace: TraceContext = NO_TRACE,
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
        traceparent=trace.traceparent,
        tracestate=trace.tracestate,
    )
    dispatch.work_submitted(task, mailbox)
    task.save(force_insert=True)
    groupId = str(group.id) if group else None  # noqa: N806 - the event's field
    events_record_many([event_for(task, "task.submitted", mailbox=mailbox.name, key=key, groupId=groupId)])
    return task
