"""``POST /v1/deliveries/{id}/extend``: a delivery's visibility, fenced by its attempt.

Each test runs on the single-statement path and on the careful (locking) path, which decides
every refusal; on SQLite only the careful path exists.
"""

from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection

from coordination.models import Message, Run
from tests.api.test_messages import (
    act,
    err,
    event_types,
    expire_visibility,
    get,
    new_run,
    receive,
    send,
)
from tests.conftest import make_client

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(params=["fast", "careful"], autouse=True)
def path(request, settings):
    """Run each test with the fast path on (PostgreSQL only) and off."""
    if request.param == "fast" and connection.vendor != "postgresql":
        pytest.skip("the single-statement path is PostgreSQL only")
    settings.RUNSTATE_FAST_PATHS = request.param == "fast"
    return request.param


@pytest.fixture
def run(api):
    """A QUEUE mailbox ``inbox`` and a run to send under."""
    assert api.put("/v1/mailboxes/inbox", {"mode": "QUEUE"}, format="json").status_code == 201
    return new_run(api)


def extend(api, delivery, visibility_ms=60_000):
    return act(api, delivery, "extend", {"visibilityMs": visibility_ms})


def parse(value):
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def test_extend_moves_visible_until_and_keeps_the_message_hidden(api, run):
    message = send(api, run, {"n": 7})
    delivery = receive(api, run, visibilityMs=1000)[0]
    before = datetime.now(UTC)
    response = extend(api, delivery, 120_000)
    assert response.status_code == 200, response.json()
    extended = response.json()
    assert extended["deliveryId"] == delivery["deliveryId"]
    assert (extended["messageId"], extended["body"], extended["attempt"]) == (message["id"], {"n": 7}, 1)
    visible_until = parse(extended["visibleUntil"])
    assert before + timedelta(seconds=119) <= visible_until <= datetime.now(UTC) + timedelta(seconds=121)
    assert visible_until > parse(delivery["visibleUntil"])
    assert parse(get(api, message["id"])["visibleAt"]) == visible_until
    assert receive(api, run) == []
    # The extended delivery is still the current one: it completes.
    assert act(api, delivery, "complete").json()["state"] == "COMPLETED"


def test_extend_can_shorten_the_visibility(api, run):
    send(api, run)
    delivery = receive(api, run, visibilityMs=600_000)[0]
    extended = extend(api, delivery, 100).json()
    assert parse(extended["visibleUntil"]) < parse(delivery["visibleUntil"])


def test_a_stale_delivery_cannot_extend_after_redelivery(api, run):
    message = send(api, run)
    first = receive(api, run)[0]
    expire_visibility(message["id"])
    second = receive(api, run)[0]
    assert second["attempt"] == 2
    error = err(extend(api, first), 409, "LEASE_LOST")
    assert error["details"]["messageId"] == message["id"]
    # The current delivery is untouched by the stale attempt and still extends.
    hidden_until = get(api, message["id"])["visibleAt"]
    assert parse(extend(api, second).json()["visibleUntil"]) > parse(hidden_until)


def test_an_expired_delivery_cannot_extend_even_before_redelivery(api, run):
    message = send(api, run)
    delivery = receive(api, run)[0]
    expire_visibility(message["id"])
    err(extend(api, delivery), 409, "LEASE_LOST")
    assert receive(api, run)[0]["attempt"] == 2


@pytest.mark.parametrize("action", ["complete", "retry", "reject"])
def test_a_finished_delivery_cannot_extend(api, run, action):
    message = send(api, run)
    delivery = receive(api, run)[0]
    assert act(api, delivery, action).status_code == 200
    err(extend(api, delivery), 409, "LEASE_LOST")
    assert get(api, message["id"])["state"] in ("COMPLETED", "QUEUED", "DEAD_LETTERED")


@pytest.mark.parametrize("cancelled", ["run", "ancestor"])
def test_under_a_cancelled_run_extend_answers_the_run_code(api, cancelled):
    api.put("/v1/mailboxes/inbox", {"mode": "QUEUE"}, format="json")
    parent = new_run(api)
    run = new_run(api, parent=parent)
    message = send(api, run)
    delivery = receive(api, run)[0]
    target = run if cancelled == "run" else parent
    assert api.post(f"/v1/runs/{target['id']}/cancel", {}, format="json").status_code == 200
    error = err(extend(api, delivery), 409, "SCOPE_CANCELLED")
    assert error["details"]["runId"] == target["id"]
    assert get(api, message["id"])["visibleAt"] == delivery["visibleUntil"]
    # Even a stale delivery hears the run's code, as a complete does (DESIGN.md "Precise points").
    expire_visibility(message["id"])
    err(extend(api, delivery), 409, "SCOPE_CANCELLED")


def test_under_a_completed_run_extend_answers_scope_completed(api, run):
    send(api, run)
    delivery = receive(api, run)[0]
    assert api.post(f"/v1/runs/{run['id']}/complete", {}, format="json").status_code == 200
    err(extend(api, delivery), 409, "SCOPE_COMPLETED")


def test_past_the_run_deadline_extend_answers_deadline_exceeded(api):
    api.put("/v1/mailboxes/inbox", {"mode": "QUEUE"}, format="json")
    deadline = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    run = api.post("/v1/runs", {"deadline": deadline}, format="json").json()
    send(api, run)
    delivery = receive(api, run)[0]
    Run.objects.filter(id=run["id"]).update(deadline=datetime.now(UTC) - timedelta(seconds=1))
    err(extend(api, delivery), 409, "DEADLINE_EXCEEDED")


@pytest.mark.parametrize(
    "body, field",
    [
        ({}, "visibilityMs"),
        ({"visibilityMs": None}, "visibilityMs"),
        ({"visibilityMs": 99}, "visibilityMs"),
        ({"visibilityMs": 86_400_001}, "visibilityMs"),
        ({"visibilityMs": "later"}, "visibilityMs"),
        ({"visibilityMs": 1000, "leaseTtlMs": 1000}, "leaseTtlMs"),
    ],
)
def test_extend_validates(api, run, body, field):
    message = send(api, run)
    delivery = receive(api, run)[0]
    assert field in err(act(api, delivery, "extend", body), 400, "VALIDATION_ERROR")["details"]
    assert get(api, message["id"])["visibleAt"] == delivery["visibleUntil"]


def test_another_projects_and_unknown_deliveries_are_not_found(api, other_api, run):
    message = send(api, run)
    delivery = receive(api, run)[0]
    err(extend(other_api, delivery), 404, "NOT_FOUND")
    assert get(api, message["id"])["visibleAt"] == delivery["visibleUntil"]
    hex_id = message["id"].replace("-", "")
    for delivery_id in ["nonsense", f"c_{hex_id}_1", f"d_{hex_id}_x", f"d_{'0' * 32}_1"]:
        response = api.post(f"/v1/deliveries/{delivery_id}/extend", {"visibilityMs": 1000}, format="json")
        err(response, 404, "NOT_FOUND")


def test_a_bound_key_cannot_extend_outside_its_subtree(project, api, run):
    sibling = new_run(api)
    bound = make_client(project, run_id=run["id"])
    send(api, sibling)
    err(extend(bound, receive(api, sibling)[0]), 404, "NOT_FOUND")
    send(api, run)
    assert extend(bound, receive(bound, run)[0]).status_code == 200


def test_extend_writes_no_event_and_changes_nothing_else(api, run):
    message = send(api, run)
    delivery = receive(api, run)[0]
    before = Message.objects.get(id=message["id"])
    assert extend(api, delivery).status_code == 200
    after = Message.objects.get(id=message["id"])
    assert (after.state, after.attempts, after.finished_at) == (before.state, before.attempts, before.finished_at)
    assert event_types(message["id"]) == ["message.sent", "message.received"]


def test_schema_lists_the_extend_endpoint(anon):
    schema = anon.get("/v1/schema", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    operation = schema["paths"]["/v1/deliveries/{delivery_id}/extend"]["post"]
    assert operation["operationId"] == "deliveries_extend"
    assert {"200", "400", "404", "409"} <= set(operation["responses"])
