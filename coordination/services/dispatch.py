"""The one seam between the services and Celery: wake-up messages, sent only after commit.

Services call these; the Celery side is whatever the workers app registers at start-up
(``workers.apps.WorkersConfig.ready`` calls ``waker_register``), so the domain imports no
worker module. Without a registration (the workers app not installed) nothing is sent and
no input is checked against a decorated task: the periodic sweeps act on everything due, as
they do when the broker is unreachable. The database stays the truth: a lost message costs
lateness, never correctness.
"""

import functools
import threading
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from datetime import datetime
from typing import Any, Protocol

from django.db import transaction

from coordination.domain.states import TaskState


class Waker(Protocol):
    """What the workers app provides to send wake-ups (``workers.dispatch`` is one)."""

    def accept_submitted(self, task: Any, mailbox: Any) -> Callable[..., None] | None:
        """Validate a new task of a bound mailbox; return the wake-up to send once committed, None if unbound."""

    def send_work_batch(self, wakes: list) -> None:
        """Send a batch of ``accept_submitted``'s wake-ups in one go."""

    def dispatch_requeued_on_commit(self, task: Any) -> None:
        """Wake a worker after commit for a task that went back to ``QUEUED``."""

    def dispatch_timer(self, timer_id: uuid.UUID, fire_at: datetime) -> None:
        """Ask a worker to fire a timer at its due time."""

    def dispatch_run_deadline(self, run_id: uuid.UUID, deadline: datetime) -> None:
        """Ask a worker to sweep a run's subtree at its deadline."""


_waker: Waker | None = None


def waker_register(waker: Waker | None) -> None:
    """Send every wake-up through ``waker`` from now on (None: send none); the workers app calls it at start-up."""
    global _waker
    _waker = waker


def waker() -> Waker | None:
    """Return the registered waker, None when no workers app registered one."""
    return _waker


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
    if _waker is None:
        return None
    return _waker.accept_submitted(task, mailbox)


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


def work_wakes_send(wakes: list) -> None:
    """Send now, in one go, the wake-ups ``work_accept`` returned for a batch whose statement committed on its own."""
    _send_wakes([wake for wake in wakes if wake is not None])


def _send_wakes(wakes: list) -> None:
    if len(wakes) == 1:
        wakes[0]()
    elif wakes and _waker is not None:
        _waker.send_work_batch(wakes)


def work_requeued(task) -> None:
    """Wake a Celery worker after commit for a task that went back to ``QUEUED`` in a bound mailbox."""
    if _waker is not None:
        _waker.dispatch_requeued_on_commit(task)


def work_resubmitted(task) -> None:
    """Wake a worker again, after commit, for a task a keyed resubmit found still ``QUEUED``.

    A client submits again with the same key when it did not get the first answer, and the
    first submit's wake-up is as uncertain as that answer: its commit can land (on a
    synchronous standby, say) while the primary dies before answering, and then the API never
    sends the message. Without this the task would wait for the re-wake sweep. A duplicate
    message is harmless: the claim decides.
    """
    if task.state == TaskState.QUEUED:
        work_requeued(task)


def timer_due(timer_id: uuid.UUID, fire_at: datetime) -> None:
    """Ask a worker, after commit, to fire the timer at its due time."""
    if _waker is not None:
        sender = _waker
        transaction.on_commit(lambda: sender.dispatch_timer(timer_id, fire_at))


def run_deadline_due(run_id: uuid.UUID, deadline: datetime) -> None:
    """Ask a worker, after commit, to sweep the run's subtree at its deadline."""
    if _waker is not None:
        sender = _waker
        transaction.on_commit(lambda: sender.dispatch_run_deadline(run_id, deadline))
