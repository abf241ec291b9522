"""Decorated handlers run in threads of this process, as a Celery threads pool runs them: each one holds its claim.

A test module declares its ``hold`` task (its own mailbox and lease) whose handler puts its
``ctx`` in ``contexts`` and waits for ``release`` or its signal; ``running_handlers`` starts
one ``workers.runtime.execute`` per task in a thread of its own and waits for every handler.
"""

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from django.db import connection

from tests.concurrency.util import run_in_threads
from tests.waiting import wait_until
from workers.runtime import execute


def hold_until_released(ctx, contexts: dict, release: threading.Event) -> None:
    """The body of a ``hold`` handler: hold the claim until the test releases it or the signal says stop."""
    # Give the connection back while waiting (to the test settings' pool, which has fewer
    # than 50); a worker's thread keeps its own, as ``runstate_project.celery`` sets up.
    connection.close()
    contexts[ctx.task_id] = ctx
    while not release.is_set() and not ctx.signal.is_set():
        release.wait(0.05)


@contextmanager
def running_handlers(task, contexts: dict, release: threading.Event) -> Iterator:
    """Yield ``start(tasks)``: run each task's handler in a thread; release and join them at the end.

    ``start`` returns a dict that gets the thread running them (``runner``) and, once they
    all returned, what ``execute`` answered for each (``results``).
    """
    task.forget_ids()
    contexts.clear()
    release.clear()
    outcome: dict = {}

    def start(tasks):
        targets = [lambda item=item: execute(task, str(item.id)) for item in tasks]
        runner = threading.Thread(target=lambda: outcome.update(results=run_in_threads(targets)), daemon=True)
        runner.start()
        outcome["runner"] = runner
        wait_until(lambda: len(contexts) >= len(tasks), what=f"{len(tasks)} handlers to start", interval_s=0.02)
        return outcome

    try:
        yield start
    finally:
        release.set()
        if "runner" in outcome:
            outcome["runner"].join(120)
