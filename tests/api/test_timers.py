"""Timers over HTTP: DESIGN.md "Timers"."""

from datetime import UTC, datetime, timedelta

import jsonschema
import pytest

from coordination.models import Event, Run, Timer
from coordination.services.timers import MAX_DELAY_S, timer_fire, timers_fire_due
from tests.conftest import err, make_client

pytestmark = pytest.mark.django_db


@pytest.fixture
def run(api):
    return api.post("/v1/runs", {}, format="json").json()


def create(api, run, **body):
    response = api.post("/v1/timers", {"runId": run["id"], **body}, format="json")
    assert response.status_code == 201, response.json()
    return response.json()


def make_due(timer):
    Timer.objects.filter(id=timer["id"]).update(fire_at=datetime.now(UTC) - timedelta(milliseconds=10))


def test_after_seconds_arms_a_timer(api, run):
    before = datetime.now(UTC)
    response = api.post("/v1/timers", {"runId": run["id"], "afterSeconds": 300}, format="json")
    assert response.status_code == 201 and response["Location"].startswith("/v1/timers/")
    timer = response.json()
    assert (timer["state"], timer["firedAt"], timer["acknowledgedAt"]) == ("ARMED", None, None)
    fire_at = datetime.fromisoformat(timer["fireAt"])
    assert before + timedelta(seconds=299) < fire_at < datetime.now(UTC) + timedelta(seconds=301)
    assert api.get(f"/v1/timers/{timer['id']}").json() == timer


def test_at_in_the_past_fires_at_once(api, run):
    timer = create(api, run, at=(datetime.now(UTC) - timedelta(minutes=1)).isoformat())
    assert timer["state"] == "FIRED" and timer["firedAt"]
    assert Event.objects.filter(type="timer.fired", subject_id=timer["id"]).count() == 1


def test_a_time_before_the_year_1000_is_rfc_3339(api, run):
    """A year-1 ``at`` once answered ``fireAt: "1-01-01T..."``, which no RFC 3339 parser reads."""
    timer = create(api, run, at="0001-01-01T00:00:00Z")
    assert timer["fireAt"] == "0001-01-01T00:00:00.000000Z"
    assert timer["createdAt"].endswith("Z") and len(timer["createdAt"]) == len("2026-01-01T00:00:00.000000Z")


@pytest.mark.parametrize(
    "body, field",
    [({}, "at"), ({"at": "2999-01-01T00:00:00Z", "afterSeconds": 5}, "at"), ({"afterSeconds": -1}, "afterSeconds")],
)
def test_exactly_one_of_at_and_after_seconds(api, run, body, field):
    error = err(api.post("/v1/timers", {"runId": run["id"], **body}, format="json"), 400, "VALIDATION_ERROR")
    assert field in error["details"]


def test_the_sweep_fires_due_timers_once(api, run):
    due, later = create(api, run, afterSeconds=60), create(api, run, afterSeconds=3600)
    make_due(due)
    assert timers_fire_due() == 1
    assert timers_fire_due() == 0
    assert api.get(f"/v1/timers/{due['id']}").json()["state"] == "FIRED"
    assert api.get(f"/v1/timers/{later['id']}").json()["state"] == "ARMED"
    timer_fire(timer_id=due["id"])  # the ETA task arriving after the sweep changes nothing
    assert Event.objects.filter(type="timer.fired", subject_id=due["id"]).count() == 1


def test_wait_acknowledges_and_is_idempotent(api, run):
    timer = create(api, run, afterSeconds=60)
    pending = api.post(f"/v1/timers/{timer['id']}/wait?timeoutMs=0")
    assert pending.status_code == 200 and pending.json()["state"] == "ARMED"
    make_due(timer)
    acked = api.post(f"/v1/timers/{timer['id']}/wait?timeoutMs=1000").json()
    assert acked["state"] == "ACKNOWLEDGED" and acked["firedAt"] and acked["acknowledgedAt"]
    again = api.post(f"/v1/timers/{timer['id']}/wait?timeoutMs=1000").json()
    assert again == acked


def test_cancel_disarms_and_fired_timers_conflict(api, run):
    timer = create(api, run, afterSeconds=60)
    cancelled = api.post(f"/v1/timers/{timer['id']}/cancel").json()
    assert cancelled["state"] == "CANCELLED"
    assert api.post(f"/v1/timers/{timer['id']}/cancel").json()["state"] == "CANCELLED"
    make_due(timer)
    assert timers_fire_due() == 0
    err(api.post(f"/v1/timers/{timer['id']}/wait?timeoutMs=0"), 409, "INVALID_STATE")
    fired = create(api, run, at=(datetime.now(UTC) - timedelta(seconds=1)).isoformat())
    err(api.post(f"/v1/timers/{fired['id']}/cancel"), 409, "TIMER_FIRED")


def test_run_cancel_cancels_armed_timers(api, run):
    child = api.post(f"/v1/runs/{run['id']}/children", {}, format="json").json()
    armed = create(api, child, afterSeconds=60)
    fired = create(api, run, at=(datetime.now(UTC) - timedelta(seconds=1)).isoformat())
    api.post(f"/v1/runs/{run['id']}/cancel", {}, format="json")
    assert api.get(f"/v1/timers/{armed['id']}").json()["state"] == "CANCELLED"
    assert api.get(f"/v1/timers/{fired['id']}").json()["state"] == "FIRED"
    err(api.post("/v1/timers", {"runId": child["id"], "afterSeconds": 1}, format="json"), 409, "SCOPE_CANCELLED")


def test_a_timer_due_after_its_runs_deadline_never_fires(api):
    run = api.post("/v1/runs", {"deadline": (datetime.now(UTC) + timedelta(hours=1)).isoformat()}, format="json").json()
    timer = create(api, run, afterSeconds=7200)
    make_due(timer)
    Run.objects.filter(id=run["id"]).update(deadline=datetime.now(UTC) - timedelta(seconds=1))
    Timer.objects.filter(id=timer["id"]).update(run_deadline=datetime.now(UTC) - timedelta(seconds=1))
    timers_fire_due()
    assert api.get(f"/v1/timers/{timer['id']}").json()["state"] == "CANCELLED"


def test_permissions_wait_needs_write(project, run):
    reader = make_client(project, permissions=["coordination_read"])
    writer = make_client(project, permissions=["coordination_write"])
    timer = writer.post("/v1/timers", {"runId": run["id"], "afterSeconds": 60}, format="json").json()
    assert reader.get(f"/v1/timers/{timer['id']}").status_code == 200
    err(reader.post(f"/v1/timers/{timer['id']}/wait?timeoutMs=0"), 403, "PERMISSION_DENIED")
    err(writer.get(f"/v1/timers/{timer['id']}"), 403, "PERMISSION_DENIED")


def test_another_projects_timer_is_not_found(api, other_api, run):
    timer = create(api, run, afterSeconds=60)
    err(other_api.get(f"/v1/timers/{timer['id']}"), 404, "NOT_FOUND")
    err(other_api.post(f"/v1/timers/{timer['id']}/cancel"), 404, "NOT_FOUND")
    err(other_api.post(f"/v1/timers/{timer['id']}/wait"), 404, "NOT_FOUND")


def nullable_as_null(schema):
    """Return ``schema`` with OpenAPI 3.0's ``nullable: true`` as JSON Schema's ``"null"`` type (for jsonschema)."""
    if isinstance(schema, list):
        return [nullable_as_null(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    converted = {key: nullable_as_null(value) for key, value in schema.items() if key != "nullable"}
    if schema.get("nullable") and "type" in converted:
        converted["type"] = [converted["type"], "null"]
    return converted


def test_the_schema_admits_a_timer_body_exactly_when_the_api_arms_it(api, run):
    """Exactly one of ``at`` and ``afterSeconds``, a delay of at most ``MAX_DELAY_S``: the schema says so too.

    Both, neither, or a delay above the maximum were schema-valid and a 400.
    """
    schema = api.get("/v1/schema", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    validator = jsonschema.Draft4Validator(
        {"$ref": "#/components/schemas/TimerCreateInRequest", "components": nullable_as_null(schema["components"])}
    )
    soon = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    bodies = [
        {},
        {"at": None, "afterSeconds": None},
        {"at": soon, "afterSeconds": 5},
        {"at": soon, "afterSeconds": None},
        {"at": None, "afterSeconds": 5},
        {"at": soon},
        {"afterSeconds": 0},
        {"afterSeconds": MAX_DELAY_S},
        {"afterSeconds": MAX_DELAY_S + 0.5},
        {"afterSeconds": 1e300},
    ]
    for body in bodies:
        body = {"runId": run["id"], **body}
        admitted = validator.is_valid(body)
        response = api.post("/v1/timers", body, format="json")
        assert response.status_code == (201 if admitted else 400), (body, response.json())
        if not admitted:
            assert response.json()["error"]["code"] == "VALIDATION_ERROR"
