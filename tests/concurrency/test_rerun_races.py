"""Reruns under races: one rerun per key, and a group's member limit kept, with real threads."""

import pytest

from coordination.domain import exceptions
from coordination.models import Event, Task, TaskGroup
from coordination.services.claims import claim_fail, task_claim
from coordination.services.groups import group_create, group_join, group_submit
from coordination.services.keys import project_ensure
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.reruns import task_rerun
from coordination.services.runs import run_create
from coordination.services.tasks import task_submit
from tests.concurrency.util import run_in_threads
from tests.group_counts import assert_counts_match

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def world():
    project = project_ensure(name="reruns")
    mailbox, _ = mailbox_ensure(project_id=project.id, name="jobs", mode="WORK")
    return project, mailbox


def failed_task(project, mailbox, run_id):
    task, _ = task_submit(project_id=project.id, mailbox=mailbox, run_id=run_id, input={"x": 1})
    held = {c.task.id: c for c in task_claim(project_id=project.id, mailbox=mailbox, run_id=run_id, max_claims=100)}
    claim_fail(project_id=project.id, claim_id=held[task.id].claim_id, error="boom")
    return task


def test_16_threads_rerun_with_one_key_make_one_task_20_rounds(world):
    project, mailbox = world
    for _ in range(20):
        run = run_create(project_id=project.id)
        old = failed_task(project, mailbox, run.id)

        def rerun(old=old):
            return task_rerun(project_id=project.id, task_id=old.id, key="again")

        answers = run_in_threads([rerun] * 16)
        assert len({task.id for task, _ in answers}) == 1, "one key made two reruns"
        assert sum(created for _, created in answers) == 1
        (new,) = Task.objects.filter(rerun_of=old)
        assert Event.objects.filter(type="task.submitted", subject_id=str(new.id)).count() == 1


def test_reruns_racing_for_a_groups_last_places_never_overfill_it_10_rounds(world):
    project, mailbox = world
    for _ in range(10):
        group = group_create(project_id=project.id, mailbox_name="jobs", condition="ALL_TERMINAL", expected_members=5)
        olds = []
        for i in range(3):
            member, _, _ = group_submit(project_id=project.id, group_id=group.id, input={"i": i})
            olds.append(member)
        claims = task_claim(project_id=project.id, mailbox=mailbox, run_id=group.scope_id, max_claims=10)
        for claim in claims:
            claim_fail(project_id=project.id, claim_id=claim.claim_id, error="bad")

        def rerun(old):
            try:
                return task_rerun(project_id=project.id, task_id=old.id)[0]
            except exceptions.GroupClosed:
                return None

        # Six reruns (each member twice) for the two places left: the fifth member closes it.
        made = [task for task in run_in_threads([lambda old=old: rerun(old) for old in olds * 2]) if task]
        assert len(made) == 2
        decided = TaskGroup.objects.get(id=group.id)
        assert decided.member_count == 5 and decided.state != "OPEN"
        assert Task.objects.filter(group_id=group.id).count() == 5


def test_reruns_of_members_joined_from_below_the_gate_all_succeed_20_rounds(world):
    """Each rerun locks its run's chain, the gate among it, to submit, and the gate FOR UPDATE to join.

    It takes the gate FOR UPDATE first (``groups.joining_chain_lock``). When it took the submit's
    share lock first, two reruns at once each held it and waited to upgrade it: PostgreSQL
    aborted one.
    """
    project, mailbox = world
    group = group_create(project_id=project.id, mailbox_name="jobs", condition="ALL_TERMINAL")
    below = run_create(project_id=project.id, parent_id=group.scope_id)
    olds = [failed_task(project, mailbox, below.id) for _ in range(4)]
    for old in olds:
        group_join(project_id=project.id, group_id=group.id, task_id=old.id)
    rerun_all_together_20_rounds(project, group, olds)


def test_reruns_of_members_on_the_gate_all_succeed_20_rounds(world):
    """A rerun on the gate is submitted through the group, which takes the gate FOR UPDATE: never after a share lock."""
    project, mailbox = world
    group = group_create(project_id=project.id, mailbox_name="jobs", condition="ALL_TERMINAL")
    olds = [group_submit(project_id=project.id, group_id=group.id, input={"i": i})[0] for i in range(4)]
    for claim in task_claim(project_id=project.id, mailbox=mailbox, run_id=group.scope_id, max_claims=4):
        claim_fail(project_id=project.id, claim_id=claim.claim_id, error="bad")
    rerun_all_together_20_rounds(project, group, olds)


def rerun_all_together_20_rounds(project, group, olds):
    """Rerun every task of ``olds`` at once, 20 rounds: each rerun is made and joins ``group``."""
    for _ in range(20):
        answers = run_in_threads([lambda old=old: task_rerun(project_id=project.id, task_id=old.id) for old in olds])
        assert all(created and task.group_id == group.id for task, created in answers)
    group.refresh_from_db()
    assert group.member_count == len(olds) * 21
    assert_counts_match(group.id)
