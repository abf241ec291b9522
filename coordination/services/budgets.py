"""Budgets: amounts that cap everything under a run, reserved then committed.

The only writer of ``Budget`` and ``BudgetReservation``.

A reservation holds its amount on **every** budget of its name on the run's chain, so a
child's spending counts against its parent's budget too. Lock order (house rule): the run
chain, then the budgets root first, then the reservation row. ``spent + reserved <= limit``
is checked under those locks and enforced again by a CHECK constraint.
"""

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from coordination.domain import exceptions
from coordination.domain.states import ReservationState
from coordination.models import Budget, BudgetReservation, Event
from coordination.services.events import event_row, events_record_many
from coordination.services.locking import chain_refusal, run_chain_lock, run_chain_lock_active

MAX_NAME_LENGTH = 200
MAX_KEY_LENGTH = 200
MAX_AMOUNT = 2**62  # any bigint sum of two stays in range
DEFAULT_TTL_MS = 600_000
MAX_TTL_MS = 7 * 24 * 3600 * 1000


def _event(reservation: BudgetReservation, type: str, **data) -> Event:
    return event_row(
        project_id=reservation.project_id,
        type=type,
        run_id=reservation.run_id,
        run_path=reservation.run_path,
        subject_id=reservation.id,
        data={"budget": reservation.budget_name, **data},
    )


def _check_name(name: str) -> None:
    if not name or len(name) > MAX_NAME_LENGTH:
        raise exceptions.ValidationFailed("Invalid budget name.", name=f"1 to {MAX_NAME_LENGTH} characters")


@transaction.atomic
def budget_create(*, project_id: uuid.UUID, run_id: uuid.UUID, name: str, limit: int) -> Budget:
    """Create the budget ``name`` under an active run; a second one of that name there is ``KEY_CONFLICT``."""
    _check_name(name)
    if not 0 <= limit <= MAX_AMOUNT:
        raise exceptions.ValidationFailed("Invalid limit.", limit=f"between 0 and {MAX_AMOUNT}")
    # Lock the chain and refuse an inactive run: a cancel committing after this waits for us.
    run = run_chain_lock_active(run_id, project_id=project_id)[-1]
    try:
        with transaction.atomic():
            return Budget.objects.create(project_id=project_id, run=run, run_path=run.path, name=name, limit=limit)
    except IntegrityError:
        # The unique (run, name) index: a concurrent create committed first, or one exists.
        raise exceptions.KeyConflict("The run already has a budget of this name.", name=name) from None


@transaction.atomic
def budget_set_limit(*, project_id: uuid.UUID, budget_id: uuid.UUID, limit: int) -> Budget:
    """Change a budget's limit; it may not go below what is spent and reserved (``VALIDATION_ERROR``)."""
    run_id = Budget.objects.filter(id=budget_id, project_id=project_id).values_list("run_id", flat=True).first()
    if run_id is None:
        raise exceptions.NotFound("Budget not found.", budgetId=str(budget_id))
    run_chain_lock(run_id, project_id=project_id)
    # Lock the budget: reservations and commits change spent/reserved under the same lock.
    budget = Budget.objects.select_for_update().get(id=budget_id)
    if not budget.spent + budget.reserved <= limit <= MAX_AMOUNT:
        raise exceptions.ValidationFailed(
            "The limit is below what is spent and reserved.", limit=f"at least {budget.spent + budget.reserved}"
        )
    budget.limit = limit
    budget.save(update_fields=["limit"])
    return budget


@dataclass(frozen=True)
class ReserveOutcome:
    """A reservation (``created`` False for an idempotent replay), or the tightest budget that refused."""

    reservation: BudgetReservation | None = None
    created: bool = False
    tightest: Budget | None = None


def _lock_budgets(ids) -> list[Budget]:
    # An ancestor's path is a prefix of its descendants', so path order is root first (house order).
    return list(Budget.objects.select_for_update().filter(id__in=list(ids)).order_by("run_path", "id"))


@transaction.atomic
def reservation_create(
    *,
    project_id: uuid.UUID,
    run_id: uuid.UUID,
    budget: str,
    amount: int,
    ttl_ms: int = DEFAULT_TTL_MS,
    key: str | None = None,
) -> ReserveOutcome:
    """Reserve ``amount`` on every budget named ``budget`` on the run's chain, all or nothing.

    A refusal (some budget lacks room) writes ``budget.exhausted`` and returns the budget with
    the least room; the caller answers ``BUDGET_EXHAUSTED`` after this transaction commits.
    """
    _check_name(budget)
    if not 1 <= amount <= MAX_AMOUNT:
        raise exceptions.ValidationFailed("Invalid amount.", amount=f"between 1 and {MAX_AMOUNT}")
    if not 1 <= ttl_ms <= MAX_TTL_MS:
        raise exceptions.ValidationFailed("Invalid ttl.", ttlMs=f"between 1 and {MAX_TTL_MS}")
    if key is not None and not 1 <= len(key) <= MAX_KEY_LENGTH:
        raise exceptions.ValidationFailed("Invalid key.", key=f"1 to {MAX_KEY_LENGTH} characters")
    # The run chain first (house order): a cancel committing after this waits for us, one
    # committed before is seen by chain_refusal, so nothing is reserved after a cancel commits.
    chain = run_chain_lock(run_id, project_id=project_id)
    run = chain[-1]
    # Lock every budget of the name on the chain, root first: concurrent reservations,
    # commits and releases on any of them serialize here, so the room seen is the room there
    # is, and two reservations with one key are looked up one after the other.
    ids = Budget.objects.filter(run_id__in=[r.id for r in chain], name=budget).values_list("id", flat=True)
    budgets = _lock_budgets(ids)
    if not budgets:
        raise exceptions.NotFound("No budget of this name on the run's chain.", budget=budget)
    if key is not None:
        # A replay returns the reservation it made, whatever became of it or of the run.
        existing = BudgetReservation.objects.filter(run=run, budget_name=budget, key=key).first()
        if existing is not None:
            if existing.amount != amount:
                raise exceptions.KeyConflict(key=key, reservationId=str(existing.id))
            return ReserveOutcome(reservation=existing)
    refusal = chain_refusal(chain)
    if refusal is not None:
        raise refusal
    tightest = min(budgets, key=lambda b: (b.remaining, -len(b.run_path)))
    now = timezone.now()
    if tightest.remaining < amount:
        events_record_many(
            [
                event_row(
                    project_id=project_id,
                    type="budget.exhausted",
                    run_id=run.id,
                    run_path=run.path,
                    # The event is visible to keys bound at this run, which must not learn
                    # about budgets above it: an ancestor's budget is not named.
                    subject_id=tightest.id if tightest.run_id == run.id else "",
                    data={"budget": budget, "amount": amount, "remaining": tightest.remaining},
                )
            ]
        )
        return ReserveOutcome(tightest=tightest)
    Budget.objects.filter(id__in=[b.id for b in budgets]).update(reserved=F("reserved") + amount)
    try:
        with transaction.atomic():
            reservation = BudgetReservation.objects.create(
                project_id=project_id,
                run=run,
                run_path=run.path,
                budget_name=budget,
                amount=amount,
                key=key,
                expires_at=now + timedelta(milliseconds=ttl_ms),
                created_at=now,
            )
    except IntegrityError:  # pragma: no cover - the budget locks above serialize same-key reservations
        raise exceptions.KeyConflict(key=key) from None
    reservation.budgets.set(budgets)
    events_record_many([_event(reservation, "budget.reserved", amount=amount)])
    return ReserveOutcome(reservation=reservation, created=True)


def _lock_reservation(project_id: uuid.UUID, reservation_id: uuid.UUID) -> tuple[BudgetReservation, list[Budget]]:
    budget_ids = list(
        BudgetReservation.budgets.through.objects.filter(
            budgetreservation_id=reservation_id, budgetreservation__project_id=project_id
        ).values_list("budget_id", flat=True)
    )
    if not budget_ids and not BudgetReservation.objects.filter(id=reservation_id, project_id=project_id).exists():
        raise exceptions.NotFound("Reservation not found.", reservationId=str(reservation_id))
    # Budgets before the reservation row (house order). Settling needs no run lock: it is
    # allowed under an inactive run, and a cancel touches neither budgets nor reservations.
    budgets = _lock_budgets(budget_ids)
    # Lock the reservation: a commit, a release and the expiry sweep settle it exactly once.
    reservation = BudgetReservation.objects.select_for_update().get(id=reservation_id)
    return reservation, budgets


def _settle(
    reservation: BudgetReservation, budgets: list[Budget], state: ReservationState, spent: int, now: datetime
) -> None:
    Budget.objects.filter(id__in=[b.id for b in budgets]).update(
        spent=F("spent") + spent, reserved=F("reserved") - reservation.amount
    )
    reservation.state = state
    reservation.committed = spent if state == ReservationState.COMMITTED else None
    reservation.settled_at = now
    reservation.save(update_fields=["state", "committed", "settled_at"])


@transaction.atomic
def reservation_commit(*, project_id: uuid.UUID, reservation_id: uuid.UUID, amount: int) -> BudgetReservation:
    """Record ``amount`` (at most the reservation) as spent and hand the rest back; allowed under an inactive run."""
    reservation, budgets = _lock_reservation(project_id, reservation_id)
    if not 0 <= amount <= reservation.amount:
        raise exceptions.ValidationFailed(
            "The amount exceeds the reservation.", amount=f"between 0 and {reservation.amount}"
        )
    now = timezone.now()
    if reservation.state != ReservationState.RESERVED or reservation.expires_at <= now:
        # A reservation past its ttl is expired even before the sweep hands it back.
        state = reservation.state if reservation.state != ReservationState.RESERVED else ReservationState.EXPIRED
        raise exceptions.InvalidState(
            "The reservation is already settled.", reservationId=str(reservation.id), state=state
        )
    _settle(reservation, budgets, ReservationState.COMMITTED, amount, now)
    events_record_many([_event(reservation, "budget.committed", amount=amount, returned=reservation.amount - amount)])
    return reservation


@transaction.atomic
def reservation_release(*, project_id: uuid.UUID, reservation_id: uuid.UUID) -> BudgetReservation:
    """Hand the whole reservation back; a settled one is answered unchanged (idempotent)."""
    reservation, budgets = _lock_reservation(project_id, reservation_id)
    if reservation.state != ReservationState.RESERVED:
        return reservation
    _settle(reservation, budgets, ReservationState.RELEASED, 0, timezone.now())
    events_record_many([_event(reservation, "budget.released", amount=reservation.amount)])
    return reservation


def reservations_expire_due(*, now: datetime | None = None, batch_size: int = 200) -> int:
    """Expire unsettled reservations past their ttl, handing their amounts back; return how many.

    One reservation per transaction (each locks its budgets first, in house order), the
    candidates skipped while another sweeper or a commit holds them.
    """
    now = now or timezone.now()
    due = list(
        BudgetReservation.objects.filter(state=ReservationState.RESERVED, expires_at__lte=now)
        .order_by("expires_at", "id")
        .values_list("id", "project_id")[:batch_size]
    )
    return sum(_expire_one(project_id, reservation_id, now) for reservation_id, project_id in due)


@transaction.atomic
def _expire_one(project_id: uuid.UUID, reservation_id: uuid.UUID, now: datetime) -> int:
    reservation, budgets = _lock_reservation(project_id, reservation_id)
    if reservation.state != ReservationState.RESERVED or reservation.expires_at > now:
        return 0  # a commit or release (or another sweeper) settled it first
    _settle(reservation, budgets, ReservationState.EXPIRED, 0, now)
    events_record_many([_event(reservation, "budget.expired", amount=reservation.amount)])
    return 1
