"""Send wake-up messages to Celery workers after commit; the database stays the truth.

A message that cannot be sent (broker down, no worker) only costs lateness: the periodic
sweeps act on everything due within about a second anyway.
"""

import functools
import logging
import os
import uuid
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

logger = logging.getLogger(__name__)


def _send(task, args: list, eta: datetime) -> None:
    # Far-future ETAs sit in worker memory and can outlive a broker's visibility timeout;
    # the periodic dispatch of upcoming timers sends those again when they come close.
    if eta - timezone.now() > timedelta(seconds=settings.RUNSTATE_ETA_HORIZON_S):
        return
    try:
        task.apply_async(args=args, eta=eta, expires=eta + timedelta(minutes=10))
    except Exception:  # noqa: BLE001 - the sweep is the safety net
        logger.warning("could not dispatch %s%s; the sweep will act on it", task.name, args, exc_info=True)


def dispatch_timer(timer_id: uuid.UUID, fire_at: datetime) -> None:
    """Ask a worker to fire ``timer_id`` at ``fire_at``."""
    from workers.tasks import fire_timer

    _send(fire_timer, [str(timer_id)], fire_at)


def dispatch_run_deadline(run_id: uuid.UUID, deadline: datetime) -> None:
    """Ask a worker to sweep ``run_id``'s subtree at ``deadline``."""
    from workers.tasks import sweep_run_deadline

    _send(sweep_run_deadline, [str(run_id)], deadline)


# Work of mailboxes bound to decorated tasks (workers.decorators) ---------------------------


def rewake_after_s() -> float:
    """Return how long a bound task may sit claimable before its message is presumed lost and sent again."""
    configured = getattr(settings, "RUNSTATE_REWAKE_AFTER_S", None)
    return float(configured if configured is not None else os.environ.get("RUNSTATE_REWAKE_AFTER_S", "60"))


def send_work(bound, task_id: uuid.UUID | str, available_at: datetime | None = None) -> None:
    """Send the Celery message that wakes a worker for runstate task ``task_id`` (at ``available_at``).

    Call it after commit. A message that cannot be sent, or an ``available_at`` beyond the
    ETA horizon, is left to the re-wake sweep (``runstate.rewake_unclaimed_work``).
    """
    now = timezone.now()
    eta = available_at if available_at is not None and available_at > now else None
    if eta is not None and eta - now > timedelta(seconds=settings.RUNSTATE_ETA_HORIZON_S):
        return
    try:
        bound.celery_task.apply_async(args=[str(task_id)], eta=eta)
    except Exception:  # noqa: BLE001 - the re-wake sweep is the safety net
        logger.warning("could not dispatch %s[%s]; the re-wake sweep will send it", bound.name, task_id, exc_info=True)


def dispatch_submitted_on_commit(task, mailbox) -> None:
    """Validate a new task's input against its mailbox's decorated task, and send its message after commit.

    Called by ``task_insert`` before the insert: an invalid input raises ``ValidationFailed``
    and nothing is written. A mailbox no decorated task is bound to costs a set lookup.
    """
    from workers.decorators import registry

    bound = registry.for_mailbox(mailbox.id, mailbox.name)
    if bound is None:
        return
    bound.validate_input(task.input)
    transaction.on_commit(functools.partial(send_work, bound, task.id, task.available_at))


def dispatch_requeued_on_commit(task) -> None:
    """Send the message of a task that went back to ``QUEUED`` in a bound mailbox, after commit."""
    from coordination.models import Task
    from workers.decorators import registry

    if not registry:
        return
    name = task.mailbox.name if Task.mailbox.is_cached(task) else None
    bound = registry.for_mailbox(task.mailbox_id, name)
    if bound is not None:
        transaction.on_commit(functools.partial(send_work, bound, task.id, task.available_at))
