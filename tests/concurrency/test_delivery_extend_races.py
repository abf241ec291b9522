"""A delivery's extend racing its own visibility expiry and a re-receive, on PostgreSQL.

A message is never held by two live deliveries: an extend of attempt ``n`` either lands
while attempt ``n`` is still the current, unexpired delivery (and then no receive hands the
message out before the extended time), or it is ``LEASE_LOST``.
"""

import random
import time
from datetime import timedelta

import pytest
from django.utils import timezone

from coordination import exceptions
from coordination.services.keys import project_ensure
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.messages import delivery_extend, message_receive, message_send
from coordination.services.runs import run_create
from tests.concurrency.util import run_in_threads

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
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            got = message_receive(project_id=project.id, mailbox=mailbox, run_id=run.id, visibility_ms=60_000)
            if got:
                return got[0]
            time.sleep(0.005)
        raise AssertionError("the message never came back")

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

    The extends that land and the ones refused both occur; none lands after the message
    was handed out again, and none reaches past the second delivery's start.
    """
    settings.RUNSTATE_FAST_PATHS = fast
    project = project_ensure(name="race")
    mailbox, _ = mailbox_ensure(project_id=project.id, name="inbox", mode="QUEUE", lease_ttl_ms=60_000)
    rng = random.Random(20)
    kinds = [kind for _ in range(ROUNDS) for kind in _one_round(project, mailbox, rng)]
    assert "extended" in kinds and "lost" in kinds, "the extends never raced the expiry"
