"""Runs: browse the tree, see effective state, cancel or complete through the services.

Runs are created through the API only; nothing here writes ``stored_state``: the actions
call ``run_cancel`` and ``run_complete``, which also end the subtree's work in the same
transaction. Both first show a confirmation page counting the work they will end.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.core.exceptions import PermissionDenied
from django.db.models import Count
from django.http import Http404, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path
from django.utils.html import format_html, format_html_join
from django.utils.http import url_has_allowed_host_and_scheme, urlencode

from coordination.domain.exceptions import CoordinationError
from coordination.domain.states import (
    TASK_HELD,
    BarrierState,
    Effective,
    GroupState,
    MessageState,
    RunState,
    TaskState,
    TimerState,
)
from coordination.models import Barrier, Message, Run, Task, TaskGroup, Timer
from coordination.reads.selectors import EffectiveState, runs_effective
from coordination.services.runs import run_cancel, run_complete

from .base import ProjectScopedAdmin, ServiceBackedAdmin, change_link, change_url, changelist_url, count_of, parse_uuid

# The change page links this many children; the rest are one click away in the changelist.
CHILDREN_SHOWN = 50
# An action's message names this many runs, then counts the others.
RUNS_NAMED = 10
# Where get_changelist_instance leaves each listed run's effective state for its column.
EFFECTIVE_ATTR = "_admin_effective"


@dataclass(frozen=True)
class SubtreeWork:
    """What ending a run would end: the unfinished work in its subtree (the run included)."""

    runs: int  # runs in the subtree, the run itself included
    active_runs: int  # of those, the ones whose own state is still ACTIVE
    queued_tasks: int
    running_tasks: int  # RUNNING or CANCELLATION_REQUESTED: their claims are refused from then on
    queued_messages: int
    armed_timers: int
    waiting_barriers: int
    open_groups: int  # OPEN or SEALED groups gated in the subtree: they finalize FAILURE

    @property
    def total(self) -> int:
        """Return how many pieces of work (tasks, messages, timers, barriers, groups) would end."""
        return (
            self.queued_tasks
            + self.running_tasks
            + self.queued_messages
            + self.armed_timers
            + self.waiting_barriers
            + self.open_groups
        )


def subtree_work(run: Run) -> SubtreeWork:
    """Count the unfinished work below ``run`` (prefix queries on the materialized paths)."""
    prefix = run.path
    runs = dict(
        Run.objects.filter(path__startswith=prefix).order_by().values_list("stored_state").annotate(n=Count("id"))
    )
    tasks = dict(
        Task.objects.filter(run_path__startswith=prefix, state__in=[TaskState.QUEUED, *TASK_HELD])
        .order_by()
        .values_list("state")
        .annotate(n=Count("id"))
    )
    return SubtreeWork(
        runs=sum(runs.values()),
        active_runs=runs.get(RunState.ACTIVE, 0),
        queued_tasks=tasks.get(TaskState.QUEUED, 0),
        running_tasks=sum(tasks.get(state, 0) for state in TASK_HELD),
        queued_messages=Message.objects.filter(run_path__startswith=prefix, state=MessageState.QUEUED).count(),
        armed_timers=Timer.objects.filter(run_path__startswith=prefix, state=TimerState.ARMED).count(),
        waiting_barriers=Barrier.objects.filter(run_path__startswith=prefix, state=BarrierState.WAITING).count(),
        open_groups=TaskGroup.objects.filter(scope__path__startswith=prefix)
        .exclude(state=GroupState.FINALIZED)
        .count(),
    )


def _effective_summary(state: EffectiveState) -> str:
    return state.effective if state.effective == Effective.ACTIVE else f"{state.effective} ({state.reason})"


def _named(runs: list[str]) -> str:
    more = len(runs) - RUNS_NAMED
    return "; ".join(runs[:RUNS_NAMED]) + (f"; and {more} more" if more > 0 else "")


@admin.register(Run)
class RunAdmin(ProjectScopedAdmin, ServiceBackedAdmin):
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

    def get_urls(self):
        """Add ``<id>/end/cancel/`` and ``<id>/end/complete/``: one run's confirmation page."""
        end = path(
            "<path:object_id>/end/<str:verb>/",
            self.admin_site.admin_view(self.end_view),
            name=f"{self.opts.app_label}_{self.opts.model_name}_end",
        )
        # Before the default routes: their "<path:object_id>/" would match this path too.
        return [end, *super().get_urls()]

    @admin.action(description="Cancel selected runs (and their subtrees)…", permissions=["change"])
    def cancel_selected(self, request, queryset):
        if request.POST.get("confirm") != "yes":
            return self._confirmation(request, list(queryset.order_by("depth", "created_at", "id")), verb="cancel")
        self._cancel_each(request, queryset)
        return None

    @admin.action(description="Complete selected runs (and end their subtrees' work)…", permissions=["change"])
    def complete_selected(self, request, queryset):
        if request.POST.get("confirm") != "yes":
            return self._confirmation(request, list(queryset.order_by("depth", "created_at", "id")), verb="complete")
        self._complete_each(request, queryset)
        return None

    def end_view(self, request, object_id: str, verb: str):
        """Confirm, then cancel or complete one run: the dashboard's run tree links here."""
        if verb not in ("cancel", "complete"):
            raise Http404("Only cancel and complete end a run.")
        run = self.get_object(request, object_id)
        if run is None:
            raise Http404("No such run.")
        if not self.has_change_permission(request, run):
            raise PermissionDenied
        if request.method == "POST" and request.POST.get("confirm") == "yes":
            queryset = Run.objects.filter(id=run.id)
            if verb == "cancel":
                self._cancel_each(request, queryset)
            else:
                self._complete_each(request, queryset)
            return HttpResponseRedirect(self._next_url(request, run))
        return self._confirmation(request, [run], verb=verb, single=True)

    def _next_url(self, request, run: Run) -> str:
        wanted = request.POST.get("next") or request.GET.get("next") or ""
        if wanted and url_has_allowed_host_and_scheme(wanted, {request.get_host()}, request.is_secure()):
            return wanted
        return change_url(run)

    def _confirmation(self, request, runs: Sequence[Run], *, verb: str, single: bool = False):
        """Render the page that counts, per run, the work the cancel or complete would end."""
        rows = [(run, runs_effective([run])[run.id], subtree_work(run)) for run in runs]
        context = {
            **self.admin_site.each_context(request),
            "title": f"{verb.capitalize()} {count_of(len(runs), 'run')}?",
            "opts": self.opts,
            "verb": verb,
            "rows": rows,
            "single": single,
            "runs_named": [str(run) for run in runs],
            "selected_ids": [str(run.pk) for run in runs],
            "action": f"{verb}_selected",
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            "next": request.GET.get("next") or request.POST.get("next") or "",
            "default_reason": self._default_reason(request),
            "nested": len(runs) > 1,
        }
        return TemplateResponse(request, "admin/runstate/run_end_confirmation.html", context)

    @staticmethod
    def _default_reason(request) -> str:
        return f"cancelled by {request.user.get_username()} in admin"

    def _cancel_each(self, request, queryset) -> None:
        reason = (request.POST.get("reason") or "").strip() or self._default_reason(request)
        self._end_each(
            request,
            queryset,
            verb="cancel",
            past="Cancelled",
            end=lambda run: run_cancel(run_id=run.id, project_id=run.project_id, reason=reason),
        )

    def _complete_each(self, request, queryset) -> None:
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
