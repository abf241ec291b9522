"""The ledger checker passes a clean history and catches each kind of violation planted in it.

Every check is shown twice: clean on a real history made through the services, then failing
(by name) once the ledger or the database is deliberately corrupted. Transactional tests, so
each service call commits on its own (and, on PostgreSQL, has its own ``txid``).
"""

import threading
import uuid

import httpx
import pytest
from django.db import connection, transaction
from django.utils import timezone

from coordination.domain import exceptions
from coordination.models import Event, GroupMember, Task, TaskGroup
from coordination.services.claims import claim_id_for
from coordination.services.events import events_record_many
from coordination.services.groups import group_create
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.runs import run_create
from runstate import Runstate
from runstate._sync.work import Claim
from tests.conftest import make_client
from tests.reliability.ledger import Ledger, Services, error_code, watch_sdk

pytestmark = pytest.mark.django_db(transaction=True)


class World:
    """A project with a WORK mailbox, a run, and a ledger recording every service call."""

    def __init__(self, project):
        self.project = project
        self.ledger = Ledger()
        self.ops = Services(self.ledger, project.id)
        self.jobs, _ = mailbox_ensure(project_id=project.id, name="jobs", mode="WORK", max_attempts=3)
        self.run = run_create(project_id=project.id, name="ledger")

    def check(self, **kwargs):
        return self.ledger.check(self.project.id, **kwargs)

    def finish_one(self, outcome=None):
        """Submit, claim and complete one task; return (task, claim id)."""
        task = self.ops.submit(self.jobs, self.run.id, {"n": str(uuid.uuid4())})
        (claim,) = self.ops.claim(self.jobs, self.run.id)
        assert claim.task.id == task.id
        self.ops.complete(claim.claim_id, outcome or {"done": True})
        return task, claim.claim_id

    def plant_event(self, type, task=None, run=None, **data):
        """Write an event in its own transaction, as a buggy service would."""
        subject = task or run
        with transaction.atomic():
            events_record_many(
                [
                    Event(
                        project_id=self.project.id,
                        type=type,
                        run_id=task.run_id if task else run.id,
                        run_path=task.run_path if task else run.path,
                        subject_id=str(subject.id),
                        data=data,
                        created_at=timezone.now(),
                    )
                ]
            )


@pytest.fixture
def world(project):
    return World(project)


def assert_fails(report, check):
    assert check in report.checks_failed(), report.describe()


# A clean history --------------------------------------------------------------------------


def test_a_clean_history_with_every_operation_passes(world):
    ops, jobs, run = world.ops, world.jobs, world.run
    done, _ = world.finish_one({"i": 0})
    # A retrying failure, then success on attempt 2.
    ops.submit(jobs, run.id, {"i": 1})
    (first,) = ops.claim(jobs, run.id)
    ops.renew(first.claim_id)
    assert ops.fail(first.claim_id, {"why": "flaky"}, retry=True).state == "QUEUED"
    (second,) = ops.claim(jobs, run.id)
    assert second.attempt == 2
    ops.complete(second.claim_id, {"i": 1})
    # The stale claim is refused, and recorded as refused.
    with pytest.raises(exceptions.LeaseLost):
        ops.complete(first.claim_id, {"late": True})
    # A final failure, a release, a cancelled queued task.
    ops.submit(jobs, run.id, {"i": 2})
    (failing,) = ops.claim(jobs, run.id)
    ops.fail(failing.claim_id, {"why": "broken"})
    ops.submit(jobs, run.id, {"i": 3})
    (released,) = ops.claim(jobs, run.id)
    ops.release(released.claim_id)
    ops.cancel_task(released.task.id)
    # A group decided by a verdict.
    group = group_create(project_id=world.project.id, mailbox_name="jobs", condition="FIRST_ACCEPTED")
    member = ops.group_submit(group.id, {"member": 1})
    (held,) = ops.claim(jobs, group.scope_id)
    ops.complete(held.claim_id, {"member": 1})
    result = ops.verdict(group.id, member.id, "ACCEPTED")
    assert result.group.outcome == "SUCCESS"
    # A cancelled run: its queued task is cancelled and the late claim refused.
    ops.submit(jobs, run.id, {"i": 4})
    (running,) = ops.claim(jobs, run.id)
    ops.submit(jobs, run.id, {"i": 5})
    ops.cancel_run(run.id)
    with pytest.raises(exceptions.ScopeCancelled):
        ops.complete(running.claim_id, {"too": "late"})
    with pytest.raises(exceptions.ScopeCancelled):
        ops.submit(jobs, run.id, {"i": 6})

    report = world.ledger.assert_clean(world.project.id, drained_runs=[run.id, group.scope_id])
    counts = report.counts
    assert counts["complete_ok"] == 3 and counts["complete_refused"] == 2
    assert counts["tasks_SUCCEEDED"] == 3 and counts["tasks_FAILED"] == 1 and counts["tasks_CANCELLED"] == 3
    assert counts["groups_decided"] == 1 and counts["run_ends"] >= 2
    assert done.id


# One check at a time ----------------------------------------------------------------------


def test_claimed_once_catches_a_claim_handed_out_twice(world):
    task, claim_id = world.finish_one()
    assert world.check().clean
    world.ledger.record("claim", ok=True, run_id=world.run.id, claim_ids=[claim_id])
    assert_fails(world.check(), "claimed_once")


def test_claimed_once_catches_a_duplicate_claimed_event(world):
    task, _ = world.finish_one()
    world.plant_event("task.claimed", task=task, attempt=1, workerId="ghost")
    report = world.check()
    assert_fails(report, "claimed_once")
    assert_fails(report, "event_replay")


def test_finished_once_catches_two_acknowledged_completions(world):
    task, claim_id = world.finish_one({"done": True})
    assert world.check().clean
    world.ledger.record("complete", ok=True, claim_id=claim_id, outcome={"done": True}, state="SUCCEEDED")
    assert_fails(world.check(), "finished_once")


def test_finished_once_catches_a_task_reaching_a_terminal_state_twice(world):
    task, _ = world.finish_one()
    world.plant_event("task.succeeded", task=task, attempt=1)
    report = world.check()
    assert_fails(report, "finished_once")
    assert_fails(report, "event_replay")


def test_event_replay_catches_a_row_that_disagrees_with_its_events(world):
    task, _ = world.finish_one()
    assert world.check().clean
    Task.objects.filter(id=task.id).update(attempts=5)
    assert_fails(world.check(), "event_replay")


def test_event_replay_catches_success_by_a_stale_attempt(world):
    task = world.ops.submit(world.jobs, world.run.id, {})
    (first,) = world.ops.claim(world.jobs, world.run.id)
    world.ops.release(first.claim_id)
    (second,) = world.ops.claim(world.jobs, world.run.id)
    assert world.check().clean
    # As if the stale attempt 1 had been allowed to complete.
    Task.objects.filter(id=task.id).update(state="SUCCEEDED")
    world.plant_event("task.succeeded", task=second.task, attempt=1)
    assert_fails(world.check(), "event_replay")


def test_acknowledged_catches_a_lost_submit(world):
    world.finish_one()
    assert world.check().clean
    world.ledger.record("submit", ok=True, run_id=world.run.id, task_id=uuid.uuid4())
    assert_fails(world.check(), "acknowledged")


def test_acknowledged_catches_a_completion_the_database_does_not_show(world):
    task, claim_id = world.finish_one({"answer": 42})
    assert world.check().clean
    Task.objects.filter(id=task.id).update(outcome={"answer": 41})
    assert_fails(world.check(), "acknowledged")
    Task.objects.filter(id=task.id).update(outcome={"answer": 42}, state="FAILED")
    assert_fails(world.check(), "acknowledged")


def test_acknowledged_catches_a_lost_retrying_failure(world):
    world.ops.submit(world.jobs, world.run.id, {})
    (claim,) = world.ops.claim(world.jobs, world.run.id)
    world.ops.fail(claim.claim_id, {"x": 1}, retry=True)
    assert world.check().clean
    Event.objects.filter(type="task.requeued").delete()
    assert_fails(world.check(), "acknowledged")


def test_a_retrying_fail_told_no_state_may_have_been_the_last_attempt(world):
    world.ops.submit(world.jobs, world.run.id, {}, max_attempts=1)
    (claim,) = world.ops.claim(world.jobs, world.run.id)
    world.ops.fail(claim.claim_id, {"x": 1}, retry=True)  # no attempt left: FAILED
    for entry in world.ledger.entries:
        entry.data.pop("state", None)  # as recorded from an answer that was not read
    assert world.check().clean
    Task.objects.filter(id=claim.task.id).update(state="QUEUED")
    assert_fails(world.check(), "acknowledged")


def test_acknowledged_catches_a_lost_verdict(world):
    group = group_create(project_id=world.project.id, mailbox_name="jobs", condition="ALL_TERMINAL")
    member = world.ops.group_submit(group.id, {})
    (claim,) = world.ops.claim(world.jobs, group.scope_id)
    world.ops.complete(claim.claim_id, {})
    world.ops.verdict(group.id, member.id, "REJECTED")
    assert world.check().clean
    GroupMember.objects.filter(task_id=member.id).update(verdict=None)
    assert_fails(world.check(), "acknowledged")


def test_refused_not_recorded_catches_a_refused_completion_that_took_effect(world):
    task, claim_id = world.finish_one()
    other, other_claim = world.finish_one()
    world.ledger.entries = [e for e in world.ledger.entries if e.claim_id != claim_id]
    assert world.check().clean
    # The worker was told LEASE_LOST, yet its attempt's success is in the database.
    world.ledger.record("complete", code="LEASE_LOST", claim_id=claim_id)
    assert_fails(world.check(), "refused_not_recorded")


def test_refused_then_unknown_is_not_held_against_the_database(world):
    task, claim_id = world.finish_one()
    world.ledger.entries = [e for e in world.ledger.entries if e.claim_id != claim_id]
    world.ledger.record("complete", unknown=True, claim_id=claim_id)  # timed out, but committed
    world.ledger.record("complete", code="LEASE_LOST", claim_id=claim_id)  # the retry
    assert world.check().clean


def test_fenced_catches_a_stale_attempt_acknowledged_after_a_takeover(world):
    task = world.ops.submit(world.jobs, world.run.id, {})
    (first,) = world.ops.claim(world.jobs, world.run.id)
    world.ops.release(first.claim_id)
    (second,) = world.ops.claim(world.jobs, world.run.id)
    world.ops.complete(second.claim_id, {})
    assert world.check().clean
    world.ledger.record("renew", ok=True, claim_id=claim_id_for(task.id, 1))
    assert_fails(world.check(), "fenced")


def test_fenced_catches_work_acknowledged_after_the_run_cancel(world):
    world.ops.submit(world.jobs, world.run.id, {})
    world.ops.cancel_run(world.run.id)
    assert world.check().clean
    world.ledger.record("submit", ok=True, run_id=world.run.id, task_id=uuid.uuid4())
    assert_fails(world.check(), "fenced")


def test_no_work_after_end_catches_a_claim_committed_after_the_cancel(world):
    task = world.ops.submit(world.jobs, world.run.id, {})
    child = run_create(project_id=world.project.id, parent_id=world.run.id)
    world.ops.cancel_run(world.run.id)
    assert world.check().clean
    world.plant_event("task.claimed", task=task, attempt=1)
    report = world.check()
    assert_fails(report, "no_work_after_end")
    Event.objects.filter(type="task.claimed").delete()
    assert world.check().clean
    world.plant_event("run.created", run=run_create(project_id=world.project.id), parentId=str(child.id))
    assert world.check().clean  # another tree is not under the cancelled run
    world.plant_event("task.succeeded", task=task, attempt=1)
    assert_fails(world.check(), "no_work_after_end")


def test_no_work_after_end_catches_work_left_unfinished_under_a_cancelled_run(world):
    task = world.ops.submit(world.jobs, world.run.id, {})
    world.ops.cancel_run(world.run.id)
    assert world.check().clean
    Task.objects.filter(id=task.id).update(state="QUEUED")
    assert_fails(world.check(), "no_work_after_end")


def test_decided_once_catches_a_second_decision(world):
    group = group_create(project_id=world.project.id, mailbox_name="jobs", condition="FIRST_ACCEPTED")
    member = world.ops.group_submit(group.id, {})
    (claim,) = world.ops.claim(world.jobs, group.scope_id)
    world.ops.complete(claim.claim_id, {})
    world.ops.verdict(group.id, member.id, "ACCEPTED")
    assert world.check().clean
    gate = group.scope
    with transaction.atomic():
        events_record_many(
            [
                Event(
                    project_id=world.project.id,
                    type="group.finalized",
                    run_id=gate.id,
                    run_path=gate.path,
                    subject_id=str(group.id),
                    data={"outcome": "FAILURE", "reason": "deadline"},
                    created_at=timezone.now(),
                )
            ]
        )
    assert_fails(world.check(), "decided_once")


def test_decided_once_catches_a_decision_the_row_does_not_show(world):
    group = group_create(project_id=world.project.id, mailbox_name="jobs", condition="ALL_TERMINAL")
    world.ops.group_submit(group.id, {})
    world.ops.close(group.id)
    assert world.check().clean
    # A waiter was told FAILURE, but the group is undecided.
    world.ledger.record("group_decision", ok=True, group_id=group.id, outcome="FAILURE", reason="all_terminal")
    assert_fails(world.check(), "decided_once")
    world.ledger.entries.pop()
    TaskGroup.objects.filter(id=group.id).update(state="FINALIZED", outcome="SUCCESS")
    assert_fails(world.check(), "decided_once")


def test_effects_once_catches_a_handler_run_twice_under_one_claim(world):
    task, _ = world.finish_one()
    world.ledger.record("effect", ok=True, task_id=task.id, attempt=1)
    assert world.check().clean
    world.ledger.record("effect", ok=True, task_id=task.id, attempt=1)
    assert_fails(world.check(), "effects_once")


def test_effects_once_catches_a_success_without_its_effect(world):
    task, _ = world.finish_one()
    world.ledger.record("effect", ok=True, task_id=task.id, attempt=2)
    assert_fails(world.check(), "effects_once")


def test_drained_catches_a_queued_task_left_behind_and_a_stuck_lease(world):
    world.finish_one()
    assert world.check(drained_runs=[world.run.id]).clean
    left = world.ops.submit(world.jobs, world.run.id, {})
    assert_fails(world.check(drained_runs=[world.run.id]), "drained")
    assert world.check().clean  # not asked: a queued task is fine in a live run
    (claim,) = world.ops.claim(world.jobs, world.run.id)
    Task.objects.filter(id=left.id).update(lease_expires_at=timezone.now() - timezone.timedelta(seconds=60))
    report = world.check(drained_runs=[world.run.id])
    assert any("stuck" in v.detail for v in report.violations), report.describe()
    assert claim


@pytest.mark.postgres_only
def test_sequence_cache_is_required_for_the_id_order_argument(world):
    world.finish_one()
    table = Event._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_get_serial_sequence(%s, 'id')", [table])
        (sequence,) = cursor.fetchone()
        cursor.execute(f"ALTER SEQUENCE {sequence} CACHE 20")
        try:
            assert_fails(world.check(), "sequence_cache")
        finally:
            cursor.execute(f"ALTER SEQUENCE {sequence} CACHE 1")
    assert world.check().clean


# Recording ------------------------------------------------------------------------------


def test_recording_is_thread_safe_and_survives_a_cut_line(tmp_path):
    path = tmp_path / "ledger.jsonl"
    ledger = Ledger(path, source="t")

    def record(n):
        for i in range(200):
            ledger.record("effect", ok=True, task_id=uuid.UUID(int=n * 1000 + i), attempt=1)

    threads = [threading.Thread(target=record, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    with open(path, "a") as handle:
        handle.write('{"op": "effect", "res')  # a writer killed mid-line
    loaded = Ledger.load(path, tmp_path / "missing.jsonl")
    assert len(ledger.entries) == len(loaded.entries) == 1600
    assert {e.task_id for e in loaded.entries} == {e.task_id for e in ledger.entries}
    assert Ledger().merge(loaded, ledger).entries.__len__() == 3200


def test_op_records_ok_refused_and_unknown(world):
    ledger = world.ledger
    with ledger.op("renew", claim_id=claim_id_for(uuid.uuid4(), 1)) as call:
        call.done(state="RUNNING")
    with pytest.raises(exceptions.LeaseLost), ledger.op("complete", claim_id=claim_id_for(uuid.uuid4(), 1)):
        raise exceptions.LeaseLost()
    with pytest.raises(ConnectionError), ledger.op("complete", claim_id=claim_id_for(uuid.uuid4(), 1)):
        raise ConnectionError("reset")
    assert [(e.op, e.result, e.code) for e in ledger.entries] == [
        ("renew", "ok", None),
        ("complete", "refused", "LEASE_LOST"),
        ("complete", "unknown", None),
    ]
    assert all(e.started_ns <= e.ended_ns for e in ledger.entries)


def test_sdk_errors_are_refusals_only_when_the_server_answered():
    import runstate
    from runstate._errors import TransportError

    assert error_code(runstate.ConflictError("x", code="LEASE_LOST", status_code=409)) == "LEASE_LOST"
    assert error_code(TransportError("timed out")) is None
    assert error_code(runstate.RunstateError("boom", code="INTERNAL", status_code=500)) is None


def test_http_answers_are_recorded(world):
    api = make_client(world.project)
    ledger = world.ledger
    response = api.post("/v1/mailboxes/jobs/tasks", {"runId": str(world.run.id), "input": {}}, format="json")
    ledger.record_response("submit", response, run_id=world.run.id, task_id=response.json()["id"])
    response = api.post("/v1/mailboxes/jobs/claims", {"runId": str(world.run.id)}, format="json")
    claim_id = response.json()["claims"][0]["claimId"]
    ledger.record_response("claim", response, run_id=world.run.id, claim_ids=[claim_id])
    response = api.post(f"/v1/claims/{claim_id}/complete", {"outcome": {"ok": 1}}, format="json")
    ledger.record_response("complete", response, claim_id=claim_id, outcome={"ok": 1}, state="SUCCEEDED")
    response = api.post(f"/v1/claims/{claim_id}/complete", {"outcome": {"ok": 2}}, format="json")
    ledger.record_response("complete", response, claim_id=claim_id, outcome={"ok": 2})
    assert [e.result for e in ledger.entries] == ["ok", "ok", "ok", "refused"]
    assert ledger.entries[-1].code == "LEASE_LOST"
    ledger.assert_clean(world.project.id, drained_runs=[world.run.id])


def _sdk_claim_answered(statuses, claim_id, *, watched):
    """Complete ``claim_id`` through the SDK against a transport answering ``statuses`` in turn."""
    answers = iter(statuses)

    def answer(request):
        status = next(answers)
        if status == 409:
            return httpx.Response(409, json={"error": {"code": "LEASE_LOST", "message": "lost", "details": {}}})
        return httpx.Response(status, json={"error": {"code": "UNAVAILABLE", "message": "busy", "details": {}}})

    ledger = Ledger()
    rs = Runstate("http://runstate.invalid", "key", backoff_base=0.001, transport=httpx.MockTransport(answer))
    if watched:
        watch_sdk(rs)
    claim = Claim(rs._http, {"claimId": claim_id, "attempt": 1, "task": {"id": "t"}, "leaseExpiresAt": None})
    with pytest.raises(Exception) as raised, ledger.op("complete", claim_id=claim_id, outcome={"done": True}):
        claim.complete({"done": True})
    assert error_code(raised.value) == "LEASE_LOST"
    rs.close()
    return ledger.entries[-1]


def test_a_refusal_that_answers_an_sdk_retry_is_not_held_against_the_database(world):
    task, claim_id = world.finish_one({"done": True})
    world.ledger.entries = [e for e in world.ledger.entries if e.claim_id != claim_id]
    # The first request committed but its answer was lost (503); the SDK's retry hears LEASE_LOST.
    retried = _sdk_claim_answered([503, 409], claim_id, watched=True)
    assert (retried.result, retried.data["http_requests"]) == ("refused", 2)
    world.ledger.entries.append(retried)
    assert world.check().clean
    # Unwatched, the same story reads as a refused completion that took effect.
    world.ledger.entries[-1] = _sdk_claim_answered([503, 409], claim_id, watched=False)
    assert_fails(world.check(), "refused_not_recorded")
    # A single refused request is held to the database, watched or not.
    world.ledger.entries[-1] = _sdk_claim_answered([409], claim_id, watched=True)
    assert_fails(world.check(), "refused_not_recorded")
