"""Barriers over HTTP: DESIGN.md "Barriers"."""

from datetime import UTC, datetime, timedelta

import pytest

from coordination.models import Event, Run
from tests.conftest import err, make_client

pytestmark = pytest.mark.django_db


@pytest.fixture
def run(api):
    return api.post("/v1/runs", {}, format="json").json()


def create(api, run, target=3, **extra):
    response = api.post("/v1/barriers", {"runId": run["id"], "target": target, **extra}, format="json")
    assert response.status_code == 201, response.json()
    return response.json()


def arrive(api, barrier, key):
    return api.post(f"/v1/barriers/{barrier['id']}/arrive", {"key": key}, format="json")


def test_create_answers_the_view(api, run):
    response = api.post("/v1/barriers", {"runId": run["id"], "target": 3, "name": "merge"}, format="json")
    assert response.status_code == 201
    barrier = response.json()
    assert response["Location"] == f"/v1/barriers/{barrier['id']}"
    assert (barrier["target"], barrier["epoch"], barrier["arrivals"], barrier["state"]) == (3, 1, 0, "WAITING")
    assert (barrier["runId"], barrier["name"], barrier["releasedAt"]) == (run["id"], "merge", None)
    assert api.get(f"/v1/barriers/{barrier['id']}").json() == barrier


def test_target_distinct_keys_release_it(api, run):
    barrier = create(api, run)
    assert arrive(api, barrier, "shard-1").json()["arrivals"] == 1
    again = arrive(api, barrier, "shard-1")
    assert again.status_code == 200 and again.json()["arrivals"] == 1  # idempotent per key
    arrive(api, barrier, "shard-2")
    released = arrive(api, barrier, "shard-3").json()
    assert (released["state"], released["arrivals"]) == ("RELEASED", 3)
    assert released["releasedAt"]
    assert arrive(api, barrier, "shard-2").json()["state"] == "RELEASED"  # known key: the view
    err(arrive(api, barrier, "shard-4"), 409, "BARRIER_RELEASED")
    types = [e.type for e in Event.objects.filter(subject_id=barrier["id"]).order_by("id")]
    assert types.count("barrier.arrived") == 3 and types.count("barrier.released") == 1


def test_next_epoch_rearms_a_released_barrier(api, run):
    barrier = create(api, run, target=1)
    err(api.post(f"/v1/barriers/{barrier['id']}/nextEpoch"), 409, "BARRIER_NOT_RELEASED")
    arrive(api, barrier, "a")
    rearmed = api.post(f"/v1/barriers/{barrier['id']}/nextEpoch").json()
    assert (rearmed["epoch"], rearmed["arrivals"], rearmed["state"], rearmed["releasedAt"]) == (2, 0, "WAITING", None)
    # The same key counts again in the new epoch.
    assert arrive(api, barrier, "a").json()["state"] == "RELEASED"
    assert api.post(f"/v1/barriers/{barrier['id']}/nextEpoch").json()["epoch"] == 3


def test_cancelling_the_run_cancels_waiting_barriers_and_keeps_released_ones(api, run):
    child = api.post(f"/v1/runs/{run['id']}/children", {}, format="json").json()
    waiting = create(api, child)
    released = create(api, run, target=1)
    arrive(api, released, "x")
    api.post(f"/v1/runs/{run['id']}/cancel", {}, format="json")
    assert api.get(f"/v1/barriers/{waiting['id']}").json()["state"] == "CANCELLED"
    assert api.get(f"/v1/barriers/{released['id']}").json()["state"] == "RELEASED"
    err(arrive(api, waiting, "late"), 409, "BARRIER_CANCELLED")
    err(api.get(f"/v1/barriers/{waiting['id']}/wait?timeoutMs=0"), 409, "BARRIER_CANCELLED")
    err(api.post("/v1/barriers", {"runId": child["id"], "target": 1}, format="json"), 409, "SCOPE_CANCELLED")
    assert Event.objects.filter(type="barrier.cancelled", subject_id=waiting["id"]).count() == 1


def test_arrival_past_the_run_deadline_is_refused(api, run):
    barrier = create(api, run)
    Run.objects.filter(id=run["id"]).update(deadline=datetime.now(UTC) - timedelta(seconds=1))
    err(arrive(api, barrier, "a"), 409, "DEADLINE_EXCEEDED")


def test_wait_answers_the_view_after_its_timeout_and_at_once_when_released(api, run):
    barrier = create(api, run, target=1)
    waited = api.get(f"/v1/barriers/{barrier['id']}/wait?timeoutMs=0")
    assert waited.status_code == 200 and waited.json()["state"] == "WAITING"
    arrive(api, barrier, "a")
    assert api.get(f"/v1/barriers/{barrier['id']}/wait?timeoutMs=5000").json()["state"] == "RELEASED"


def test_permissions(project, run):
    writer = make_client(project, permissions=["coordination_write", "coordination_read"])
    err(writer.post("/v1/barriers", {"runId": run["id"], "target": 1}, format="json"), 403, "PERMISSION_DENIED")
    config = make_client(project, permissions=["resource_config"])
    barrier = config.post("/v1/barriers", {"runId": run["id"], "target": 2}, format="json").json()
    err(config.post(f"/v1/barriers/{barrier['id']}/arrive", {"key": "k"}, format="json"), 403, "PERMISSION_DENIED")
    err(config.get(f"/v1/barriers/{barrier['id']}"), 403, "PERMISSION_DENIED")
    reader = make_client(project, permissions=["coordination_read"])
    assert reader.get(f"/v1/barriers/{barrier['id']}/wait?timeoutMs=0").status_code == 200
    assert writer.post(f"/v1/barriers/{barrier['id']}/arrive", {"key": "k"}, format="json").status_code == 200


@pytest.mark.parametrize(
    "body, field", [({"target": 0}, "target"), ({"target": "x"}, "target"), ({"target": 2, "nope": 1}, "nope")]
)
def test_create_validates(api, run, body, field):
    error = err(api.post("/v1/barriers", {"runId": run["id"], **body}, format="json"), 400, "VALIDATION_ERROR")
    assert field in error["details"]


def test_arrive_validates_the_key(api, run):
    barrier = create(api, run)
    err(api.post(f"/v1/barriers/{barrier['id']}/arrive", {}, format="json"), 400, "VALIDATION_ERROR")
    err(api.post(f"/v1/barriers/{barrier['id']}/arrive", {"key": "x" * 201}, format="json"), 400, "VALIDATION_ERROR")


def test_another_projects_barrier_is_not_found(api, other_api, run):
    barrier = create(api, run)
    err(other_api.get(f"/v1/barriers/{barrier['id']}"), 404, "NOT_FOUND")
    err(other_api.post(f"/v1/barriers/{barrier['id']}/arrive", {"key": "k"}, format="json"), 404, "NOT_FOUND")
    err(other_api.post("/v1/barriers", {"runId": run["id"], "target": 1}, format="json"), 404, "NOT_FOUND")
