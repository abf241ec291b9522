"""The run deadline sweep: everything below a run past its deadline ends, groups first."""

from datetime import UTC, datetime, timedelta

import pytest

from coordination.models import Barrier, Event, Message, Run, Task, TaskGroup, Timer
from coordination.services.barriers import barrier_create
from coordination.services.claims import task_claim
from coordination.services.groups import group_create, group_submit
from coordination.services.keys import project_ensure
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.messages import message_send
from coordination.services.runs import run_create, runs_sweep_deadlines
from coordination.services.tasks import task_submit
from coordination.services.timers import timer_create

pytestmark = pytest.mark.django_db


def test_sweep_expires_work_fails_groups_and_cancels_timers_barriers_messages():
    project = project_ensure(name="sweep")
    jobs, _ = mailbox_ensure(project_id=project.id, name="jobs", mode="WORK")
    queue, _ = mailbox_ensure(project_id=project.id, name="q", mode="QUEUE")
    run = run_create(project_id=project.id, deadline=datetime.now(UTC) + timedelta(hours=1))
    child = run_create(project_id=project.id, parent_id=run.id)
    queued, _ = task_submit(project_id=project.id, mailbox=jobs, run_id=child.id, input={"q": 1})
    running, _ = task_submit(project_id=project.id, mailbox=jobs, run_id=run.id, input={"r": 1})
    task_claim(project_id=project.id, mailbox=jobs, run_id=run.id)
    group = group_create(project_id=project.id, mailbox_name="jobs", condition="ALL_TERMINAL", parent_scope_id=run.id)
    member, _, _ = group_submit(project_id=project.id, group_id=group.id, input={"m": 1})
    timer = timer_create(project_id=project.id, run_id=child.id, after_seconds=600)
    barrier = barrier_create(project_id=project.id, run_id=run.id, target=2)
    message, _ = message_send(project_id=project.id, mailbox=queue, run_id=run.id, body={"b": 1})
    outsider = run_create(project_id=project.id)
    untouched, _ = task_submit(project_id=project.id, mailbox=jobs, run_id=outsider.id, input={})

    assert runs_sweep_deadlines() == 0  # not due yet
    Run.objects.filter(id=run.id).update(deadline=datetime.now(UTC) - timedelta(seconds=1))
    assert runs_sweep_deadlines() == 1

    group.refresh_from_db()
    assert (group.state, group.outcome, group.outcome_reason) == ("FINALIZED", "FAILURE", "deadline")
    assert Task.objects.get(id=member.id).state == "CANCELLED"  # a finalizing group cancels its members
    assert Task.objects.get(id=queued.id).state == "EXPIRED"
    assert Task.objects.get(id=running.id).state == "EXPIRED"
    assert Timer.objects.get(id=timer.id).state == "CANCELLED"
    assert Barrier.objects.get(id=barrier.id).state == "CANCELLED"
    assert Message.objects.get(id=message.id).state == "CANCELLED"
    assert Task.objects.get(id=untouched.id).state == "QUEUED"
    swept = Run.objects.get(id=run.id)
    assert swept.stored_state == "ACTIVE" and swept.deadline_swept_at is not None
    assert Event.objects.filter(type="run.deadline_exceeded", subject_id=str(run.id)).count() == 1
    assert Event.objects.get(type="task.expired", subject_id=str(queued.id)).data["cause"] == "run_deadline"
    # The group decided before the tasks expired (groups first).
    finalized = Event.objects.get(type="group.finalized", subject_id=str(group.id))
    expired = Event.objects.get(type="task.expired", subject_id=str(running.id))
    assert finalized.id < expired.id
    assert runs_sweep_deadlines() == 0  # once
    assert TaskGroup.objects.filter(state="FINALIZED").count() == 1
