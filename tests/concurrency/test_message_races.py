"""Queue receivers racing on PostgreSQL: each message is handed out and completed exactly once."""

import threading
from collections import Counter

import pytest
from django.db import transaction

from coordination.domain import exceptions
from coordination.domain.states import MessageState
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
from tests.concurrency.util import force_order, run_closing, run_in_threads
from tests.waiting import WAIT_S, wait_until

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
    for _ in range(10):
        _retries_racing_a_cancel(project, mailbox)


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("first", ["retry", "cancel"])
def test_a_retry_and_a_cancel_forced_in_each_order(first):
    """A retry that commits first queues the message and the cascade cancels it; one that waits cancels it itself.

    Each order is forced (``force_order``): the first side holds its transaction open until the
    other waits on its lock, then commits. Either way nothing stays queued under the cancelled run.
    """
    project = project_ensure(name="race")
    mailbox, _ = mailbox_ensure(project_id=project.id, name="inbox", mode="QUEUE", lease_ttl_ms=600_000)
    run = run_create(project_id=project.id)
    message, _ = message_send(project_id=project.id, mailbox=mailbox, run_id=run.id, body={})
    (delivery,) = message_receive(project_id=project.id, mailbox=mailbox, run_id=run.id)

    def retry():
        return delivery_retry(project_id=project.id, delivery_id=delivery.delivery_id).state

    def cancel():
        run_cancel(run_id=run.id, project_id=project.id)

    if first == "retry":
        answer, _ = force_order(retry, cancel)
        assert answer == MessageState.QUEUED
    else:
        _, answer = force_order(cancel, retry)
        assert answer == MessageState.CANCELLED
    assert Message.objects.get(id=message.id).state == MessageState.CANCELLED


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
def test_a_receiver_skips_a_message_another_holds_and_takes_the_next_without_waiting():
    """SKIP LOCKED, forced: while one receiver's transaction holds a message, another takes the next one.

    The second receive finishes while the first still holds its row (it never waits for it),
    so receivers share the work instead of queueing behind each other.
    """
    project = project_ensure(name="race")
    mailbox, _ = mailbox_ensure(project_id=project.id, name="inbox", mode="QUEUE", lease_ttl_ms=600_000)
    run = run_create(project_id=project.id)
    sent = [message_send(project_id=project.id, mailbox=mailbox, run_id=run.id, body={"n": n})[0].id for n in range(2)]
    holding, let_go = threading.Event(), threading.Event()
    taken, errors = {}, []

    def first_receiver():
        with transaction.atomic():
            taken["first"] = message_receive(project_id=project.id, mailbox=mailbox, run_id=run.id)
            holding.set()
            assert let_go.wait(WAIT_S)

    thread = threading.Thread(target=run_closing(first_receiver, errors))
    thread.start()
    try:
        wait_until(lambda: holding.is_set() or errors, what="the first receiver holds its message", interval_s=0.01)
        assert not errors, errors
        second = message_receive(project_id=project.id, mailbox=mailbox, run_id=run.id)
        assert not let_go.is_set() and thread.is_alive()  # taken while the first still held its row
    finally:
        let_go.set()
        thread.join(WAIT_S)
    assert not thread.is_alive() and errors == []
    assert sorted([taken["first"][0].message.id, second[0].message.id]) == sorted(sent)
