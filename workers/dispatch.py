"""Send wake-up messages to Celery workers after commit; the database stays the truth.

A message that cannot be sent (broker down, no worker) only costs lateness: the periodic
sweeps act on everything due within about a second anyway.
"""

import logging
import uuid
from datetime import datetime, timedelta

from django.conf import settings
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
