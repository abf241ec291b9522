"""The one seam between the services and Celery: wake-up messages, sent only after commit.

Services call these; only this module imports ``workers.dispatch`` (lazily, so the domain
does not load Celery until a wake-up is due). The database stays the truth: a lost message
costs lateness, never correctness, since the periodic sweeps act on everything due.
"""

import functools
import threading
import uuid
from contextlib import contextmanager
from datetime import datetime

from django.db import transaction


def work_submitted(task, mailbox) -> None:
    """Validate a new task of a mailbox bound to a decorated Celery task; wake a worker after commit.

    Every submit (API, SDK, ``task.submit``, group members) inserts through the task
    services, which call this before the insert: an invalid input raises
    ``ValidationFailed`` and nothing is written. Unbound mailboxes cost an in-memory lookup.
    """
    work_wake_on_commit(work_accept(task, mailbox))


def work_accept(task, mailbox):
    """Validate a new task of a bound mailbox before it is written; return the wake-up to send once committed.

    For single-statement inserts that run outside ``transaction.atomic()``, where
    ``on_commit`` would fire before the statement: call the returned callable (if any) after it.
    """
    from workers.dispatch import accept_submitted

    return accept_submitted(task, mailbox)


_batch = threading.local()


def work_wake_on_commit(wake) -> None:
    """Send ``wake`` (``work_accept``'s answer, None for an unbound mailbox) after commit, with its batch if any."""
    if wake is None:
        return
    collecting = getattr(_batch, "wakes", None)
    # In a batch, the wake-up joins it at commit, unless its savepoint was rolled back.
    transaction.on_commit(wake if collecting is None else functools.partial(collecting.append, wake))


@contextmanager
def work_wakes_batched():
    """Inside an atomic block: send the wake-ups of the submits made inside after commit, in one go."""
    if getattr(_batch, "wakes", None) is not None:
        yield
        return
    _batch.wakes = collected = []
    try:
        yield
    finally:
        _batch.wakes = None
    # Registered last, so it runs after the callbacks that collect.
    transaction.on_commit(functools.partial(_send_wakes, collected))


def work_accepted_on_commit(wakes: list) -> None:
    """Send, after commit and in one go, the wake-ups ``work_accept`` returned for a batch of submits."""
    wakes = [wake for wake in wakes if wake is not None]
    if len(wakes) == 1:
        transaction.on_commit(wakes[0])
    elif wakes:
        transaction.on_commit(functools.partial(_send_wakes, wakes))


def _send_wakes(wakes: list) -> None:
    if len(wakes) == 1:
        wakes[0]()
    elif wakes:
        from workers.dispatch import send_work_batch

        send_work_batch(wakes)


def work_requeued(task) -> None:
    """Wake a Celery worker after commit for a task that went back to ``QUEUED`` in a bound mailbox."""
    from workers.dispatch import dispatch_requeued_on_commit

    dispatch_requeued_on_commit(task)


def timer_due(timer_id: uuid.UUID, fire_at: datetime) -> None:
    """Ask a worker, after commit, to fire the timer at its due time."""
    from workers.dispatch import dispatch_timer

    transaction.on_commit(lambda: dispatch_timer(timer_id, fire_at))


def run_deadline_due(run_id: uuid.UUID, deadline: datetime) -> None:
    """Ask a worker, after commit, to sweep the run's subtree at its deadline."""
    from workers.dispatch import dispatch_run_deadline

    transaction.on_commit(lambda: dispatch_run_deadline(run_id, deadline))
