"""A delivery's extend racing its own visibility expiry and a re-receive, on PostgreSQL.

A message is never held by two live deliveries: an extend of attempt ``n`` either lands
while attempt ``n`` is still the current, unexpired delivery (and then no receive hands the
message out before the extended time), or it is ``LEASE_LOST``.
"""

import random
import threading
import time
from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from coordination.domain import exceptions
from coordination.models import Message
from coordination.services.keys import project_ensure
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.messages import delivery_extend, message_receive, message_send
from coordination.services.runs import run_create
from tests.concurrency.util import force_order, run_closing, run_in_threads
from tests.waiting import WAIT_S, wait_until

VISIBILITY_MS = 100
ROUNDS = 25
EXTENDS_PER_ROUND = 4


def _one_round(project, mailbox, rng):
    run = run_create(project_id=project.id)
    message_send(project_id=project.id, mailbox=mailbox, run_id=run.id, body={"n": 1})
    first = message_receive(project_id=project.id, mailbox=mailbox, run_id=run.id, visibility_ms=VISIBILITY_MS)[0]
    pauses = [rng.uniform(0.04, 0.13) for _ in range(EXTENDS_PER_ROUND)]

    def extender():
        """Extend a few times with pauses around the visibility; note what each extend answered."""
        answers = []
        for pause in pauses:
            time.sleep(pause)
            try:
                extended = delivery_extend(
                    project_id=project.id, delivery_id=first.delivery_id, visibility_ms=VISIBILITY_MS
                )
            except exceptions.LeaseLost:
                answers.append(("lost", timezone.now()))
                continue
            answers.append(("extended", extended.visible_until))
        return answers

    def receiver():
        """Receive until the message is handed out again; return that delivery."""
        return wait_until(
            lambda: message_receive(project_id=project.id, mailbox=mailbox, run_id=run.id, visibility_ms=60_000),
            what="the message to come back",
            interval_s=0.005,
        )[0]

    answers, second = run_in_threads([extender, receiver])
    assert second.attempt == 2
    received_at = second.visible_until - timedelta(milliseconds=60_000)
    extended = [at for kind, at in answers if kind == "extended"]
    # Every extend that landed kept the message hidden up to a time no later than the re-receive.
    assert all(until <= received_at for until in extended), (extended, received_at)
    # Once an extend was refused, no later one of the same delivery succeeded.
    kinds = [kind for kind, _ in answers]
    assert "extended" not in kinds[kinds.index("lost") :] if "lost" in kinds else True
    return kinds


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "careful"])
def test_extend_racing_expiry_and_re_receive_never_leaves_two_live_deliveries(settings, fast):
    """25 rounds: one thread extends attempt 1 near its expiry while another re-receives.

    No extend lands after the message was handed out again, and none reaches past the second
    delivery's start. Whether extends land or are refused is left to the machine's timing:
    the two forced tests below prove each side.
    """
    settings.RUNSTATE_FAST_PATHS = fast
    project = project_ensure(name="race")
    mailbox, _ = mailbox_ensure(project_id=project.id, name="inbox", mode="QUEUE", lease_ttl_ms=60_000)
    rng = random.Random(20)
    for _ in range(ROUNDS):
        _one_round(project, mailbox, rng)


def _received(settings, fast, visibility_ms):
    """A QUEUE mailbox, a message in it and its first delivery, hidden for ``visibility_ms``."""
    settings.RUNSTATE_FAST_PATHS = fast
    project = project_ensure(name="race")
    mailbox, _ = mailbox_ensure(project_id=project.id, name="inbox", mode="QUEUE", lease_ttl_ms=60_000)
    run = run_create(project_id=project.id)
    message_send(project_id=project.id, mailbox=mailbox, run_id=run.id, body={"n": 1})
    (first,) = message_receive(project_id=project.id, mailbox=mailbox, run_id=run.id, visibility_ms=visibility_ms)
    return project, mailbox, run, first


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "careful"])
def test_an_extend_waiting_on_the_re_receive_is_lease_lost(settings, fast):
    """Forced: attempt 1 ran out and a receiver holds the re-taken message; its extend waits, then is refused."""
    project, mailbox, run, first = _received(settings, fast, VISIBILITY_MS)
    wait_until(lambda: timezone.now() > first.visible_until, what="attempt 1's visibility ran out", interval_s=0.01)

    def re_receive():
        return message_receive(project_id=project.id, mailbox=mailbox, run_id=run.id, visibility_ms=60_000)

    def extend():
        try:
            return delivery_extend(project_id=project.id, delivery_id=first.delivery_id, visibility_ms=60_000)
        except exceptions.LeaseLost:
            return "lost"

    (second,), answer = force_order(re_receive, extend)
    assert second.attempt == 2 and answer == "lost"
    stored = Message.objects.get(id=first.message.id)
    assert (stored.attempts, stored.visible_at) == (2, second.visible_until)


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "careful"])
def test_a_receive_past_the_old_expiry_while_the_extend_commits_does_not_take_the_message(settings, fast):
    """Forced: an extend landed before attempt 1 ran out and holds its row past that time.

    A receiver arriving then sees the old, past visibility but skips the locked row; once the
    extend commits, the message stays hidden until the extended time: never two live deliveries.
    """
    # 5 s: ample for the extend below to run before attempt 1 runs out, on any machine.
    project, mailbox, run, first = _received(settings, fast, 5_000)
    holding, let_go = threading.Event(), threading.Event()
    extended, errors = {}, []

    def extend_and_hold():
        with transaction.atomic():
            extended["delivery"] = delivery_extend(
                project_id=project.id, delivery_id=first.delivery_id, visibility_ms=60_000
            )
            holding.set()
            assert let_go.wait(WAIT_S)

    def receive():
        return message_receive(project_id=project.id, mailbox=mailbox, run_id=run.id, visibility_ms=60_000)

    thread = threading.Thread(target=run_closing(extend_and_hold, errors))
    thread.start()
    try:
        wait_until(lambda: holding.is_set() or errors, what="the extend holds the message", interval_s=0.01)
        assert not errors, errors  # the extend landed (attempt 1 was still current)
        wait_until(
            lambda: timezone.now() > first.visible_until, what="attempt 1's old visibility ran out", interval_s=0.01
        )
        assert receive() == []  # the old visibility is past, but the row is the extend's
    finally:
        let_go.set()
        thread.join(WAIT_S)
    assert not thread.is_alive() and errors == []
    assert receive() == []  # hidden until the extended time
    stored = Message.objects.get(id=first.message.id)
    assert (stored.attempts, stored.visible_at) == (1, extended["delivery"].visible_until)
