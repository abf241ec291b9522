"""Pools and their leases: each pool with its capacity, use and queue; capacity changed through ``pool_put``.

The capacity is the one editable field: saving it calls ``pool_put`` (a growth grants the
waiters that now fit, in the same transaction). ``in_use``, ``waiting`` and the leases' states are
written only by ``coordination.services.pools``; the release action calls its service.
"""

from django import forms
from django.contrib import admin, messages

from coordination.domain.exceptions import CoordinationError
from coordination.models import Pool, PoolLease
from coordination.services.mailboxes import NAME_PATTERN
from coordination.services.pools import MAX_CAPACITY, pool_lease_release, pool_put, pool_stats

from .base import ProjectScopedAdmin, ServiceBackedAdmin, change_link


class PoolForm(forms.ModelForm):
    """A pool's name (on add) and capacity."""

    class Meta:
        model = Pool
        fields = ("project", "name", "capacity")

    def clean_name(self) -> str:
        """Refuse here what ``pool_put`` would refuse (the API's name rule)."""
        name = self.cleaned_data["name"]
        if not NAME_PATTERN.fullmatch(name):
            raise forms.ValidationError("1-100 of A-Z a-z 0-9 . _ - (starting with a letter or digit).")
        return name

    def clean_capacity(self) -> int:
        """Refuse here what ``pool_put`` would refuse."""
        capacity = self.cleaned_data["capacity"]
        if not 1 <= capacity <= MAX_CAPACITY:
            raise forms.ValidationError(f"Between 1 and {MAX_CAPACITY}.")
        return capacity


@admin.register(Pool)
class PoolAdmin(ProjectScopedAdmin, ServiceBackedAdmin):
    """Pools: capacity, units in use and waiters; the capacity is changed through the service."""

    form = PoolForm
    list_display = ("name", "project", "capacity", "in_use_now", "waiting_now", "updated_at")
    list_filter = ("project",)
    search_fields = ("name",)
    ordering = ("project", "name")

    def get_readonly_fields(self, request, obj=None):  # noqa: D102
        shown = ("in_use_now", "waiting_now", "created_at", "updated_at")
        return ("project", "name", *shown) if obj is not None else ()

    def get_fields(self, request, obj=None):  # noqa: D102
        if obj is None:
            return ("project", "name", "capacity")
        return ("project", "name", "capacity", "in_use_now", "waiting_now", "created_at", "updated_at")

    def get_queryset(self, request):  # noqa: D102
        return super().get_queryset(request).select_related("project")

    def get_changelist_instance(self, request):  # noqa: D102
        changelist = super().get_changelist_instance(request)
        # One query for the page's use figures, not two per row.
        self._stats = pool_stats(list(changelist.result_list))
        return changelist

    def _stat(self, pool: Pool, index: int) -> int:
        stats = getattr(self, "_stats", {})
        if pool.id not in stats:
            stats = pool_stats([pool])
        return stats[pool.id][index]

    @admin.display(description="in use")
    def in_use_now(self, pool: Pool) -> int:
        return self._stat(pool, 0)

    @admin.display(description="waiting")
    def waiting_now(self, pool: Pool) -> int:
        return self._stat(pool, 1)

    def create_through_service(self, request, form) -> Pool:  # noqa: D102
        pool, _ = pool_put(
            project_id=form.cleaned_data["project"].id,
            name=form.cleaned_data["name"],
            capacity=form.cleaned_data["capacity"],
        )
        return pool

    def save_model(self, request, obj, form, change):  # noqa: D102
        if change and "capacity" in form.changed_data:
            pool_put(project_id=obj.project_id, name=obj.name, capacity=form.cleaned_data["capacity"])


@admin.register(PoolLease)
class PoolLeaseAdmin(ProjectScopedAdmin):
    """Pool leases and waiters: read-only, with a release action (the service's, idempotent)."""

    list_display = ("id", "pool", "run_link", "units", "state", "key", "arrival", "expires_at", "granted_at")
    list_filter = ("state", "pool")
    list_select_related = ("pool", "run")
    ordering = ("-created_at",)
    show_full_result_count = False
    actions = ("release",)
    readonly_fields = (
        "id",
        "project",
        "pool",
        "run_link",
        "units",
        "lease_ttl_ms",
        "key",
        "state",
        "arrival",
        "expires_at",
        "created_at",
        "granted_at",
        "ended_at",
    )
    fields = readonly_fields

    def has_add_permission(self, request):  # noqa: D102
        return False  # acquired through the API

    def has_change_permission(self, request, obj=None):  # noqa: D102
        # The release action needs the change permission; a lease's own page has nothing to
        # edit, so it is shown as a view (and a post to it is refused).
        return obj is None and super().has_change_permission(request)

    def has_delete_permission(self, request, obj=None):  # noqa: D102
        return False  # ended leases stay readable

    @admin.display(description="run", ordering="run")
    def run_link(self, lease: PoolLease) -> str:
        return change_link(lease.run)

    @admin.action(description="Release the selected leases (a waiter leaves the queue)", permissions=["change"])
    def release(self, request, queryset):
        released = 0
        for lease in queryset.order_by("id"):
            try:
                pool_lease_release(project_id=lease.project_id, lease_id=lease.id)
                released += 1
            except CoordinationError as error:
                self.message_user(request, f"lease {lease.id}: {error.message}", messages.ERROR)
        self.message_user(request, f"Released {released} lease(s).", messages.SUCCESS)
