"""Quotas (a rate: a token bucket) and budgets (an amount, reserved then committed)."""

from django.db import models
from django.db.models import F, Q
from django.utils import timezone

from coordination.domain.ids import uuid7
from coordination.domain.states import ReservationState

# A quota's level is kept in micro-tokens (integers), so the refill arithmetic is exact on
# both databases; see coordination/services/quotas.py.
MICRO = 1_000_000


class Quota(models.Model):
    """A token bucket of one project: at most ``limit`` tokens, refilled at ``limit`` per ``period_ms``.

    The level is stored as "``level_micro`` micro-tokens at ``level_at``": the current level is
    computed from it by whoever reads or takes (no background refill job).
    """

    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    # No index of its own: quota_project_name leads with it.
    project = models.ForeignKey("coordination.Project", on_delete=models.CASCADE, related_name="+", db_index=False)
    name = models.CharField(max_length=200)
    limit = models.BigIntegerField()
    period_ms = models.BigIntegerField()
    level_micro = models.BigIntegerField()
    level_at = models.DateTimeField()
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.UniqueConstraint(fields=["project", "name"], name="quota_project_name"),
            models.CheckConstraint(condition=Q(limit__gt=0, period_ms__gt=0), name="quota_limit_period_positive"),
            models.CheckConstraint(
                condition=Q(level_micro__gte=0, level_micro__lte=F("limit") * MICRO), name="quota_level_in_bucket"
            ),
        ]

    def __str__(self) -> str:
        return f"quota {self.name} ({self.limit} per {self.period_ms} ms)"


class Budget(models.Model):
    """An amount that caps everything under ``run``: ``spent + reserved <= limit`` always."""

    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    project = models.ForeignKey("coordination.Project", on_delete=models.CASCADE, related_name="+")
    # No index of its own: budget_run_name leads with it.
    run = models.ForeignKey("coordination.Run", on_delete=models.PROTECT, related_name="budgets", db_index=False)
    run_path = models.TextField(editable=False)
    name = models.CharField(max_length=200)
    limit = models.BigIntegerField()
    spent = models.BigIntegerField(default=0)
    reserved = models.BigIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["created_at", "id"]
        constraints = [
            models.UniqueConstraint(fields=["run", "name"], name="budget_run_name"),
            models.CheckConstraint(
                condition=Q(spent__gte=0, reserved__gte=0, limit__gte=F("spent") + F("reserved")),
                name="budget_within_limit",
            ),
        ]

    def __str__(self) -> str:
        return f"budget {self.name} {self.id} ({self.spent}+{self.reserved}/{self.limit})"

    @property
    def remaining(self) -> int:
        """Return what is left to reserve: ``limit - spent - reserved``."""
        return self.limit - self.spent - self.reserved


class BudgetReservation(models.Model):
    """An amount held on every budget of one name on a run's chain until committed, released or expired."""

    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    project = models.ForeignKey("coordination.Project", on_delete=models.CASCADE, related_name="+")
    run = models.ForeignKey("coordination.Run", on_delete=models.PROTECT, related_name="budget_reservations")
    run_path = models.TextField(editable=False)
    budget_name = models.CharField(max_length=200)
    # The budgets held, root first (those of the name on the chain when it was reserved).
    budgets = models.ManyToManyField(Budget, related_name="reservations")
    amount = models.BigIntegerField()
    committed = models.BigIntegerField(null=True, blank=True)
    key = models.CharField(max_length=200, null=True, blank=True)  # noqa: DJ001 - null means "no key"
    state = models.CharField(max_length=16, choices=ReservationState, default=ReservationState.RESERVED)
    expires_at = models.DateTimeField()
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    settled_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["created_at", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["run", "budget_name", "key"], condition=Q(key__isnull=False), name="reservation_key_once"
            ),
        ]
        indexes = [
            models.Index(fields=["expires_at"], condition=Q(state="RESERVED"), name="reservation_unsettled_due"),
        ]

    def __str__(self) -> str:
        return f"reservation {self.id} of {self.amount} {self.budget_name} ({self.state})"
