"""``/v1/runs/{id}/budgets``, ``/v1/budgets`` and ``/v1/budget-reservations``."""

from drf_spectacular.utils import extend_schema
from rest_framework.response import Response

from coordination.api import limit_shapes as ls
from coordination.api.views.base import ApiView, with_errors
from coordination.domain import exceptions
from coordination.domain.states import Permission
from coordination.reads import selectors
from coordination.services import budgets as budget_services


class RunBudgetsView(ApiView):
    """Create a budget under a run."""

    required_permissions = {"POST": Permission.RESOURCE_CONFIG}

    @extend_schema(operation_id="budgets_create", request=ls.BudgetCreateIn, responses=with_errors({201: ls.BudgetOut}))
    def post(self, request, run_id):
        """Create the budget ``name`` capping everything under the run (``KEY_CONFLICT`` if it has one)."""
        data = self.body(ls.BudgetCreateIn)
        run = selectors.run_get(self.visibility, run_id)
        budget = budget_services.budget_create(
            project_id=self.project_id, run_id=run.id, name=data["name"], limit=data["limit"]
        )
        return Response(ls.present_budget(budget), status=201, headers={"Location": f"/v1/budgets/{budget.id}"})


class BudgetDetailView(ApiView):
    """A budget's view; its limit changed."""

    required_permissions = {"GET": Permission.COORDINATION_READ, "PATCH": Permission.RESOURCE_CONFIG}

    @extend_schema(operation_id="budgets_retrieve", responses=with_errors({200: ls.BudgetOut}))
    def get(self, request, budget_id):
        """Return the budget: limit, spent, reserved, remaining."""
        return Response(ls.present_budget(selectors.budget_get(self.visibility, budget_id)))

    @extend_schema(
        operation_id="budgets_set_limit", request=ls.BudgetLimitIn, responses=with_errors({200: ls.BudgetOut})
    )
    def patch(self, request, budget_id):
        """Change the budget's ``limit``: never below what is spent and reserved (``VALIDATION_ERROR``)."""
        data = self.body(ls.BudgetLimitIn)
        visible = selectors.budget_get(self.visibility, budget_id)
        budget = budget_services.budget_set_limit(project_id=self.project_id, budget_id=visible.id, limit=data["limit"])
        return Response(ls.present_budget(budget))


class ReservationCollectionView(ApiView):
    """Reserve against the budgets of a run's chain."""

    @extend_schema(
        operation_id="budget_reservations_create",
        request=ls.ReservationCreateIn,
        responses=with_errors({200: ls.ReservationOut, 201: ls.ReservationOut}),
    )
    def post(self, request):
        """Reserve ``amount`` on every budget named ``budget`` on the run's chain, all or nothing.

        ``409 BUDGET_EXHAUSTED`` names the budget with the least room (its ``budgetId`` and
        ``runId`` only when the caller's key may see that run). A replayed ``key`` answers 200.
        """
        data = self.body(ls.ReservationCreateIn)
        run = selectors.run_get(self.visibility, data["runId"])
        outcome = budget_services.reservation_create(
            project_id=self.project_id,
            run_id=run.id,
            budget=data["budget"],
            amount=data["amount"],
            ttl_ms=data["ttlMs"],
            key=data["key"],
        )
        if outcome.reservation is None:
            tightest = outcome.tightest
            details = {"remaining": tightest.remaining}
            if self.visibility.sees_path(tightest.run_path):
                details.update(budgetId=str(tightest.id), runId=str(tightest.run_id))
            raise exceptions.BudgetExhausted(**details)
        reservation = outcome.reservation
        headers = {"Location": f"/v1/budget-reservations/{reservation.id}"} if outcome.created else {}
        return Response(ls.present_reservation(reservation), status=201 if outcome.created else 200, headers=headers)


class ReservationDetailView(ApiView):
    """A reservation's view."""

    required_permissions = {"GET": Permission.COORDINATION_READ}

    @extend_schema(operation_id="budget_reservations_retrieve", responses=with_errors({200: ls.ReservationOut}))
    def get(self, request, reservation_id):
        """Return the reservation."""
        return Response(ls.present_reservation(selectors.reservation_get(self.visibility, reservation_id)))


class ReservationCommitView(ApiView):
    """Record what a reservation actually spent."""

    @extend_schema(
        operation_id="budget_reservations_commit",
        request=ls.ReservationCommitIn,
        responses=with_errors({200: ls.ReservationOut}),
    )
    def post(self, request, reservation_id):
        """Record ``amount`` (at most the reservation) as spent and return the rest; allowed under an inactive run."""
        data = self.body(ls.ReservationCommitIn)
        reservation = selectors.reservation_get(self.visibility, reservation_id)
        reservation = budget_services.reservation_commit(
            project_id=self.project_id, reservation_id=reservation.id, amount=data["amount"]
        )
        return Response(ls.present_reservation(reservation))


class ReservationReleaseView(ApiView):
    """Hand a reservation back."""

    @extend_schema(
        operation_id="budget_reservations_release", request=None, responses=with_errors({200: ls.ReservationOut})
    )
    def post(self, request, reservation_id):
        """Return the whole reservation (idempotent: a settled one is answered unchanged)."""
        reservation = selectors.reservation_get(self.visibility, reservation_id)
        reservation = budget_services.reservation_release(project_id=self.project_id, reservation_id=reservation.id)
        return Response(ls.present_reservation(reservation))
