"""Quotas and budgets: bucket levels, budget use, reservations; limits changed through the services.

A quota's limit and period, and a budget's limit, are edited on their change page; the save
calls ``quota_put`` / ``budget_set_limit`` (which keep the level, and refuse a budget limit
below what is spent and reserved) instead of writing the row. Reservations are read-only
here, with a release action that calls ``reservation_release``.
"""

from django.contrib import admin, messages
from django.utils.html import format_html, format_html_join

from coordination.domain.exceptions import CoordinationError
from coordination.domain.states import ReservationState
from coordination.models import Budget, BudgetReservation, Quota
from coordination.services.budgets import budget_set_limit, reservation_release
from coordination.services.quotas import available, quota_put

from .base import ProjectScopedAdmin, change_link, change_url, count_of

# A budget's change page lists this many of its latest reservations.
RESERVATIONS_SHOWN = 100


def bar(used: int, limit: int, width_px: int = 120) -> str:
    """Return a small HTML bar of ``used`` out of ``limit``."""
    filled = 0 if limit <= 0 else min(width_px, round(width_px * used / limit))
    return format_html(
        '<span class="limit-bar" style="display:inline-block;width:{}px;height:8px;background:#ddd;">'
        '<span style="display:block;width:{}px;height:8px;background:#417690;"></span></span>',
        width_px,
        filled,
    )


@admin.register(Quota)
class QuotaAdmin(ProjectScopedAdmin):
    """Quotas: level now; limit and period editable (through ``quota_put``)."""

    list_display = ("name", "project", "limit", "period_ms", "level", "updated_at")
    list_filter = ("project",)
    search_fields = ("name",)
    ordering = ("project", "name")
    fields = ("name", "project", "limit", "period_ms", "level", "created_at", "updated_at")
    readonly_fields = ("name", "project", "level", "created_at", "updated_at")

    def has_add_permission(self, request):  # noqa: D102
        return False  # PUT /v1/quotas/{name} creates them

    @admin.display(description="available now")
    def level(self, quota: Quota) -> str:
        tokens = available(quota)
        return format_html("{} {} / {}", bar(tokens, quota.limit), tokens, quota.limit)

    def save_model(self, request, obj, form, change):  # noqa: D102
        try:
            quota_put(project_id=obj.project_id, name=obj.name, limit=obj.limit, period_ms=obj.period_ms)
        except CoordinationError as error:
            self.message_user(request, f"Not changed: {error.message} {error.details}", messages.ERROR)


@admin.register(Budget)
class BudgetAdmin(ProjectScopedAdmin):
    """Budgets: spent, reserved and limit; the limit editable (through ``budget_set_limit``)."""

    list_display = ("name", "run_link", "limit", "spent", "reserved", "remaining_display", "use")
    list_filter = ("project",)
    list_select_related = ("run",)
    search_fields = ("name",)
    ordering = ("-created_at", "-id")
    show_full_result_count = False
    fields = ("id", "name", "project", "run_link", "limit", "spent", "reserved", "use", "reservations_table")
    readonly_fields = ("id", "name", "project", "run_link", "spent", "reserved", "use", "reservations_table")

    def has_add_permission(self, request):  # noqa: D102
        return False  # POST /v1/runs/{id}/budgets creates them

    def has_delete_permission(self, request, obj=None):  # noqa: D102
        return False  # reservations point at them

    @admin.display(description="run", ordering="run")
    def run_link(self, budget: Budget) -> str:
        return change_link(budget.run)

    @admin.display(description="remaining")
    def remaining_display(self, budget: Budget) -> int:
        return budget.remaining

    @admin.display(description="spent + reserved / limit")
    def use(self, budget: Budget) -> str:
        used = budget.spent + budget.reserved
        return format_html("{} {} / {}", bar(used, budget.limit), used, budget.limit)

    @admin.display(description="latest reservations")
    def reservations_table(self, budget: Budget) -> str:
        reservations = list(budget.reservations.order_by("-created_at", "-id")[:RESERVATIONS_SHOWN])
        if not reservations:
            return "none"
        rows = format_html_join(
            "",
            '<tr><td><a href="{}">{}</a></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>',
            (
                (change_url(r), r.id, r.state, r.amount, "" if r.committed is None else r.committed, r.expires_at)
                for r in reservations
            ),
        )
        return format_html(
            "<table><thead><tr><th>reservation</th><th>state</th><th>amount</th><th>committed</th>"
            "<th>expires at</th></tr></thead><tbody>{}</tbody></table>",
            rows,
        )

    def save_model(self, request, obj, form, change):  # noqa: D102
        try:
            budget_set_limit(project_id=obj.project_id, budget_id=obj.id, limit=obj.limit)
        except CoordinationError as error:
            self.message_user(request, f"Limit not changed: {error.message} {error.details}", messages.ERROR)


@admin.register(BudgetReservation)
class BudgetReservationAdmin(ProjectScopedAdmin):
    """Reservations: read-only; release through the service."""

    list_display = ("id", "budget_name", "run_link", "amount", "committed", "state", "expires_at", "created_at")
    list_filter = ("state", "project")
    list_select_related = ("run",)
    search_fields = ("budget_name", "key")
    ordering = ("-created_at", "-id")
    show_full_result_count = False
    actions = ("release_selected",)
    fields = (
        "id",
        "project",
        "run_link",
        "budget_name",
        "key",
        "amount",
        "committed",
        "state",
        "expires_at",
        "created_at",
        "settled_at",
    )
    readonly_fields = fields

    def has_add_permission(self, request):  # noqa: D102
        return False

    def has_change_permission(self, request, obj=None):  # noqa: D102
        return obj is None and super().has_change_permission(request)  # the action needs it

    def has_delete_permission(self, request, obj=None):  # noqa: D102
        return False

    @admin.display(description="run", ordering="run")
    def run_link(self, reservation: BudgetReservation) -> str:
        return change_link(reservation.run)

    @admin.action(description="Release the selected reservations (hand their amounts back)", permissions=["change"])
    def release_selected(self, request, queryset):
        released = 0
        for reservation in queryset.filter(state=ReservationState.RESERVED).select_related(None):
            reservation_release(project_id=reservation.project_id, reservation_id=reservation.id)
            released += 1
        self.message_user(request, f"Released {count_of(released, 'reservation')}.", messages.SUCCESS)
