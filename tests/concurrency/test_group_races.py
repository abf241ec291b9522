"""Groups decided exactly once under races: real threads, real connections."""

import random
import time

import pytest
from django.db import connection
from django.db.models import Q

from coordination.domain import exceptions
from coordination.domain.states import Verdict
from coordination.models import Event, GroupMember, Task, TaskGroup
from coordination.services.claims import claim_complete, claim_fail, task_claim
from coordination.services.groups import group_close, group_create, group_submit, group_verdict
from coordination.services.keys import project_ensure
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.runs import run_cancel, run_create
from coordination.services.tasks import task_cancel
from tests.concurrency.util import force_order, rounds, run_in_threads
from tests.group_counts import assert_counts_match

pytestmark = pytest.mark.django_db(transaction=True)

TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED", "EXPIRED"}


@pytest.fixture
def world():
    project = project_ensure(name="group-races")
    mailbox, _ = mailbox_ensure(project_id=project.id, name="reviews", mode="WORK")
    return project, mailbox


def make_group(project, mailbox, *, members, succeed=(), fail=(), parent_id=None, **create):
    """Create a group with ``members`` members; complete those in ``succeed``, fail those in ``fail``."""
    group = group_create(project_id=project.id, mailbox_name=mailbox.name, parent_scope_id=parent_id, **create)
    tasks = [group_submit(project_id=project.id, group_id=group.id, input={"i": i})[0] for i in range(members)]
    finishing = set(succeed) | set(fail)
    if finishing:
        claims = task_claim(project_id=project.id, mailbox=mailbox, run_id=group.scope_id, max_claims=members)
        by_task = {c.task.id: c for c in claims}
        for index in sorted(finishing):
            claim = by_task[tasks[index].id]
            if index in succeed:
                claim_complete(project_id=project.id, claim_id=claim.claim_id, outcome={"i": index})
            else:
                claim_fail(project_id=project.id, claim_id=claim.claim_id, error="no")
    return group, tasks


# An independent model of the condition table (DESIGN.md "Task groups"), used to audit the
# recorded history; it deliberately does not import coordination.domain.group_rules.
def model_decision(condition, threshold, closed, members):
    accepted = sum(1 for state, verdict in members.values() if verdict == "ACCEPTED")
    rejected = sum(1 for state, verdict in members.values() if verdict == "REJECTED")
    acceptable = sum(
        1 for state, verdict in members.values() if state not in TERMINAL or (state == "SUCCEEDED" and verdict is None)
    )
    finished = all(
        state in TERMINAL and (state != "SUCCEEDED" or verdict is not None) for state, verdict in members.values()
    )
    if condition == "FIRST_ACCEPTED" and accepted >= 1:
        return ("SUCCESS", "first_accepted")
    if condition == "N_ACCEPTED":
        if accepted >= threshold:
            return ("SUCCESS", "threshold_reached")
        if closed and accepted + acceptable < threshold:
            return ("FAILURE", "threshold_unreachable")
    if condition == "ALL_TERMINAL" and closed and finished:
        return ("SUCCESS", "all_terminal") if accepted >= 1 and rejected == 0 else ("FAILURE", "all_terminal")
    return None


def audit(group_id):
    """Replay the group's history (its events are serialized by the group lock) against the model.

    Checks: decided at most once; decided at exactly the first step where the model says so,
    with the model's outcome; nothing unfinished after the decision; late verdicts only after;
    the group's counters equal a recount of its members.
    """
    assert_counts_match(group_id)
    group = TaskGroup.objects.get(id=group_id)
    member_ids = {str(t) for t in GroupMember.objects.filter(group=group).values_list("task_id", flat=True)}
    members, closed, decision = {}, False, None
    history = Event.objects.filter(
        Q(subject_id__in=member_ids) | Q(subject_id=str(group_id)), project_id=group.project_id
    ).order_by("id")
    state_of = {
        "task.submitted": "QUEUED",
        "task.claimed": "RUNNING",
        "task.requeued": "QUEUED",
        "task.succeeded": "SUCCEEDED",
        "task.failed": "FAILED",
        "task.cancelled": "CANCELLED",
        "task.expired": "EXPIRED",
        "task.cancellation_requested": "CANCELLATION_REQUESTED",
    }
    finalized_events = 0
    for event in history:
        subject = event.subject_id
        if event.type in state_of and subject in member_ids:
            verdict = members.get(subject, (None, None))[1]
            members[subject] = (state_of[event.type], verdict)
        elif event.type == "member.verdict" and event.data.get("groupId") == str(group_id):
            assert event.data["late"] == (decision is not None), "late flag disagrees with the decision time"
            if decision is None:
                members[subject] = (members[subject][0], event.data["verdict"])
        elif event.type == "group.closed" and subject == str(group_id):
            closed = True
        elif event.type == "group.finalized" and subject == str(group_id):
            finalized_events += 1
            expected = model_decision(group.condition, group.threshold, closed, members)
            reason = event.data["reason"]
            if reason == "cancelled":
                assert expected is None, f"cancelled although already decided {expected}"
            else:
                assert expected == (event.data["outcome"], reason), f"model {expected} vs recorded {event.data}"
            decision = (event.data["outcome"], reason)
            continue
        if decision is None and model_decision(group.condition, group.threshold, closed, members) is not None:
            # Decided now: the finalize must follow, written by the same transaction.
            following = history.filter(id__gt=event.id, type="group.finalized", subject_id=str(group_id)).first()
            assert following is not None, "the model decided but the group never finalized"
            if connection.vendor == "postgresql":
                assert following.txid == event.txid, "decided in another transaction than the deciding change"
    assert finalized_events <= 1, "decided twice"
    if decision is not None:
        assert (group.state, group.outcome, group.outcome_reason) == ("FINALIZED", *decision)
        unfinished = Task.objects.filter(group_id=group_id).exclude(state__in=TERMINAL)
        assert not unfinished.exists(), "an unfinished member survived the decision"
    else:
        assert group.state != "FINALIZED"
    return decision


def test_two_accepts_for_the_last_place_forced_in_order_decide_once(world):
    """The second verdict waits on the first's group lock and, once it commits, is late: one decision."""
    project, mailbox = world
    group, tasks = make_group(project, mailbox, members=3, succeed=range(3), condition="N_ACCEPTED", threshold=2)
    group_verdict(project_id=project.id, group_id=group.id, task_id=tasks[0].id, verdict=Verdict.ACCEPTED)

    def accept(task):
        return lambda: group_verdict(
            project_id=project.id, group_id=group.id, task_id=task.id, verdict=Verdict.ACCEPTED
        )

    deciding, late = force_order(accept(tasks[1]), accept(tasks[2]))
    assert (deciding.member.late, late.member.late) == (False, True)
    assert Event.objects.filter(type="group.finalized", subject_id=str(group.id)).count() == 1
    assert audit(group.id) == ("SUCCESS", "threshold_reached")


@pytest.mark.parametrize("first", ["fail", "close"])
def test_the_last_member_failing_and_a_close_forced_in_each_order_decide_once(world, first):
    """ALL_TERMINAL decides when closed with every member finished: whichever of the two commits second decides."""
    project, mailbox = world
    group, tasks = make_group(project, mailbox, members=2, condition="ALL_TERMINAL")
    claims = {
        c.task.id: c for c in task_claim(project_id=project.id, mailbox=mailbox, run_id=group.scope_id, max_claims=2)
    }
    claim_complete(project_id=project.id, claim_id=claims[tasks[0].id].claim_id, outcome=None)
    group_verdict(project_id=project.id, group_id=group.id, task_id=tasks[0].id, verdict=Verdict.ACCEPTED)

    def fail():
        claim_fail(project_id=project.id, claim_id=claims[tasks[1].id].claim_id, error="no")

    def close():
        group_close(project_id=project.id, group_id=group.id)

    force_order(*((fail, close) if first == "fail" else (close, fail)))
    assert Event.objects.filter(type="group.finalized", subject_id=str(group.id)).count() == 1
    assert audit(group.id) == ("SUCCESS", "all_terminal")


def test_16_threads_accept_50_members_threshold_5_exactly_one_decision_every_round(world):
    """A soak for a broken invariant (each order is forced above): 20 rounds on PostgreSQL (was 50), 5 on SQLite."""
    project, mailbox = world
    for _ in range(rounds(postgresql=20, sqlite=5)):
        group, tasks = make_group(project, mailbox, members=50, succeed=range(50), condition="N_ACCEPTED", threshold=5)
        ids = [t.id for t in tasks]
        random.shuffle(ids)
        slices = [ids[i::16] for i in range(16)]

        def acceptor(my_ids, group_id=group.id):
            late = 0
            for task_id in my_ids:
                result = group_verdict(
                    project_id=project.id, group_id=group_id, task_id=task_id, verdict=Verdict.ACCEPTED
                )
                late += result.member.late
            return late

        run_in_threads([lambda s=s: acceptor(s) for s in slices])
        assert Event.objects.filter(type="group.finalized", subject_id=str(group.id)).count() == 1
        group.refresh_from_db()
        assert (group.state, group.outcome, group.outcome_reason) == ("FINALIZED", "SUCCESS", "threshold_reached")
        verdicts = GroupMember.objects.filter(group=group)
        assert verdicts.filter(verdict="ACCEPTED", late=False).count() == 5
        assert verdicts.filter(verdict="ACCEPTED", late=True).count() == 45
        audit(group.id)


def work_through(project, claims, plan, **fail) -> None:
    """A worker: complete the claims whose task ``plan`` says succeeds, fail the others (``fail``: claim_fail's)."""
    for claim in claims:
        try:
            if plan[claim.task.id]:
                claim_complete(project_id=project.id, claim_id=claim.claim_id, outcome=None)
            else:
                claim_fail(project_id=project.id, claim_id=claim.claim_id, error="no", **fail)
        except (exceptions.ScopeCancelled, exceptions.LeaseLost):
            pass  # the group finalized first and cancelled the rest


def test_completions_racing_close_and_verdicts_80_rounds(world):
    """Members finish, a reviewer judges, someone closes: the audit replays every history.

    A soak for a broken invariant (the orders of a completion and a close are forced above):
    80 rounds (was 200), each a fresh race under random conditions.
    """
    project, mailbox = world
    rng = random.Random(7)
    decided = 0
    for _ in range(80):
        condition = rng.choice(["N_ACCEPTED", "ALL_TERMINAL", "FIRST_ACCEPTED"])
        threshold = rng.randint(1, 3) if condition == "N_ACCEPTED" else None
        group, tasks = make_group(project, mailbox, members=4, condition=condition, threshold=threshold)
        claims = task_claim(project_id=project.id, mailbox=mailbox, run_id=group.scope_id, max_claims=4)
        plan = {c.task.id: rng.random() < 0.7 for c in claims}

        def worker(claims=claims, plan=plan):
            work_through(project, claims, plan)

        def reviewer(tasks=tasks, group_id=group.id, seed=rng.random()):
            local = random.Random(seed)
            for _ in range(3):
                for task in tasks:
                    verdict = Verdict.ACCEPTED if local.random() < 0.6 else Verdict.REJECTED
                    try:
                        group_verdict(project_id=project.id, group_id=group_id, task_id=task.id, verdict=verdict)
                    except (exceptions.TaskNotSucceeded, exceptions.TaskNotFinished, exceptions.VerdictConflict):
                        pass

        def closer(group_id=group.id):
            group_close(project_id=project.id, group_id=group_id)

        run_in_threads([worker, reviewer, closer])
        decided += audit(group.id) is not None
    assert decided > 0


def group_under_a_parent(project, mailbox):
    """A FIRST_ACCEPTED group of 2 under a parent run, member 0 succeeded and awaiting its verdict."""
    parent = run_create(project_id=project.id)
    group, tasks = make_group(project, mailbox, members=2, succeed=[0], parent_id=parent.id, condition="FIRST_ACCEPTED")
    return parent, group, tasks


def assert_decided_once(group, tasks):
    """The group finalized once, by the accept or by the cancel; the other member ended; return its outcome."""
    group.refresh_from_db()
    outcome = (group.state, group.outcome, group.outcome_reason)
    assert outcome in {("FINALIZED", "SUCCESS", "first_accepted"), ("FINALIZED", "FAILURE", "cancelled")}
    assert Event.objects.filter(type="group.finalized", subject_id=str(group.id)).count() == 1
    assert Task.objects.get(id=tasks[1].id).state == "CANCELLED"
    audit(group.id)
    return outcome[1]


@pytest.mark.parametrize("first", ["accept", "cancel"])
def test_parent_cancel_and_the_deciding_accept_forced_in_each_order(world, first):
    """Whichever of the accept and the parent's cancel commits first decides the group.

    Each order is forced (``force_order``): the first side holds its transaction open until the
    other waits on its lock (PostgreSQL) or on the write lock (SQLite), then commits.
    """
    project, mailbox = world
    parent, group, tasks = group_under_a_parent(project, mailbox)

    def accept():
        group_verdict(project_id=project.id, group_id=group.id, task_id=tasks[0].id, verdict=Verdict.ACCEPTED)

    def cancel():
        run_cancel(run_id=parent.id, project_id=project.id)

    if first == "accept":
        force_order(accept, cancel)
        assert assert_decided_once(group, tasks) == "SUCCESS"
    else:
        force_order(cancel, accept)
        assert assert_decided_once(group, tasks) == "FAILURE"


def test_parent_cancel_racing_the_deciding_accept(world):
    """Under real races the group is decided once, whichever order timing gives, 50 rounds.

    Which orders occur is left to the machine: the forced test above proves each order, so
    the rounds only look for a broken invariant (50, down from 100; each round is a fresh race).
    """
    project, mailbox = world
    for _ in range(50):
        parent, group, tasks = group_under_a_parent(project, mailbox)

        # A random head start for either side, so both orders are likely (not required).
        head_start = random.uniform(-0.005, 0.005)

        def accept(group_id=group.id, task_id=tasks[0].id, delay=max(0.0, head_start)):
            time.sleep(delay)
            group_verdict(project_id=project.id, group_id=group_id, task_id=task_id, verdict=Verdict.ACCEPTED)

        def cancel(parent_id=parent.id, delay=max(0.0, -head_start)):
            time.sleep(delay)
            run_cancel(run_id=parent_id, project_id=project.id)

        run_in_threads([accept, cancel])
        assert_decided_once(group, tasks)


def test_verdicts_racing_completions_and_cancels_keep_the_counters_and_decide_once(world):
    """Four reviewers accept 20 succeeded members (threshold 10) while a worker finishes 20 more and
    someone cancels members: one finalize, late verdicts after it, counters equal to a recount.
    """
    project, mailbox = world
    rng = random.Random(27)
    for _ in range(rounds(postgresql=20, sqlite=3)):
        group, tasks = make_group(project, mailbox, members=40, condition="N_ACCEPTED", threshold=10)
        claims = task_claim(project_id=project.id, mailbox=mailbox, run_id=group.scope_id, max_claims=40)
        by_task = {c.task.id: c for c in claims}
        for task in tasks[:20]:
            claim_complete(project_id=project.id, claim_id=by_task[task.id].claim_id, outcome=None)
        claims = [by_task[task.id] for task in tasks[20:]]
        plan = {c.task.id: rng.random() < 0.5 for c in claims}
        accepted = [t.id for t in tasks[:20]]
        rng.shuffle(accepted)
        cancelled = rng.sample([c.task.id for c in claims], 8)

        def reviewer(my_ids, group_id=group.id):
            for task_id in my_ids:
                group_verdict(project_id=project.id, group_id=group_id, task_id=task_id, verdict=Verdict.ACCEPTED)

        def worker(claims=claims, plan=plan):
            work_through(project, claims, plan, retry=False)

        def canceller(task_ids=cancelled):
            for task_id in task_ids:
                task_cancel(project_id=project.id, task_id=task_id, reason="race")

        reviewers = [lambda s=accepted[i::4]: reviewer(s) for i in range(4)]
        run_in_threads([*reviewers, worker, canceller])
        assert Event.objects.filter(type="group.finalized", subject_id=str(group.id)).count() == 1
        group.refresh_from_db()
        assert (group.state, group.outcome, group.outcome_reason) == ("FINALIZED", "SUCCESS", "threshold_reached")
        verdicts = GroupMember.objects.filter(group=group, verdict="ACCEPTED")
        assert (verdicts.filter(late=False).count(), verdicts.filter(late=True).count()) == (10, 10)
        assert group.accepted_count == 20
        audit(group.id)
