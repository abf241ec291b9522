"""The event table's NOTIFY trigger: one notification per statement, and which topics it carries.

A raw ``LISTEN`` connection sees exactly what the database sends. Every check runs a change
(which commits), then sends a marker notification: PostgreSQL delivers notifications in
commit order, so everything before the marker came from the change, and nothing is timed.
"""

import asyncio
import threading
import uuid
from collections import Counter
from contextlib import contextmanager

import pytest
from django.db import connection, transaction
from django.utils import timezone

from coordination.models import Event
from coordination.plumbing.notify import CHANNEL, HELD_TOPIC, hub
from coordination.services.claims import claim_complete, claim_fail, claim_release, task_claim
from coordination.services.events import events_record_many
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.messages import delivery_complete, delivery_retry, message_receive, message_send
from coordination.services.runs import run_cancel, run_create
from coordination.services.tasks import task_cancel, task_submit

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres_only]

PAYLOAD_LIMIT = 8000  # PostgreSQL refuses a payload of this many bytes or more


@contextmanager
def listening():
    """Yield an autocommit connection listening on the runstate channel."""
    listener = hub._connect()
    try:
        yield listener
    finally:
        listener.close()


def payloads_of(listener, change) -> list[str]:
    """Run ``change`` (it commits), then return the payloads of the notifications it sent, in order."""
    change()
    marker = f"marker-{uuid.uuid4()}"
    listener.execute("SELECT pg_notify(%s, %s)", [CHANNEL, marker])
    payloads = []
    for notify in listener.notifies(timeout=30):
        if notify.payload == marker:
            return payloads
        payloads.append(notify.payload)
    pytest.fail("the marker notification never arrived")


def topics_of(payloads: list[str]) -> set[str]:
    return {topic for payload in payloads for topic in payload.split()}


def event(project, run, type: str, subject_id: object = "") -> Event:
    return Event(
        project_id=project.id,
        type=type,
        run_id=run.id,
        run_path=run.path,
        subject_id=str(subject_id),
        data={},
        created_at=timezone.now(),
    )


@pytest.fixture
def work(project):
    mailbox, _ = mailbox_ensure(project_id=project.id, name="jobs", mode="WORK")
    return project, mailbox, run_create(project_id=project.id)


def test_a_cascade_of_500_events_sends_one_notification_per_chunk(work):
    project, mailbox, run = work
    tasks = [task_submit(project_id=project.id, mailbox=mailbox, run_id=run.id, input={})[0] for _ in range(500)]

    with listening() as listener:
        payloads = payloads_of(listener, lambda: run_cancel(run_id=run.id, project_id=project.id))

    # The cascade wrote its 500 task.cancelled events in one statement, the run's own event
    # in another. 216 task ids of 36 bytes fit in one payload (216 x 37 - 1 = 7991 bytes), so
    # the cascade takes 3 payloads, the run's event 1.
    assert Event.objects.filter(run_id=run.id, type="task.cancelled").count() == 500
    assert len(payloads) == 4
    assert all(len(payload.encode()) < PAYLOAD_LIMIT for payload in payloads)
    topics = Counter(topic for payload in payloads for topic in payload.split())
    assert topics == Counter({str(t.id) for t in tasks} | {str(run.id)})  # every topic, once


def test_a_statement_sends_each_topic_once(work):
    """500 requeues of one run: 500 task ids and the run id, once, in as few payloads as fit."""
    project, _, run = work
    subjects = [uuid.uuid4() for _ in range(500)]

    def write():
        with transaction.atomic():
            events_record_many([event(project, run, "task.requeued", s) for s in subjects])

    with listening() as listener:
        payloads = payloads_of(listener, write)

    assert len(payloads) == 3  # 501 topics of 36 bytes, 216 per payload
    assert all(len(payload.encode()) < PAYLOAD_LIMIT for payload in payloads)
    topics = Counter(topic for payload in payloads for topic in payload.split())
    assert topics == Counter({str(s) for s in subjects} | {str(run.id)})


def test_long_topics_stay_under_the_payload_limit(work):
    project, _, run = work
    subjects = [f"{i:04d}".rjust(64, "s") for i in range(500)]  # the longest subject ids

    def write():
        with transaction.atomic():
            events_record_many([event(project, run, "test.long", s) for s in subjects])

    with listening() as listener:
        payloads = payloads_of(listener, write)

    assert len(payloads) == 5  # 123 topics of 64 bytes per payload (123 x 65 - 1 = 7994)
    assert all(len(payload.encode()) < PAYLOAD_LIMIT for payload in payloads)
    assert topics_of(payloads) == set(subjects)


def test_a_statement_of_topicless_events_still_sends_one_notification(work):
    """Event-log readers (``ANY_TOPIC``) wake for every statement, even one with no topic."""
    project, _, run = work

    def write():
        with transaction.atomic():
            events_record_many([event(project, run, "task.claimed") for _ in range(3)])

    with listening() as listener:
        assert payloads_of(listener, write) == [""]


def test_a_statement_inserting_no_event_sends_nothing(work):
    columns = "txid, project_id, type, run_id, run_path, subject_id, data, created_at"

    def insert_nothing():
        with connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO coordination_event ({columns}) SELECT {columns} FROM coordination_event WHERE false"
            )

    with listening() as listener:
        assert payloads_of(listener, insert_nothing) == []


def test_only_events_that_bring_work_carry_the_run_id(work):
    project, mailbox, run = work
    queue, _ = mailbox_ensure(project_id=project.id, name="inbox", mode="QUEUE")
    ids = {"run": str(run.id)}

    with listening() as listener:

        def topics(change):
            return topics_of(payloads_of(listener, change))

        def submit(name):
            def change():
                ids[name] = str(task_submit(project_id=project.id, mailbox=mailbox, run_id=run.id, input={})[0].id)

            return change

        def claim():
            (ids["claim"],) = [c.claim_id for c in task_claim(project_id=project.id, mailbox=mailbox, run_id=run.id)]

        assert topics(submit("a")) == {ids["a"], ids["run"]}  # task.submitted
        assert topics(claim) == {ids["a"]}  # task.claimed
        assert topics(lambda: claim_complete(project_id=project.id, claim_id=ids["claim"], outcome=1)) == {ids["a"]}

        assert topics(submit("b")) == {ids["b"], ids["run"]}
        assert topics(claim) == {ids["b"]}
        # task.requeued, by a retry and by a release
        retried = topics(lambda: claim_fail(project_id=project.id, claim_id=ids["claim"], error={}, retry=True))
        assert retried == {ids["b"], ids["run"]}
        assert topics(claim) == {ids["b"]}
        assert topics(lambda: claim_release(project_id=project.id, claim_id=ids["claim"])) == {ids["b"], ids["run"]}
        assert topics(claim) == {ids["b"]}
        assert topics(lambda: claim_fail(project_id=project.id, claim_id=ids["claim"], error={})) == {ids["b"]}

        assert topics(submit("c")) == {ids["c"], ids["run"]}
        assert topics(lambda: task_cancel(project_id=project.id, task_id=ids["c"])) == {ids["c"]}

        def send():
            message, _ = message_send(project_id=project.id, mailbox=queue, run_id=run.id, body={})
            ids["m"] = str(message.id)

        def receive():
            (delivery,) = message_receive(project_id=project.id, mailbox=queue, run_id=run.id)
            ids["delivery"] = delivery.delivery_id

        assert topics(send) == {ids["m"], ids["run"]}  # message.sent
        assert topics(receive) == {ids["m"]}  # message.received
        retried = topics(lambda: delivery_retry(project_id=project.id, delivery_id=ids["delivery"]))
        assert retried == {ids["m"], ids["run"]}  # message.retried
        assert topics(receive) == {ids["m"]}
        assert topics(lambda: delivery_complete(project_id=project.id, delivery_id=ids["delivery"])) == {ids["m"]}

        assert topics(lambda: run_cancel(run_id=run.id, project_id=project.id)) == {ids["run"]}  # run.cancelled


def in_thread(fn):
    """Run ``fn`` in a thread with its own connection; return an awaitable of its end."""

    def target():
        try:
            fn()
        finally:
            connection.close()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return asyncio.get_running_loop().run_in_executor(None, thread.join)


def test_an_idle_claimer_wakes_for_a_submit_not_for_other_tasks_claims_and_completions(work):
    """The hub's view: a waiter on the run's chain (as a claim wait subscribes) is left alone
    by claims and completions on its run, and woken by the next submit.
    """
    project, mailbox, run = work
    for _ in range(3):
        task_submit(project_id=project.id, mailbox=mailbox, run_id=run.id, input={})

    def notify(topic):
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_notify(%s, %s)", [CHANNEL, topic])

    async def scenario():
        claimer = hub.subscribe(run.chain_ids)
        marker = str(uuid.uuid4())
        marker_waiter = hub.subscribe([marker])
        try:
            await hub.ready()
            # Notifications are dispatched in order: once the marker woke its waiter, every
            # earlier wake-up (the submits above, the listener's connect) has landed too.
            await in_thread(lambda: notify(marker))
            assert await marker_waiter.wait(30)
            claimer.event.clear()

            def busy_elsewhere():
                claims = task_claim(project_id=project.id, mailbox=mailbox, run_id=run.id, max_claims=3)
                claim_complete(project_id=project.id, claim_id=claims[0].claim_id, outcome=None)
                claim_fail(project_id=project.id, claim_id=claims[1].claim_id, error={})
                task_cancel(project_id=project.id, task_id=claims[2].task.id)  # cancellation requested
                notify(marker)

            await in_thread(busy_elsewhere)
            assert await marker_waiter.wait(30)
            not_woken = not claimer.event.is_set()

            await in_thread(lambda: task_submit(project_id=project.id, mailbox=mailbox, run_id=run.id, input={}))
            woken_by_submit = await claimer.wait(30)
            return not_woken, woken_by_submit
        finally:
            hub.unsubscribe(claimer)
            hub.unsubscribe(marker_waiter)

    not_woken, woken_by_submit = asyncio.run(scenario())
    assert not_woken, "claims and completions of other tasks woke the run's idle claimer"
    assert woken_by_submit


def test_only_events_that_name_a_held_claim_carry_the_held_topic(work):
    """``claims.held`` wakes the claim watches' feed: a cancel of a held claim sends it, a drain never does."""
    project, mailbox, run = work
    first, second = (task_submit(project_id=project.id, mailbox=mailbox, run_id=run.id, input={})[0] for _ in "ab")

    with listening() as listener:

        def topics(change):
            return topics_of(payloads_of(listener, change))

        def claim():
            (held,) = task_claim(project_id=project.id, mailbox=mailbox, run_id=run.id, worker_id="w1")
            return held

        claims = []
        assert HELD_TOPIC not in topics(lambda: claims.append(claim()))  # task.claimed
        assert HELD_TOPIC in topics(lambda: task_cancel(project_id=project.id, task_id=claims[0].task.id))
        # The worker's own complete of the cancelled claim names nobody.
        completed = topics(lambda: claim_complete(project_id=project.id, claim_id=claims[0].claim_id, outcome=None))
        assert HELD_TOPIC not in completed
        assert HELD_TOPIC not in topics(lambda: claims.append(claim()))
        assert HELD_TOPIC in topics(lambda: run_cancel(run_id=run.id, project_id=project.id))  # the held one ends
    assert {c.task.id for c in claims} == {first.id, second.id}
