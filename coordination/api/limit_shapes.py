"""Request validation, response shapes and presenters of quotas and budgets (see ``serializers.py``)."""

from rest_framework import serializers

from coordination.api.presenters import iso
from coordination.api.serializers import MAX_NAME_LENGTH, StrictCharField, StrictIntegerField, StrictSerializer
from coordination.domain.states import ReservationState
from coordination.models import Budget, BudgetReservation, Quota
from coordination.services import budgets as budget_services
from coordination.services import quotas as quota_services

# Quotas -----------------------------------------------------------------------------------


class QuotaPutIn(StrictSerializer):
    """Body of ``PUT /v1/quotas/{name}``."""

    limit = StrictIntegerField(min_value=1, max_value=quota_services.MAX_LIMIT)
    periodMs = StrictIntegerField(min_value=1, max_value=quota_services.MAX_PERIOD_MS)


class QuotaOut(serializers.Serializer):
    """A quota: ``available`` whole tokens now."""

    name = serializers.CharField()
    limit = serializers.IntegerField()
    periodMs = serializers.IntegerField()
    available = serializers.IntegerField()


class QuotaTakeIn(StrictSerializer):
    """Body of ``POST /v1/quotas/{name}/take``."""

    runId = StrictCharField(max_length=100)
    amount = StrictIntegerField(required=False, default=1, min_value=1, max_value=quota_services.MAX_LIMIT)
    waitMs = StrictIntegerField(required=False, default=0, min_value=0)


class QuotaTakeOut(serializers.Serializer):
    """A granted take: whole tokens left in the bucket."""

    granted = serializers.BooleanField()
    remaining = serializers.IntegerField()


def present_quota(quota: Quota) -> dict:
    """Return the API shape of a quota, its level computed now."""
    return {
        "name": quota.name,
        "limit": quota.limit,
        "periodMs": quota.period_ms,
        "available": quota_services.available(quota),
    }


# Budgets ----------------------------------------------------------------------------------


class BudgetCreateIn(StrictSerializer):
    """Body of ``POST /v1/runs/{id}/budgets``."""

    name = StrictCharField(max_length=MAX_NAME_LENGTH)
    limit = StrictIntegerField(min_value=0, max_value=budget_services.MAX_AMOUNT)


class BudgetLimitIn(StrictSerializer):
    """Body of ``PATCH /v1/budgets/{id}``."""

    limit = StrictIntegerField(min_value=0, max_value=budget_services.MAX_AMOUNT)


class BudgetOut(serializers.Serializer):
    """A budget: ``remaining = limit - spent - reserved``."""

    id = serializers.CharField()
    runId = serializers.CharField()
    name = serializers.CharField()
    limit = serializers.IntegerField()
    spent = serializers.IntegerField()
    reserved = serializers.IntegerField()
    remaining = serializers.IntegerField()
    createdAt = serializers.DateTimeField()


class ReservationCreateIn(StrictSerializer):
    """Body of ``POST /v1/budget-reservations``."""

    runId = StrictCharField(max_length=100)
    budget = StrictCharField(max_length=MAX_NAME_LENGTH)
    amount = StrictIntegerField(min_value=1, max_value=budget_services.MAX_AMOUNT)
    ttlMs = StrictIntegerField(
        required=False, default=budget_services.DEFAULT_TTL_MS, min_value=1, max_value=budget_services.MAX_TTL_MS
    )
    key = StrictCharField(required=False, allow_null=True, default=None, max_length=budget_services.MAX_KEY_LENGTH)


class ReservationCommitIn(StrictSerializer):
    """Body of ``POST /v1/budget-reservations/{id}/commit``."""

    amount = StrictIntegerField(min_value=0, max_value=budget_services.MAX_AMOUNT)


class ReservationOut(serializers.Serializer):
    """A reservation."""

    reservationId = serializers.CharField()
    runId = serializers.CharField()
    budget = serializers.CharField()
    amount = serializers.IntegerField()
    committed = serializers.IntegerField(allow_null=True)
    key = serializers.CharField(allow_null=True)
    state = serializers.ChoiceField(choices=ReservationState.choices)
    expiresAt = serializers.DateTimeField()
    createdAt = serializers.DateTimeField()
    settledAt = serializers.DateTimeField(allow_null=True)


def present_budget(budget: Budget) -> dict:
    """Return the API shape of a budget."""
    return {
        "id": str(budget.id),
        "runId": str(budget.run_id),
        "name": budget.name,
        "limit": budget.limit,
        "spent": budget.spent,
        "reserved": budget.reserved,
        "remaining": budget.remaining,
        "createdAt": iso(budget.created_at),
    }


def present_reservation(reservation: BudgetReservation) -> dict:
    """Return the API shape of a reservation."""
    return {
        "reservationId": str(reservation.id),
        "runId": str(reservation.run_id),
        "budget": reservation.budget_name,
        "amount": reservation.amount,
        "committed": reservation.committed,
        "key": reservation.key,
        "state": reservation.state,
        "expiresAt": iso(reservation.expires_at),
        "createdAt": iso(reservation.created_at),
        "settledAt": iso(reservation.settled_at),
    }
