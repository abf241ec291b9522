"""Send wake-up messages to Celery workers after commit; the database stays the truth.

A message that cannot be sent (broker down, no worker) only costs lateness: the periodic
sweeps act on everything due within about a second anyway, and two of them, here beside
what they send again, re-send the wake-ups a far ETA skipped or a lost message took away
(``runstate.dispatch_upcoming_timers``, ``runstate.rewake_unclaimed_work``).

This module is the services' waker (``coordination.services.dispatch.Waker``; registered
by ``workers.apps``). It sends ``workers.tasks``' on-time tasks and finds the decorated task
of a mailbox in ``workers.registry``; neither imports it.
"""

import functools
import logging
import os
import threading
import uuid
from datetime import UTC, datetime, timedelta

from celery import shared_task
from django.conf import settings
from django.db import close_old_connections, transaction
from django.utils import timezone

from workers.registry import registry
from workers.tasks import fire_timer, sweep_run_deadline

logger = logging.getLogger(__name__)


def _send(task, args: list, eta: datetime) -> bool:
    """Send ``task`` with ``eta``; return whether a message went out."""
    # Far-future ETAs sit in worker memory and can outlive a broker's visibility timeout;
    # the periodic dispatch of upcoming timers sends those again when they come close.
    if eta - timezone.now() > timedelta(seconds=settings.RUNSTATE_ETA_HORIZON_S):
        return False
    try:
        task.apply_async(args=args, eta=eta, expires=eta + timedelta(minutes=10))
    except Exception:  # noqa: BLE001 - the sweep is the safety net
        logger.warning("could not dispatch %s%s; the sweep will act on it", task.name, args, exc_info=True)
        return False
    return True


# Timer wake-ups are coalesced per bucket of due time: a wake-up fires every timer due by
# then (workers.tasks.fire_timer drains), so a burst needs two messages per bucket, not one
# per timer. The first timer of a bucket is woken at its own time (a lone timer stays exact)
# and its wake-up stays until the bucket's end, firing the bucket's later timers as they come
# due (workers.tasks.fire_as_due, a tick apart); the second sends one more wake-up at the
# bucket's end, which covers every timer of the bucket should the first be lost or late
# (then at most TIMER_WAKE_BUCKET late); the rest send nothing.
TIMER_WAKE_BUCKET = timedelta(milliseconds=100)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_timer_wake_lock = threading.Lock()
_timer_wakes_sent: dict[int, int] = {}  # bucket number -> wake-ups sent or being sent for it


def _timer_wake_reserve(bucket: int) -> int | None:
    """Count one more wake-up for ``bucket``; return how many were there before, None if enough."""
    with _timer_wake_lock:
        sent = _timer_wakes_sent.get(bucket, 0)
        if sent >= 2:
            return None
        if len(_timer_wakes_sent) > 10_000:
            # Forget buckets already past: their wake-ups are delivered or lost either way.
            current = (timezone.now() - _EPOCH) // TIMER_WAKE_BUCKET
            for old in [b for b in _timer_wakes_sent if b < current]:
                del _timer_wakes_sent[old]
        _timer_wakes_sent[bucket] = sent + 1
        return sent


def _timer_wake_release(bucket: int) -> None:
    """Forget a wake-up that was not sent, so the next timer of ``bucket`` sends one."""
    with _timer_wake_lock:
        if _timer_wakes_sent.get(bucket, 0) > 0:
            _timer_wakes_sent[bucket] -= 1


def dispatch_timer(timer_id: uuid.UUID, fire_at: datetime) -> None:
    """Ask a worker to fire ``timer_id`` at ``fire_at``, or by the end of its bucket with the others due then."""
    bucket = (fire_at - _EPOCH) // TIMER_WAKE_BUCKET
    sent = _timer_wake_reserve(bucket)
    if sent is None:
        return
    bucket_end = _EPOCH + (bucket + 1) * TIMER_WAKE_BUCKET
    eta = fire_at if sent == 0 else bucket_end
    if not _send(fire_timer, [str(timer_id), bucket_end.isoformat()], max(eta, fire_at)):
        _timer_wake_release(bucket)


def dispatch_run_deadline(run_id: uuid.UUID, deadline: datetime) -> None:
    """Ask a worker to sweep ``run_id``'s subtree at ``deadline``."""
    _send(sweep_run_deadline, [str(run_id)], deadline)


@shared_task(name="runstate.dispatch_upcoming_timers", ignore_result=True)
def dispatch_upcoming_timers() -> int:
    """Send ETA wake-ups for armed timers coming due within the horizon (far timers skipped them)."""
    from coordination.domain.states import TimerState
    from coordination.models import Timer

    close_old_connections()
    now = timezone.now()
    upcoming = Timer.objects.filter(
        state=TimerState.ARMED, fire_at__gt=now, fire_at__lte=now + timedelta(seconds=settings.RUNSTATE_ETA_HORIZON_S)
    ).values_list("id", "fire_at")
    count = 0
    for timer_id, fire_at in upcoming.iterator():
        dispatch_timer(timer_id, fire_at)
        count += 1
    return count


# Work of mailboxes bound to decorated tasks (workers.decorators) ---------------------------


def rewake_after_s() -> float:
    """Return how long a bound task may sit claimable before its message is presumed lost and sent again."""
    configured = getattr(settings, "RUNSTATE_REWAKE_AFTER_S", None)
    return float(configured if configured is not None else os.environ.get("RUNSTATE_REWAKE_AFTER_S", "60"))


def send_work(bound, task_id: uuid.UUID | str, available_at: datetime | None = None, *, producer=None) -> None:
    """Send the Celery message that wakes a worker for runstate task ``task_id`` (at ``available_at``).

    Call it after commit. A message that cannot be sent, or an ``available_at`` beyond the
    ETA horizon, is left to the re-wake sweep (``runstate.rewake_unclaimed_work``).
    """
    now = timezone.now()
    eta = available_at if available_at is not None and available_at > now else None
    if eta is not None and eta - now > timedelta(seconds=settings.RUNSTATE_ETA_HORIZON_S):
        return
    try:
        bound.celery_task.apply_async(args=[str(task_id)], eta=eta, producer=producer)
    except Exception:  # noqa: BLE001 - the re-wake sweep is the safety net
        logger.warning("could not dispatch %s[%s]; the re-wake sweep will send it", bound.name, task_id, exc_info=True)


def send_work_batch(wakes: list) -> None:
    """Send the wake-ups of a batch of submitted tasks (``accept_submitted``'s) in one go.

    One producer, on one broker connection acquired once, publishes every message, as a
    Celery group does; each message still wakes one worker for one task.
    """
    if not wakes:
        return
    app = wakes[0].args[0].celery_task.app
    try:
        producer_context = app.producer_or_acquire()
        producer = producer_context.__enter__()
    except Exception:  # noqa: BLE001 - no broker: every message is the re-wake sweep's
        logger.warning("could not dispatch %d tasks; the re-wake sweep will send them", len(wakes), exc_info=True)
        return
    try:
        for wake in wakes:
            wake(producer=producer)
    finally:
        producer_context.__exit__(None, None, None)


def accept_submitted(task, mailbox):
    """Validate a new task's input against its mailbox's decorated task; return its wake-up, or None.

    Called before the insert: an invalid input raises ``ValidationFailed`` and nothing is
    written. The caller sends the returned wake-up once the task is committed. A mailbox no
    decorated task is bound to costs a set lookup and returns None.
    """
    bound = registry.for_mailbox(mailbox.id, mailbox.name)
    if bound is None:
        return None
    bound.validate_input(task.input)
    return functools.partial(send_work, bound, task.id, task.available_at)


def dispatch_requeued_on_commit(task) -> None:
    """Send the message of a task that went back to ``QUEUED`` in a bound mailbox, after commit."""
    from coordination.models import Task

    if not registry:
        return
    name = task.mailbox.name if Task.mailbox.is_cached(task) else None
    bound = registry.for_mailbox(task.mailbox_id, name)
    if bound is not None:
        transaction.on_commit(functools.partial(send_work, bound, task.id, task.available_at))


@shared_task(name="runstate.rewake_unclaimed_work", ignore_result=True)
def rewake_unclaimed_work() -> int:
    """Send again the messages of bound tasks left claimable too long (a broker outage or a killed worker lost them).

    Only the mailboxes bound in this process are looked at, so every worker should import
    every decorated task module (docs/deploy.md). One batch per run: a deep backlog is
    re-announced gradually, never all at once.
    """
    from coordination.services.sweeps import tasks_rewake_unclaimed

    close_old_connections()
    if not registry:
        return 0
    mailbox_ids = registry.mailbox_ids()
    if not mailbox_ids:
        return 0
    return tasks_rewake_unclaimed(mailbox_ids=mailbox_ids, unclaimed_for=timedelta(seconds=rewake_after_s()))
