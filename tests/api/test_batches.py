"""Batch endpoints over HTTP: a batch submit is all or nothing; batch completes and renews answer per item."""

import pytest
from django.test import override_settings

from coordination.api import throttling
from coordination.api.throttling import LocalWindows
from coordination.domain.states import TaskState
from coordination.models import Event, Task
from tests.api.test_tasks import claim, err
from tests.conftest import make_client

pytestmark = pytest.mark.django_db


@pytest.fixture
def work(api):
    assert api.put("/v1/mailboxes/jobs", {"mode": "WORK"}, format="json").status_code == 201
    return api.post("/v1/runs", {}, format="json").json()


def batch(api, run, tasks):
    return api.post("/v1/mailboxes/jobs/tasks/batch", {"runId": run["id"], "tasks": tasks}, format="json")


def test_batch_submit_answers_201_in_request_order_then_200_for_a_full_resubmit(api, work):
    tasks = [{"input": {"i": i}, "key": f"k{i}", "priority": i} for i in range(5)]
    first = batch(api, work, tasks)
    assert first.status_code == 201, first.json()
    answered = first.json()["tasks"]
    assert [t["input"] for t in answered] == [{"i": i} for i in range(5)]
    assert [t["priority"] for t in answered] == list(range(5))
    assert {t["state"] for t in answered} == {"QUEUED"} and {t["mailbox"] for t in answered} == {"jobs"}
    again = batch(api, work, tasks)
    assert again.status_code == 200
    assert [t["id"] for t in again.json()["tasks"]] == [t["id"] for t in answered]
    mixed = batch(api, work, [tasks[0], {"input": {"new": True}}])
    assert mixed.status_code == 201
    assert mixed.json()["tasks"][0]["id"] == answered[0]["id"]
    assert Task.objects.filter(run_id=work["id"]).count() == 6
    assert Event.objects.filter(run_id=work["id"], type="task.submitted").count() == 6


def test_one_bad_item_refuses_the_batch_and_writes_nothing(api, work):
    invalid = err(batch(api, work, [{"input": {}}, {"input": {}, "maxAttempts": 0}]), 400, "VALIDATION_ERROR")
    assert "tasks.1.maxAttempts" in invalid["details"], invalid
    past = err(
        batch(api, work, [{"input": {}}, {"input": {}}, {"input": {}, "expiresAt": "2001-01-01T00:00:00Z"}]),
        400,
        "VALIDATION_ERROR",
    )
    assert past["details"]["index"] == 2 and "tasks.2.expiresAt" in past["details"], past
    batch(api, work, [{"input": {"a": 1}, "key": "taken"}])
    conflict = err(
        batch(api, work, [{"input": {"fresh": 1}, "key": "fresh"}, {"input": {"a": 2}, "key": "taken"}]),
        409,
        "KEY_CONFLICT",
    )
    assert conflict["details"]["index"] == 1
    assert Task.objects.filter(run_id=work["id"]).count() == 1, "a refused batch wrote tasks"
    assert Event.objects.filter(run_id=work["id"], type="task.submitted").count() == 1


def test_batch_limits_and_refused_runs(api, work):
    err(batch(api, work, []), 400, "VALIDATION_ERROR")
    err(batch(api, work, [{"input": {}}] * 1001), 400, "VALIDATION_ERROR")
    assert batch(api, work, [{"input": {}}] * 1000).status_code == 201
    assert api.post(f"/v1/runs/{work['id']}/cancel", {}, format="json").status_code == 200
    err(batch(api, work, [{"input": {}}]), 409, "SCOPE_CANCELLED")
    assert Task.objects.filter(run_id=work["id"], state=TaskState.QUEUED).count() == 0


def test_batch_complete_answers_each_item_on_its_own(api, other_api, work, project):
    batch(api, work, [{"input": {"i": i}} for i in range(4)])
    claims = claim(api, work, max=4)
    # A claim of another project, and one of a run outside a bound key's subtree.
    assert other_api.put("/v1/mailboxes/jobs", {"mode": "WORK"}, format="json").status_code == 201
    other_run = other_api.post("/v1/runs", {}, format="json").json()
    batch(other_api, other_run, [{"input": {}}])
    (foreign,) = claim(other_api, other_run)
    stale = claims[1]["claimId"]
    assert api.post(f"/v1/claims/{stale}/complete", {"outcome": "first"}, format="json").status_code == 200
    items = [
        {"claimId": claims[0]["claimId"], "outcome": {"ok": 1}},
        {"claimId": stale, "outcome": "again"},
        {"claimId": foreign["claimId"], "outcome": "not mine"},
        {"claimId": "c_nonsense", "outcome": None},
        {"claimId": claims[2]["claimId"]},
    ]
    response = api.post("/v1/claims/complete", {"items": items}, format="json")
    assert response.status_code == 200, response.json()
    results = response.json()["results"]
    assert [r["claimId"] for r in results] == [i["claimId"] for i in items]
    assert [r["ok"] for r in results] == [True, False, False, False, True]
    assert results[0]["task"]["state"] == "SUCCEEDED" and results[0]["task"]["outcome"] == {"ok": 1}
    assert results[0]["task"]["mailbox"] == "jobs"
    assert results[1]["error"]["code"] == "LEASE_LOST"
    assert results[2]["error"]["code"] == "NOT_FOUND" and results[3]["error"]["code"] == "NOT_FOUND"
    assert results[4]["task"]["outcome"] is None
    assert Task.objects.get(id=foreign["task"]["id"]).state == TaskState.RUNNING, "a foreign claim was completed"
    assert Task.objects.get(id=claims[1]["task"]["id"]).outcome == "first"
    assert Task.objects.get(id=claims[3]["task"]["id"]).state == TaskState.RUNNING

    # A key bound to another run sees none of these claims: per-item NOT_FOUND, nothing changed.
    sibling = api.post("/v1/runs", {}, format="json").json()
    bound = make_client(project, run_id=sibling["id"])
    outside = bound.post("/v1/claims/complete", {"items": [{"claimId": claims[3]["claimId"]}]}, format="json")
    assert outside.status_code == 200
    assert outside.json()["results"] == [
        {"claimId": claims[3]["claimId"], "ok": False, "error": outside.json()["results"][0]["error"]}
    ]
    assert outside.json()["results"][0]["error"]["code"] == "NOT_FOUND"
    assert Task.objects.get(id=claims[3]["task"]["id"]).state == TaskState.RUNNING


def test_batch_renew_answers_each_item_on_its_own(api, work):
    batch(api, work, [{"input": {"i": i}} for i in range(2)])
    claims = claim(api, work, max=2)
    api.post(f"/v1/claims/{claims[1]['claimId']}/complete", {}, format="json")
    items = [{"claimId": claims[0]["claimId"], "leaseTtlMs": 600_000}, {"claimId": claims[1]["claimId"]}]
    results = api.post("/v1/claims/renew", {"items": items}, format="json").json()["results"]
    assert results[0]["ok"] and results[0]["claim"]["claimId"] == claims[0]["claimId"]
    assert results[0]["claim"]["leaseExpiresAt"] > claims[0]["leaseExpiresAt"]
    assert results[0]["claim"]["cancellationRequested"] is False
    assert not results[1]["ok"] and results[1]["error"]["code"] == "LEASE_LOST"
    err(api.post("/v1/claims/renew", {"items": [items[0], items[0]]}, format="json"), 400, "VALIDATION_ERROR")
    err(api.post("/v1/claims/renew", {"items": [items[0]] * 501}, format="json"), 400, "VALIDATION_ERROR")
    err(
        api.post("/v1/claims/renew", {"items": [{"claimId": "x", "leaseTtlMs": 5}]}, format="json"),
        400,
        "VALIDATION_ERROR",
    )


def test_the_rate_limit_counts_a_batchs_items(project, monkeypatch):
    monkeypatch.setattr(throttling.limiter, "local", LocalWindows())
    client = make_client(project)
    client.put("/v1/mailboxes/jobs", {"mode": "WORK"}, format="json")
    run = client.post("/v1/runs", {}, format="json").json()
    with override_settings(RUNSTATE_RATE_LIMIT="10/hour", CELERY_BROKER_URL="filesystem://"):
        assert batch(client, run, [{"input": {}}] * 8).status_code == 201  # 8 of 10
        refused = batch(client, run, [{"input": {}}] * 3)  # 11 of 10
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "RATE_LIMITED"
    assert Task.objects.filter(run_id=run["id"]).count() == 8
