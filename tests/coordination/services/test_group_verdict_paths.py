"""A verdict that does not decide is one statement on PostgreSQL, and writes what the careful path writes.

Each scenario runs twice on fresh groups, with the fast paths on and off
(``RUNSTATE_FAST_PATHS``): the answers, the members' rows, the group's decision and
counters, the members the finalize cancelled and the events (type, subject, data, in order)
must be the same; after every step the counters equal a recount of the members.
"""

import pytest
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from coordination.domain import exceptions
from coordination.models import Event, GroupMember, Task, TaskGroup
from coordination.services.claims import claim_complete, claim_fail, task_claim
from coordination.services.groups import group_create, group_join, group_submit, group_verdict
from coordination.services.keys import project_ensure
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.runs import run_create
from coordination.services.tasks import task_submit
from tests.claim_ids import claim_named
from tests.group_counts import assert_counts_match, stored_counts

pytestmark = pytest.mark.postgres_only


def _world(name: str, condition: str, threshold: int | None):
    """A group of five members: two succeeded, one failed, one still queued, one queued on another run."""
    project = project_ensure(name=name)
    mailbox, _ = mailbox_ensure(project_id=project.id, name="reviews", mode="WORK")
    group = group_create(project_id=project.id, mailbox_name="reviews", condition=condition, threshold=threshold)
    tasks = [group_submit(project_id=project.id, group_id=group.id, input={"i": i})[0] for i in range(4)]
    elsewhere = run_create(project_id=project.id)
    loose, _ = task_submit(project_id=project.id, mailbox=mailbox, run_id=elsewhere.id, input={"i": 4})
    tasks.append(group_join(project_id=project.id, group_id=group.id, task_id=loose.id)[0])
    claimed = task_claim(project_id=project.id, mailbox=mailbox, run_id=group.scope_id, max_claims=3)
    claims = {c.task.id: c for c in claimed}
    done = [claims[t.id] for t in tasks[:3]]
    claim_complete(project_id=project.id, claim_id=done[0].claim_id, outcome={"ok": 0})
    claim_complete(project_id=project.id, claim_id=done[1].claim_id, outcome={"ok": 1})
    claim_fail(project_id=project.id, claim_id=done[2].claim_id, error={"no": 2})
    return project, group, tasks


# (member index, verdict) steps; indices: 0 and 1 succeeded, 2 failed, 3 and 4 queued.
ACCEPT, REJECT = "ACCEPTED", "REJECTED"
SCENARIOS = {
    "accept decides N_ACCEPTED 2, then a late one": ("N_ACCEPTED", 2, [(0, ACCEPT), (1, ACCEPT), (2, REJECT)]),
    "first accept decides FIRST_ACCEPTED": ("FIRST_ACCEPTED", None, [(2, REJECT), (1, ACCEPT), (0, REJECT)]),
    "undecided: rejects and an accept on ALL_TERMINAL": ("ALL_TERMINAL", None, [(0, REJECT), (2, REJECT), (1, ACCEPT)]),
    "repeat, conflict, not succeeded, not finished": (
        "N_ACCEPTED",
        3,
        [(0, ACCEPT), (0, ACCEPT), (0, REJECT), (2, ACCEPT), (3, REJECT), (1, REJECT)],
    ),
}


def _run(fast: bool, name: str, condition: str, threshold: int | None, steps) -> dict:
    project, group, tasks = _world(f"{name}-{'fast' if fast else 'careful'}", condition, threshold)
    answers = []
    with override_settings(RUNSTATE_FAST_PATHS=fast):
        for index, verdict in steps:
            try:
                task_id = tasks[index].id
                result = group_verdict(project_id=project.id, group_id=group.id, task_id=task_id, verdict=verdict)
                answers.append((result.member.verdict, result.member.late, result.group.state))
            except exceptions.CoordinationError as exc:
                answers.append(exc.code)
            assert_counts_match(group.id)
    order = {t.id: i for i, t in enumerate(tasks)}
    group.refresh_from_db()
    subjects = {str(t.id): f"task{i}" for i, t in enumerate(tasks)} | {str(group.id): "group"}
    subjects |= {str(group.scope_id): "gate"}
    events = [
        (e.type, subjects.get(e.subject_id, "other"), _comparable(e.subject_id, e.data))
        for e in Event.objects.filter(project_id=project.id).order_by("txid", "id")
    ]
    return {
        "answers": answers,
        "group": (group.state, group.outcome, group.outcome_reason),
        "counts": stored_counts(group.id),
        "members": sorted(
            (order[m.task_id], m.verdict, m.late, m.verdict_at is not None)
            for m in GroupMember.objects.filter(group=group)
        ),
        "tasks": sorted((order[t.id], t.state, t.cancel_reason) for t in Task.objects.filter(group=group)),
        "events": events,
    }


@pytest.mark.django_db
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_fast_and_careful_verdicts_write_the_same_rows_and_events(scenario):
    condition, threshold, steps = SCENARIOS[scenario]
    fast = _run(True, "verdicts", condition, threshold, steps)
    careful = _run(False, "verdicts", condition, threshold, steps)
    assert fast == careful
    if not scenario.startswith(("repeat", "undecided")):
        # Finalized: the member on the gate and the one joined from another run are both cancelled.
        assert fast["group"][0] == "FINALIZED"
        reason = f"group_{fast['group'][2]}"
        assert {(3, "CANCELLED", reason), (4, "CANCELLED", reason)} <= set(fast["tasks"])
        assert ("task.cancelled", "task4", {"reason": reason, "cause": "group_finalized"}) in fast["events"]


@pytest.mark.django_db
def test_a_verdict_that_does_not_decide_is_one_statement():
    project, group, tasks = _world("verdict-statements", "N_ACCEPTED", 2)
    with CaptureQueriesContext(connection) as captured:
        result = group_verdict(project_id=project.id, group_id=group.id, task_id=tasks[0].id, verdict="ACCEPTED")
    # One statement, in no transaction block of its own (no savepoint inside the test's).
    (statement,) = [q["sql"].replace('"', "") for q in captured.captured_queries]
    for part in (
        "FOR UPDATE OF g",
        "FOR UPDATE OF t",
        "UPDATE coordination_groupmember",
        "INSERT INTO coordination_event",
    ):
        assert part in statement
    assert "UPDATE coordination_taskgroup" in statement
    assert (result.member.verdict, result.member.late, result.group.state) == ("ACCEPTED", False, "OPEN")
    assert (result.group.accepted_count, result.group.acceptable_count) == (1, 3)
    assert TaskGroup.objects.get(id=group.id).state == "OPEN"
    assert Event.objects.filter(type="member.verdict", subject_id=str(tasks[0].id)).count() == 1
    assert_counts_match(group.id)


@pytest.mark.django_db
def test_a_deciding_verdict_writes_nothing_in_the_statement_and_decides_in_one_transaction():
    project, group, tasks = _world("verdict-decides", "N_ACCEPTED", 1)
    with CaptureQueriesContext(connection) as captured:
        result = group_verdict(project_id=project.id, group_id=group.id, task_id=tasks[0].id, verdict="ACCEPTED")
    statements = [q["sql"].replace('"', "") for q in captured.captured_queries]
    assert "UPDATE coordination_groupmember" in statements[0]
    # Then the careful transaction (a savepoint inside the test's): lock, record, finalize, cancel.
    assert statements[1].startswith("SAVEPOINT")
    assert (result.member.verdict, result.member.late, result.group.state) == ("ACCEPTED", False, "FINALIZED")
    assert Event.objects.filter(type="member.verdict", subject_id=str(tasks[0].id)).count() == 1
    assert Event.objects.filter(type="group.finalized", subject_id=str(group.id)).count() == 1
    assert_counts_match(group.id)


def _comparable(subject_id: str, data: dict) -> dict:
    """An event's data as both paths agree on it: no group id; a claim id checked against its task, its attempt kept."""
    data = {k: v for k, v in data.items() if k != "groupId"}
    if "claimId" in data:
        data["claimId"] = claim_named(subject_id, data["claimId"])
    return data
