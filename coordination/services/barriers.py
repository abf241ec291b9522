"""Barriers: create, arrive, next epoch. The only writer of ``Barrier.state``.

Lock order: the run chain, then the barrier row (house rule).
"""

import uuid
from dataclasses import dataclass

from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from coordination.domain import exceptions
from coordination.domain.states import BarrierState
from coordination.models import Barrier, BarrierArrival, Event, Run
from coordination.plumbing.tracing import record_span
from coordination.services.cascade import SubtreeEnd, cascade_step, subtree_rows_end
from coordination.services.events import event_for, events_record_many
from coordination.services.locking import chain_refusal, run_chain_lock, run_chain_lock_active

MAX_TARGET = 100_000
MAX_KEY_LENGTH = 200


def _event(barrier: Barrier, type: str, **data) -> Event:
    return event_for(barrier, type, epoch=barrier.epoch, **data)


@transaction.atomic
def barrier_create(*, project_id: uuid.UUID, run_id: uuid.UUID, target: int, name: str = "") -> Barrier:
    """Create a barrier under an active run: it releases when ``target`` distinct keys arrive."""
    if not 1 <= target <= MAX_TARGET:
        raise exceptions.ValidationFailed("Invalid target.", target=f"between 1 and {MAX_TARGET}")
    chain = run_chain_lock_active(run_id, project_id=project_id)
    run = chain[-1]
    barrier = Barrier.objects.create(project_id=project_id, run=run, run_path=run.path, name=name, target=target)
    events_record_many([_event(barrier, "barrier.created", target=target)])
    return barrier


@dataclass(frozen=True)
class LockedBarrier:
    """A barrier row locked after its run chain."""

    barrier: Barrier
    chain: list[Run]


def _lock(project_id: uuid.UUID, barrier_id: uuid.UUID) -> LockedBarrier:
    run_id = Barrier.objects.filter(id=barrier_id, project_id=project_id).values_list("run_id", flat=True).first()
    if run_id is None:
        raise exceptions.NotFound("Barrier not found.", barrierId=str(barrier_id))
    chain = run_chain_lock(run_id, project_id=project_id)
    # Arrivals serialize on the barrier row: the one that reaches the target releases it.
    barrier = Barrier.objects.select_for_update().get(id=barrier_id)
    return LockedBarrier(barrier, chain)


@transaction.atomic
def barrier_arrive(*, project_id: uuid.UUID, barrier_id: uuid.UUID, key: str) -> Barrier:
    """Record ``key``'s arrival in the current epoch; the arrival that reaches the target releases.

    The same key again answers the barrier unchanged. A new key after release is
    ``BARRIER_RELEASED``; any arrival on a cancelled barrier is ``BARRIER_CANCELLED``.
    """
    if not key or len(key) > MAX_KEY_LENGTH:
        raise exceptions.ValidationFailed("Invalid key.", key=f"1 to {MAX_KEY_LENGTH} characters")
    locked = _lock(project_id, barrier_id)
    barrier = locked.barrier
    if barrier.state == BarrierState.CANCELLED:
        raise exceptions.BarrierCancelled(barrierId=str(barrier.id))
    if BarrierArrival.objects.filter(barrier=barrier, epoch=barrier.epoch, key=key).exists():
        return barrier
    if barrier.state == BarrierState.RELEASED:
        raise exceptions.BarrierReleased(barrierId=str(barrier.id), epoch=barrier.epoch)
    refusal = chain_refusal(locked.chain)
    if refusal is not None:
        raise refusal
    now = timezone.now()
    try:
        with transaction.atomic():
            BarrierArrival.objects.create(barrier=barrier, epoch=barrier.epoch, key=key, arrived_at=now)
    except IntegrityError:  # pragma: no cover - the row lock above serializes arrivals
        return barrier
    barrier.arrivals += 1
    events = [_event(barrier, "barrier.arrived", key=key, arrivals=barrier.arrivals)]
    if barrier.arrivals >= barrier.target:
        barrier.state = BarrierState.RELEASED
        barrier.released_at = now
        events.append(_event(barrier, "barrier.released", arrivals=barrier.arrivals))
        record_span(
            "release barrier",
            barrier_id=barrier.id,
            run_id=barrier.run_id,
            epoch=barrier.epoch,
            arrivals=barrier.arrivals,
            key=key,
        )
    barrier.save(update_fields=["arrivals", "state", "released_at"])
    events_record_many(events)
    return barrier


@transaction.atomic
def barrier_next_epoch(*, project_id: uuid.UUID, barrier_id: uuid.UUID) -> Barrier:
    """Re-arm a released barrier for epoch + 1 with no arrivals; epochs are never reused."""
    locked = _lock(project_id, barrier_id)
    barrier = locked.barrier
    if barrier.state == BarrierState.CANCELLED:
        raise exceptions.BarrierCancelled(barrierId=str(barrier.id))
    if barrier.state != BarrierState.RELEASED:
        raise exceptions.BarrierNotReleased(barrierId=str(barrier.id), state=barrier.state)
    refusal = chain_refusal(locked.chain)
    if refusal is not None:
        raise refusal
    barrier.epoch += 1
    barrier.arrivals = 0
    barrier.state = BarrierState.WAITING
    barrier.released_at = None
    barrier.save(update_fields=["epoch", "arrivals", "state", "released_at"])
    events_record_many([_event(barrier, "barrier.next_epoch")])
    return barrier


@cascade_step
def barriers_cancel_subtree(end: SubtreeEnd) -> None:
    """Cancel the subtree's waiting barriers (released ones keep their state)."""
    if connection.vendor == "postgresql":  # one statement, see subtree_rows_end
        subtree_rows_end(
            end,
            Barrier,
            states=[BarrierState.WAITING],
            final_state=BarrierState.CANCELLED,
            event_type="barrier.cancelled",
            data_sql="jsonb_build_object('epoch', epoch, 'cause', %(cause)s::text, 'reason', %(reason)s::text)",
            returning="epoch",
        )
        return
    barriers = list(
        Barrier.objects.filter(run_path__startswith=end.path_prefix, state=BarrierState.WAITING)
        .order_by("id")
        .select_for_update()
    )
    if not barriers:
        return
    Barrier.objects.filter(id__in=[b.id for b in barriers]).update(state=BarrierState.CANCELLED)
    events_record_many([_event(b, "barrier.cancelled", cause=end.cause, reason=end.reason) for b in barriers])
