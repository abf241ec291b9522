"""Work handed out once under races: real threads, real connections."""

import itertools
import random
import time

import pytest

from coordination.domain import exceptions
from coordination.domain.states import TaskState
from coordination.models import Event, Task
from coordination.services.claims import claim_complete, task_claim
from coordination.services.keys import project_ensure
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.runs import run_cancel, run_create
from coordination.services.tasks import task_submit
from tests.concurrency.util import force_order, rounds, run_in_threads

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


def test_64_threads_race_for_one_task_one_winner_every_round(world):
    """50 rounds on PostgreSQL, 10 on SQLite (``rounds``)."""
    project, mailbox = world
    for _ in range(rounds(postgresql=50, sqlite=10)):
        run = run_create(project_id=project.id)
        (task,) = submit_many(project, mailbox, run, 1)

        def racer(run=run):
            return task_claim(project_id=project.id, mailbox=mailbox, run_id=run.id)

        results = run_in_threads([racer] * 64)
        winners = [claims for claims in results if claims]
        assert len(winners) == 1
        assert winners[0][0].task.id == task.id and winners[0][0].attempt == 1
        assert Task.objects.get(id=task.id).attempts == 1


def claimed_task(project, mailbox):
    """A run with one task, claimed: returns the run, the task and the claim."""
    run = run_create(project_id=project.id)
    (task,) = submit_many(project, mailbox, run, 1)
    (claim,) = task_claim(project_id=project.id, mailbox=mailbox, run_id=run.id)
    return run, task, claim


def complete_or_refused(project, claim):
    """Complete ``claim``; answer the task's state, or ``"refused"`` when its run was cancelled."""
    try:
        return claim_complete(project_id=project.id, claim_id=claim.claim_id, outcome="done").state
    except exceptions.ScopeCancelled:
        return "refused"


def assert_one_outcome(task, answer):
    """Exactly one terminal state and event, the one the complete's ``answer`` says won."""
    final = Task.objects.get(id=task.id)
    terminal_events = list(
        Event.objects.filter(subject_id=str(task.id), type__in=["task.succeeded", "task.cancelled"]).values_list(
            "type", flat=True
        )
    )
    assert len(terminal_events) == 1, terminal_events
    if answer == TaskState.SUCCEEDED:
        assert final.state == TaskState.SUCCEEDED and final.outcome == "done"
        assert terminal_events == ["task.succeeded"]
    else:
        assert answer == "refused"
        assert final.state == TaskState.CANCELLED and final.outcome is None
        assert terminal_events == ["task.cancelled"]
    return final.state


@pytest.mark.parametrize("fast", [pytest.param(True, marks=pytest.mark.postgres_only), False], ids=["fast", "careful"])
@pytest.mark.parametrize("first", ["complete", "cancel"])
def test_run_cancel_and_task_complete_forced_in_each_order(world, settings, fast, first):
    """The complete and the cancel both lock the task row: whichever commits first wins.

    Each order is forced (``force_order``): the first side holds its transaction open until the
    other waits on its lock (PostgreSQL) or on the write lock (SQLite), then commits. On
    PostgreSQL on the single-statement fast paths and on the careful ones (SQLite has only these).
    """
    settings.RUNSTATE_FAST_PATHS = fast
    project, mailbox = world
    run, task, claim = claimed_task(project, mailbox)

    def complete():
        return complete_or_refused(project, claim)

    def cancel():
        run_cancel(run_id=run.id, project_id=project.id)

    if first == "complete":
        answer, _ = force_order(complete, cancel)
        assert assert_one_outcome(task, answer) == TaskState.SUCCEEDED
    else:
        _, answer = force_order(cancel, complete)
        assert assert_one_outcome(task, answer) == TaskState.CANCELLED


def test_run_cancel_racing_task_complete_100_rounds_exactly_one_outcome(world):
    """Under real races the invariants hold in whichever order timing gives.

    A task is never CANCELLED after SUCCEEDED was recorded (the complete's answer says which
    side won). Which orders occur is left to the machine's timing: the forced test above
    proves each order.
    """
    project, mailbox = world
    for _ in range(100):
        run, task, claim = claimed_task(project, mailbox)
        # A random head start for either side, so both orders are likely (not required).
        head_start = random.uniform(-0.005, 0.005)

        def complete(claim=claim, delay=max(0.0, head_start)):
            time.sleep(delay)
            return complete_or_refused(project, claim)

        def cancel(run=run, delay=max(0.0, -head_start)):
            time.sleep(delay)
            run_cancel(run_id=run.id, project_id=project.id)

        answer, _ = run_in_threads([complete, cancel])
        assert_one_outcome(task, answer)


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
