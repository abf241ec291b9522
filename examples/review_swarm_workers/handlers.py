r"""The drafting handler, run by ``runstate worker`` processes: one draft per task in ``worker-drafts``.

    runstate worker examples.review_swarm_workers.handlers:draft --mailbox worker-drafts \
        --scope $RUNSTATE_SCOPE_ID --concurrency 4

A plain ``consume()`` handler: it gets a context with the task's ``input`` and returns the
outcome, which the worker records. ``runstate worker`` runs a plain function in a thread of
its own, with ``ctx.signal`` a ``threading.Event``. It is the Celery example's
``write_draft`` (same drafts, same scores) without Celery: nothing here imports Django or
the service.
"""

import logging
import random

logger = logging.getLogger(__name__)


def draft(ctx):
    """Write one draft in a few steps; stop starting new steps once the draft is no longer wanted."""
    topic, angle, steps = ctx.input["topic"], ctx.input["angle"], ctx.input.get("steps", 4)
    rng = random.Random(f"{topic}/{angle}")
    parts = []
    for step in range(steps):
        # Waiting on the signal instead of sleeping: when the group decides without this draft,
        # its task is cancelled, the worker learns it at the next lease renewal (a third of the
        # lease) and sets the signal, which ends the wait at once.
        if ctx.signal.wait(rng.uniform(0.5, 2.0)):
            logger.warning("draft %s (angle %s) stopped after %s of %s steps", ctx.task_id, angle, step, steps)
            return None  # not recorded: the task is already CANCELLED
        parts.append(f"{topic}, seen from angle {angle}, part {step + 1}.")
    return {"title": f"{topic.capitalize()} #{angle}", "text": " ".join(parts), "score": rng.randint(1, 10)}
