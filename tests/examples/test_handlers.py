"""The ``runstate worker`` example's handler, unit-tested with ``runstate.testing`` (no server).

What a user copies along with the handler: a test that it writes a draft, and that it
observes its signal, stopping between steps with nothing to record when its draft is no
longer wanted.
"""

from examples.review_swarm_workers.handlers import draft
from runstate.testing import FakeContext


def test_draft_is_written_and_recorded():
    ctx = FakeContext({"topic": "durable timers", "angle": 3, "steps": 1})
    record = ctx.run(draft)
    assert record.state == "SUCCEEDED"
    assert record.outcome["title"] == "Durable timers #3"
    assert record.outcome["text"] == "durable timers, seen from angle 3, part 1."
    assert 1 <= record.outcome["score"] <= 10
    # The same input writes the same draft: a retried task gives the same score.
    assert FakeContext({"topic": "durable timers", "angle": 3, "steps": 1}).run(draft).outcome == record.outcome


def test_draft_stops_between_steps_once_cancellation_is_requested():
    ctx = FakeContext({"topic": "durable timers", "angle": 3, "steps": 10})
    # Every step waits at least 0.5 s: the request arrives during the first one.
    ctx.request_cancellation(after=0.1)
    record = ctx.run(draft)
    assert record.state == "CANCELLED"
    assert record.outcome is None
    assert ctx.stop_reason == "cancellation_requested"


def test_draft_stops_when_its_lease_is_lost():
    ctx = FakeContext({"topic": "durable timers", "angle": 5, "steps": 10})
    ctx.lose_lease()
    record = ctx.run(draft)
    assert record.state == "LOST"
    assert record.outcome is None
