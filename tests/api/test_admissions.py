"""Admissions over HTTP: DESIGN.md "Shared limits", admissions."""

import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection

from coordination.models import Admission, AdmissionConfig, Event, Run
from coordination.services.runs import runs_sweep_deadlines
from tests.conftest import err, make_client

# Long-polls read through other connections: the data must be committed.
pytestmark = pytest.mark.django_db(transaction=True)


def later(delay_s, fn):
    """Run ``fn`` in a thread after ``delay_s``; return the thread."""

    def target():
        try:
            time.sleep(delay_s)
            fn()
        finally:
            connection.close()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def past(moment):
    """Sleep until ``moment`` has passed."""
    time.sleep(max(0.0, (moment - datetime.now(UTC)).total_seconds()) + 0.05)


@pytest.fixture
def parent(api):
    return api.post("/v1/runs", {"name": "job"}, format="json").json()


def configure(api, run, max_active):
    return api.put(f"/v1/runs/{run['id']}/admission", {"maxActive": max_active}, format="json")


def ask(api, run, **body):
    return api.post(f"/v1/runs/{run['id']}/admissions", body, format="json")


def admitted(api, run, **body):
    response = ask(api, run, **body)
    assert response.status_code == 201, response.content
    assert response.json()["state"] == "ADMITTED"
    return response.json()


def test_without_a_limit_every_admission_is_admitted_at_once_with_its_child_run(api, parent):
    deadline = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    answers = [admitted(api, parent, name=f"agent-{i}", deadline=deadline) for i in range(3)]
    for i, answer in enumerate(answers):
        assert answer["position"] is None
        assert answer["run"]["parentId"] == parent["id"] and answer["run"]["name"] == f"agent-{i}"
        assert answer["run"]["deadline"] and answer["run"]["effective"] == "ACTIVE"
        assert api.get(f"/v1/admissions/{answer['admissionId']}").json() == answer
    assert Run.objects.filter(parent_id=parent["id"]).count() == 3
    view = api.get(f"/v1/runs/{parent['id']}/admission").json()
    assert (view["maxActive"], view["admitted"], view["waiting"]) == (None, 3, 0)


def test_configure_answers_201_then_200_and_the_view(api, parent):
    first = configure(api, parent, 2)
    assert first.status_code == 201, first.content
    assert (first.json()["maxActive"], first.json()["admitted"], first.json()["waiting"]) == (2, 0, 0)
    again = configure(api, parent, 3)
    assert again.status_code == 200 and again.json()["maxActive"] == 3
    err(configure(api, parent, -1), 400, "VALIDATION_ERROR")
    err(api.put(f"/v1/runs/{parent['id']}/admission", {}, format="json"), 400, "VALIDATION_ERROR")


def test_beyond_max_active_requests_wait_in_line_with_positions(api, parent):
    configure(api, parent, 2)
    admitted(api, parent)
    admitted(api, parent)
    waiting = [ask(api, parent, name=f"w{i}") for i in range(3)]
    for i, response in enumerate(waiting):
        assert response.status_code == 200, response.content
        body = response.json()
        assert (body["state"], body["position"], body["run"]) == ("WAITING", i + 1, None)
    view = api.get(f"/v1/runs/{parent['id']}/admission").json()
    assert (view["admitted"], view["waiting"]) == (2, 3)
    assert Run.objects.filter(parent_id=parent["id"]).count() == 2
    types = [e.type for e in Event.objects.filter(run_id=parent["id"], type__startswith="admission.").order_by("id")]
    assert types == ["admission.admitted"] * 2 + ["admission.waiting"] * 3


@pytest.mark.parametrize("end", ["complete", "cancel"])
def test_an_admitted_child_ending_admits_the_next_waiter_in_the_same_transaction(api, parent, end):
    configure(api, parent, 1)
    first = admitted(api, parent)
    second = ask(api, parent, name="second").json()
    third = ask(api, parent, name="third").json()
    assert api.post(f"/v1/runs/{first['run']['id']}/{end}", {}, format="json").status_code == 200
    now_second = api.get(f"/v1/admissions/{second['admissionId']}").json()
    assert now_second["state"] == "ADMITTED" and now_second["run"]["name"] == "second"
    assert api.get(f"/v1/admissions/{third['admissionId']}").json()["position"] == 1
    ended = Event.objects.get(
        type={"complete": "run.completed", "cancel": "run.cancelled"}[end], subject_id=first["run"]["id"]
    )
    admission_event = Event.objects.get(type="admission.admitted", subject_id=second["admissionId"])
    assert admission_event.txid == ended.txid  # one transaction
    view = api.get(f"/v1/runs/{parent['id']}/admission").json()
    assert (view["admitted"], view["waiting"]) == (1, 1)


def test_a_waiter_long_polls_and_is_answered_201_when_admitted_meanwhile(api, parent):
    configure(api, parent, 1)
    first = admitted(api, parent)
    thread = later(0.3, lambda: api.post(f"/v1/runs/{first['run']['id']}/complete", {}, format="json"))
    response = ask(api, parent, key="agent-2", waitMs=20000)
    thread.join()
    assert response.status_code == 201, response.content
    assert response.json()["state"] == "ADMITTED" and response.json()["run"]["parentId"] == parent["id"]


def test_after_a_timeout_the_same_key_picks_the_admission_up_again(api, parent):
    configure(api, parent, 1)
    first = admitted(api, parent)
    timed_out = ask(api, parent, key="agent-2", waitMs=50)
    assert timed_out.status_code == 200 and timed_out.json()["state"] == "WAITING"
    again = ask(api, parent, key="agent-2")
    assert again.status_code == 200 and again.json()["admissionId"] == timed_out.json()["admissionId"]
    assert Admission.objects.filter(parent_id=parent["id"], key="agent-2").count() == 1
    api.post(f"/v1/runs/{first['run']['id']}/cancel", {}, format="json")
    picked = ask(api, parent, key="agent-2", waitMs=1000)
    assert picked.json()["state"] == "ADMITTED" and picked.json()["admissionId"] == timed_out.json()["admissionId"]
    # Once admitted, the key answers the same admission (found, not created: 200).
    assert ask(api, parent, key="agent-2").status_code == 200


def test_withdraw_leaves_the_line_and_is_invalid_once_admitted(api, parent):
    configure(api, parent, 1)
    first = admitted(api, parent)
    second = ask(api, parent).json()
    third = ask(api, parent).json()
    withdrawn = api.post(f"/v1/admissions/{second['admissionId']}/withdraw")
    assert withdrawn.status_code == 200 and withdrawn.json()["state"] == "WITHDRAWN"
    assert api.post(f"/v1/admissions/{second['admissionId']}/withdraw").json()["state"] == "WITHDRAWN"
    assert api.get(f"/v1/admissions/{third['admissionId']}").json()["position"] == 1
    err(api.post(f"/v1/admissions/{first['admissionId']}/withdraw"), 409, "INVALID_STATE")
    api.post(f"/v1/runs/{first['run']['id']}/complete", {}, format="json")
    assert api.get(f"/v1/admissions/{third['admissionId']}").json()["state"] == "ADMITTED"
    assert api.get(f"/v1/admissions/{second['admissionId']}").json()["state"] == "WITHDRAWN"
    assert Event.objects.filter(type="admission.withdrawn", subject_id=second["admissionId"]).count() == 1


def test_raising_max_active_admits_the_waiters_that_now_fit(api, parent):
    configure(api, parent, 1)
    admitted(api, parent)
    waiters = [ask(api, parent).json() for _ in range(3)]
    view = configure(api, parent, 3).json()
    assert (view["admitted"], view["waiting"]) == (3, 1)
    states = [api.get(f"/v1/admissions/{w['admissionId']}").json()["state"] for w in waiters]
    assert states == ["ADMITTED", "ADMITTED", "WAITING"]


def test_cancelling_the_parent_cancels_every_waiter_and_answers_their_code(api, parent):
    configure(api, parent, 1)
    admitted(api, parent)
    waiters = [ask(api, parent, key=f"k{i}").json() for i in range(3)]
    thread = later(0.3, lambda: api.post(f"/v1/runs/{parent['id']}/cancel", {"reason": "stop"}, format="json"))
    err(ask(api, parent, key="k0", waitMs=20000), 409, "SCOPE_CANCELLED")
    thread.join()
    for waiter in waiters:
        body = api.get(f"/v1/admissions/{waiter['admissionId']}").json()
        assert (body["state"], body["endCode"], body["position"]) == ("CANCELLED", "SCOPE_CANCELLED", None)
    assert Event.objects.filter(type="admission.cancelled", run_id=parent["id"]).count() == 3
    err(ask(api, parent), 409, "SCOPE_CANCELLED")
    err(ask(api, parent, key="k1"), 409, "SCOPE_CANCELLED")
    view = AdmissionConfig.objects.get(run_id=parent["id"])
    assert (view.admitted, view.waiting) == (0, 0)


def test_a_cancelled_ancestor_frees_slots_below_and_cancels_their_waiters(api):
    root = api.post("/v1/runs", {}, format="json").json()
    job = api.post(f"/v1/runs/{root['id']}/children", {}, format="json").json()
    configure(api, job, 1)
    admitted(api, job)
    waiter = ask(api, job).json()
    api.post(f"/v1/runs/{root['id']}/complete", {}, format="json")
    body = api.get(f"/v1/admissions/{waiter['admissionId']}").json()
    assert (body["state"], body["endCode"]) == ("CANCELLED", "SCOPE_COMPLETED")
    assert Run.objects.filter(parent_id=job["id"]).count() == 1  # nobody admitted under an ended run


def test_the_deadline_sweep_of_an_admitted_child_admits_the_next(api, parent):
    configure(api, parent, 1)
    soon = datetime.now(UTC) + timedelta(seconds=1.5)  # room for a loaded machine before it passes
    first = admitted(api, parent, deadline=soon.isoformat())
    second = ask(api, parent).json()
    past(soon)
    assert api.get(f"/v1/admissions/{second['admissionId']}").json()["state"] == "WAITING"  # until the sweep
    assert runs_sweep_deadlines() >= 1
    assert api.get(f"/v1/admissions/{second['admissionId']}").json()["state"] == "ADMITTED"
    swept = Event.objects.get(type="run.deadline_exceeded", subject_id=first["run"]["id"])
    assert Event.objects.get(type="admission.admitted", subject_id=second["admissionId"]).txid == swept.txid


def test_a_waiter_under_a_parent_past_its_deadline_is_answered_at_once(api):
    soon = datetime.now(UTC) + timedelta(seconds=1.5)  # room for a loaded machine before it passes
    parent = api.post("/v1/runs", {"deadline": soon.isoformat()}, format="json").json()
    configure(api, parent, 1)
    admitted(api, parent)
    waiter = ask(api, parent, key="w").json()
    past(soon)
    err(ask(api, parent, key="w", waitMs=5000), 409, "DEADLINE_EXCEEDED")
    err(ask(api, parent), 409, "DEADLINE_EXCEEDED")
    runs_sweep_deadlines()
    body = api.get(f"/v1/admissions/{waiter['admissionId']}").json()
    assert (body["state"], body["endCode"]) == ("CANCELLED", "DEADLINE_EXCEEDED")


def test_child_limit_still_applies(api):
    parent = api.post("/v1/runs", {"childLimit": 1}, format="json").json()
    admitted(api, parent)
    err(ask(api, parent), 409, "CHILD_LIMIT_REACHED")
    assert Admission.objects.filter(parent_id=parent["id"]).count() == 1


def test_a_waiter_whose_run_cannot_be_created_is_cancelled_with_that_code(api):
    parent = api.post("/v1/runs", {"childLimit": 1}, format="json").json()
    configure(api, parent, 1)
    first = admitted(api, parent)
    waiter = ask(api, parent).json()
    api.post(f"/v1/runs/{first['run']['id']}/complete", {}, format="json")
    body = api.get(f"/v1/admissions/{waiter['admissionId']}").json()
    assert (body["state"], body["endCode"]) == ("CANCELLED", "CHILD_LIMIT_REACHED")


def test_request_validates(api, parent):
    past = (datetime.now(UTC) - timedelta(seconds=1)).isoformat()
    err(ask(api, parent, deadline=past), 400, "VALIDATION_ERROR")
    err(ask(api, parent, waitMs=-1), 400, "VALIDATION_ERROR")
    err(ask(api, parent, surprise=1), 400, "VALIDATION_ERROR")
    err(ask(api, parent, key=""), 400, "VALIDATION_ERROR")


def test_permissions(project, parent):
    reader = make_client(project, permissions=["coordination_read"])
    writer = make_client(project, permissions=["coordination_write"])
    err(writer.put(f"/v1/runs/{parent['id']}/admission", {"maxActive": 1}, format="json"), 403, "PERMISSION_DENIED")
    err(reader.post(f"/v1/runs/{parent['id']}/admissions", {}, format="json"), 403, "PERMISSION_DENIED")
    answer = writer.post(f"/v1/runs/{parent['id']}/admissions", {}, format="json").json()
    assert reader.get(f"/v1/admissions/{answer['admissionId']}").status_code == 200
    assert reader.get(f"/v1/runs/{parent['id']}/admission").status_code == 200


def test_another_projects_admissions_are_not_found(api, other_api, parent):
    answer = admitted(api, parent)
    err(other_api.get(f"/v1/admissions/{answer['admissionId']}"), 404, "NOT_FOUND")
    err(other_api.post(f"/v1/admissions/{answer['admissionId']}/withdraw"), 404, "NOT_FOUND")
    err(other_api.post(f"/v1/runs/{parent['id']}/admissions", {}, format="json"), 404, "NOT_FOUND")
    err(other_api.put(f"/v1/runs/{parent['id']}/admission", {"maxActive": 1}, format="json"), 404, "NOT_FOUND")
    err(other_api.get(f"/v1/runs/{parent['id']}/admission"), 404, "NOT_FOUND")
    err(api.get("/v1/admissions/not-an-id"), 404, "NOT_FOUND")


def test_a_run_bound_key_sees_only_its_subtrees_admissions(project, api, parent):
    mine = api.post(f"/v1/runs/{parent['id']}/children", {}, format="json").json()
    outside = admitted(api, parent)
    inside = admitted(api, mine)
    bound = make_client(project, run_id=Run.objects.get(id=mine["id"]).id)
    err(bound.get(f"/v1/admissions/{outside['admissionId']}"), 404, "NOT_FOUND")
    err(bound.post(f"/v1/runs/{parent['id']}/admissions", {}, format="json"), 404, "NOT_FOUND")
    assert bound.get(f"/v1/admissions/{inside['admissionId']}").status_code == 200
    assert bound.post(f"/v1/runs/{mine['id']}/admissions", {}, format="json").status_code == 201


def test_a_raise_past_the_child_limit_admits_what_fits_and_answers_the_rest(api):
    parent = api.post("/v1/runs", {"childLimit": 2}, format="json").json()
    configure(api, parent, 1)
    admitted(api, parent)
    waiters = [ask(api, parent).json() for _ in range(3)]
    view = configure(api, parent, 5)
    assert view.status_code == 200, view.content
    assert (view.json()["admitted"], view.json()["waiting"]) == (2, 0)
    answers = [api.get(f"/v1/admissions/{w['admissionId']}").json() for w in waiters]
    assert [(a["state"], a["endCode"]) for a in answers] == [
        ("ADMITTED", None),
        ("CANCELLED", "CHILD_LIMIT_REACHED"),
        ("CANCELLED", "CHILD_LIMIT_REACHED"),
    ]
    err(ask(api, parent, key=None, waitMs=0), 409, "CHILD_LIMIT_REACHED")
