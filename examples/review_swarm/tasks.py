"""The drafting handler, run by Celery workers: one draft per runstate task in the ``drafts`` mailbox.

Every process of the service imports this module when started with
``RUNSTATE_TASK_MODULES=examples.review_swarm.tasks``: the API then validates submitted
drafts against ``DRAFT_SCHEMA`` and wakes a worker after commit; the worker runs
``write_draft`` under a lease.
"""

import logging
import random

from examples.review_swarm import MAILBOX
from workers import runstate_task

logger = logging.getLogger(__name__)

# The development project that `scripts/start` creates and its API key belongs to.
PROJECT = "dev"
DRAFT_SCHEMA = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "minLength": 3},
        "angle": {"type": "integer", "minimum": 1},
        "steps": {"type": "integer", "minimum": 1, "maximum": 10},
    },
    "required": ["topic", "angle"],
}


@runstate_task(mailbox=MAILBOX, project=PROJECT, lease_ttl=6, max_attempts=2, input_schema=DRAFT_SCHEMA)
def write_draft(ctx, topic: str, angle: int, steps: int = 4):
    """Write one draft in a few steps; stop starting new steps once the draft is no longer wanted."""
    rng = random.Random(f"{topic}/{angle}")
    parts = []
    for step in range(steps):
        # Waiting on the signal instead of sleeping: a cancel (the group decided without this
        # draft) interrupts the wait at the next heartbeat, a third of the lease.
        if ctx.signal.wait(rng.uniform(0.5, 2.0)):
            logger.warning(
                "draft %s (angle %s) stopped after %s of %s steps: %s", ctx.task_id, angle, step, steps, ctx.lost
            )
            return None  # not recorded: the task is already CANCELLED
        parts.append(f"{topic}, seen from angle {angle}, part {step + 1}.")
    return {"title": f"{topic.capitalize()} #{angle}", "text": " ".join(parts), "score": rng.randint(1, 10)}
