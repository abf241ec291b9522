"""Queue mailboxes over HTTP: DESIGN.md "Mailboxes" (QUEUE), deliveries under visibility leases.

The receive endpoint is an async long-poll that reads through other threads and
connections, so these tests commit for real (``transaction=True``).
"""

import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection

from coordination.models import Event, Mailbox, Message, Run
from coordination.services.messages import (
    message_send,
    messages_cancel_orphaned_in_flight,
    messages_dead_letter_exhausted,
)
from coordination.services.runs import run_cancel
from tests.conftest import err, make_client

pytestmark = pytest.mark.django_db(transaction=True)


def new_run(api, parent=None):
    response = api.post("/v1/runs", {"parentId": parent["id"]} if parent else {}, format="json")
    assert response.status_code == 201, response.json()
    return response.json()


@pytest.fixture
def run(api):
    """A QUEUE mailbox ``inbox`` and a run to send under."""
    assert api.put("/v1/mailboxes/inbox", {"mode": "QUEUE"}, format="json").status_code == 201
    return new_run(api)


def send(api, run, body=None, **extra):
    payload = {"runId": run["id"], "body": {"n": 0} if body is None else body, **extra}
    response = api.post("/v1/mailboxes/inbox/messages", payload, format="json")
    assert response.status_code in (200, 201), response.json()
    return response.json()


def receive(api, run, **extra):
    response = api.post("/v1/mailboxes/inbox/deliveries", {"runId": run["id"], **extra}, format="json")
    assert response.status_code == 200, response.json()
    return response.json()["deliveries"]


def act(api, delivery, action, body=None):
    return api.post(f"/v1/deliveries/{delivery['deliveryId']}/{action}", body or {}, format="json")


def get(api, message_id):
    response = api.get(f"/v1/messages/{message_id}")
    assert response.status_code == 200, response.json()
    return response.json()


def expire_visibility(message_id):
    """Let the message's visibility lease run out without waiting for it."""
    Message.objects.filter(id=message_id).update(visible_at=datetime.now(UTC) - timedelta(seconds=1))


def event_types(message_id):
    return list(Event.objects.filter(subject_id=str(message_id)).order_by("id").values_list("type", flat=True))


# Send ------------------------------------------------------------------------------------


def test_send_answers_201_with_the_message_and_its_location(api, run):
    response = api.post("/v1/mailboxes/inbox/messages", {"runId": run["id"], "body": {"a": [1, 2]}}, format="json")
    assert response.status_code == 201
    message = response.json()
    assert response["Location"] == f"/v1/messages/{message['id']}"
    assert message["mailbox"] == "inbox" and message["runId"] == run["id"]
    assert message["key"] is None and message["body"] == {"a": [1, 2]}
    assert (message["state"], message["attempts"]) == ("QUEUED", 0)
    assert message["createdAt"].endswith("Z") and message["visibleAt"].endswith("Z")
    assert message["finishedAt"] is None and message["deadLetterReason"] is None
    assert get(api, message["id"]) == message
    assert event_types(message["id"]) == ["message.sent"]


def test_any_json_body_is_accepted(api, run):
    for body in ["text", 7, [1, "x"], {"deep": {"er": None}}]:
        assert get(api, send(api, run, body)["id"])["body"] == body


def test_same_key_same_body_returns_the_message_other_body_conflicts(api, run):
    first = api.post("/v1/mailboxes/inbox/messages", {"runId": run["id"], "body": {"n": 1}, "key": "k"}, format="json")
    assert first.status_code == 201
    again = api.post("/v1/mailboxes/inbox/messages", {"runId": run["id"], "body": {"n": 1}, "key": "k"}, format="json")
    assert again.status_code == 200 and "Location" not in again
    assert again.json()["id"] == first.json()["id"]
    conflict = api.post(
        "/v1/mailboxes/inbox/messages", {"runId": run["id"], "body": {"n": 2}, "key": "k"}, format="json"
    )
    error = err(conflict, 409, "KEY_CONFLICT")
    assert error["details"]["messageId"] == first.json()["id"]
    assert Message.objects.count() == 1
    assert Event.objects.filter(type="message.sent").count() == 1


def test_key_is_unique_per_run(api, run):
    other = new_run(api)
    a = send(api, run, {"n": 1}, key="k")
    b = send(api, other, {"n": 2}, key="k")
    assert a["id"] != b["id"]


def test_send_needs_write_and_get_needs_read(project, api, run):
    message = send(api, run)
    reader = make_client(project, permissions=["coordination_read"])
    writer = make_client(project, permissions=["coordination_write"])
    err(
        reader.post("/v1/mailboxes/inbox/messages", {"runId": run["id"], "body": 1}, format="json"),
        403,
        "PERMISSION_DENIED",
    )
    err(reader.post("/v1/mailboxes/inbox/deliveries", {"runId": run["id"]}, format="json"), 403, "PERMISSION_DENIED")
    assert reader.get(f"/v1/messages/{message['id']}").status_code == 200
    err(writer.get(f"/v1/messages/{message['id']}"), 403, "PERMISSION_DENIED")
    delivery = receive(writer, run)[0]
    err(reader.post(f"/v1/deliveries/{delivery['deliveryId']}/complete", {}, format="json"), 403, "PERMISSION_DENIED")
    assert act(writer, delivery, "complete").status_code == 200


# Receive ---------------------------------------------------------------------------------


def test_receive_hands_out_oldest_first_up_to_max(api, run):
    sent = [send(api, run, {"n": n}) for n in range(3)]
    first = receive(api, run, max=2)
    assert [d["messageId"] for d in first] == [sent[0]["id"], sent[1]["id"]]
    assert [d["body"] for d in first] == [{"n": 0}, {"n": 1}]
    for delivery in first:
        assert delivery["attempt"] == 1
        assert delivery["deliveryId"].startswith("d_")
        assert delivery["visibleUntil"].endswith("Z")
    assert [d["messageId"] for d in receive(api, run, max=5)] == [sent[2]["id"]]
    assert receive(api, run, max=5) == []
    message = get(api, sent[0]["id"])
    assert (message["state"], message["attempts"]) == ("IN_FLIGHT", 1)
    assert message["visibleAt"] == first[0]["visibleUntil"]
    assert Event.objects.filter(type="message.received").count() == 3


def test_visibility_defaults_to_the_mailbox_lease_ttl_and_can_be_set(api):
    api.put("/v1/mailboxes/inbox", {"mode": "QUEUE", "leaseTtlMs": 600_000}, format="json")
    run = new_run(api)
    send(api, run)
    send(api, run)
    before = datetime.now(UTC)
    default = datetime.fromisoformat(receive(api, run)[0]["visibleUntil"])
    chosen = datetime.fromisoformat(receive(api, run, visibilityMs=1000)[0]["visibleUntil"])
    assert default >= before + timedelta(seconds=600)
    assert chosen < before + timedelta(seconds=60)


def test_receive_takes_messages_of_exactly_that_run(api, run):
    below = new_run(api, parent=run)
    send(api, below, {"where": "child"})
    assert receive(api, run) == []
    assert [d["body"] for d in receive(api, below)] == [{"where": "child"}]


def test_expired_visibility_delivers_again_with_attempt_2(api, run):
    message = send(api, run)
    first = receive(api, run)[0]
    assert receive(api, run) == []
    expire_visibility(message["id"])
    second = receive(api, run)[0]
    assert second["messageId"] == message["id"]
    assert (first["attempt"], second["attempt"]) == (1, 2)
    assert second["deliveryId"] != first["deliveryId"]
    # The first delivery is fenced off: only the current one can answer.
    error = err(act(api, first, "complete"), 409, "LEASE_LOST")
    assert error["details"]["messageId"] == message["id"]
    err(act(api, first, "retry"), 409, "LEASE_LOST")
    err(act(api, first, "reject"), 409, "LEASE_LOST")
    done = act(api, second, "complete").json()
    assert (done["state"], done["attempts"]) == ("COMPLETED", 2)
    assert event_types(message["id"]) == ["message.sent", "message.received", "message.received", "message.completed"]


# Complete, retry, reject -----------------------------------------------------------------


def test_complete_acknowledges_once(api, run):
    message = send(api, run)
    delivery = receive(api, run)[0]
    response = act(api, delivery, "complete")
    assert response.status_code == 200
    done = response.json()
    assert done["id"] == message["id"]
    assert (done["state"], done["attempts"]) == ("COMPLETED", 1)
    assert done["finishedAt"] is not None
    assert get(api, message["id"])["state"] == "COMPLETED"
    err(act(api, delivery, "complete"), 409, "LEASE_LOST")
    expire_visibility(message["id"])
    assert receive(api, run) == []
    assert event_types(message["id"]) == ["message.sent", "message.received", "message.completed"]


def test_an_expired_delivery_is_lost_even_before_redelivery(api, run):
    message = send(api, run)
    delivery = receive(api, run)[0]
    expire_visibility(message["id"])
    for action in ("complete", "retry", "reject"):
        err(act(api, delivery, action), 409, "LEASE_LOST")
    assert get(api, message["id"])["state"] == "IN_FLIGHT"


def test_retry_queues_the_message_again_at_once(api, run):
    message = send(api, run)
    first = receive(api, run)[0]
    retried = act(api, first, "retry")
    assert retried.status_code == 200
    assert (retried.json()["state"], retried.json()["attempts"]) == ("QUEUED", 1)
    again = receive(api, run)[0]
    assert (again["messageId"], again["attempt"]) == (message["id"], 2)
    err(act(api, first, "complete"), 409, "LEASE_LOST")
    assert "message.retried" in event_types(message["id"])


def test_retry_with_delay_hides_the_message_until_then(api, run):
    message = send(api, run)
    delivery = receive(api, run)[0]
    before = datetime.now(UTC)
    retried = act(api, delivery, "retry", {"delayMs": 60_000}).json()
    assert retried["state"] == "QUEUED"
    assert datetime.fromisoformat(retried["visibleAt"]) >= before + timedelta(seconds=60)
    assert receive(api, run) == []
    expire_visibility(message["id"])
    assert [(d["messageId"], d["attempt"]) for d in receive(api, run)] == [(message["id"], 2)]
    retried_event = Event.objects.get(type="message.retried", subject_id=message["id"])
    assert retried_event.data == {"attempt": 1, "delayMs": 60_000}


def test_reject_dead_letters_and_the_message_stays_readable(api, run):
    message = send(api, run, {"poison": True})
    delivery = receive(api, run)[0]
    rejected = act(api, delivery, "reject", {"reason": "cannot parse"})
    assert rejected.status_code == 200
    assert rejected.json()["state"] == "DEAD_LETTERED"
    read = get(api, message["id"])
    assert read["state"] == "DEAD_LETTERED"
    assert read["deadLetterReason"] == "cannot parse"
    assert read["body"] == {"poison": True}
    assert read["finishedAt"] is not None
    expire_visibility(message["id"])
    assert receive(api, run) == []
    err(act(api, delivery, "reject"), 409, "LEASE_LOST")
    dead = Event.objects.get(type="message.dead_lettered", subject_id=message["id"])
    assert dead.data == {"attempt": 1, "reason": "cannot parse"}


def test_reject_without_reason(api, run):
    send(api, run)
    assert act(api, receive(api, run)[0], "reject").json()["deadLetterReason"] is None


# Poison messages: maxAttempts ------------------------------------------------------------


def _mailbox_max_attempts(api, n):
    response = api.put("/v1/mailboxes/inbox", {"mode": "QUEUE", "maxAttempts": n}, format="json")
    assert response.status_code in (200, 201), response.json()


def test_a_message_retried_max_attempts_times_is_dead_lettered(api, run):
    """DESIGN.md "Mailboxes": delivered ``maxAttempts`` times without completion, a poison message is dead-lettered."""
    message = send(api, run, {"poison": True})
    for attempt in (1, 2):
        delivery = receive(api, run)[0]
        assert delivery["attempt"] == attempt
        retried = act(api, delivery, "retry").json()
        assert retried["state"] == "QUEUED"
    third = receive(api, run)[0]
    assert third["attempt"] == 3
    answer = act(api, third, "retry")
    assert answer.status_code == 200, answer.json()
    assert (answer.json()["state"], answer.json()["deadLetterReason"]) == ("DEAD_LETTERED", "max_attempts")
    read = get(api, message["id"])
    assert (read["state"], read["attempts"], read["deadLetterReason"]) == ("DEAD_LETTERED", 3, "max_attempts")
    assert read["finishedAt"] is not None
    assert receive(api, run) == []
    dead = Event.objects.get(type="message.dead_lettered", subject_id=message["id"])
    assert dead.data == {"attempt": 3, "reason": "max_attempts"}
    err(act(api, third, "complete"), 409, "LEASE_LOST")


def test_a_message_whose_visibility_runs_out_max_attempts_times_is_dead_lettered_on_receive(api, run):
    _mailbox_max_attempts(api, 2)
    poison = send(api, run, {"poison": True})
    for attempt in (1, 2):
        assert [d["attempt"] for d in receive(api, run)] == [attempt]
        expire_visibility(poison["id"])
    healthy = send(api, run, {"n": 1})
    # The exhausted message is dead-lettered in the receiving transaction, and the receive
    # hands out the next message instead of coming back empty.
    deliveries = receive(api, run, max=1)
    assert [(d["messageId"], d["attempt"]) for d in deliveries] == [(healthy["id"], 1)]
    read = get(api, poison["id"])
    assert (read["state"], read["attempts"], read["deadLetterReason"]) == ("DEAD_LETTERED", 2, "max_attempts")
    assert event_types(poison["id"])[-1] == "message.dead_lettered"
    assert Event.objects.get(type="message.dead_lettered", subject_id=poison["id"]).data == {
        "attempt": 2,
        "reason": "max_attempts",
    }


def test_the_sweep_dead_letters_an_exhausted_message_nobody_receives(api, run):
    _mailbox_max_attempts(api, 1)
    poison = send(api, run)
    other = send(api, run)
    receive(api, run, max=2)
    expire_visibility(poison["id"])  # ``other`` is still within its visibility lease
    assert messages_dead_letter_exhausted() == 1
    assert messages_dead_letter_exhausted() == 0
    assert (get(api, poison["id"])["state"], get(api, poison["id"])["deadLetterReason"]) == (
        "DEAD_LETTERED",
        "max_attempts",
    )
    assert get(api, other["id"])["state"] == "IN_FLIGHT"


def test_an_exhausted_message_under_a_cancelled_run_is_dead_lettered_not_cancelled(api, run):
    """The attempts rule comes first, whichever sweep reaches the message first."""
    _mailbox_max_attempts(api, 1)
    poison = send(api, run)
    receive(api, run)
    assert api.post(f"/v1/runs/{run['id']}/cancel", {}, format="json").status_code == 200
    expire_visibility(poison["id"])
    assert messages_cancel_orphaned_in_flight() == 0
    assert messages_dead_letter_exhausted() == 1
    assert get(api, poison["id"])["state"] == "DEAD_LETTERED"


def test_lowering_max_attempts_applies_to_a_message_already_delivered_that_often(api, run):
    message = send(api, run)
    delivery = receive(api, run)[0]
    act(api, delivery, "retry")
    receive(api, run)
    expire_visibility(message["id"])
    _mailbox_max_attempts(api, 2)
    assert receive(api, run) == []
    assert get(api, message["id"])["deadLetterReason"] == "max_attempts"


# Run cancel, complete and deadline -------------------------------------------------------


@pytest.mark.parametrize("cancelled", ["run", "ancestor"])
def test_run_cancel_ends_queued_messages_and_refuses_new_work(api, cancelled):
    api.put("/v1/mailboxes/inbox", {"mode": "QUEUE"}, format="json")
    parent = new_run(api)
    run = new_run(api, parent=parent)
    completing, retrying, rejecting, queued = (send(api, run, {"n": n}) for n in range(4))
    deliveries = receive(api, run, max=3)
    assert [d["messageId"] for d in deliveries] == [completing["id"], retrying["id"], rejecting["id"]]
    target = run if cancelled == "run" else parent
    assert api.post(f"/v1/runs/{target['id']}/cancel", {"reason": "stop"}, format="json").status_code == 200

    # Queued messages are cancelled in the cancel's transaction; in-flight ones are not.
    assert get(api, queued["id"])["state"] == "CANCELLED"
    assert get(api, queued["id"])["finishedAt"] is not None
    cancel_event = Event.objects.get(type="message.cancelled", subject_id=queued["id"])
    assert cancel_event.data == {"reason": "stop", "cause": "run_cancelled"}
    assert get(api, completing["id"])["state"] == "IN_FLIGHT"

    sent = api.post("/v1/mailboxes/inbox/messages", {"runId": run["id"], "body": 1}, format="json")
    assert err(sent, 409, "SCOPE_CANCELLED")["details"]["runId"] == target["id"]
    err(api.post("/v1/mailboxes/inbox/deliveries", {"runId": run["id"]}, format="json"), 409, "SCOPE_CANCELLED")
    completed = act(api, deliveries[0], "complete")
    assert err(completed, 409, "SCOPE_CANCELLED")["details"]["runId"] == target["id"]
    assert get(api, completing["id"])["state"] == "IN_FLIGHT"

    retried = act(api, deliveries[1], "retry", {"delayMs": 10})
    assert retried.status_code == 200 and retried.json()["state"] == "CANCELLED"
    assert retried.json()["finishedAt"] is not None
    rejected = act(api, deliveries[2], "reject", {"reason": "late"})
    assert rejected.status_code == 200 and rejected.json()["state"] == "DEAD_LETTERED"
    assert event_types(retrying["id"])[-1] == "message.cancelled"
    assert event_types(rejecting["id"])[-1] == "message.dead_lettered"
    assert Event.objects.get(type="message.cancelled", subject_id=retrying["id"]).data == {
        "cause": "retried_after_run_ended",
        "code": "SCOPE_CANCELLED",
    }


def test_run_complete_refuses_with_scope_completed(api, run):
    queued = send(api, run)
    send(api, run)
    delivery = receive(api, run)[0]
    assert api.post(f"/v1/runs/{run['id']}/complete").status_code == 200
    assert get(api, delivery["messageId"])["state"] == "IN_FLIGHT"
    assert get(api, queued["id"])["state"] != "QUEUED"
    cancelled = Message.objects.get(state="CANCELLED")
    assert Event.objects.get(type="message.cancelled", subject_id=str(cancelled.id)).data["cause"] == "run_completed"
    err(
        api.post("/v1/mailboxes/inbox/messages", {"runId": run["id"], "body": 1}, format="json"), 409, "SCOPE_COMPLETED"
    )
    err(api.post("/v1/mailboxes/inbox/deliveries", {"runId": run["id"]}, format="json"), 409, "SCOPE_COMPLETED")
    err(act(api, delivery, "complete"), 409, "SCOPE_COMPLETED")
    assert act(api, delivery, "retry").json()["state"] == "CANCELLED"


def test_deadline_refuses_new_work_and_completes_at_once(api, run):
    send(api, run)
    delivery = receive(api, run)[0]
    Run.objects.filter(id=run["id"]).update(deadline=datetime.now(UTC) - timedelta(seconds=1))
    err(
        api.post("/v1/mailboxes/inbox/messages", {"runId": run["id"], "body": 1}, format="json"),
        409,
        "DEADLINE_EXCEEDED",
    )
    err(api.post("/v1/mailboxes/inbox/deliveries", {"runId": run["id"]}, format="json"), 409, "DEADLINE_EXCEEDED")
    err(act(api, delivery, "complete"), 409, "DEADLINE_EXCEEDED")
    assert act(api, delivery, "reject").json()["state"] == "DEAD_LETTERED"


def test_a_stale_delivery_on_a_cancelled_run_answers_the_run_code_on_complete(api, run):
    send(api, run)
    stale = receive(api, run)[0]
    expire_visibility(stale["messageId"])
    current = receive(api, run)[0]
    assert api.post(f"/v1/runs/{run['id']}/cancel", {}, format="json").status_code == 200
    err(act(api, stale, "complete"), 409, "SCOPE_CANCELLED")
    err(act(api, stale, "retry"), 409, "LEASE_LOST")
    err(act(api, stale, "reject"), 409, "LEASE_LOST")
    assert act(api, current, "retry").json()["state"] == "CANCELLED"


def test_sweep_cancels_expired_in_flight_messages_of_inactive_runs_only(api, run):
    live = new_run(api)
    parent = new_run(api)
    below = new_run(api, parent=parent)
    late = new_run(api)
    ids = {}
    for name, where in [("live", live), ("below", below), ("visible", below), ("late", late)]:
        ids[name] = send(api, where, {"name": name})["id"]
    receive(api, live)
    receive(api, below, max=2)
    receive(api, late)
    assert api.post(f"/v1/runs/{parent['id']}/cancel", {}, format="json").status_code == 200
    Run.objects.filter(id=late["id"]).update(deadline=datetime.now(UTC) - timedelta(seconds=1))
    for name in ("live", "below", "late"):
        expire_visibility(ids[name])

    assert messages_cancel_orphaned_in_flight(batch_size=1) == 1
    assert messages_cancel_orphaned_in_flight() == 1
    assert messages_cancel_orphaned_in_flight() == 0
    states = {name: get(api, message_id)["state"] for name, message_id in ids.items()}
    assert states == {"live": "IN_FLIGHT", "below": "CANCELLED", "visible": "IN_FLIGHT", "late": "CANCELLED"}
    assert Event.objects.get(type="message.cancelled", subject_id=ids["below"]).data == {
        "cause": "visibility_expired_run_inactive"
    }
    # The live run's message is simply delivered again.
    assert [d["attempt"] for d in receive(api, live)] == [2]


# Waiting ---------------------------------------------------------------------------------


def _later(fn, delay_s=0.3):
    def target():
        try:
            time.sleep(delay_s)
            fn()
        finally:
            connection.close()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def test_receive_with_wait_returns_when_a_message_is_sent(project, api, run):
    mailbox = Mailbox.objects.get(project=project, name="inbox")
    thread = _later(lambda: message_send(project_id=project.id, mailbox=mailbox, run_id=run["id"], body={"late": 1}))
    deliveries = receive(api, run, waitMs=20_000)
    thread.join(10)
    assert [d["body"] for d in deliveries] == [{"late": 1}]
    assert deliveries[0]["attempt"] == 1


def test_receive_with_wait_answers_empty_when_nothing_comes(api, run):
    assert receive(api, run, waitMs=200) == []


def test_a_waiting_receive_is_refused_when_the_run_is_cancelled(project, api, run):
    thread = _later(lambda: run_cancel(run_id=run["id"], project_id=project.id))
    response = api.post("/v1/mailboxes/inbox/deliveries", {"runId": run["id"], "waitMs": 20_000}, format="json")
    thread.join(10)
    err(response, 409, "SCOPE_CANCELLED")


# Isolation, modes, validation ------------------------------------------------------------


def test_another_projects_messages_and_deliveries_are_not_found(api, other_api, run):
    message = send(api, run)
    delivery = receive(api, run)[0]
    other_api.put("/v1/mailboxes/inbox", {"mode": "QUEUE"}, format="json")
    err(other_api.get(f"/v1/messages/{message['id']}"), 404, "NOT_FOUND")
    for action in ("complete", "retry", "reject"):
        err(act(other_api, delivery, action), 404, "NOT_FOUND")
    err(
        other_api.post("/v1/mailboxes/inbox/messages", {"runId": run["id"], "body": 1}, format="json"), 404, "NOT_FOUND"
    )
    err(other_api.post("/v1/mailboxes/inbox/deliveries", {"runId": run["id"]}, format="json"), 404, "NOT_FOUND")
    assert get(api, message["id"])["state"] == "IN_FLIGHT"


def test_unknown_mailbox_run_and_malformed_ids_are_not_found(api, run):
    err(api.post("/v1/mailboxes/nope/messages", {"runId": run["id"], "body": 1}, format="json"), 404, "NOT_FOUND")
    err(api.post("/v1/mailboxes/nope/deliveries", {"runId": run["id"]}, format="json"), 404, "NOT_FOUND")
    err(api.post("/v1/mailboxes/inbox/messages", {"runId": "not-a-run", "body": 1}, format="json"), 404, "NOT_FOUND")
    err(api.get("/v1/messages/not-an-id"), 404, "NOT_FOUND")
    message = send(api, run)
    hex_id = message["id"].replace("-", "")
    for delivery_id in ["nonsense", f"c_{hex_id}_1", f"d_{hex_id}_x", "d_zz_1", f"d_{hex_id}_1_2", f"d_{'0' * 32}_1"]:
        err(api.post(f"/v1/deliveries/{delivery_id}/complete", {}, format="json"), 404, "NOT_FOUND")
    # A well-formed id of a message that was never received is a lost lease, not a 404.
    err(api.post(f"/v1/deliveries/d_{hex_id}_1/complete", {}, format="json"), 409, "LEASE_LOST")


def test_bound_key_sees_only_messages_of_its_subtree(project, api, run):
    sibling = new_run(api)
    bound = make_client(project, run_id=run["id"])
    inside = send(bound, run)
    outside = send(api, sibling)
    assert bound.get(f"/v1/messages/{inside['id']}").status_code == 200
    err(bound.get(f"/v1/messages/{outside['id']}"), 404, "NOT_FOUND")
    err(
        bound.post("/v1/mailboxes/inbox/messages", {"runId": sibling["id"], "body": 1}, format="json"), 404, "NOT_FOUND"
    )
    err(bound.post("/v1/mailboxes/inbox/deliveries", {"runId": sibling["id"]}, format="json"), 404, "NOT_FOUND")
    delivery = receive(api, sibling)[0]
    err(act(bound, delivery, "complete"), 404, "NOT_FOUND")
    assert act(bound, receive(bound, run)[0], "complete").status_code == 200


def test_work_and_queue_mailboxes_do_not_mix(api, run):
    api.put("/v1/mailboxes/jobs", {"mode": "WORK"}, format="json")
    error = err(
        api.post("/v1/mailboxes/jobs/messages", {"runId": run["id"], "body": 1}, format="json"),
        409,
        "MAILBOX_MODE_CONFLICT",
    )
    assert error["details"]["mode"] == "WORK"
    err(api.post("/v1/mailboxes/jobs/deliveries", {"runId": run["id"]}, format="json"), 409, "MAILBOX_MODE_CONFLICT")
    err(api.post("/v1/mailboxes/inbox/tasks", {"runId": run["id"]}, format="json"), 409, "MAILBOX_MODE_CONFLICT")
    err(api.post("/v1/mailboxes/inbox/claims", {"runId": run["id"]}, format="json"), 409, "MAILBOX_MODE_CONFLICT")


@pytest.mark.parametrize(
    "body, field",
    [
        ({"body": 1}, "runId"),
        ({"runId": "r"}, "body"),
        ({"runId": "r", "body": None}, "body"),
        ({"runId": "r", "body": 1, "key": "k" * 201}, "key"),
        ({"runId": "r", "body": 1, "priority": 1}, "priority"),
    ],
)
def test_send_validates(api, run, body, field):
    body = {k: run["id"] if v == "r" and k == "runId" else v for k, v in body.items()}
    error = err(api.post("/v1/mailboxes/inbox/messages", body, format="json"), 400, "VALIDATION_ERROR")
    assert field in error["details"]


@pytest.mark.parametrize(
    "body, field",
    [
        ({"max": 0}, "max"),
        ({"max": 101}, "max"),
        ({"waitMs": -1}, "waitMs"),
        ({"visibilityMs": 1}, "visibilityMs"),
        ({"visibilityMs": "soon"}, "visibilityMs"),
        ({"leaseTtlMs": 1000}, "leaseTtlMs"),
    ],
)
def test_receive_validates(api, run, body, field):
    response = api.post("/v1/mailboxes/inbox/deliveries", {"runId": run["id"], **body}, format="json")
    assert field in err(response, 400, "VALIDATION_ERROR")["details"]


@pytest.mark.parametrize(
    "action, body, field",
    [
        ("retry", {"delayMs": -1}, "delayMs"),
        ("retry", {"delayMs": "later"}, "delayMs"),
        ("retry", {"retry": True}, "retry"),
        ("reject", {"reason": "x" * 1001}, "reason"),
        ("reject", {"error": "x"}, "error"),
        ("complete", {"outcome": 1}, "outcome"),
    ],
)
def test_delivery_operations_validate(api, run, action, body, field):
    send(api, run)
    delivery = receive(api, run)[0]
    assert field in err(act(api, delivery, action, body), 400, "VALIDATION_ERROR")["details"]
    assert get(api, delivery["messageId"])["state"] == "IN_FLIGHT"


def test_schema_lists_the_message_endpoints(anon):
    schema = anon.get("/v1/schema", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    operations = {
        ("/v1/mailboxes/{name}/messages", "post"): "messages_send",
        ("/v1/messages/{message_id}", "get"): "messages_retrieve",
        ("/v1/mailboxes/{name}/deliveries", "post"): "deliveries_receive",
        ("/v1/deliveries/{delivery_id}/complete", "post"): "deliveries_complete",
        ("/v1/deliveries/{delivery_id}/retry", "post"): "deliveries_retry",
        ("/v1/deliveries/{delivery_id}/reject", "post"): "deliveries_reject",
    }
    for (path, method), operation_id in operations.items():
        assert schema["paths"][path][method]["operationId"] == operation_id
    assert "409" in schema["paths"]["/v1/deliveries/{delivery_id}/complete"]["post"]["responses"]
    assert "201" in schema["paths"]["/v1/mailboxes/{name}/messages"]["post"]["responses"]
