"""The single-statement fast paths on PostgreSQL: fencing, races, batches, statement counts.

Real threads and connections; no timing is asserted. The careful path's own behaviour is
covered by the rest of the suite (and ``test_claim_paths_state_machine`` shows both agree).
"""

import random
import time

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from coordination.domain import exceptions
from coordination.domain.states import TaskState
from coordination.models import Event, Task
from coordination.services.claims import (
    claim_complete,
    claim_id_for,
    claims_complete_many,
    claims_renew_many,
    task_claim,
)
from coordination.services.keys import project_ensure
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.runs import run_cancel, run_create
from coordination.services.tasks import TaskSpec, task_submit, tasks_submit_many
from tests.concurrency.util import run_in_threads

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def world():
    project = project_ensure(name="fast")
    mailbox, _ = mailbox_ensure(project_id=project.id, name="jobs", mode="WORK")
    return project, mailbox


def statements(queries) -> list[str]:
    """The SQL statements run, BEGIN/COMMIT/SAVEPOINT included, each named by its first words."""
    return [q["sql"].split()[0].upper() for q in queries.captured_queries]


def test_submit_claim_and_complete_are_one_statement_each(world):
    project, mailbox = world
    run = run_create(project_id=project.id)
    with CaptureQueriesContext(connection) as submit_sql:
        task, created = task_submit(project_id=project.id, mailbox=mailbox, run_id=run.id, input={"n": 1})
    with CaptureQueriesContext(connection) as claim_sql:
        (claim,) = task_claim(project_id=project.id, mailbox=mailbox, run_id=run.id, max_claims=10)
    with CaptureQueriesContext(connection) as complete_sql:
        done = claim_complete(project_id=project.id, claim_id=claim.claim_id, outcome={"ok": True})
    assert created and claim.task.id == task.id and done.state == TaskState.SUCCEEDED
    assert statements(submit_sql) == ["WITH"], submit_sql.captured_queries
    assert statements(claim_sql) == ["WITH"], claim_sql.captured_queries
    assert statements(complete_sql) == ["WITH"], complete_sql.captured_queries
    # Each statement wrote its own event.
    types = list(Event.objects.filter(subject_id=str(task.id)).order_by("id").values_list("type", flat=True))
    assert types == ["task.submitted", "task.claimed", "task.succeeded"]
    stored = Task.objects.get(id=task.id)
    assert (stored.state, stored.attempts, stored.outcome, stored.lease_expires_at) == (
        TaskState.SUCCEEDED,
        1,
        {"ok": True},
        None,
    )


def test_claim_of_100_is_one_statement(world):
    project, mailbox = world
    run = run_create(project_id=project.id)
    tasks_submit_many(
        project_id=project.id, mailbox=mailbox, run_id=run.id, items=[TaskSpec(input={"i": i}) for i in range(150)]
    )
    with CaptureQueriesContext(connection) as claim_sql:
        claims = task_claim(project_id=project.id, mailbox=mailbox, run_id=run.id, max_claims=100)
    assert len(claims) == 100 and len({c.task.id for c in claims}) == 100
    assert statements(claim_sql) == ["WITH"]
    assert Event.objects.filter(run_id=run.id, type="task.claimed").count() == 100


def test_complete_with_a_stale_attempt_is_lease_lost(world):
    project, mailbox = world
    run = run_create(project_id=project.id)
    task, _ = task_submit(project_id=project.id, mailbox=mailbox, run_id=run.id, input={})
    (claim,) = task_claim(project_id=project.id, mailbox=mailbox, run_id=run.id)
    stale = claim_id_for(task.id, claim.attempt + 1)  # an attempt the task never had
    older = claim_id_for(task.id, claim.attempt - 1)
    for claim_id in (stale, older):
        with pytest.raises(exceptions.LeaseLost):
            claim_complete(project_id=project.id, claim_id=claim_id, outcome=None)
    claim_complete(project_id=project.id, claim_id=claim.claim_id, outcome=None)
    with pytest.raises(exceptions.LeaseLost):  # a second complete of the same claim
        claim_complete(project_id=project.id, claim_id=claim.claim_id, outcome=None)
    assert Event.objects.filter(subject_id=str(task.id), type="task.succeeded").count() == 1


def test_complete_races_a_run_cancel_exactly_one_wins(world):
    """Under real races exactly one side wins, with its events, whichever order timing gives.

    Which orders occur is left to the machine: ``test_task_races``'s
    ``test_run_cancel_and_task_complete_forced_in_each_order[fast-*]`` forces each order.
    """
    project, mailbox = world
    outcomes = {"completed": 0, "cancelled": 0}
    for round_ in range(60):
        run = run_create(project_id=project.id)
        task, _ = task_submit(project_id=project.id, mailbox=mailbox, run_id=run.id, input={"round": round_})
        (claim,) = task_claim(project_id=project.id, mailbox=mailbox, run_id=run.id)
        # One side, chosen at random, waits a little: both orders are likely (not required).
        late = random.choice(["complete", "cancel"])
        head_start = random.random() * 0.015

        def complete(claim=claim, head_start=head_start, late=late):
            if late == "complete":
                time.sleep(head_start)
            try:
                return claim_complete(project_id=project.id, claim_id=claim.claim_id, outcome="done").state
            except exceptions.ScopeCancelled:
                return "refused"

        def cancel(run=run, head_start=head_start, late=late):
            if late == "cancel":
                time.sleep(head_start)
            run_cancel(project_id=project.id, run_id=run.id, reason="stop")

        answer, _ = run_in_threads([complete, cancel])
        stored = Task.objects.get(id=task.id)
        events = list(Event.objects.filter(subject_id=str(task.id)).order_by("id").values_list("type", flat=True))
        if answer == TaskState.SUCCEEDED:
            outcomes["completed"] += 1
            assert stored.state == TaskState.SUCCEEDED and stored.outcome == "done"
            assert events == ["task.submitted", "task.claimed", "task.succeeded"]
        else:
            outcomes["cancelled"] += 1
            assert answer == "refused"
            assert stored.state == TaskState.CANCELLED and stored.outcome is None
            assert events == ["task.submitted", "task.claimed", "task.cancelled"]
    print("complete vs cancel outcomes:", outcomes)
    assert sum(outcomes.values()) == 60


def test_complete_many_mixes_valid_stale_and_foreign_claims(world):
    project, mailbox = world
    other = project_ensure(name="foreign")
    other_mailbox, _ = mailbox_ensure(project_id=other.id, name="jobs", mode="WORK")
    run = run_create(project_id=project.id)
    other_run = run_create(project_id=other.id)
    tasks_submit_many(
        project_id=project.id, mailbox=mailbox, run_id=run.id, items=[TaskSpec(input={"i": i}) for i in range(4)]
    )
    task_submit(project_id=other.id, mailbox=other_mailbox, run_id=other_run.id, input={})
    mine = task_claim(project_id=project.id, mailbox=mailbox, run_id=run.id, max_claims=4)
    (foreign,) = task_claim(project_id=other.id, mailbox=other_mailbox, run_id=other_run.id)
    # One of ours goes stale: completed already.
    claim_complete(project_id=project.id, claim_id=mine[1].claim_id, outcome="first")
    items = [
        (mine[0].claim_id, "a"),
        (mine[1].claim_id, "again"),
        (foreign.claim_id, "not yours"),
        ("c_not-a-claim", "x"),
        (mine[2].claim_id, None),
        (mine[3].claim_id, [1, 2]),
    ]
    with CaptureQueriesContext(connection) as batch_sql:
        answers = claims_complete_many(project_id=project.id, items=items)
    assert isinstance(answers[0], Task) and answers[0].state == TaskState.SUCCEEDED and answers[0].outcome == "a"
    assert isinstance(answers[1], exceptions.LeaseLost)
    assert isinstance(answers[2], exceptions.NotFound)
    assert isinstance(answers[3], exceptions.NotFound)
    assert isinstance(answers[4], Task) and answers[4].outcome is None
    assert isinstance(answers[5], Task) and answers[5].outcome == [1, 2]
    # The three valid items went in one statement; the two refused ones each took the careful path.
    assert statements(batch_sql).count("WITH") == 1
    foreign_task = Task.objects.get(id=foreign.task.id)
    assert foreign_task.state == TaskState.RUNNING and foreign_task.outcome is None, "a foreign claim was touched"
    assert Task.objects.get(id=mine[1].task.id).outcome == "first"
    assert Event.objects.filter(run_id=run.id, type="task.succeeded").count() == 4
    assert Event.objects.filter(run_id=other_run.id, type="task.succeeded").count() == 0


def test_renew_many_answers_per_item(world):
    project, mailbox = world
    run = run_create(project_id=project.id)
    tasks_submit_many(
        project_id=project.id, mailbox=mailbox, run_id=run.id, items=[TaskSpec(input={"i": i}) for i in range(3)]
    )
    claims = task_claim(project_id=project.id, mailbox=mailbox, run_id=run.id, max_claims=3)
    claim_complete(project_id=project.id, claim_id=claims[2].claim_id, outcome=None)
    answers = claims_renew_many(
        project_id=project.id,
        items=[(claims[0].claim_id, 60_000), (claims[1].claim_id, None), (claims[2].claim_id, 30_000)],
    )
    assert answers[0].lease_expires_at > claims[0].lease_expires_at
    assert answers[1].claim_id == claims[1].claim_id
    assert isinstance(answers[2], exceptions.LeaseLost)
    with pytest.raises(exceptions.ValidationFailed):
        claims_renew_many(project_id=project.id, items=[(claims[0].claim_id, None), (claims[0].claim_id, None)])


def test_complete_many_batches_race_without_deadlock_and_complete_each_once(world):
    project, mailbox = world
    run = run_create(project_id=project.id)
    tasks_submit_many(
        project_id=project.id, mailbox=mailbox, run_id=run.id, items=[TaskSpec(input={"i": i}) for i in range(200)]
    )
    claims = []
    while batch := task_claim(project_id=project.id, mailbox=mailbox, run_id=run.id, max_claims=100):
        claims += batch
    assert len(claims) == 200

    def completer(seed):
        def go():
            mine = list(claims)
            random.Random(seed).shuffle(mine)  # every thread sends all 200, in its own order
            answers = claims_complete_many(project_id=project.id, items=[(c.claim_id, seed) for c in mine])
            return sum(isinstance(a, Task) for a in answers)

        return go

    won = run_in_threads([completer(seed) for seed in range(6)])
    assert sum(won) == 200, won
    assert Task.objects.filter(run=run, state=TaskState.SUCCEEDED).count() == 200
    assert Event.objects.filter(run_id=run.id, type="task.succeeded").values("subject_id").distinct().count() == 200
    assert Event.objects.filter(run_id=run.id, type="task.succeeded").count() == 200


def test_submit_many_is_idempotent_by_key_and_refuses_a_conflict_whole(world):
    project, mailbox = world
    run = run_create(project_id=project.id)
    first = tasks_submit_many(
        project_id=project.id,
        mailbox=mailbox,
        run_id=run.id,
        items=[TaskSpec(input={"i": 0}, key="k0"), TaskSpec(input={"i": 1}), TaskSpec(input={"i": 0}, key="k0")],
    )
    assert [created for _, created in first] == [True, True, False]
    assert first[0][0].id == first[2][0].id, "a repeated key within a batch answers the task it created"
    again = tasks_submit_many(
        project_id=project.id, mailbox=mailbox, run_id=run.id, items=[TaskSpec(input={"i": 0}, key="k0")]
    )
    assert again == [(again[0][0], False)] and again[0][0].id == first[0][0].id
    before = Task.objects.filter(run=run).count()
    with pytest.raises(exceptions.KeyConflict) as conflict:
        tasks_submit_many(
            project_id=project.id,
            mailbox=mailbox,
            run_id=run.id,
            items=[TaskSpec(input={"new": 1}, key="fresh"), TaskSpec(input={"other": True}, key="k0")],
        )
    assert conflict.value.details["index"] == 1
    assert Task.objects.filter(run=run).count() == before, "a refused batch left tasks behind"
    with pytest.raises(exceptions.ValidationFailed) as invalid:
        tasks_submit_many(
            project_id=project.id,
            mailbox=mailbox,
            run_id=run.id,
            items=[TaskSpec(input={}), TaskSpec(input={}, max_attempts=0)],
        )
    assert invalid.value.details["index"] == 1 and "items.1.maxAttempts" in invalid.value.details
    assert Task.objects.filter(run=run).count() == before
    assert Event.objects.filter(run_id=run.id, type="task.submitted").count() == before


def test_submit_many_racing_a_cancel_is_all_or_nothing(world):
    project, mailbox = world
    seen = {"all": 0, "none": 0}
    for round_ in range(40):
        run = run_create(project_id=project.id)
        head_start = random.random() * 0.003

        def submit(run=run, round_=round_, head_start=head_start):
            if random.random() < 0.5:
                time.sleep(head_start)
            try:
                tasks_submit_many(
                    project_id=project.id,
                    mailbox=mailbox,
                    run_id=run.id,
                    items=[TaskSpec(input={"round": round_, "i": i}) for i in range(100)],
                )
                return "submitted"
            except exceptions.ScopeCancelled:
                return "refused"

        def cancel(run=run, head_start=head_start):
            if random.random() < 0.5:
                time.sleep(head_start)
            run_cancel(project_id=project.id, run_id=run.id)

        answer, _ = run_in_threads([submit, cancel])
        tasks = Task.objects.filter(run=run)
        if answer == "submitted":
            # The batch committed first: the cancel then ended every one of its tasks.
            seen["all"] += 1
            assert tasks.count() == 100
            assert tasks.filter(state=TaskState.CANCELLED).count() == 100
            assert Event.objects.filter(run_id=run.id, type="task.cancelled").count() == 100
        else:
            seen["none"] += 1
            assert tasks.count() == 0
            assert not Event.objects.filter(run_id=run.id, type="task.submitted").exists()
        with pytest.raises(exceptions.ScopeCancelled):
            task_claim(project_id=project.id, mailbox=mailbox, run_id=run.id)
    print("batch submit vs cancel:", seen)
    assert sum(seen.values()) == 40
