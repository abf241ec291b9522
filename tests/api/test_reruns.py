"""Rerun over HTTP: ``POST /v1/tasks/{id}/rerun`` (DESIGN.md "HTTP API", issue 20)."""

from datetime import UTC, datetime, timedelta

import pytest

from coordination.models import Event, Task
from coordination.services.sweeps import tasks_expire_queued
from tests.conftest import err, make_client

pytestmark = pytest.mark.django_db


@pytest.fixture
def work(api):
    """A WORK mailbox and a run."""
    assert api.put("/v1/mailboxes/jobs", {"mode": "WORK", "maxAttempts": 5}, format="json").status_code == 201
    return api.post("/v1/runs", {}, format="json").json()


def submit(api, run, input=None, mailbox="jobs", **extra):
    body = {"runId": run["id"], "input": {"n": 1} if input is None else input, **extra}
    response = api.post(f"/v1/mailboxes/{mailbox}/tasks", body, format="json")
    assert response.status_code in (200, 201), response.json()
    return response.json()


def claim(api, run, mailbox="jobs"):
    response = api.post(f"/v1/mailboxes/{mailbox}/claims", {"runId": run["id"], "max": 10}, format="json")
    assert response.status_code == 200, response.json()
    return response.json()["claims"]


def rerun(api, task_id, expect=(201,), **body):
    response = api.post(f"/v1/tasks/{task_id}/rerun", body, format="json")
    assert response.status_code in expect, response.content
    return response.json()


def task_in(api, run, state):
    """Submit a task (priority 7, maxAttempts 2) and drive it to ``state`` through the API."""
    task = submit(api, run, {"old": True}, priority=7, maxAttempts=2)
    if state == "QUEUED":
        return task
    if state == "EXPIRED":
        Task.objects.filter(id=task["id"]).update(expires_at=datetime.now(UTC) - timedelta(seconds=1))
        assert tasks_expire_queued() == 1
        return api.get(f"/v1/tasks/{task['id']}").json()
    if state == "CANCELLED":
        return api.post(f"/v1/tasks/{task['id']}/cancel", {}, format="json").json()
    (held,) = claim(api, run)
    claim_url = f"/v1/claims/{held['claimId']}"
    if state == "RUNNING":
        return held["task"]
    if state == "CANCELLATION_REQUESTED":
        return api.post(f"/v1/tasks/{task['id']}/cancel", {}, format="json").json()
    if state == "SUCCEEDED":
        return api.post(f"{claim_url}/complete", {"outcome": {"done": 1}}, format="json").json()
    assert state == "FAILED"
    return api.post(f"{claim_url}/fail", {"error": "boom"}, format="json").json()


@pytest.mark.parametrize("state", ["QUEUED", "RUNNING", "CANCELLATION_REQUESTED"])
def test_an_unfinished_task_is_invalid_state(api, work, state):
    task = task_in(api, work, state)
    assert task["state"] == state
    error = err(api.post(f"/v1/tasks/{task['id']}/rerun", {}, format="json"), 409, "INVALID_STATE")
    assert error["details"]["state"] == state
    assert Task.objects.filter(rerun_of_id=task["id"]).count() == 0


@pytest.mark.parametrize("state", ["SUCCEEDED", "FAILED", "CANCELLED", "EXPIRED"])
def test_a_finished_task_is_submitted_again_with_its_input(api, work, state):
    old = task_in(api, work, state)
    assert old["state"] == state
    response = api.post(f"/v1/tasks/{old['id']}/rerun", {}, format="json")
    assert response.status_code == 201, response.json()
    new = response.json()
    assert response["Location"] == f"/v1/tasks/{new['id']}"
    assert new["id"] != old["id"] and new["rerunOf"] == old["id"]
    assert (new["mailbox"], new["runId"], new["input"]) == ("jobs", work["id"], {"old": True})
    # What carries over, and what a new task starts without.
    assert (new["priority"], new["maxAttempts"]) == (7, 2)
    assert (new["state"], new["attempts"], new["outcome"], new["error"]) == ("QUEUED", 0, None, None)
    assert (new["expiresAt"], new["cancelReason"], new["key"], new["groupId"]) == (None, None, None, None)
    assert api.get(f"/v1/tasks/{new['id']}").json()["rerunOf"] == old["id"]
    assert api.get(f"/v1/tasks/{old['id']}").json()["rerunOf"] is None
    submitted = Event.objects.get(type="task.submitted", subject_id=new["id"])
    assert submitted.data["rerunOf"] == old["id"]  # a reader of the events knows it is a rerun
    # The rerun is ordinary work: a worker of the run claims it.
    assert [c["task"]["id"] for c in claim(api, work)] == [new["id"]]


@pytest.mark.parametrize("state", ["SUCCEEDED", "FAILED"])
def test_a_rerun_with_new_input_uses_it(api, work, state):
    old = task_in(api, work, state)
    new = rerun(api, old["id"], input={"fixed": [1, 2]})
    assert (new["input"], new["rerunOf"]) == ({"fixed": [1, 2]}, old["id"])
    assert api.get(f"/v1/tasks/{old['id']}").json()["input"] == {"old": True}


def test_a_task_is_rerun_as_often_as_asked_without_a_key(api, work):
    old = task_in(api, work, "FAILED")
    first, second = rerun(api, old["id"]), rerun(api, old["id"])
    assert first["id"] != second["id"]
    assert {first["rerunOf"], second["rerunOf"]} == {old["id"]}


def test_a_rerun_of_a_rerun_links_to_its_own_source(api, work):
    old = task_in(api, work, "FAILED")
    first = rerun(api, old["id"])
    Task.objects.filter(id=first["id"]).update(state="FAILED")
    second = rerun(api, first["id"])
    assert second["rerunOf"] == first["id"]


def test_a_key_makes_the_rerun_idempotent(api, work):
    old = task_in(api, work, "FAILED")
    first = rerun(api, old["id"], key="again")
    assert (first["key"], first["rerunOf"]) == ("again", old["id"])
    assert rerun(api, old["id"], expect=(200,), key="again")["id"] == first["id"]
    # The same key with another input is refused, as a submit's key is.
    error = err(
        api.post(f"/v1/tasks/{old['id']}/rerun", {"key": "again", "input": {"x": 2}}, format="json"),
        409,
        "KEY_CONFLICT",
    )
    assert error["details"]["key"] == "again"
    # With a new input, the same key and input answer the same rerun.
    other = rerun(api, old["id"], key="fixed", input={"x": 3})
    assert rerun(api, old["id"], expect=(200,), key="fixed", input={"x": 3})["id"] == other["id"]
    assert Task.objects.filter(rerun_of_id=old["id"]).count() == 2


def test_a_key_taken_by_a_task_that_is_not_this_rerun_conflicts(api, work):
    old, sibling = task_in(api, work, "FAILED"), task_in(api, work, "SUCCEEDED")
    plain = submit(api, work, {"old": True}, key="taken")
    error = err(api.post(f"/v1/tasks/{old['id']}/rerun", {"key": "taken"}, format="json"), 409, "KEY_CONFLICT")
    assert error["details"]["taskId"] == plain["id"]
    # A rerun of another task with the same input does not answer for this one either.
    rerun(api, sibling["id"], key="shared")
    err(api.post(f"/v1/tasks/{old['id']}/rerun", {"key": "shared"}, format="json"), 409, "KEY_CONFLICT")


@pytest.mark.parametrize("end, code", [("cancel", "SCOPE_CANCELLED"), ("complete", "SCOPE_COMPLETED")])
def test_a_rerun_under_an_inactive_run_is_refused_with_its_code(api, work, end, code):
    finished = task_in(api, work, "SUCCEEDED")
    cancelled_by_run = submit(api, work, {"queued": True})
    assert api.post(f"/v1/runs/{work['id']}/{end}", {}, format="json").status_code == 200
    for task_id in (finished["id"], cancelled_by_run["id"]):
        err(api.post(f"/v1/tasks/{task_id}/rerun", {}, format="json"), 409, code)
    assert Task.objects.filter(rerun_of__isnull=False).count() == 0


def test_a_rerun_under_a_cancelled_ancestor_is_scope_cancelled(api, work):
    child = api.post(f"/v1/runs/{work['id']}/children", {}, format="json").json()
    task = task_in(api, child, "FAILED")
    api.post(f"/v1/runs/{work['id']}/cancel", {}, format="json")
    err(api.post(f"/v1/tasks/{task['id']}/rerun", {}, format="json"), 409, "SCOPE_CANCELLED")


def test_rerun_validates_its_body(api, work):
    old = task_in(api, work, "FAILED")
    for body in ({"key": "k" * 1000}, {"input": {"x": "\u0000"}}, {"runId": work["id"]}):
        err(api.post(f"/v1/tasks/{old['id']}/rerun", body, format="json"), 400, "VALIDATION_ERROR")


# Isolation and permissions ---------------------------------------------------------------


def test_another_projects_task_is_not_found(api, other_api, work):
    old = task_in(api, work, "FAILED")
    err(other_api.post(f"/v1/tasks/{old['id']}/rerun", {}, format="json"), 404, "NOT_FOUND")
    err(api.post("/v1/tasks/not-an-id/rerun", {}, format="json"), 404, "NOT_FOUND")
    assert Task.objects.filter(rerun_of_id=old["id"]).count() == 0


def test_a_key_bound_to_a_run_reruns_only_tasks_in_its_subtree(api, project, work):
    inside = api.post(f"/v1/runs/{work['id']}/children", {}, format="json").json()
    outside = api.post("/v1/runs", {}, format="json").json()
    bound = make_client(project, run_id=inside["id"])
    mine, theirs = task_in(api, inside, "FAILED"), task_in(api, outside, "FAILED")
    err(bound.post(f"/v1/tasks/{theirs['id']}/rerun", {}, format="json"), 404, "NOT_FOUND")
    assert rerun(bound, mine["id"])["rerunOf"] == mine["id"]
    assert Task.objects.filter(rerun_of_id=theirs["id"]).count() == 0


def test_rerun_needs_coordination_write(api, project, work):
    old = task_in(api, work, "FAILED")
    reader = make_client(project, permissions=["coordination_read"])
    err(reader.post(f"/v1/tasks/{old['id']}/rerun", {}, format="json"), 403, "PERMISSION_DENIED")


# Groups ----------------------------------------------------------------------------------


def group(api, **create):
    api.put("/v1/mailboxes/reviews", {"mode": "WORK"}, format="json")
    response = api.post("/v1/groups", {"mailbox": "reviews", **create}, format="json")
    assert response.status_code == 201, response.json()
    return response.json()


def failed_member(api, created, input=None):
    member = api.post(f"/v1/groups/{created['id']}/members", {"input": input or {"draft": 1}}, format="json").json()
    gate = {"id": created["scopeId"]}
    held = {c["task"]["id"]: c for c in claim(api, gate, mailbox="reviews")}
    api.post(f"/v1/claims/{held[member['id']]['claimId']}/fail", {"error": "bad"}, format="json")
    return member


def test_a_member_is_rerun_into_its_open_group(api, project):
    created = group(api, condition="ALL_TERMINAL")
    old = failed_member(api, created)
    new = rerun(api, old["id"])
    assert (new["groupId"], new["runId"], new["rerunOf"]) == (created["id"], created["scopeId"], old["id"])
    members = api.get(f"/v1/groups/{created['id']}").json()["members"]
    assert [m["taskId"] for m in members] == [old["id"], new["id"]]
    events = Event.objects.filter(type="task.submitted", subject_id=new["id"])
    assert (events.get().data["groupId"], events.get().data["rerunOf"]) == (created["id"], old["id"])


def test_a_joined_member_is_rerun_on_its_own_run_and_joins_the_same_group(api, project):
    created = group(api, condition="ALL_TERMINAL")
    elsewhere = api.post("/v1/runs", {}, format="json").json()
    loose = submit(api, elsewhere, {"x": 1}, mailbox="reviews")
    assert api.post(f"/v1/groups/{created['id']}/join", {"taskId": loose["id"]}, format="json").status_code == 200
    (held,) = claim(api, elsewhere, mailbox="reviews")
    api.post(f"/v1/claims/{held['claimId']}/fail", {"error": "bad"}, format="json")
    new = rerun(api, loose["id"])
    assert (new["groupId"], new["runId"], new["rerunOf"]) == (created["id"], elsewhere["id"], loose["id"])
    members = api.get(f"/v1/groups/{created['id']}").json()["members"]
    assert [m["taskId"] for m in members] == [loose["id"], new["id"]]


def test_a_member_of_a_closed_group_is_group_closed(api, project):
    created = group(api, condition="ALL_TERMINAL")
    old = failed_member(api, created)
    failed_member(api, created)  # still open: the group waits for close
    assert api.post(f"/v1/groups/{created['id']}/seal").status_code == 200
    err(api.post(f"/v1/tasks/{old['id']}/rerun", {}, format="json"), 409, "GROUP_CLOSED")
    assert Task.objects.filter(rerun_of_id=old["id"]).count() == 0


def test_a_joined_member_of_a_closed_group_is_group_closed_and_nothing_is_submitted(api, project):
    created = group(api, condition="FIRST_ACCEPTED")
    elsewhere = api.post("/v1/runs", {}, format="json").json()
    loose = submit(api, elsewhere, {"x": 1}, mailbox="reviews")
    api.post(f"/v1/groups/{created['id']}/join", {"taskId": loose["id"]}, format="json")
    (held,) = claim(api, elsewhere, mailbox="reviews")
    api.post(f"/v1/claims/{held['claimId']}/fail", {"error": "bad"}, format="json")
    assert api.post(f"/v1/groups/{created['id']}/close").status_code == 200
    err(api.post(f"/v1/tasks/{loose['id']}/rerun", {}, format="json"), 409, "GROUP_CLOSED")
    assert Task.objects.filter(run_id=elsewhere["id"]).count() == 1


def test_a_member_of_a_finalized_group_is_group_closed(api, project):
    created = group(api, condition="N_ACCEPTED", threshold=1)
    old = failed_member(api, created)
    winner = api.post(f"/v1/groups/{created['id']}/members", {"input": {"draft": 2}}, format="json").json()
    held = {c["task"]["id"]: c for c in claim(api, {"id": created["scopeId"]}, mailbox="reviews")}
    api.post(f"/v1/claims/{held[winner['id']]['claimId']}/complete", {}, format="json")
    api.post(f"/v1/groups/{created['id']}/members/{winner['id']}/accept")
    assert api.get(f"/v1/groups/{created['id']}").json()["state"] == "FINALIZED"
    err(api.post(f"/v1/tasks/{old['id']}/rerun", {}, format="json"), 409, "GROUP_CLOSED")
