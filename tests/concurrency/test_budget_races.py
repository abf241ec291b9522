"""Budgets under races: never overspent on any budget of the chain, all or nothing, settled once."""

import random
import time
from datetime import timedelta

import pytest
from django.utils import timezone

from coordination.domain import exceptions
from coordination.domain.states import ReservationState
from coordination.models import Budget, BudgetReservation, Event
from coordination.services.budgets import (
    budget_create,
    reservation_commit,
    reservation_create,
    reservation_release,
    reservations_expire_due,
)
from coordination.services.keys import project_ensure
from coordination.services.runs import run_cancel, run_create
from tests.concurrency.util import race_a_cancel, run_in_threads

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres_only]


def outstanding(budget: Budget) -> int:
    return sum(r.amount for r in BudgetReservation.objects.filter(budgets=budget, state=ReservationState.RESERVED))


def spent(budget: Budget) -> int:
    return sum(r.committed for r in BudgetReservation.objects.filter(budgets=budget, state=ReservationState.COMMITTED))


def test_reservations_on_a_child_and_its_parent_never_overspend_either_20_rounds():
    project = project_ensure(name="budgets")
    for round_ in range(20):
        root = run_create(project_id=project.id)
        child = run_create(project_id=project.id, parent_id=root.id)
        parent_budget = budget_create(project_id=project.id, run_id=root.id, name="usd", limit=100)
        child_budget = budget_create(project_id=project.id, run_id=child.id, name="usd", limit=60)
        rng = random.Random(round_)
        plans = [[(rng.choice([root, child]), rng.randint(1, 15), rng.random()) for _ in range(6)] for _ in range(16)]

        def worker(plan):
            granted = []
            for run, amount, settle in plan:
                try:
                    outcome = reservation_create(project_id=project.id, run_id=run.id, budget="usd", amount=amount)
                except exceptions.Conflict:  # pragma: no cover - no run is cancelled here
                    raise
                if outcome.reservation is None:
                    continue
                granted.append((run.id, amount))
                reservation_id = outcome.reservation.id
                if settle < 0.3:
                    reservation_commit(project_id=project.id, reservation_id=reservation_id, amount=amount // 2)
                elif settle < 0.5:
                    reservation_release(project_id=project.id, reservation_id=reservation_id)
            return granted

        run_in_threads([lambda p=plan: worker(p) for plan in plans])
        for budget in (parent_budget, child_budget):
            budget.refresh_from_db()
            assert budget.spent + budget.reserved <= budget.limit
            # What the budget holds is exactly what its reservations hold: no partial leftover.
            assert (budget.reserved, budget.spent) == (outstanding(budget), spent(budget))
        child_reservations = BudgetReservation.objects.filter(run=child)
        # Every reservation under the child holds both budgets; those of the root only the parent's.
        assert all(set(r.budgets.all()) == {parent_budget, child_budget} for r in child_reservations)
        assert all(set(r.budgets.all()) == {parent_budget} for r in BudgetReservation.objects.filter(run=root))
        refused = Event.objects.filter(type="budget.exhausted", run_id=child.id).count()
        granted = Event.objects.filter(type="budget.reserved", run_path__startswith=root.path).count()
        assert granted == BudgetReservation.objects.filter(run_path__startswith=root.path).count()
        assert refused + granted > 0


def test_the_last_room_goes_to_exactly_as_many_as_fit_30_rounds():
    project = project_ensure(name="budgets")
    for _ in range(30):
        root = run_create(project_id=project.id)
        child = run_create(project_id=project.id, parent_id=root.id)
        parent_budget = budget_create(project_id=project.id, run_id=root.id, name="usd", limit=10)
        child_budget = budget_create(project_id=project.id, run_id=child.id, name="usd", limit=1000)

        def reserve(child=child):
            outcome = reservation_create(project_id=project.id, run_id=child.id, budget="usd", amount=3)
            return outcome.reservation is not None

        assert sum(run_in_threads([reserve] * 16)) == 3
        parent_budget.refresh_from_db()
        child_budget.refresh_from_db()
        # The child's budget had room for all 16: the 13 refused left nothing on it either.
        assert (parent_budget.reserved, child_budget.reserved) == (9, 9)


def test_one_key_reserves_once_under_16_threads_20_rounds():
    project = project_ensure(name="budgets")
    root = run_create(project_id=project.id)
    budget = budget_create(project_id=project.id, run_id=root.id, name="usd", limit=1_000_000)
    for round_ in range(20):

        def reserve(round_=round_):
            outcome = reservation_create(
                project_id=project.id, run_id=root.id, budget="usd", amount=7, key=f"call-{round_}"
            )
            return outcome.reservation.id, outcome.created

        results = run_in_threads([reserve] * 16)
        assert len({reservation_id for reservation_id, _ in results}) == 1
        assert sum(created for _, created in results) == 1
    budget.refresh_from_db()
    assert budget.reserved == 7 * 20


def test_commit_release_and_expiry_racing_settle_once_20_rounds():
    project = project_ensure(name="budgets")
    root = run_create(project_id=project.id)
    budget = budget_create(project_id=project.id, run_id=root.id, name="usd", limit=1_000_000)
    for _ in range(20):
        reservation = reservation_create(
            project_id=project.id, run_id=root.id, budget="usd", amount=10, ttl_ms=1
        ).reservation
        time.sleep(0.002)

        def commit(reservation=reservation):
            try:
                reservation_commit(project_id=project.id, reservation_id=reservation.id, amount=4)
                return "committed"
            except exceptions.InvalidState:
                return "refused"

        def release(reservation=reservation):
            return reservation_release(project_id=project.id, reservation_id=reservation.id).state

        def sweep():
            return reservations_expire_due(now=timezone.now() + timedelta(seconds=1))

        run_in_threads([commit, release, sweep, sweep])
        reservation.refresh_from_db()
        assert reservation.state in (ReservationState.RELEASED, ReservationState.EXPIRED)
        settled = Event.objects.filter(subject_id=str(reservation.id)).exclude(type="budget.reserved").count()
        assert settled == 1
    budget.refresh_from_db()
    assert (budget.reserved, budget.spent) == (0, 0)


def test_reservations_racing_a_cancel_grant_nothing_once_the_cancel_committed_20_rounds():
    project = project_ensure(name="budgets")
    for _ in range(20):
        root = run_create(project_id=project.id)
        child = run_create(project_id=project.id, parent_id=root.id)
        budget_create(project_id=project.id, run_id=root.id, name="usd", limit=1_000_000)
        race_a_cancel(
            lambda root=root: run_cancel(project_id=project.id, run_id=root.id),
            lambda child=child: reservation_create(project_id=project.id, run_id=child.id, budget="usd", amount=1),
        )


def test_the_beat_lease_sweep_expires_reservations_past_their_ttl():
    from workers.tasks import sweep_leases

    project = project_ensure(name="budgets")
    root = run_create(project_id=project.id)
    budget = budget_create(project_id=project.id, run_id=root.id, name="usd", limit=100)
    kept = reservation_create(project_id=project.id, run_id=root.id, budget="usd", amount=5).reservation
    due = reservation_create(project_id=project.id, run_id=root.id, budget="usd", amount=30, ttl_ms=1).reservation
    BudgetReservation.objects.filter(id=due.id).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert sweep_leases() >= 1
    due.refresh_from_db()
    kept.refresh_from_db()
    budget.refresh_from_db()
    assert (due.state, kept.state, budget.reserved) == (ReservationState.EXPIRED, ReservationState.RESERVED, 5)
