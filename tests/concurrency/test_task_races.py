"""Work handed out once under races: real threads, real connections."""

import itertools
import random
import time

import pytest

from coordination import exceptions
from coordination.models import Event, Task
from coordination.services.claims import claim_complete, task_claim
from coordination.services.keys import project_ensure
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.runs import run_cancel, run_create
from coordination.services.tasks import task_submit
from coordination.states import TaskState
from tests.concurrency.util import run_in_threads

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def world():
    project = project_ensure(name="races")
    mailbox, _ = mailbox_ensure(project_id=project.id, name="jobs", mode="WORK")
    return project, mailbox


def submit_many(project, mailbox, run, count):
    return [task_submit(project_id=project.id, mailbox=mailbox, run_id=run.id, input={"i": i})[0] for i in range(count)]


def test_32_threads_drain_500_tasks_each_claimed_exactly_once(world):
    project, mailbox = world
    run = run_create(project_id=project.id)
    submitted = {t.id for t in submit_many(project, mailbox, run, 500)}

    def worker():
        done = []
        while True:
            claims = task_claim(project_id=project.id, mailbox=mailbox, run_id=run.id, max_claims=3)
            if not claims:
                return done
            for claim in claims:
                claim_complete(project_id=project.id, claim_id=claim.claim_id, outcome=None)
                done.append(claim.task.id)

    completed = list(itertools.chain.from_iterable(run_in_threads([worker] * 32)))
    assert len(completed) == len(set(completed)) == 500, "a task was handed out twice"
    assert set(completed) == submitted, "a task was lost"
    rows = Task.objects.filter(run=run)
    assert rows.filter(state=TaskState.SUCCEEDED, attempts=1).count() == 500
    assert Event.objects.filter(type="task.claimed", run_id=run.id).count() == 500


def test_64_threads_race_for_one_task_50_rounds_one_winner_each(world):
    project, mailbox = world
    for _ in range(50):
        run = run_create(project_id=project.id)
        (task,) = submit_many(project, mailbox, run, 1)

        def racer(run=run):
            return task_claim(project_id=project.id, mailbox=mailbox, run_id=run.id)

        results = run_in_threads([racer] * 64)
        winners = [claims for claims in results if claims]
        assert len(winners) == 1
        assert winners[0][0].task.id == task.id and winners[0][0].attempt == 1
        assert Task.objects.get(id=task.id).attempts == 1


def test_run_cancel_racing_task_complete_200_rounds_exactly_one_outcome(world):
    """The complete and the cancel both lock the task row: whichever commits first wins.

    A task is never CANCELLED after SUCCEEDED was recorded (the complete's answer says which
    side won), and both orders are seen.
    """
    project, mailbox = world
    seen = set()
    for _ in range(200):
        run = run_create(project_id=project.id)
        (task,) = submit_many(project, mailbox, run, 1)
        (claim,) = task_claim(project_id=project.id, mailbox=mailbox, run_id=run.id)

        # A random head start for either side, so both orders occur whatever the machine's timing.
        head_start = random.uniform(-0.005, 0.005)

        def complete(claim=claim, delay=max(0.0, head_start)):
            time.sleep(delay)
            try:
                return claim_complete(project_id=project.id, claim_id=claim.claim_id, outcome="done").state
            except exceptions.ScopeCancelled:
                return "refused"

        def cancel(run=run, delay=max(0.0, -head_start)):
            time.sleep(delay)
            run_cancel(run_id=run.id, project_id=project.id)

        outcome, _ = run_in_threads([complete, cancel])
        final = Task.objects.get(id=task.id)
        terminal_events = list(
            Event.objects.filter(subject_id=str(task.id), type__in=["task.succeeded", "task.cancelled"]).values_list(
                "type", flat=True
            )
        )
        assert len(terminal_events) == 1, terminal_events
        if outcome == TaskState.SUCCEEDED:
            assert final.state == TaskState.SUCCEEDED and final.outcome == "done"
            assert terminal_events == ["task.succeeded"]
        else:
            assert outcome == "refused"
            assert final.state == TaskState.CANCELLED and final.outcome is None
            assert terminal_events == ["task.cancelled"]
        seen.add(final.state)
    assert seen == {TaskState.SUCCEEDED, TaskState.CANCELLED}, f"only saw {seen}"


def test_16_threads_submitting_while_the_run_is_cancelled(world):
    project, mailbox = world
    for _ in range(10):
        run = run_create(project_id=project.id)

        def submitter(run=run):
            accepted = 0
            for i in range(10):
                try:
                    task_submit(project_id=project.id, mailbox=mailbox, run_id=run.id, input={"i": i})
                    accepted += 1
                except exceptions.ScopeCancelled:
                    pass
            return accepted

        def cancel(run=run):
            run_cancel(run_id=run.id, project_id=project.id)

        results = run_in_threads([submitter] * 16 + [cancel])
        tasks = Task.objects.filter(run=run)
        assert tasks.count() == sum(results[:16])
        assert not tasks.filter(state__in=[TaskState.QUEUED, TaskState.RUNNING]).exists()
        assert tasks.filter(state=TaskState.CANCELLED).count() == tasks.count()
        with pytest.raises(exceptions.ScopeCancelled):
            task_submit(project_id=project.id, mailbox=mailbox, run_id=run.id, input={})
