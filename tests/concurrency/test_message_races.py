"""Queue receivers racing on PostgreSQL: each message is handed out and completed exactly once."""

from collections import Counter

import pytest

from coordination import exceptions
from coordination.models import Event, Message
from coordination.services.keys import project_ensure
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.messages import (
    delivery_complete,
    delivery_retry,
    message_receive,
    message_send,
)
from coordination.services.runs import run_cancel, run_create
from coordination.states import MessageState
from tests.concurrency.util import run_in_threads

MESSAGES = 300
RECEIVERS = 16


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
def test_sixteen_receivers_complete_every_message_exactly_once():
    """16 threads receive (up to 5 at a time) and complete 300 messages.

    SKIP LOCKED hands each message to one receiver: every message ends COMPLETED after a
    single delivery, every complete succeeds, and none is lost or completed twice.
    """
    project = project_ensure(name="race")
    mailbox, _ = mailbox_ensure(project_id=project.id, name="inbox", mode="QUEUE", lease_ttl_ms=600_000)
    run = run_create(project_id=project.id)
    sent = {
        message_send(project_id=project.id, mailbox=mailbox, run_id=run.id, body={"n": n})[0].id
        for n in range(MESSAGES)
    }

    def receiver():
        completed = []
        while True:
            deliveries = message_receive(project_id=project.id, mailbox=mailbox, run_id=run.id, max_messages=5)
            if not deliveries:
                # Empty can mean "all left are locked by other receivers right now".
                if not Message.objects.filter(run_id=run.id, state=MessageState.QUEUED).exists():
                    return completed
                continue
            for delivery in deliveries:
                message = delivery_complete(project_id=project.id, delivery_id=delivery.delivery_id)
                assert message.state == MessageState.COMPLETED
                completed.append(message.id)

    results = run_in_threads([receiver] * RECEIVERS)
    completed = Counter(message_id for result in results for message_id in result)
    assert set(completed) == sent
    assert max(completed.values()) == 1
    assert sum(1 for result in results if result) > 1, "only one receiver ever got work"
    rows = Message.objects.filter(run_id=run.id)
    assert set(rows.values_list("state", flat=True)) == {MessageState.COMPLETED}
    assert set(rows.values_list("attempts", flat=True)) == {1}
    assert Event.objects.filter(type="message.received").count() == MESSAGES
    assert Event.objects.filter(type="message.completed").count() == MESSAGES


def _retries_racing_a_cancel(project, mailbox):
    """Run one round: every in-flight message of a run is retried while the run is cancelled."""
    run = run_create(project_id=project.id)
    for n in range(RECEIVERS * 4):
        message_send(project_id=project.id, mailbox=mailbox, run_id=run.id, body={"n": n})
    deliveries = message_receive(project_id=project.id, mailbox=mailbox, run_id=run.id, max_messages=100)

    def retrier(chunk):
        return lambda: [delivery_retry(project_id=project.id, delivery_id=d.delivery_id).state for d in chunk]

    def canceller():
        run_cancel(run_id=run.id, project_id=project.id)

    results = run_in_threads([retrier(deliveries[i::RECEIVERS]) for i in range(RECEIVERS)] + [canceller])
    states = Counter(state for result in results[:RECEIVERS] for state in result)
    assert set(states) <= {MessageState.QUEUED, MessageState.CANCELLED}
    assert set(Message.objects.filter(run_id=run.id).values_list("state", flat=True)) == {MessageState.CANCELLED}
    with pytest.raises(exceptions.ScopeCancelled):
        message_receive(project_id=project.id, mailbox=mailbox, run_id=run.id)
    return states


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
def test_a_retry_racing_a_cancel_never_leaves_a_queued_message_behind():
    """Consumers retry their deliveries while the run is cancelled, 10 rounds.

    A retry either commits before the cancel (and the cascade cancels the queued message)
    or sees the cancelled run (and cancels the message itself): nothing stays queued under
    a cancelled run, where no one could ever receive it.
    """
    project = project_ensure(name="race")
    mailbox, _ = mailbox_ensure(project_id=project.id, name="inbox", mode="QUEUE", lease_ttl_ms=600_000)
    states = sum((_retries_racing_a_cancel(project, mailbox) for _ in range(10)), Counter())
    assert states[MessageState.QUEUED] > 0 and states[MessageState.CANCELLED] > 0, "the cancel never raced a retry"
