"""Runs over HTTP: every rule of DESIGN.md "Runs (scopes)"."""

from datetime import UTC, datetime, timedelta

import pytest

from coordination.models import Event, Run

pytestmark = pytest.mark.django_db


def future(seconds=3600):
    return (datetime.now(UTC) + timedelta(seconds=seconds)).isoformat()


def create(api, **body):
    response = api.post("/v1/runs", body, format="json")
    assert response.status_code == 201, response.json()
    return response.json()


def child(api, run_id, **body):
    response = api.post(f"/v1/runs/{run_id}/children", body, format="json")
    assert response.status_code == 201, response.json()
    return response.json()


def status(api, run_id):
    response = api.get(f"/v1/runs/{run_id}")
    assert response.status_code == 200, response.json()
    return response.json()


def assert_error(response, status_code, code):
    assert response.status_code == status_code, response.content
    body = response.json()
    assert body["error"]["code"] == code, body
    assert isinstance(body["error"]["message"], str)
    return body["error"]


@pytest.fixture
def tree(api):
    """A three-level tree: root -> mid -> leaf."""
    root = create(api, name="root")
    mid = child(api, root["id"], name="mid")
    leaf = child(api, mid["id"], name="leaf")
    return root, mid, leaf


def test_create_returns_the_run_with_location(api):
    response = api.post("/v1/runs", {"name": "swarm", "childLimit": 5}, format="json")
    assert response.status_code == 201
    run = response.json()
    assert response["Location"] == f"/v1/runs/{run['id']}"
    assert run["name"] == "swarm"
    assert run["parentId"] is None
    assert run["storedState"] == "ACTIVE"
    assert run["effective"] == "ACTIVE"
    assert run["inactiveReason"] is None and run["inactiveRunId"] is None
    assert run["childLimit"] == 5
    assert run["createdAt"].endswith("Z")
    assert run["endedAt"] is None and run["cancelReason"] is None


def test_default_child_limit_is_1000(api):
    assert create(api)["childLimit"] == 1000


def test_two_creates_with_one_name_make_two_runs(api):
    first, second = create(api, name="same"), create(api, name="same")
    assert first["id"] != second["id"]
    assert Run.objects.filter(name="same").count() == 2


def test_child_via_parent_id_and_children_endpoint(api):
    root = create(api)
    a = create(api, parentId=root["id"])
    b = child(api, root["id"], name="b")
    assert a["parentId"] == b["parentId"] == root["id"]
    listed = api.get(f"/v1/runs?parentId={root['id']}").json()
    assert [r["id"] for r in listed["results"]] == [a["id"], b["id"]]


def test_cancel_cascades_to_effective_state_of_the_subtree(api, tree):
    root, mid, leaf = tree
    response = api.post(f"/v1/runs/{mid['id']}/cancel", {"reason": "stop"}, format="json")
    assert response.status_code == 200
    cancelled = response.json()
    assert cancelled["storedState"] == "CANCELLED"
    assert cancelled["cancelReason"] == "stop"
    assert cancelled["endedAt"] is not None
    assert cancelled["inactiveReason"] == "CANCELLED" and cancelled["inactiveRunId"] == mid["id"]

    leaf_now = status(api, leaf["id"])
    assert leaf_now["storedState"] == "ACTIVE"
    assert leaf_now["effective"] == "INACTIVE"
    assert leaf_now["inactiveReason"] == "CANCELLED"
    assert leaf_now["inactiveRunId"] == mid["id"]
    # The ancestor above the cancelled run is untouched.
    assert status(api, root["id"])["effective"] == "ACTIVE"


def test_cancel_is_idempotent(api, tree):
    _, mid, _ = tree
    first = api.post(f"/v1/runs/{mid['id']}/cancel", {"reason": "one"}, format="json").json()
    second = api.post(f"/v1/runs/{mid['id']}/cancel", {"reason": "two"}, format="json")
    assert second.status_code == 200
    assert second.json()["cancelReason"] == "one"
    assert second.json()["endedAt"] == first["endedAt"]
    assert Event.objects.filter(type="run.cancelled", subject_id=mid["id"]).count() == 1


def test_cancel_of_completed_run_conflicts(api, tree):
    root, _, _ = tree
    assert api.post(f"/v1/runs/{root['id']}/complete").status_code == 200
    error = assert_error(api.post(f"/v1/runs/{root['id']}/cancel", {}, format="json"), 409, "SCOPE_COMPLETED")
    assert error["details"]["runId"] == root["id"]
    assert status(api, root["id"])["storedState"] == "COMPLETED"


def test_complete_of_cancelled_run_conflicts_and_complete_is_idempotent(api, tree):
    root, mid, leaf = tree
    api.post(f"/v1/runs/{mid['id']}/cancel", {}, format="json")
    assert_error(api.post(f"/v1/runs/{mid['id']}/complete"), 409, "SCOPE_CANCELLED")
    assert api.post(f"/v1/runs/{leaf['id']}/complete").json()["storedState"] == "COMPLETED"
    again = api.post(f"/v1/runs/{leaf['id']}/complete")
    assert again.status_code == 200 and again.json()["storedState"] == "COMPLETED"


def test_complete_refuses_new_work_below_with_scope_completed(api, tree):
    root, mid, leaf = tree
    api.post(f"/v1/runs/{root['id']}/complete")
    leaf_now = status(api, leaf["id"])
    assert (leaf_now["effective"], leaf_now["inactiveReason"], leaf_now["inactiveRunId"]) == (
        "INACTIVE",
        "COMPLETED",
        root["id"],
    )
    error = assert_error(api.post(f"/v1/runs/{leaf['id']}/children", {}, format="json"), 409, "SCOPE_COMPLETED")
    assert error["details"]["runId"] == root["id"]


def test_child_under_cancelled_ancestor_is_refused(api, tree):
    root, _, leaf = tree
    api.post(f"/v1/runs/{root['id']}/cancel", {}, format="json")
    before = Run.objects.count()
    assert_error(api.post(f"/v1/runs/{leaf['id']}/children", {}, format="json"), 409, "SCOPE_CANCELLED")
    assert_error(api.post("/v1/runs", {"parentId": leaf["id"]}, format="json"), 409, "SCOPE_CANCELLED")
    assert Run.objects.count() == before


def test_child_limit_is_enforced(api):
    root = create(api, childLimit=2)
    child(api, root["id"])
    child(api, root["id"])
    error = assert_error(api.post(f"/v1/runs/{root['id']}/children", {}, format="json"), 409, "CHILD_LIMIT_REACHED")
    assert error["details"]["childLimit"] == 2
    assert Run.objects.filter(parent_id=root["id"]).count() == 2


def test_child_limit_zero_allows_no_children(api):
    root = create(api, childLimit=0)
    assert_error(api.post(f"/v1/runs/{root['id']}/children", {}, format="json"), 409, "CHILD_LIMIT_REACHED")


def test_deadline_in_the_past_is_a_validation_error(api):
    past = (datetime.now(UTC) - timedelta(seconds=1)).isoformat()
    error = assert_error(api.post("/v1/runs", {"deadline": past}, format="json"), 400, "VALIDATION_ERROR")
    assert "deadline" in error["details"]
    assert Run.objects.count() == 0


def test_deadline_passing_makes_the_subtree_inactive_at_once(api, tree):
    root, mid, leaf = tree
    Run.objects.filter(id=mid["id"]).update(deadline=datetime.now(UTC) - timedelta(seconds=1))
    leaf_now = status(api, leaf["id"])
    assert leaf_now["storedState"] == "ACTIVE"
    assert (leaf_now["effective"], leaf_now["inactiveReason"], leaf_now["inactiveRunId"]) == (
        "INACTIVE",
        "DEADLINE_EXCEEDED",
        mid["id"],
    )
    error = assert_error(api.post(f"/v1/runs/{leaf['id']}/children", {}, format="json"), 409, "DEADLINE_EXCEEDED")
    assert error["details"]["runId"] == mid["id"]
    assert status(api, root["id"])["effective"] == "ACTIVE"


def test_future_deadline_is_kept_and_active(api):
    deadline = future()
    run = create(api, deadline=deadline)
    assert run["effective"] == "ACTIVE"
    assert datetime.fromisoformat(run["deadline"]) == datetime.fromisoformat(deadline)


def test_root_most_cause_names_the_inactive_run(api, tree):
    root, mid, leaf = tree
    api.post(f"/v1/runs/{mid['id']}/cancel", {}, format="json")
    api.post(f"/v1/runs/{root['id']}/cancel", {}, format="json")
    assert status(api, leaf["id"])["inactiveRunId"] == root["id"]


@pytest.mark.parametrize(
    "body, field",
    [
        ({"childLimit": -1}, "childLimit"),
        ({"childLimit": "many"}, "childLimit"),
        ({"deadline": "tomorrow"}, "deadline"),
        ({"name": "x" * 201}, "name"),
        ({"surprise": 1}, "surprise"),
    ],
)
def test_bad_create_bodies_are_400_with_the_field(api, body, field):
    error = assert_error(api.post("/v1/runs", body, format="json"), 400, "VALIDATION_ERROR")
    assert field in error["details"]


def test_body_that_is_not_an_object_is_400(api):
    assert_error(api.post("/v1/runs", [1, 2], format="json"), 400, "VALIDATION_ERROR")
    assert_error(
        api.post("/v1/runs", "{not json", content_type="application/json"),
        400,
        "VALIDATION_ERROR",
    )


def test_unknown_or_malformed_ids_are_404(api):
    assert_error(api.get("/v1/runs/not-a-uuid"), 404, "NOT_FOUND")
    assert_error(api.get("/v1/runs/00000000-0000-7000-8000-000000000000"), 404, "NOT_FOUND")
    assert_error(api.post("/v1/runs", {"parentId": "nope"}, format="json"), 404, "NOT_FOUND")
    assert_error(api.post("/v1/runs/nope/cancel", {}, format="json"), 404, "NOT_FOUND")


def test_another_projects_run_is_not_found_everywhere(api, other_api):
    theirs = create(other_api)
    assert_error(api.get(f"/v1/runs/{theirs['id']}"), 404, "NOT_FOUND")
    assert_error(api.post(f"/v1/runs/{theirs['id']}/cancel", {}, format="json"), 404, "NOT_FOUND")
    assert_error(api.post(f"/v1/runs/{theirs['id']}/complete"), 404, "NOT_FOUND")
    assert_error(api.post(f"/v1/runs/{theirs['id']}/children", {}, format="json"), 404, "NOT_FOUND")
    assert_error(api.post("/v1/runs", {"parentId": theirs["id"]}, format="json"), 404, "NOT_FOUND")
    assert_error(api.get(f"/v1/runs?parentId={theirs['id']}"), 404, "NOT_FOUND")
    assert api.get("/v1/runs").json()["results"] == []
    assert status(other_api, theirs["id"])["storedState"] == "ACTIVE"


def test_list_pages_oldest_first_with_a_cursor(api):
    ids = [create(api, name=f"r{i}")["id"] for i in range(5)]
    seen, cursor = [], None
    while True:
        url = "/v1/runs?limit=2" + (f"&cursor={cursor}" if cursor else "")
        page = api.get(url).json()
        seen += [r["id"] for r in page["results"]]
        cursor = page["nextCursor"]
        if cursor is None:
            break
    assert seen == ids


def test_list_filters_by_state(api, tree):
    root, mid, leaf = tree
    api.post(f"/v1/runs/{mid['id']}/cancel", {}, format="json")
    cancelled = api.get("/v1/runs?state=CANCELLED").json()["results"]
    assert [r["id"] for r in cancelled] == [mid["id"]]
    assert {r["id"] for r in api.get("/v1/runs?state=ACTIVE").json()["results"]} == {root["id"], leaf["id"]}


@pytest.mark.parametrize(
    "query",
    # An empty state or parentId once listed every run (found by Schemathesis).
    ["limit=0", "limit=1001", "limit=x", "limit=", "cursor=%%%", "cursor=bm9wZQ", "state=GONE", "state=", "parentId="],
)
def test_bad_list_queries_are_400(api, query):
    assert_error(api.get(f"/v1/runs?{query}"), 400, "VALIDATION_ERROR")


def test_events_are_written_with_each_change(api, tree):
    root, mid, leaf = tree
    api.post(f"/v1/runs/{mid['id']}/cancel", {"reason": "r"}, format="json")
    api.post(f"/v1/runs/{root['id']}/complete")
    types = list(Event.objects.order_by("id").values_list("type", "subject_id"))
    assert types == [
        ("run.created", root["id"]),
        ("run.created", mid["id"]),
        ("run.created", leaf["id"]),
        ("run.cancelled", mid["id"]),
        ("run.completed", root["id"]),
    ]


def test_unknown_endpoint_is_a_json_404(api):
    assert_error(api.get("/v1/nothing-here"), 404, "NOT_FOUND")


def test_wrong_method_is_405_with_envelope(api):
    assert_error(api.delete("/v1/runs"), 405, "METHOD_NOT_ALLOWED")
