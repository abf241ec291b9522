"""The decorated task the load swarm's Celery workers run (``--include`` / ``RUNSTATE_TASK_MODULES``).

Its outcome names the worker process that ran it, so the swarm can tell that both workers
did work, and each execution is written to the ledger file named by ``RUNSTATE_SWARM_LEDGER``
(an ``effect``: the ledger checks a handler ran at most once per claim). Kept apart from
``swarm.py`` so that the test process never registers it.
"""

import os

from tests.reliability.ledger import Ledger
from tests.reliability.swarm import CELERY_MAILBOX, LEDGER_ENV, PROJECT
from workers import runstate_task

ledger = Ledger(os.environ[LEDGER_ENV], source=f"celery {os.getpid()}") if os.environ.get(LEDGER_ENV) else None


@runstate_task(mailbox=CELERY_MAILBOX, project=PROJECT, lease_ttl=10, max_attempts=3)
def swarm_step(ctx, i: int, seconds: float = 0):
    if ledger is not None:
        ledger.record("effect", ok=True, task_id=ctx.task_id, attempt=ctx.attempt)
    # Work for a while (a cancel may come meanwhile), stopping early on the signal.
    ctx.signal.wait(seconds)
    return {"i": i, "pid": os.getpid()}
