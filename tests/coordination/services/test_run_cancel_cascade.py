"""The run cascade ends exactly the unfinished work of the subtree, one event per row.

On PostgreSQL each step is one statement (``subtree_rows_end``), so these tests also pin what
that statement must keep from the ORM path it replaced: the states, the columns, the event
data and time, and nothing outside the subtree.
"""

from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from bench.cancel import build
from coordination.domain import exceptions
from coordination.domain.ids import claim_id_for
from coordination.domain.states import TASK_HELD, TASK_UNFINISHED
from coordination.models import Barrier, Event, Message, Run, Task, Timer
from coordination.services.barriers import barrier_arrive, barrier_create
from coordination.services.claims import claim_complete, claim_fail, task_claim
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.messages import message_receive, message_send
from coordination.services.runs import run_cancel, run_complete, run_create, runs_sweep_deadlines
from coordination.services.tasks import task_cancel, task_submit
from coordination.services.timers import timer_create

pytestmark = pytest.mark.django_db

TERMINAL_EVENTS = ("task.succeeded", "task.failed", "task.cancelled", "task.expired")


def _tasks_in_every_state(project, mailbox, run) -> dict[str, Task]:
    """Submit one task per state on ``run``: queued, running, cancellation requested, succeeded, failed."""
    tasks = {}
    for state in ("SUCCEEDED", "FAILED", "CANCELLATION_REQUESTED", "RUNNING"):
        task, _ = task_submit(project_id=project.id, mailbox=mailbox, run_id=run.id, input={"state": state})
        [claim] = task_claim(project_id=project.id, mailbox=mailbox, run_id=run.id, worker_id="w")
        assert claim.task.id == task.id
        if state == "SUCCEEDED":
            claim_complete(project_id=project.id, claim_id=claim.claim_id, outcome={"ok": True})
        elif state == "FAILED":
            claim_fail(project_id=project.id, claim_id=claim.claim_id, error={"boom": 1})
        elif state == "CANCELLATION_REQUESTED":
            task_cancel(project_id=project.id, task_id=task.id, reason="one task")
        tasks[state] = task
    tasks["QUEUED"], _ = task_submit(project_id=project.id, mailbox=mailbox, run_id=run.id, input={"state": "QUEUED"})
    for state, task in tasks.items():
        task.refresh_from_db()
        assert task.state == state
    return tasks


def _snapshot(task_ids) -> dict:
    """Return every column of the tasks, to compare before and after."""
    return {row["id"]: row for row in Task.objects.filter(id__in=task_ids).values()}


def _held(task_id, before: dict) -> dict:
    """Return what the end's event says of the claim on the task, as the task was before it."""
    if before["state"] in TASK_HELD and before["worker_id"]:
        return {"heldBy": before["worker_id"], "claimId": claim_id_for(task_id, before["attempts"])}
    return {}


def _terminal_events(task_ids) -> Counter:
    return Counter(
        Event.objects.filter(subject_id__in=[str(t) for t in task_ids], type__in=TERMINAL_EVENTS).values_list(
            "subject_id", flat=True
        )
    )


@pytest.fixture
def tree(project):
    """A top run with the target subtree (three children, one grandchild) and a sibling of the target."""
    jobs, _ = mailbox_ensure(project_id=project.id, name="jobs", mode="WORK")
    queue, _ = mailbox_ensure(project_id=project.id, name="q", mode="QUEUE")
    top = run_create(project_id=project.id)
    target = run_create(project_id=project.id, parent_id=top.id)
    kids = [run_create(project_id=project.id, parent_id=target.id) for _ in range(3)]
    grandchild = run_create(project_id=project.id, parent_id=kids[0].id)
    sibling = run_create(project_id=project.id, parent_id=top.id)
    inside = {run.id: _tasks_in_every_state(project, jobs, run) for run in [target, *kids, grandchild]}
    outside = _tasks_in_every_state(project, jobs, sibling)
    queued_message, _ = message_send(project_id=project.id, mailbox=queue, run_id=kids[1].id, body={"m": 1})
    in_flight, _ = message_send(project_id=project.id, mailbox=queue, run_id=kids[2].id, body={"m": 2})
    message_receive(project_id=project.id, mailbox=queue, run_id=kids[2].id)
    sibling_message, _ = message_send(project_id=project.id, mailbox=queue, run_id=sibling.id, body={"m": 3})
    waiting = barrier_create(project_id=project.id, run_id=kids[1].id, target=2)
    released = barrier_create(project_id=project.id, run_id=grandchild.id, target=1)
    barrier_arrive(project_id=project.id, barrier_id=released.id, key="k")
    armed = timer_create(project_id=project.id, run_id=grandchild.id, after_seconds=600)
    fired = timer_create(project_id=project.id, run_id=kids[2].id, at=datetime.now(UTC) - timedelta(seconds=1))
    sibling_barrier = barrier_create(project_id=project.id, run_id=sibling.id, target=2)
    sibling_timer = timer_create(project_id=project.id, run_id=sibling.id, after_seconds=600)
    return {
        "project": project,
        "barriers": {"waiting": waiting, "released": released, "sibling": sibling_barrier},
        "timers": {"armed": armed, "fired": fired, "sibling": sibling_timer},
        "jobs": jobs,
        "target": target,
        "kids": kids,
        "sibling": sibling,
        "inside": inside,
        "outside": outside,
        "messages": {"queued": queued_message, "in_flight": in_flight, "sibling": sibling_message},
    }


def _before(tree):
    inside = [task.id for per_run in tree["inside"].values() for task in per_run.values()]
    return _snapshot(inside), _snapshot([t.id for t in tree["outside"].values()])


def _expire(tree):
    Run.objects.filter(id=tree["target"].id).update(deadline=datetime.now(UTC) - timedelta(seconds=1))
    assert runs_sweep_deadlines() == 1


END_SUBTREE = {
    "cancel": lambda tree: run_cancel(run_id=tree["target"].id, project_id=tree["project"].id, reason="stop"),
    "complete": lambda tree: run_complete(run_id=tree["target"].id, project_id=tree["project"].id),
    "deadline": _expire,
}


@pytest.mark.parametrize(
    ("how", "state", "event_type", "data"),
    [
        ("cancel", "CANCELLED", "task.cancelled", {"reason": "stop", "cause": "run_cancelled"}),
        ("complete", "CANCELLED", "task.cancelled", {"reason": None, "cause": "run_completed"}),
        ("deadline", "EXPIRED", "task.expired", {"reason": "deadline", "cause": "run_deadline"}),
    ],
)
def test_the_subtree_ends_exactly_its_unfinished_tasks(tree, how, state, event_type, data):
    _end_and_check(tree, how, state=state, event_type=event_type, data=data)
    other = "task.cancelled" if event_type == "task.expired" else "task.expired"
    assert not Event.objects.filter(type=other).exists()


def _end_and_check(tree, how, *, state, event_type, data):
    """End the target run's subtree ``how``; check exactly its unfinished tasks ended, one event each."""
    before_inside, before_outside = _before(tree)
    END_SUBTREE[how](tree)
    inside = [task for per_run in tree["inside"].values() for task in per_run.values()]
    ended = [t.id for t in inside if before_inside[t.id]["state"] in TASK_UNFINISHED]
    kept = [t.id for t in inside if before_inside[t.id]["state"] not in TASK_UNFINISHED]
    assert len(ended) == 5 * 3 and len(kept) == 5 * 2

    after = _snapshot(before_inside)
    finished_at = {after[t]["finished_at"] for t in ended}
    assert len(finished_at) == 1  # the cascade's one time
    for task_id in ended:
        row = after[task_id]
        assert row["state"] == state
        assert row["cancel_reason"] == data["reason"]
        assert row["lease_expires_at"] is None
        assert row["worker_id"] == ""
        unchanged = {
            k: v
            for k, v in row.items()
            if k not in ("state", "finished_at", "cancel_reason", "lease_expires_at", "worker_id")
        }
        assert unchanged == {k: v for k, v in before_inside[task_id].items() if k in unchanged}
    for task_id in kept:
        assert after[task_id] == before_inside[task_id]

    events = list(Event.objects.filter(type=event_type, subject_id__in=[str(t) for t in ended]))
    assert Counter(e.subject_id for e in events) == Counter(str(t) for t in ended)  # exactly one each
    by_subject = {e.subject_id: e for e in events}
    for task_id in ended:
        event = by_subject[str(task_id)]
        assert event.data == {**data, **_held(task_id, before_inside[task_id])}
        assert event.created_at == after[task_id]["finished_at"]
        assert (event.run_id, event.run_path, event.project_id) == (
            after[task_id]["run_id"],
            after[task_id]["run_path"],
            after[task_id]["project_id"],
        )
    # A held task's event names its claim and worker (the claim watch pushes it): some are.
    assert any("heldBy" in event.data for event in events)
    # The finished ones got no second terminal event.
    assert set(_terminal_events(kept).values()) == {1}

    # Nothing outside the subtree moved.
    assert _snapshot(before_outside) == before_outside
    assert not Event.objects.filter(type__in=("task.cancelled", "task.expired"), run_id=tree["sibling"].id).exists()
    return events


def test_cancel_ends_the_queued_messages_waiting_barriers_and_armed_timers_too(tree, is_postgres):
    target = tree["target"]
    events = _end_and_check(
        tree,
        "cancel",
        state="CANCELLED",
        event_type="task.cancelled",
        data={"reason": "stop", "cause": "run_cancelled"},
    )
    # All in the cancel's transaction: the same txid as run.cancelled (0 on SQLite).
    run_event = Event.objects.get(type="run.cancelled", subject_id=str(target.id))
    assert {e.txid for e in events} == {run_event.txid}
    # Child runs keep their own storedState (DESIGN.md "Runs").
    assert set(Run.objects.filter(parent_id=target.id).values_list("stored_state", flat=True)) == {"ACTIVE"}

    messages = tree["messages"]
    queued = Message.objects.get(id=messages["queued"].id)
    assert queued.state == "CANCELLED" and queued.finished_at is not None
    [cancelled] = Event.objects.filter(type="message.cancelled", subject_id=str(queued.id))
    assert cancelled.data == {"reason": "stop", "cause": "run_cancelled"}
    assert cancelled.created_at == queued.finished_at and cancelled.txid == run_event.txid
    assert Message.objects.get(id=messages["in_flight"].id).state == "IN_FLIGHT"  # ends through its delivery
    assert Message.objects.get(id=messages["sibling"].id).state == "QUEUED"
    assert Event.objects.filter(type="message.cancelled").count() == 1

    barriers, timers = tree["barriers"], tree["timers"]
    assert Barrier.objects.get(id=barriers["waiting"].id).state == "CANCELLED"
    assert Barrier.objects.get(id=barriers["released"].id).state == "RELEASED"
    assert Barrier.objects.get(id=barriers["sibling"].id).state == "WAITING"
    [barrier_event] = Event.objects.filter(type="barrier.cancelled")
    assert barrier_event.subject_id == str(barriers["waiting"].id)
    assert barrier_event.data == {"epoch": 1, "cause": "run_cancelled", "reason": "stop"}
    assert (barrier_event.run_id, barrier_event.txid) == (tree["kids"][1].id, run_event.txid)
    assert Timer.objects.get(id=timers["armed"].id).state == "CANCELLED"
    assert Timer.objects.get(id=timers["fired"].id).state == "FIRED"
    assert Timer.objects.get(id=timers["sibling"].id).state == "ARMED"
    [timer_event] = Event.objects.filter(type="timer.cancelled")
    assert timer_event.subject_id == str(timers["armed"].id)
    assert timer_event.data == {"cause": "run_cancelled", "reason": "stop"}
    if is_postgres:  # the one-statement steps date every event at the cascade's time
        assert timer_event.created_at == barrier_event.created_at == cancelled.created_at


def _cancel_counting(children, tasks_per_child):
    project, mailbox, root, kids = build(children, tasks_per_child)
    with CaptureQueriesContext(connection) as statements:
        run_cancel(run_id=root.id, project_id=project.id, reason="big")
    return project, mailbox, root, kids, len(statements.captured_queries)


@pytest.mark.postgres_only
def test_a_large_cancel_leaves_nothing_claimable_and_one_terminal_event_per_task():
    project, mailbox, root, kids, _ = _cancel_counting(20, 50)
    task_ids = list(Task.objects.filter(run_path__startswith=root.path).values_list("id", flat=True))
    assert len(task_ids) == 20 * 50
    assert not Task.objects.filter(run_path__startswith=root.path, state__in=TASK_UNFINISHED).exists()
    for kid in kids:
        with pytest.raises(exceptions.ScopeCancelled):
            task_claim(project_id=project.id, mailbox=mailbox, run_id=kid.id, max_claims=100)
    assert not Task.objects.filter(run_path__startswith=root.path, state="RUNNING").exists()
    terminal = _terminal_events(task_ids)
    assert set(terminal) == {str(t) for t in task_ids}
    assert set(terminal.values()) == {1}
    assert Event.objects.filter(project_id=project.id, type="task.cancelled").count() == 20 * 50


@pytest.mark.postgres_only
def test_the_statements_of_a_cancel_do_not_grow_with_its_tasks():
    *_, small = _cancel_counting(2, 3)
    *_, large = _cancel_counting(20, 150)  # 3,000 tasks: more than one chunk of the ORM path
    assert small == large
