"""Durable timers: create, fire, acknowledge, cancel. The only writer of ``Timer.state``.

Firing is idempotent: the Celery task dispatched for the due time and the sweep both call
``timer_fire``/``timers_fire_due``, and whichever locks the row first fires it.
"""

import time
import uuid
from datetime import datetime, timedelta

from django.db import connection, transaction
from django.utils import timezone

from coordination.domain import exceptions
from coordination.domain.states import TimerState
from coordination.models import Event, Timer
from coordination.plumbing.tracing import record_span
from coordination.services import dispatch, sql
from coordination.services.cascade import SubtreeEnd, cascade_step, subtree_rows_end
from coordination.services.events import event_for, event_insert_sql, events_record_many
from coordination.services.locking import run_chain_lock_active

MAX_DELAY_S = 10 * 365 * 24 * 3600


@transaction.atomic
def timer_create(
    *, project_id: uuid.UUID, run_id: uuid.UUID, at: datetime | None = None, after_seconds: float | None = None
) -> Timer:
    """Arm a timer at ``at`` or after ``after_seconds`` (exactly one); one in the past fires at once."""
    if (at is None) == (after_seconds is None):
        raise exceptions.ValidationFailed(
            "Give exactly one of at and afterSeconds.", at="exactly one of at, afterSeconds"
        )
    if after_seconds is not None and not 0 <= after_seconds <= MAX_DELAY_S:
        raise exceptions.ValidationFailed("Invalid delay.", afterSeconds=f"between 0 and {MAX_DELAY_S}")
    chain = run_chain_lock_active(run_id, project_id=project_id)
    run = chain[-1]
    now = timezone.now()
    fire_at = at if at is not None else now + timedelta(seconds=after_seconds)
    timer = Timer.objects.create(
        project_id=project_id,
        run=run,
        run_path=run.path,
        run_deadline=min((r.deadline for r in chain if r.deadline is not None), default=None),
        fire_at=fire_at,
        created_at=now,
    )
    events_record_many([event_for(timer, "timer.created", fireAt=fire_at.isoformat())])
    if fire_at <= now:
        _fire(timer, now)
    else:
        dispatch.timer_due(timer.id, timer.fire_at)
    return timer


def _fire(timer: Timer, now: datetime) -> list[Event]:
    """Fire a locked armed timer; a timer due after its run's deadline is cancelled instead.

    Every firing is a ``fire timer`` span (when tracing): its wake-up's, an acknowledge's that
    found it due, a create's of a timer already due.
    """
    if timer.run_deadline is not None and timer.fire_at >= timer.run_deadline:
        timer.state = TimerState.CANCELLED
        timer.save(update_fields=["state"])
        event = event_for(timer, "timer.cancelled", cause="run_deadline")
    else:
        timer.state = TimerState.FIRED
        timer.fired_at = now
        timer.save(update_fields=["state", "fired_at"])
        event = event_for(timer, "timer.fired", fireAt=timer.fire_at.isoformat(), lateMs=_late_ms(timer, now))
    events_record_many([event])
    record_span("fire timer", timer_id=timer.id, run_id=timer.run_id, state=timer.state)
    return [event]


def _late_ms(timer: Timer, now: datetime) -> int:
    # Whole milliseconds, rounded down, in integer arithmetic (FIRE_DUE_SQL computes the same).
    return max(0, (now - timer.fire_at) // timedelta(milliseconds=1))


@transaction.atomic
def timer_fire(*, timer_id: uuid.UUID) -> Timer | None:
    """Fire one timer if it is armed and due; return it (None if unknown). Idempotent."""
    timer = Timer.objects.select_for_update().filter(id=timer_id).first()
    if timer is None:
        return None
    now = timezone.now()
    if timer.state == TimerState.ARMED and timer.fire_at <= now:
        _fire(timer, now)
    return timer


# A batch of due timers in one statement (PostgreSQL): pick the armed ones due by ``now``,
# oldest first, skipping rows another sweeper holds; fire them (or cancel those due at or
# after their run's deadline, as ``_fire`` does) and write their events, as the careful path
# below does. ``fireAt`` is Python's ``isoformat()`` of a UTC time (no fraction when it is
# zero). The states are literals (``sql.literal``) so that even a generic plan uses the partial index
# ``timer_armed_due``.
_ARMED, _FIRED = sql.literal(TimerState.ARMED), sql.literal(TimerState.FIRED)
_FIRE_AT_ISO_SQL = (
    "to_char(fire_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS') "
    "|| CASE WHEN to_char(fire_at AT TIME ZONE 'UTC', 'US') = '000000' THEN '' "
    "ELSE to_char(fire_at AT TIME ZONE 'UTC', '.US') END || '+00:00'"
)
FIRE_DUE_SQL = f"""
WITH due AS (
    SELECT id FROM coordination_timer
    WHERE state = {_ARMED} AND fire_at <= %(now)s
    ORDER BY fire_at, id
    LIMIT %(batch_size)s
    FOR UPDATE SKIP LOCKED
), done AS (
    UPDATE coordination_timer t
    SET state = CASE WHEN t.fire_at >= t.run_deadline THEN {sql.literal(TimerState.CANCELLED)} ELSE {_FIRED} END,
        fired_at = CASE WHEN t.fire_at >= t.run_deadline THEN t.fired_at ELSE %(fire_time)s END
    FROM due
    WHERE t.id = due.id AND t.state = {_ARMED}
    RETURNING t.id, t.project_id, t.run_id, t.run_path, t.state, t.fire_at
)
{
    event_insert_sql(
        "done",
        type_sql=f"CASE WHEN state = {_FIRED} THEN 'timer.fired' ELSE 'timer.cancelled' END",
        data_sql=f"CASE WHEN state = {_FIRED} THEN jsonb_build_object('fireAt', "
        + _FIRE_AT_ISO_SQL
        + ", 'lateMs', greatest(0, floor(extract(epoch FROM %(fire_time)s - fire_at) * 1000))::bigint) "
        "ELSE jsonb_build_object('cause', 'run_deadline') END",
        created_at_sql="%(fire_time)s",
    )
}
"""


@transaction.atomic
def timers_fire_due(*, now: datetime | None = None, batch_size: int = 1000) -> int:
    """Fire armed timers that are due, one batch, skipping rows another sweeper holds.

    On PostgreSQL the batch is one statement (``FIRE_DUE_SQL``). Elsewhere it is written in
    bulk: one UPDATE for the timers that fire, one for those due at or after their run's
    deadline (cancelled instead, as ``_fire`` does) and one insert of all their events, so a
    burst of due timers costs a few statements per batch, not per timer. A batch that ended
    any timer is a span (``fire timers``, with the count); an empty sweep is none.
    """
    started_ns = time.time_ns()
    ended = _timers_fire_due(now=now, batch_size=batch_size)
    if ended:
        record_span("fire timers", started_ns=started_ns, timers=ended)
    return ended


def _timers_fire_due(*, now: datetime | None, batch_size: int) -> int:
    now = now or timezone.now()
    if sql.fast_paths_enabled():
        with connection.cursor() as cursor:
            cursor.execute(FIRE_DUE_SQL, {"now": now, "batch_size": batch_size, "fire_time": timezone.now()})
            return cursor.rowcount
    # Timers are last in the lock order and this path locks nothing else; skip_locked lets
    # concurrent sweepers and wake-ups split a burst instead of queueing behind each other.
    due = list(
        Timer.objects.filter(state=TimerState.ARMED, fire_at__lte=now)
        .order_by("fire_at", "id")
        .select_for_update(skip_locked=True)[:batch_size]
    )
    if not due:
        return 0
    fire_time = timezone.now()
    fired, cancelled, events = [], [], []
    for timer in due:
        if timer.run_deadline is not None and timer.fire_at >= timer.run_deadline:
            cancelled.append(timer.id)
            events.append(event_for(timer, "timer.cancelled", cause="run_deadline"))
        else:
            fired.append(timer.id)
            late_ms = _late_ms(timer, fire_time)
            events.append(event_for(timer, "timer.fired", fireAt=timer.fire_at.isoformat(), lateMs=late_ms))
    # We hold every row's lock since the SELECT above, so each is still ARMED; the guard and
    # the count check make a broken lock roll the whole batch back instead of firing twice.
    changed = 0
    if fired:
        changed += Timer.objects.filter(id__in=fired, state=TimerState.ARMED).update(
            state=TimerState.FIRED, fired_at=fire_time
        )
    if cancelled:
        changed += Timer.objects.filter(id__in=cancelled, state=TimerState.ARMED).update(state=TimerState.CANCELLED)
    if changed != len(due):
        raise RuntimeError(f"{len(due) - changed} locked due timers were no longer armed")
    events_record_many(events)
    return len(due)


def timer_next_due(*, until: datetime) -> datetime | None:
    """Return when the next armed timer due by ``until`` is due (maybe already), or None."""
    return (
        Timer.objects.filter(state=TimerState.ARMED, fire_at__lte=until)
        .order_by("fire_at")
        .values_list("fire_at", flat=True)
        .first()
    )


@transaction.atomic
def timer_acknowledge(*, project_id: uuid.UUID, timer_id: uuid.UUID) -> Timer:
    """Acknowledge a fired timer (idempotent) and return it; fire it first if it is due.

    An armed timer not yet due is returned unchanged; a cancelled one is ``INVALID_STATE``.
    """
    timer = Timer.objects.select_for_update().filter(id=timer_id, project_id=project_id).first()
    if timer is None:
        raise exceptions.NotFound("Timer not found.", timerId=str(timer_id))
    now = timezone.now()
    if timer.state == TimerState.ARMED and timer.fire_at <= now:
        _fire(timer, now)
    if timer.state == TimerState.CANCELLED:
        raise exceptions.InvalidState("The timer was cancelled.", timerId=str(timer.id), state=timer.state)
    if timer.state == TimerState.FIRED:
        timer.state = TimerState.ACKNOWLEDGED
        timer.acknowledged_at = now
        timer.save(update_fields=["state", "acknowledged_at"])
        events_record_many([event_for(timer, "timer.acknowledged")])
    return timer


@transaction.atomic
def timer_cancel(*, project_id: uuid.UUID, timer_id: uuid.UUID) -> Timer:
    """Disarm an armed timer; ``TIMER_FIRED`` once it fired; a cancelled one is unchanged."""
    timer = Timer.objects.select_for_update().filter(id=timer_id, project_id=project_id).first()
    if timer is None:
        raise exceptions.NotFound("Timer not found.", timerId=str(timer_id))
    if timer.state in (TimerState.FIRED, TimerState.ACKNOWLEDGED):
        raise exceptions.TimerFired(timerId=str(timer.id), firedAt=timer.fired_at.isoformat())
    if timer.state == TimerState.ARMED:
        timer.state = TimerState.CANCELLED
        timer.save(update_fields=["state"])
        events_record_many([event_for(timer, "timer.cancelled", cause="cancel_requested")])
    return timer


@cascade_step
def timers_cancel_subtree(end: SubtreeEnd) -> None:
    """Cancel the subtree's armed timers."""
    if connection.vendor == "postgresql":  # one statement, see subtree_rows_end
        subtree_rows_end(
            end, Timer, states=[TimerState.ARMED], final_state=TimerState.CANCELLED, event_type="timer.cancelled"
        )
        return
    timers = list(
        Timer.objects.filter(run_path__startswith=end.path_prefix, state=TimerState.ARMED)
        .order_by("id")
        .select_for_update()
    )
    if not timers:
        return
    Timer.objects.filter(id__in=[t.id for t in timers]).update(state=TimerState.CANCELLED)
    events_record_many([event_for(t, "timer.cancelled", cause=end.cause, reason=end.reason) for t in timers])
