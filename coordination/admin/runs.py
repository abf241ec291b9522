"""Runs: browse the tree, see effective state, cancel or complete through the services.

Runs are created through the API only; nothing here writes ``stored_state``: the actions
call ``run_cancel`` and ``run_complete``, which also end the subtree's work in the same
transaction.
"""

from collections.abc import Callable

from django.contrib import admin, messages
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode

from coordination.exceptions import CoordinationError
from coordination.models import Run
from coordination.selectors import EffectiveState, runs_effective
from coordination.services.runs import run_cancel, run_complete
from coordination.states import Effective

from .base import ServiceBackedAdmin, change_link, changelist_url, count_of, parse_uuid

# The change page links this many children; the rest are one click away in the changelist.
CHILDREN_SHOWN = 50
# An action's message names this many runs, then counts the others.
RUNS_NAMED = 10
# Where get_changelist_instance leaves each listed run's effective state for its column.
EFFECTIVE_ATTR = "_admin_effective"


def _effective_summary(state: EffectiveState) -> str:
    return state.effective if state.effective == Effective.ACTIVE else f"{state.effective} ({state.reason})"


def _named(runs: list[str]) -> str:
    more = len(runs) - RUNS_NAMED
    return "; ".join(runs[:RUNS_NAMED]) + (f"; and {more} more" if more > 0 else "")


@admin.register(Run)
class RunAdmin(ServiceBackedAdmin):
    list_display = ("id", "name", "project", "parent_link", "stored_state", "effective", "deadline", "created_at")
    list_filter = ("stored_state", "project")
    list_select_related = ("project", "parent")
    search_fields = ("name",)
    search_help_text = "A run id (exact match) or words of its name."
    ordering = ("-created_at", "-id")
    show_full_result_count = False
    actions = ("cancel_selected", "complete_selected")
    editable_on_change = ("name",)
    fieldsets = (
        (None, {"fields": ("id", "name", "project", "parent", "path", "depth", "created_at")}),
        ("State", {"fields": ("stored_state", "effective_detail", "deadline", "ended_at", "cancel_reason")}),
        ("Children", {"fields": ("child_limit", "child_count", "children_links")}),
    )

    def get_readonly_fields(self, request, obj=None):  # noqa: D102
        # Only the label is edited here. The tree, the state and the limits belong to the
        # services (a deadline or child limit changed outside them would skip their checks).
        return tuple(
            name for _, options in self.fieldsets for name in options["fields"] if name not in self.editable_on_change
        )

    def has_add_permission(self, request):  # noqa: D102
        return False  # runs are created through the API

    def has_delete_permission(self, request, obj=None):  # noqa: D102
        return False  # runs end by cancel or complete, and stay readable

    # Changelist ----------------------------------------------------------------------------

    def get_changelist_instance(self, request):
        """Compute the effective state of the page's runs at once (one query for all ancestors)."""
        changelist = super().get_changelist_instance(request)
        runs = list(changelist.result_list)
        changelist.result_list = runs  # the rows rendered are the ones annotated below
        states = runs_effective(runs)
        for run in runs:
            setattr(run, EFFECTIVE_ATTR, states[run.id])
        return changelist

    def get_search_results(self, request, queryset, search_term):
        """Match a run id exactly through the primary key, otherwise words of the name."""
        run_id = parse_uuid(search_term)
        if run_id is None:
            return super().get_search_results(request, queryset, search_term)
        # "=id" would build id__iexact, which compares every row's id as text.
        return queryset.filter(id=run_id), False

    @admin.display(description="parent", ordering="parent")
    def parent_link(self, run: Run) -> str | None:
        return change_link(run.parent) if run.parent_id else None

    @admin.display(description="effective")
    def effective(self, run: Run) -> str:
        state = getattr(run, EFFECTIVE_ATTR, None) or runs_effective([run])[run.id]
        return _effective_summary(state)

    # Change page ---------------------------------------------------------------------------

    @admin.display(description="effective state")
    def effective_detail(self, run: Run) -> str:
        state = runs_effective([run])[run.id]
        if state.effective == Effective.ACTIVE:
            return format_html("{}: the run and every ancestor accept new work", state.effective)
        cause_run = None if state.cause_run_id == run.id else Run.objects.filter(id=state.cause_run_id).first()
        cause = "this run" if cause_run is None else format_html("ancestor {}", change_link(cause_run))
        return format_html("{} — {}, caused by {}", state.effective, state.reason, cause)

    @admin.display(description="children")
    def children_links(self, run: Run) -> str:
        children = list(
            run.children.order_by("created_at", "id").only("id", "name", "stored_state")[: CHILDREN_SHOWN + 1]
        )
        if not children:
            return "none"
        items = format_html_join(
            "", "<li>{} · {}</li>", ((change_link(child), child.stored_state) for child in children[:CHILDREN_SHOWN])
        )
        more = ""
        if len(children) > CHILDREN_SHOWN:
            more = format_html("<p>… and {} more.</p>", run.children.count() - CHILDREN_SHOWN)
        every_child = format_html(
            '<a href="{}?{}">All children in the run list</a>',
            changelist_url(Run),
            urlencode({"parent__exact": run.pk}),
        )
        return format_html("<ul>{}</ul>{}<p>{}</p>", items, more, every_child)

    # Actions -------------------------------------------------------------------------------

    @admin.action(description="Cancel selected runs (and their subtrees)", permissions=["change"])
    def cancel_selected(self, request, queryset):
        reason = f"cancelled by {request.user.get_username()} in admin"
        self._end_each(
            request,
            queryset,
            verb="cancel",
            past="Cancelled",
            end=lambda run: run_cancel(run_id=run.id, project_id=run.project_id, reason=reason),
        )

    @admin.action(description="Complete selected runs", permissions=["change"])
    def complete_selected(self, request, queryset):
        self._end_each(
            request,
            queryset,
            verb="complete",
            past="Completed",
            end=lambda run: run_complete(run_id=run.id, project_id=run.project_id),
        )

    def _end_each(self, request, queryset, *, verb: str, past: str, end: Callable[[Run], Run]) -> None:
        """Call ``end`` on each run in its own transaction and report what happened to each."""
        done: list[str] = []
        failed: list[str] = []
        # Roots first, so a selected run's own cascade has already reached the runs below it.
        for run in queryset.select_related(None).order_by("depth", "created_at", "id").only("id", "project_id", "name"):
            try:
                end(run)
            except CoordinationError as error:
                failed.append(f"{run}: {error.code} ({error.message})")
            else:
                done.append(str(run))
        if done:
            self.message_user(request, f"{past} {count_of(len(done), 'run')}: {_named(done)}.", messages.SUCCESS)
        if failed:
            self.message_user(
                request, f"Could not {verb} {count_of(len(failed), 'run')}: {_named(failed)}.", messages.ERROR
            )
