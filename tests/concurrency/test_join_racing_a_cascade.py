"""A task joining a group while a cancel of its run is under way: the group is still decided once.

A cancel's cascade reads the groups of the subtree's members, locks them, then ends the
subtree's tasks. A join that committed in between would make an ended task a member of a
group the cascade never locked, so a decision the ending made went unmade. The join locks
the task's run chain before the group (docs/internals.md, "One lock order"): it commits
before the cancel or waits for it.
"""

import random
import threading

import pytest
from django.db import transaction
from django.db.models import F

from coordination.domain import exceptions
from coordination.models import Task, TaskGroup
from coordination.services.groups import group_create, group_join, group_submit
from coordination.services.runs import run_cancel, run_create
from coordination.services.tasks import task_cancel, task_submit
from tests.concurrency.test_group_races import audit, world  # noqa: F401 - the fixture
from tests.concurrency.util import backend_pid, rounds, run_closing, run_in_threads, waiting_on_a_lock
from tests.waiting import WAIT_S, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def a_group_one_join_from_failing(project, mailbox):
    """An open N_ACCEPTED group (threshold 1) expecting two members, its first cancelled.

    The join of a second member closes it; it fails as soon as that member has ended unaccepted.
    """
    group = group_create(
        project_id=project.id, mailbox_name=mailbox.name, condition="N_ACCEPTED", threshold=1, expected_members=2
    )
    first = group_submit(project_id=project.id, group_id=group.id, input={"member": 1})[0]
    task_cancel(project_id=project.id, task_id=first.id)
    return group


@pytest.mark.postgres_only
def test_a_join_in_the_cascades_window_waits_for_the_cancel_and_decides_the_group(world):  # noqa: F811
    """The cascade is held between its read of the member groups and its task step.

    A task of the run with a lower id is held locked by the test, so the cascade's task step
    (rows locked in id order) waits on it before reaching the joining task. The join must
    then wait for the cancel, not commit in the window; once the cancel commits, the join
    adds an ended task, which closes the group and fails it, in the join's transaction.
    """
    project, mailbox = world
    group = a_group_one_join_from_failing(project, mailbox)
    run = run_create(project_id=project.id)
    submitted = [task_submit(project_id=project.id, mailbox=mailbox, run_id=run.id, input={"n": n})[0] for n in (1, 2)]
    held, joining = sorted(submitted, key=lambda task: task.id)
    holding, release = threading.Event(), threading.Event()
    pids, done, errors = {}, {}, []

    def hold_the_lower_task():
        with transaction.atomic():
            Task.objects.select_for_update().get(id=held.id)
            holding.set()
            assert release.wait(WAIT_S), "the test never released the task"

    def cancel():
        pids["cancel"] = backend_pid()
        done["cancel"] = run_cancel(project_id=project.id, run_id=run.id)

    def join():
        pids["join"] = backend_pid()
        done["join"] = group_join(project_id=project.id, group_id=group.id, task_id=joining.id)

    threads = [threading.Thread(target=run_closing(target, errors)) for target in (hold_the_lower_task, cancel, join)]
    try:
        threads[0].start()
        wait_until(lambda: holding.is_set() or errors, what="the lower task is held", interval_s=0.01)
        threads[1].start()
        wait_until(
            lambda: errors or ("cancel" in pids and waiting_on_a_lock(pids["cancel"])),
            what="the cascade waits",
            interval_s=0.01,
        )
        threads[2].start()
        wait_until(
            lambda: errors or "join" in done or ("join" in pids and waiting_on_a_lock(pids["join"])),
            what="the join commits or waits",
            interval_s=0.01,
        )
        joined_in_the_window = "join" in done
    finally:
        release.set()
        for thread in threads:
            if thread.ident is not None:
                thread.join(WAIT_S)
    assert not any(thread.is_alive() for thread in threads), "a side did not finish in time"
    assert not errors, errors
    assert not joined_in_the_window, "the join committed while the cancel's cascade was under way"

    assert Task.objects.get(id=joining.id).state == "CANCELLED"
    group.refresh_from_db()
    assert (group.state, group.outcome, group.outcome_reason) == ("FINALIZED", "FAILURE", "threshold_unreachable")
    assert audit(group.id) == ("FAILURE", "threshold_unreachable")


def test_joins_racing_cancels_of_the_joiners_runs_decide_every_group_once(world):  # noqa: F811
    """Joiners move tasks of four runs into three groups while the runs are cancelled.

    Whatever the order, every group is decided exactly when its members say so (``audit``)
    and no racer meets an error other than the rules' refusals: no deadlock surfaces.
    """
    project, mailbox = world
    rng = random.Random(31)
    decided = 0
    for _ in range(rounds(postgresql=30, sqlite=5)):
        parent = run_create(project_id=project.id)
        runs = [run_create(project_id=project.id, parent_id=parent.id) for _ in range(4)]
        tasks = [
            task_submit(project_id=project.id, mailbox=mailbox, run_id=run.id, input={"r": r, "n": n})[0]
            for r, run in enumerate(runs)
            for n in range(3)
        ]
        groups = [a_group_one_join_from_failing(project, mailbox) for _ in range(2)]
        groups.append(
            group_create(project_id=project.id, mailbox_name=mailbox.name, condition="ALL_TERMINAL", expected_members=3)
        )
        rng.shuffle(tasks)
        plans = [[(rng.choice(groups).id, task.id) for task in tasks[i::3]] for i in range(3)]
        refusals = []

        def joiner(plan, refusals=refusals):
            for group_id, task_id in plan:
                try:
                    group_join(project_id=project.id, group_id=group_id, task_id=task_id)
                except exceptions.CoordinationError as refusal:  # closed, full, in another group
                    refusals.append(refusal.code)

        def canceller(order):
            for run in order:
                run_cancel(project_id=project.id, run_id=run.id)

        order = rng.sample(runs, 4)
        run_in_threads([*(lambda p=plan: joiner(p) for plan in plans), lambda o=order: canceller(o)])
        assert set(refusals) <= {"GROUP_CLOSED", "INVALID_STATE"}, refusals
        for group in groups:
            decided += audit(group.id) is not None
        # Every task ended with its run: a group that took its expected members is decided.
        for group in TaskGroup.objects.filter(id__in=[g.id for g in groups], member_count=F("expected_members")):
            assert group.state == "FINALIZED", (group.condition, group.member_count)
    assert decided > 0
