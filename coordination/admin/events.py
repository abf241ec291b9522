"""Events: the append-only log, read-only here."""

from django.contrib import admin
from django.db.models import Q

from coordination.models import Event

from .base import ProjectScopedAdmin, parse_uuid


@admin.register(Event)
class EventAdmin(ProjectScopedAdmin):
    list_display = ("type", "run_id", "subject_id", "created_at", "id")
    list_filter = ("type", "project")
    search_fields = ("subject_id", "run_id")
    search_help_text = "A subject id or a run id (exact match)."
    fields = ("id", "type", "project", "run_id", "run_path", "subject_id", "data", "txid", "created_at")
    readonly_fields = fields
    # Newest first through the primary key index; (txid, id) is the order cursor readers use.
    ordering = ("-id",)
    show_full_result_count = False

    def get_search_results(self, request, queryset, search_term):
        """Match the subject id, or the run id, exactly."""
        term = search_term.strip()
        if not term:
            return queryset, False
        match = Q(subject_id=term)
        run_id = parse_uuid(term)
        if run_id is not None:
            match |= Q(run_id=run_id)
        return queryset.filter(match), False

    def has_add_permission(self, request):  # noqa: D102
        return False

    def has_change_permission(self, request, obj=None):  # noqa: D102
        return False

    def has_delete_permission(self, request, obj=None):  # noqa: D102
        return False
