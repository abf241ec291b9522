"""Celery tasks of runstate: the periodic sweeps and the on-time wake-ups.

Every task calls the services, which are idempotent and take their own locks: a duplicate
delivery, two beat schedulers or two workers running the same sweep never double-act.
"""

import time
import uuid
from datetime import datetime, timedelta

from celery import shared_task
from django.db import close_old_connections
from django.utils import timezone

# Each periodic sweep works for at most this long per run, in short batches.
SWEEP_BUDGET_S = 0.8


def _drain(sweep, budget_s: float = SWEEP_BUDGET_S, **kwargs) -> int:
    """Call ``sweep`` (one batch, one transaction) until it finds nothing or the budget is spent."""
    close_old_connections()
    started, total = time.monotonic(), 0
    while time.monotonic() - started < budget_s:
        done = sweep(**kwargs)
        total += done
        if not done:
            break
    return total


# While a wake-up stays on for the rest of its bucket, it fires at most this often: each
# batch is what came due since the last one, so a timer is about this much late at most,
# plus the batch's statement.
TIMER_FIRE_TICK_S = 0.01
# ... and it stays on for no longer than this (a bucket is far shorter; workers.dispatch).
TIMER_STAY_MAX_S = 1.0


@shared_task(name="runstate.fire_timer", ignore_result=True)
def fire_timer(timer_id: str, until: str | None = None) -> None:
    """Fire one timer at its due time (dispatched on creation with an ETA), then every other due timer.

    Timers often come due together and their wake-ups are coalesced (``workers.dispatch``):
    this message stands for every timer of its bucket, so it drains the due ones in batches
    whatever became of its own timer (fired by a sweep, cancelled), then stays until
    ``until`` (the bucket's end), firing the bucket's later timers as they come due.
    """
    from coordination.services.timers import timer_fire, timers_fire_due

    close_old_connections()
    timer_fire(timer_id=uuid.UUID(timer_id))
    _drain(timers_fire_due, budget_s=0.5)
    if until is not None:
        fire_as_due(until=datetime.fromisoformat(until))


def fire_as_due(*, until: datetime) -> int:
    """Fire the timers due by ``until`` as they come due, in batches at most a tick apart; return how many.

    Several workers may do this over the same timers at once: each batch skips the rows
    another one holds, and a timer fires once (``timers_fire_due``).
    """
    from coordination.services.timers import timer_next_due, timers_fire_due

    stay_until = min(until, timezone.now() + timedelta(seconds=TIMER_STAY_MAX_S))
    give_up = time.monotonic() + 2 * TIMER_STAY_MAX_S  # rows held elsewhere: the sweep is there
    total = 0
    while (next_due := timer_next_due(until=stay_until)) is not None and time.monotonic() < give_up:
        time.sleep(max((next_due - timezone.now()).total_seconds(), TIMER_FIRE_TICK_S))
        total += _drain(timers_fire_due, budget_s=0.5)
    return total


@shared_task(name="runstate.sweep_run_deadline", ignore_result=True)
def sweep_run_deadline(run_id: str) -> None:
    """End the work below one run at its deadline (dispatched on creation with an ETA)."""
    from coordination.services.runs import run_sweep_deadline

    close_old_connections()
    run_sweep_deadline(run_id=uuid.UUID(run_id))


@shared_task(name="runstate.sweep_timers", ignore_result=True)
def sweep_timers() -> int:
    """Fire every armed timer that is due."""
    from coordination.services.timers import timers_fire_due

    return _drain(timers_fire_due)


@shared_task(name="runstate.sweep_leases", ignore_result=True)
def sweep_leases() -> int:
    """Settle expired leases and cancel graces; expire budget reservations past their ttl."""
    from coordination.services.budgets import reservations_expire_due
    from coordination.services.messages import messages_cancel_orphaned_in_flight, messages_dead_letter_exhausted
    from coordination.services.pools import pools_settle_due
    from coordination.services.sweeps import tasks_settle_expired_leases

    return (
        _drain(tasks_settle_expired_leases)
        + _drain(messages_dead_letter_exhausted)  # delivered maxAttempts times: dead-lettered, never again
        + _drain(messages_cancel_orphaned_in_flight)
        + _drain(pools_settle_due)  # pool leases past their expiry free their units and grant waiters
        + _drain(reservations_expire_due)  # budget reservations past their ttl hand their amounts back
    )


@shared_task(name="runstate.sweep_deadlines", ignore_result=True)
def sweep_deadlines() -> int:
    """Act on passed deadlines: runs (their subtree's work), groups, and tasks' ``expiresAt``."""
    from coordination.services.groups import groups_finalize_due
    from coordination.services.runs import runs_sweep_deadlines
    from coordination.services.sweeps import tasks_expire_queued

    return _drain(runs_sweep_deadlines) + _drain(groups_finalize_due) + _drain(tasks_expire_queued)


@shared_task(name="runstate.prune_events", ignore_result=True)
def prune_events() -> int:
    """Keep the event log's partitions ahead of time, then prune events past the retention setting.

    On PostgreSQL the next days' partitions are created first (``services/event_partitions.py``),
    then whole expired days are dropped; on SQLite expired rows are deleted in small batches.
    """
    from coordination.services.event_partitions import event_partitions_create_ahead
    from coordination.services.events import events_prune

    close_old_connections()
    event_partitions_create_ahead()
    return _drain(events_prune, budget_s=30)
