"""Mailboxes, tasks and claims over HTTP: DESIGN.md "Mailboxes" and "Tasks and claims"."""

from datetime import UTC, datetime, timedelta

import pytest

from coordination.models import Event, Task
from coordination.services.sweeps import tasks_expire_queued, tasks_settle_expired_leases
from tests.conftest import err

pytestmark = pytest.mark.django_db


@pytest.fixture
def work(api):
    """A WORK mailbox and a run."""
    assert api.put("/v1/mailboxes/jobs", {"mode": "WORK"}, format="json").status_code == 201
    return api.post("/v1/runs", {}, format="json").json()


def submit(api, run, input=None, **extra):
    response = api.post("/v1/mailboxes/jobs/tasks", {"runId": run["id"], "input": input or {}, **extra}, format="json")
    assert response.status_code in (200, 201), response.json()
    return response.json()


def claim(api, run, **extra):
    response = api.post("/v1/mailboxes/jobs/claims", {"runId": run["id"], **extra}, format="json")
    assert response.status_code == 200, response.json()
    return response.json()["claims"]


def expire_lease(task_id):
    Task.objects.filter(id=task_id).update(lease_expires_at=datetime.now(UTC) - timedelta(seconds=1))


# Mailboxes -------------------------------------------------------------------------------


def test_ensure_creates_then_finds(api):
    created = api.put("/v1/mailboxes/search", {"mode": "WORK", "leaseTtlMs": 5000, "maxAttempts": 2}, format="json")
    assert created.status_code == 201
    assert created["Location"] == "/v1/mailboxes/search"
    body = created.json()
    assert (body["name"], body["mode"], body["leaseTtlMs"], body["maxAttempts"]) == ("search", "WORK", 5000, 2)
    found = api.put("/v1/mailboxes/search", {"mode": "WORK"}, format="json")
    assert found.status_code == 200 and found.json()["leaseTtlMs"] == 5000
    assert api.get("/v1/mailboxes/search").json()["maxAttempts"] == 2


def test_ensure_defaults(api):
    body = api.put("/v1/mailboxes/q", {"mode": "QUEUE"}, format="json").json()
    assert (body["leaseTtlMs"], body["maxAttempts"]) == (30000, 3)


def test_ensure_with_another_mode_conflicts(api):
    api.put("/v1/mailboxes/x", {"mode": "WORK"}, format="json")
    error = err(api.put("/v1/mailboxes/x", {"mode": "QUEUE"}, format="json"), 409, "MAILBOX_MODE_CONFLICT")
    assert error["details"]["mode"] == "WORK"


@pytest.mark.parametrize(
    "name, body, field",
    [
        ("ok", {"mode": "STACK"}, "mode"),
        ("ok", {}, "mode"),
        ("ok", {"mode": "WORK", "leaseTtlMs": 5}, "leaseTtlMs"),
        ("ok", {"mode": "WORK", "maxAttempts": 0}, "maxAttempts"),
        ("bad name!", {"mode": "WORK"}, "name"),
    ],
)
def test_ensure_validates(api, name, body, field):
    error = err(api.put(f"/v1/mailboxes/{name}", body, format="json"), 400, "VALIDATION_ERROR")
    assert field in error["details"]


def test_ensure_needs_resource_config(project):
    from tests.conftest import make_client

    writer = make_client(project, permissions=["coordination_write", "coordination_read"])
    err(writer.put("/v1/mailboxes/x", {"mode": "WORK"}, format="json"), 403, "PERMISSION_DENIED")


def test_mailboxes_are_per_project(api, other_api):
    api.put("/v1/mailboxes/jobs", {"mode": "WORK"}, format="json")
    err(other_api.get("/v1/mailboxes/jobs"), 404, "NOT_FOUND")
    assert other_api.put("/v1/mailboxes/jobs", {"mode": "QUEUE"}, format="json").status_code == 201


# Submit ----------------------------------------------------------------------------------


def test_submit_answers_201_with_the_task(api, work):
    response = api.post(
        "/v1/mailboxes/jobs/tasks", {"runId": work["id"], "input": {"n": 1}, "priority": 5}, format="json"
    )
    assert response.status_code == 201
    task = response.json()
    assert response["Location"] == f"/v1/tasks/{task['id']}"
    assert task["state"] == "QUEUED" and task["attempts"] == 0 and task["maxAttempts"] == 3
    assert (task["mailbox"], task["runId"], task["input"], task["priority"]) == ("jobs", work["id"], {"n": 1}, 5)
    assert Event.objects.filter(type="task.submitted", subject_id=task["id"]).count() == 1


def test_same_key_same_input_returns_the_task_other_input_conflicts(api, work):
    first = api.post("/v1/mailboxes/jobs/tasks", {"runId": work["id"], "input": {"a": 1}, "key": "k"}, format="json")
    again = api.post("/v1/mailboxes/jobs/tasks", {"runId": work["id"], "input": {"a": 1}, "key": "k"}, format="json")
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["id"] == first.json()["id"]
    other = api.post("/v1/mailboxes/jobs/tasks", {"runId": work["id"], "input": {"a": 2}, "key": "k"}, format="json")
    err(other, 409, "KEY_CONFLICT")
    assert Task.objects.count() == 1


def test_key_is_unique_per_mailbox_and_run(api, work):
    other_run = api.post("/v1/runs", {}, format="json").json()
    a = submit(api, work, {"x": 1}, key="k")
    b = submit(api, other_run, {"x": 2}, key="k")
    assert a["id"] != b["id"]


def test_submit_refusals(api, work):
    api.put("/v1/mailboxes/q", {"mode": "QUEUE"}, format="json")
    err(api.post("/v1/mailboxes/q/tasks", {"runId": work["id"]}, format="json"), 409, "MAILBOX_MODE_CONFLICT")
    err(api.post("/v1/mailboxes/nope/tasks", {"runId": work["id"]}, format="json"), 404, "NOT_FOUND")
    err(api.post("/v1/mailboxes/jobs/tasks", {"runId": "nope"}, format="json"), 404, "NOT_FOUND")
    past = (datetime.now(UTC) - timedelta(seconds=1)).isoformat()
    error = err(
        api.post("/v1/mailboxes/jobs/tasks", {"runId": work["id"], "expiresAt": past}, format="json"),
        400,
        "VALIDATION_ERROR",
    )
    assert "expiresAt" in error["details"]
    error = err(api.post("/v1/mailboxes/jobs/tasks", {"input": {}}, format="json"), 400, "VALIDATION_ERROR")
    assert "runId" in error["details"]


def test_submit_under_cancelled_run_is_refused(api, work):
    api.post(f"/v1/runs/{work['id']}/cancel", {}, format="json")
    err(api.post("/v1/mailboxes/jobs/tasks", {"runId": work["id"]}, format="json"), 409, "SCOPE_CANCELLED")
    assert Task.objects.count() == 0


def test_task_max_attempts_defaults_to_the_mailbox(api):
    api.put("/v1/mailboxes/jobs", {"mode": "WORK", "maxAttempts": 7}, format="json")
    run = api.post("/v1/runs", {}, format="json").json()
    assert submit(api, run)["maxAttempts"] == 7
    assert submit(api, run, maxAttempts=2)["maxAttempts"] == 2


# Claims ----------------------------------------------------------------------------------


def test_claim_hands_out_priority_then_age_of_exactly_that_run(api, work):
    child = api.post(f"/v1/runs/{work['id']}/children", {}, format="json").json()
    submit(api, child, {"in": "child"})
    low = submit(api, work, {"p": 0})
    high = submit(api, work, {"p": 9}, priority=9)
    low2 = submit(api, work, {"p": "0b"})
    claims = claim(api, work, max=10, workerId="w1")
    assert [c["task"]["id"] for c in claims] == [high["id"], low["id"], low2["id"]]
    first = claims[0]
    assert first["attempt"] == 1 and first["task"]["state"] == "RUNNING" and first["task"]["attempts"] == 1
    assert first["task"]["workerId"] == "w1" and first["leaseExpiresAt"]
    assert first["cancellationRequested"] is False
    assert claim(api, work) == []
    assert [c["task"]["input"] for c in claim(api, child)] == [{"in": "child"}]


def test_complete_records_the_outcome(api, work):
    task = submit(api, work)
    (c,) = claim(api, work)
    done = api.post(f"/v1/claims/{c['claimId']}/complete", {"outcome": {"ok": True}}, format="json")
    assert done.status_code == 200
    assert (done.json()["state"], done.json()["outcome"]) == ("SUCCEEDED", {"ok": True})
    assert done.json()["finishedAt"]
    err(api.post(f"/v1/claims/{c['claimId']}/complete", {}, format="json"), 409, "LEASE_LOST")
    assert api.get(f"/v1/tasks/{task['id']}").json()["state"] == "SUCCEEDED"
    types = list(Event.objects.filter(subject_id=task["id"]).order_by("id").values_list("type", flat=True))
    assert types == ["task.submitted", "task.claimed", "task.succeeded"]


def test_renew_extends_the_lease(api, work):
    submit(api, work)
    (c,) = claim(api, work, leaseTtlMs=1000)
    renewed = api.post(f"/v1/claims/{c['claimId']}/renew", {"leaseTtlMs": 60000}, format="json")
    assert renewed.status_code == 200
    body = renewed.json()
    assert body["cancellationRequested"] is False and body["attempt"] == 1
    assert datetime.fromisoformat(body["leaseExpiresAt"]) > datetime.fromisoformat(c["leaseExpiresAt"])


def test_fail_with_retry_requeues_until_attempts_are_spent(api, work):
    task = submit(api, work, maxAttempts=2)
    (c1,) = claim(api, work)
    retried = api.post(f"/v1/claims/{c1['claimId']}/fail", {"error": "boom", "retry": True}, format="json").json()
    assert (retried["state"], retried["attempts"], retried["error"]) == ("QUEUED", 1, "boom")
    (c2,) = claim(api, work)
    assert c2["attempt"] == 2 and c2["task"]["id"] == task["id"]
    failed = api.post(f"/v1/claims/{c2['claimId']}/fail", {"error": {"e": 2}, "retry": True}, format="json").json()
    assert (failed["state"], failed["attempts"], failed["error"]) == ("FAILED", 2, {"e": 2})
    assert Event.objects.filter(type="task.failed", subject_id=task["id"]).count() == 1


def test_fail_without_retry_is_final(api, work):
    submit(api, work)
    (c,) = claim(api, work)
    assert api.post(f"/v1/claims/{c['claimId']}/fail", {"error": "x"}, format="json").json()["state"] == "FAILED"


def test_retry_delay_hides_the_task_until_then(api, work):
    task = submit(api, work)
    (c,) = claim(api, work)
    api.post(f"/v1/claims/{c['claimId']}/fail", {"retry": True, "retryDelayMs": 60000}, format="json")
    assert claim(api, work) == []
    Task.objects.filter(id=task["id"]).update(available_at=datetime.now(UTC) - timedelta(seconds=1))
    assert [x["task"]["id"] for x in claim(api, work)] == [task["id"]]


def test_release_puts_the_task_back(api, work):
    task = submit(api, work)
    (c,) = claim(api, work)
    released = api.post(f"/v1/claims/{c['claimId']}/release")
    assert released.status_code == 200 and released.json()["state"] == "QUEUED"
    err(api.post(f"/v1/claims/{c['claimId']}/complete", {}, format="json"), 409, "LEASE_LOST")
    (again,) = claim(api, work)
    assert again["task"]["id"] == task["id"] and again["attempt"] == 2


def test_fencing_a_stale_claim_after_takeover(api, work):
    """A claims, its lease expires, B claims: A's renew/complete/fail are LEASE_LOST, B completes."""
    task = submit(api, work)
    (a,) = claim(api, work, workerId="A")
    expire_lease(task["id"])
    (b,) = claim(api, work, workerId="B")
    assert b["task"]["id"] == task["id"] and b["attempt"] == 2
    for action, body in [("renew", {}), ("complete", {"outcome": "A"}), ("fail", {"error": "A"}), ("release", None)]:
        err(api.post(f"/v1/claims/{a['claimId']}/{action}", body, format="json"), 409, "LEASE_LOST")
    done = api.post(f"/v1/claims/{b['claimId']}/complete", {"outcome": "B"}, format="json").json()
    assert (done["state"], done["outcome"], done["attempts"]) == ("SUCCEEDED", "B", 2)
    assert Event.objects.filter(type="task.requeued", subject_id=task["id"]).count() == 1


def test_expired_lease_is_lost_even_before_takeover(api, work):
    task = submit(api, work)
    (a,) = claim(api, work)
    expire_lease(task["id"])
    err(api.post(f"/v1/claims/{a['claimId']}/complete", {}, format="json"), 409, "LEASE_LOST")
    err(api.post(f"/v1/claims/{a['claimId']}/renew", {}, format="json"), 409, "LEASE_LOST")


def test_takeover_with_attempts_spent_fails_the_task(api, work):
    task = submit(api, work, maxAttempts=1)
    claim(api, work)
    expire_lease(task["id"])
    assert claim(api, work) == []
    failed = api.get(f"/v1/tasks/{task['id']}").json()
    assert failed["state"] == "FAILED" and failed["error"]["code"] == "lease_expired"


def test_lease_sweep_requeues_and_fails(api, work):
    requeued = submit(api, work, {"a": 1})
    spent = submit(api, work, {"b": 2}, maxAttempts=1)
    claim(api, work, max=2)
    expire_lease(requeued["id"])
    expire_lease(spent["id"])
    assert tasks_settle_expired_leases() == 2
    assert api.get(f"/v1/tasks/{requeued['id']}").json()["state"] == "QUEUED"
    assert api.get(f"/v1/tasks/{spent['id']}").json()["state"] == "FAILED"
    assert tasks_settle_expired_leases() == 0


def test_expires_at_expires_a_queued_task(api, work):
    task = submit(api, work, expiresAt=(datetime.now(UTC) + timedelta(hours=1)).isoformat())
    Task.objects.filter(id=task["id"]).update(expires_at=datetime.now(UTC) - timedelta(seconds=1))
    assert claim(api, work) == []
    assert tasks_expire_queued() == 1
    assert api.get(f"/v1/tasks/{task['id']}").json()["state"] == "EXPIRED"
    assert Event.objects.filter(type="task.expired", subject_id=task["id"]).exists()


@pytest.mark.parametrize(
    "body, field",
    [({"max": 0}, "max"), ({"max": 101}, "max"), ({"waitMs": -1}, "waitMs"), ({"leaseTtlMs": 1}, "leaseTtlMs")],
)
def test_claim_validates(api, work, body, field):
    error = err(
        api.post("/v1/mailboxes/jobs/claims", {"runId": work["id"], **body}, format="json"), 400, "VALIDATION_ERROR"
    )
    assert field in error["details"]


def test_malformed_or_foreign_claim_ids_are_404(api, other_api, work):
    submit(api, work)
    (c,) = claim(api, work)
    err(api.post("/v1/claims/garbage/complete", {}, format="json"), 404, "NOT_FOUND")
    err(api.post("/v1/claims/c_zz_1/complete", {}, format="json"), 404, "NOT_FOUND")
    err(other_api.post(f"/v1/claims/{c['claimId']}/complete", {}, format="json"), 404, "NOT_FOUND")
    err(other_api.get(f"/v1/tasks/{c['task']['id']}"), 404, "NOT_FOUND")
    err(other_api.post(f"/v1/tasks/{c['task']['id']}/cancel", {}, format="json"), 404, "NOT_FOUND")


# Run cancellation and inactive runs ------------------------------------------------------


def test_run_cancel_cancels_queued_and_running_tasks_and_refuses_the_claim(api, work):
    child = api.post(f"/v1/runs/{work['id']}/children", {}, format="json").json()
    queued = submit(api, child, {"q": 1})
    running = submit(api, work, {"r": 1})
    done = submit(api, work, {"d": 1})
    (c_run,) = claim(api, work)
    assert c_run["task"]["id"] == running["id"]
    (c_done,) = claim(api, work)
    api.post(f"/v1/claims/{c_done['claimId']}/complete", {"outcome": "kept"}, format="json")

    api.post(f"/v1/runs/{work['id']}/cancel", {"reason": "stop"}, format="json")

    assert api.get(f"/v1/tasks/{queued['id']}").json()["state"] == "CANCELLED"
    cancelled = api.get(f"/v1/tasks/{running['id']}").json()
    assert (cancelled["state"], cancelled["cancelReason"]) == ("CANCELLED", "stop")
    kept = api.get(f"/v1/tasks/{done['id']}").json()
    assert (kept["state"], kept["outcome"]) == ("SUCCEEDED", "kept")
    for action in ("renew", "complete", "fail"):
        err(api.post(f"/v1/claims/{c_run['claimId']}/{action}", {}, format="json"), 409, "SCOPE_CANCELLED")
    released = api.post(f"/v1/claims/{c_run['claimId']}/release")
    assert released.status_code == 200 and released.json()["state"] == "CANCELLED"
    err(api.post("/v1/mailboxes/jobs/claims", {"runId": child["id"]}, format="json"), 409, "SCOPE_CANCELLED")
    assert Event.objects.filter(type="task.cancelled").count() == 2


def test_deadline_refuses_claims_and_renewals_at_once(api, work):
    from coordination.models import Run

    task = submit(api, work)
    (c,) = claim(api, work)
    past = datetime.now(UTC) - timedelta(seconds=1)
    Run.objects.filter(id=work["id"]).update(deadline=past)
    Task.objects.filter(id=task["id"]).update(run_deadline=past)
    err(api.post(f"/v1/claims/{c['claimId']}/renew", {}, format="json"), 409, "DEADLINE_EXCEEDED")
    err(api.post(f"/v1/claims/{c['claimId']}/complete", {}, format="json"), 409, "DEADLINE_EXCEEDED")
    err(api.post("/v1/mailboxes/jobs/claims", {"runId": work["id"]}, format="json"), 409, "DEADLINE_EXCEEDED")


# Cooperative cancellation ----------------------------------------------------------------


def test_cancel_of_a_queued_task_is_immediate(api, work):
    task = submit(api, work)
    cancelled = api.post(f"/v1/tasks/{task['id']}/cancel", {"reason": "nope"}, format="json").json()
    assert (cancelled["state"], cancelled["cancelReason"]) == ("CANCELLED", "nope")
    assert claim(api, work) == []


def test_cancel_of_a_running_task_is_cooperative_then_cancelled_on_return(api, work):
    task = submit(api, work)
    (c,) = claim(api, work)
    requested = api.post(f"/v1/tasks/{task['id']}/cancel", {"reason": "user"}, format="json").json()
    assert requested["state"] == "CANCELLATION_REQUESTED"
    again = api.post(f"/v1/tasks/{task['id']}/cancel", {"reason": "other"}, format="json").json()
    assert (again["state"], again["cancelReason"]) == ("CANCELLATION_REQUESTED", "user")
    renewed = api.post(f"/v1/claims/{c['claimId']}/renew", {}, format="json").json()
    assert renewed["cancellationRequested"] is True
    done = api.post(f"/v1/claims/{c['claimId']}/complete", {"outcome": "partial"}, format="json").json()
    assert done["state"] == "CANCELLED"
    assert Event.objects.filter(type="task.cancellation_requested", subject_id=task["id"]).count() == 1


def test_failure_after_cancel_request_stays_failed(api, work):
    task = submit(api, work)
    (c,) = claim(api, work)
    api.post(f"/v1/tasks/{task['id']}/cancel", {}, format="json")
    failed = api.post(f"/v1/claims/{c['claimId']}/fail", {"error": "crash", "retry": True}, format="json").json()
    assert failed["state"] == "FAILED"


def test_lease_expiry_after_cancel_request_records_cancelled(api, work):
    task = submit(api, work)
    claim(api, work)
    api.post(f"/v1/tasks/{task['id']}/cancel", {}, format="json")
    expire_lease(task["id"])
    assert tasks_settle_expired_leases() == 1
    assert api.get(f"/v1/tasks/{task['id']}").json()["state"] == "CANCELLED"


def test_grace_passing_loses_the_claim_and_records_cancelled(api, work):
    task = submit(api, work)
    (c,) = claim(api, work, leaseTtlMs=600000)
    api.post(f"/v1/tasks/{task['id']}/cancel", {"graceMs": 60000}, format="json")
    assert api.post(f"/v1/claims/{c['claimId']}/renew", {}, format="json").json()["cancellationRequested"]
    Task.objects.filter(id=task["id"]).update(cancel_grace_until=datetime.now(UTC) - timedelta(seconds=1))
    err(api.post(f"/v1/claims/{c['claimId']}/complete", {}, format="json"), 409, "LEASE_LOST")
    assert tasks_settle_expired_leases() == 1
    assert api.get(f"/v1/tasks/{task['id']}").json()["state"] == "CANCELLED"


def test_cancel_of_a_finished_task_answers_it_unchanged(api, work):
    task = submit(api, work)
    (c,) = claim(api, work)
    api.post(f"/v1/claims/{c['claimId']}/complete", {"outcome": 1}, format="json")
    response = api.post(f"/v1/tasks/{task['id']}/cancel", {}, format="json")
    assert response.status_code == 200 and response.json()["state"] == "SUCCEEDED"


def test_cancel_validates_grace(api, work):
    task = submit(api, work)
    err(api.post(f"/v1/tasks/{task['id']}/cancel", {"graceMs": -5}, format="json"), 400, "VALIDATION_ERROR")


def test_a_key_bound_to_a_run_reaches_only_claims_and_tasks_in_its_subtree(api, project, work):
    from tests.conftest import make_client

    inside = api.post(f"/v1/runs/{work['id']}/children", {}, format="json").json()
    outside = api.post("/v1/runs", {}, format="json").json()
    bound = make_client(project, run_id=inside["id"])
    mine = submit(bound, inside, {"mine": 1})
    theirs = submit(api, outside, {"theirs": 1})
    (their_claim,) = claim(api, outside)
    (my_claim,) = claim(bound, inside)
    assert my_claim["task"]["id"] == mine["id"]
    for action, body in [("renew", {}), ("complete", {}), ("fail", {}), ("release", None)]:
        err(bound.post(f"/v1/claims/{their_claim['claimId']}/{action}", body, format="json"), 404, "NOT_FOUND")
    err(bound.get(f"/v1/tasks/{theirs['id']}"), 404, "NOT_FOUND")
    err(bound.post(f"/v1/tasks/{theirs['id']}/cancel", {}, format="json"), 404, "NOT_FOUND")
    err(bound.post("/v1/mailboxes/jobs/claims", {"runId": outside["id"]}, format="json"), 404, "NOT_FOUND")
    assert bound.post(f"/v1/claims/{my_claim['claimId']}/complete", {}, format="json").json()["state"] == "SUCCEEDED"
    assert api.get(f"/v1/tasks/{theirs['id']}").json()["state"] == "RUNNING"
