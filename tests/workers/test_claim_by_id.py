"""Claim by id, what a Celery worker does for each delivery: one statement, and the same answers.

On PostgreSQL a queued task of an active run is claimed by one statement (``CLAIM_BY_ID_SQL``);
every other case goes to the careful path. Real threads and connections race it; the answers
are compared with the careful path's (``RUNSTATE_FAST_PATHS = False``).
"""

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from coordination.domain import exceptions
from coordination.domain.states import TaskState
from coordination.models import Event, Task
from coordination.services.claims import claim_complete, claim_id_for, task_claim_by_id
from coordination.services.keys import project_ensure
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.runs import run_cancel, run_create
from coordination.services.tasks import task_submit
from tests.concurrency.util import run_in_threads

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def world():
    project = project_ensure(name="by-id")
    mailbox, _ = mailbox_ensure(project_id=project.id, name="jobs", mode="WORK", lease_ttl_ms=20_000)
    other, _ = mailbox_ensure(project_id=project.id, name="other", mode="WORK")
    return project, mailbox, other


def submit(project, mailbox, run, **fields):
    return task_submit(project_id=project.id, mailbox=mailbox, run_id=run.id, input={}, **fields)[0]


@pytest.mark.postgres_only
def test_a_claim_by_id_is_one_statement_with_its_event(world):
    project, mailbox, _ = world
    run = run_create(project_id=project.id)
    task = submit(project, mailbox, run)
    with CaptureQueriesContext(connection) as claim_sql:
        claim = task_claim_by_id(project_id=project.id, task_id=task.id, worker_id="w1", mailbox_id=mailbox.id)
    assert [q["sql"].split()[0].upper() for q in claim_sql.captured_queries] == ["WITH"]
    assert (claim.task.state, claim.attempt, claim.task.worker_id, claim.lease_ttl_ms) == ("RUNNING", 1, "w1", 20_000)
    assert claim.lease_expires_at == Task.objects.get(id=task.id).lease_expires_at
    event = Event.objects.get(subject_id=str(task.id), type="task.claimed")
    assert event.data == {"attempt": 1, "workerId": "w1", "claimId": claim_id_for(task.id, 1)}


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "careful"])
def test_every_answer_of_a_claim_by_id(world, settings, fast):
    settings.RUNSTATE_FAST_PATHS = fast
    project, mailbox, other = world
    run = run_create(project_id=project.id)
    now = timezone.now()

    def claim(task, **kwargs):
        return task_claim_by_id(project_id=project.id, task_id=task.id, mailbox_id=mailbox.id, **kwargs)

    queued = submit(project, mailbox, run)
    first = claim(queued, worker_id="a", lease_ttl_ms=5_000)
    assert first.attempt == 1 and first.lease_ttl_ms == 5_000
    assert claim(queued) is None, "a duplicate delivery claims nothing"
    claim_complete(project_id=project.id, claim_id=first.claim_id, outcome=1)
    assert claim(queued) is None, "a finished task is not claimed"

    later = submit(project, mailbox, run)
    Task.objects.filter(id=later.id).update(available_at=now + timedelta(minutes=5))
    assert claim(later) is None, "not available yet (a retry delay)"

    expired = submit(project, mailbox, run, expires_at=now + timedelta(minutes=5))
    Task.objects.filter(id=expired.id).update(expires_at=now - timedelta(seconds=1))
    assert claim(expired) is None, "past its expiresAt"

    taken = submit(project, mailbox, run)
    assert claim(taken).attempt == 1
    Task.objects.filter(id=taken.id).update(lease_expires_at=now - timedelta(seconds=1))
    again = claim(taken, worker_id="b")
    assert again.attempt == 2 and again.task.worker_id == "b", "an expired lease is taken over"

    elsewhere = submit(project, other, run)
    with pytest.raises(exceptions.NotFound):
        claim(elsewhere)
    with pytest.raises(exceptions.NotFound):
        task_claim_by_id(project_id=project_id_of_another(), task_id=queued.id)

    cancelled_run = run_create(project_id=project.id)
    orphan = submit(project, mailbox, cancelled_run)
    run_cancel(project_id=project.id, run_id=cancelled_run.id)
    Task.objects.filter(id=orphan.id).update(state=TaskState.QUEUED)  # as if the cascade had missed it
    with pytest.raises(exceptions.CoordinationError) as refused:
        claim(orphan)
    assert refused.value.code == "SCOPE_CANCELLED"
    assert Task.objects.get(id=orphan.id).state == TaskState.QUEUED


def project_id_of_another():
    return project_ensure(name="by-id-elsewhere").id


@pytest.mark.postgres_only
def test_16_threads_claiming_one_task_by_id_30_rounds_one_winner_each(world):
    project, mailbox, _ = world
    for _ in range(30):
        run = run_create(project_id=project.id)
        task = submit(project, mailbox, run)

        def racer(task=task):
            return task_claim_by_id(project_id=project.id, task_id=task.id, worker_id="racer")

        winners = [claim for claim in run_in_threads([racer] * 16) if claim is not None]
        assert len(winners) == 1 and winners[0].attempt == 1
        assert Task.objects.get(id=task.id).attempts == 1
        assert Event.objects.filter(subject_id=str(task.id), type="task.claimed").count() == 1


@pytest.mark.postgres_only
def test_a_claim_by_id_racing_a_run_cancel_never_leaves_work_running_on_a_cancelled_run(world):
    project, mailbox, _ = world
    outcomes = set()
    for _ in range(30):
        run = run_create(project_id=project.id)
        task = submit(project, mailbox, run)

        def claimer(task=task):
            try:
                return "claimed" if task_claim_by_id(project_id=project.id, task_id=task.id) else "nothing"
            except exceptions.CoordinationError as refusal:
                return refusal.code

        def canceller(run=run):
            run_cancel(project_id=project.id, run_id=run.id)

        answer, _ = run_in_threads([claimer, canceller])
        outcomes.add(answer)
        row = Task.objects.get(id=task.id)
        # Whichever came first, the cancel ends the task: a claim it waited for is cut short.
        assert row.state in (TaskState.CANCELLED, TaskState.CANCELLATION_REQUESTED), (answer, row.state)
        assert answer in ("claimed", "nothing", "SCOPE_CANCELLED")
    assert outcomes
