"""Admissions: each run's limit with its admitted and waiting, and the line itself.

Nothing here writes ``AdmissionConfig``'s counters or ``Admission.state``: the actions call
``admission_configure`` (a raised limit admits waiters at once, with their runs) and
``admission_withdraw``, which keep the line's rules.
"""

from collections import defaultdict

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.utils import display_for_value
from django.template.response import TemplateResponse
from django.utils.html import format_html, format_html_join

from coordination.domain.exceptions import CoordinationError
from coordination.domain.states import AdmissionState
from coordination.models import Admission, AdmissionConfig
from coordination.services.admissions import MAX_ACTIVE, admission_configure, admission_withdraw

from .base import ProjectScopedAdmin, change_link, count_of, parse_uuid

# A config's change page lists this many of its line (admitted still active, then waiting).
LINE_SHOWN = 200
NAMED = 10


def _named(items: list[str]) -> str:
    more = len(items) - NAMED
    return "; ".join(items[:NAMED]) + (f"; and {more} more" if more > 0 else "")


def _report(admin_, request, outcomes: dict[str, list[str]], texts: dict[str, tuple[int, str]], noun: str) -> None:
    for kind, (level, text) in texts.items():
        items = outcomes.get(kind)
        if items:
            admin_.message_user(request, f"{text.format(count_of(len(items), noun))}: {_named(items)}.", level)


class MaxActiveForm(forms.Form):
    """The intermediate form of the "set maxActive" action."""

    max_active = forms.IntegerField(
        label="maxActive",
        min_value=0,
        max_value=MAX_ACTIVE,
        help_text="How many admitted child runs may be active at once. Raising it admits the first waiters at once; "
        "lowering it revokes nobody.",
    )


@admin.register(AdmissionConfig)
class AdmissionConfigAdmin(ProjectScopedAdmin):
    """Each run's admission limit and use; the limit changes through an action."""

    list_display = ("run_link", "max_active_display", "admitted", "waiting", "updated_at")
    list_filter = ("project",)
    list_select_related = ("run",)
    search_help_text = "A run id (exact match)."
    search_fields = ("run_path",)
    ordering = ("-updated_at", "-id")
    show_full_result_count = False
    actions = ("set_max_active",)
    fieldsets = (
        (None, {"fields": ("id", "project", "run_link", "created_at", "updated_at")}),
        ("Use", {"fields": ("max_active_display", "admitted", "waiting")}),
        ("The line", {"fields": ("line_table",)}),
    )
    readonly_fields = tuple(name for _, options in fieldsets for name in options["fields"])

    def has_add_permission(self, request):  # noqa: D102
        return False  # configured through the API (or created by a run's first admission)

    def has_change_permission(self, request, obj=None):  # noqa: D102
        # The action needs the change permission; the page itself is a view.
        return obj is None and super().has_change_permission(request)

    def has_delete_permission(self, request, obj=None):  # noqa: D102
        return False

    def get_search_results(self, request, queryset, search_term):
        """Match the run's id exactly."""
        run_id = parse_uuid(search_term)
        if not search_term.strip():
            return queryset, False
        return (queryset.none() if run_id is None else queryset.filter(run_id=run_id)), False

    @admin.display(description="run", ordering="run")
    def run_link(self, config: AdmissionConfig) -> str:
        return change_link(config.run)

    @admin.display(description="maxActive", ordering="max_active")
    def max_active_display(self, config: AdmissionConfig) -> str:
        return "no limit" if config.max_active is None else str(config.max_active)

    @admin.display(description="admitted (active) and waiting, in order")
    def line_table(self, config: AdmissionConfig) -> str:
        admitted = list(
            Admission.objects.filter(config_id=config.id, holds_slot=True)
            .select_related("run")
            .order_by("ticket")[:LINE_SHOWN]
        )
        waiting = list(
            Admission.objects.filter(config_id=config.id, state=AdmissionState.WAITING).order_by("ticket")[:LINE_SHOWN]
        )
        if not admitted and not waiting:
            return "nobody admitted or waiting"
        empty = self.get_empty_value_display()
        rows = [
            (change_link(a, a.id), "ADMITTED", "—", change_link(a.run), display_for_value(a.admitted_at, empty))
            for a in admitted
        ] + [
            (change_link(a, a.id), "WAITING", str(position), "—", display_for_value(a.created_at, empty))
            for position, a in enumerate(waiting, start=1)
        ]
        body = format_html_join("", "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>", rows)
        return format_html(
            "<table><thead><tr><th>admission</th><th>state</th><th>position</th><th>run</th><th>since</th></tr>"
            "</thead><tbody>{}</tbody></table>",
            body,
        )

    @admin.action(description="Set maxActive of selected runs…", permissions=["change"])
    def set_max_active(self, request, queryset):
        form = MaxActiveForm(request.POST if "apply" in request.POST else None)
        if not form.is_valid():
            context = {
                **self.admin_site.each_context(request),
                "title": f"Set maxActive of {count_of(queryset.count(), 'run')}",
                "opts": self.opts,
                "form": form,
                "configs": list(queryset.select_related("run")[:NAMED]),
                "more": max(0, queryset.count() - NAMED),
                "selected_ids": [str(pk) for pk in queryset.values_list("pk", flat=True)],
                "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            }
            return TemplateResponse(request, "admin/runstate/admission_max_active_form.html", context)
        max_active = form.cleaned_data["max_active"]
        outcomes: dict[str, list[str]] = defaultdict(list)
        for config in queryset.order_by("id"):
            try:
                after, _ = admission_configure(
                    project_id=config.project_id, run_id=config.run_id, max_active=max_active
                )
            except CoordinationError as error:
                outcomes["failed"].append(f"run {config.run_id}: {error.code} ({error.message})")
                continue
            outcomes["set"].append(f"run {after.run_id} ({after.admitted} admitted, {after.waiting} waiting)")
        _report(
            self,
            request,
            outcomes,
            {
                "set": (messages.SUCCESS, "Set maxActive to " + str(max_active) + " on {}"),
                "failed": (messages.ERROR, "Could not change {}"),
            },
            "run",
        )
        return None


@admin.register(Admission)
class AdmissionAdmin(ProjectScopedAdmin):
    """Admissions: read-only (requests come through the API); waiters can be withdrawn."""

    list_display = ("id", "parent_link", "state", "ticket", "key", "name", "run_link", "created_at", "admitted_at")
    list_filter = ("state", "project")
    list_select_related = ("parent", "run")
    search_fields = ("key",)
    search_help_text = "An admission id or a key (exact match)."
    ordering = ("-created_at", "-id")
    show_full_result_count = False
    actions = ("withdraw_selected",)
    fields = (
        "id",
        "project",
        "parent_link",
        "state",
        "ticket",
        "key",
        "name",
        "deadline",
        "run_link",
        "holds_slot",
        "end_code",
        "created_at",
        "admitted_at",
        "ended_at",
        "released_at",
    )
    readonly_fields = fields

    def has_add_permission(self, request):  # noqa: D102
        return False

    def has_change_permission(self, request, obj=None):  # noqa: D102
        return obj is None and super().has_change_permission(request)

    def has_delete_permission(self, request, obj=None):  # noqa: D102
        return False

    def get_search_results(self, request, queryset, search_term):
        """Match an admission id or a key exactly."""
        term = search_term.strip()
        if not term:
            return queryset, False
        admission_id = parse_uuid(term)
        if admission_id is not None:
            return queryset.filter(id=admission_id), False
        return queryset.filter(key=term), False

    @admin.display(description="parent run", ordering="parent")
    def parent_link(self, admission: Admission) -> str:
        return change_link(admission.parent)

    @admin.display(description="run")
    def run_link(self, admission: Admission) -> str:
        return change_link(admission.run) if admission.run_id else "—"

    @admin.action(description="Withdraw selected waiting admissions", permissions=["change"])
    def withdraw_selected(self, request, queryset):
        outcomes: dict[str, list[str]] = defaultdict(list)
        for admission in queryset.order_by("id"):
            if admission.state != AdmissionState.WAITING:
                outcomes["skipped"].append(str(admission))
                continue
            try:
                after = admission_withdraw(project_id=admission.project_id, admission_id=admission.id)
            except CoordinationError as error:
                outcomes["failed"].append(f"{admission}: {error.code} ({error.message})")
                continue
            outcomes["withdrawn" if after.state == AdmissionState.WITHDRAWN else "skipped"].append(str(after))
        _report(
            self,
            request,
            outcomes,
            {
                "withdrawn": (messages.SUCCESS, "Withdrew {}"),
                "skipped": (messages.INFO, "Skipped {} not waiting"),
                "failed": (messages.ERROR, "Could not withdraw {}"),
            },
            "admission",
        )
