"""Task groups: watch their progress and members, close them through the services.

Groups are created through the API only and are read-only here: the one action calls
``group_close``, the only writer of ``TaskGroup.state`` besides the other group services.
Verdicts are given through the API, where the reviewer is.
"""

import uuid
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from django.contrib import admin, messages
from django.contrib.admin.utils import display_for_value
from django.db.models import Count, Q
from django.utils.html import format_html, format_html_join

from coordination.domain.exceptions import CoordinationError
from coordination.domain.states import GroupCondition, GroupState, Verdict
from coordination.models import GroupMember, TaskGroup
from coordination.reads.selectors import group_is_due
from coordination.services.groups import group_close

from .base import ProjectScopedAdmin, ServiceBackedAdmin, change_link, count_of, parse_uuid

# Where get_changelist_instance leaves each listed group's accepted counts for its column.
ACCEPTED_ATTR = "_admin_accepted"
# An action's message names this many groups, then counts the others.
GROUPS_NAMED = 10


@dataclass(frozen=True)
class Accepted:
    """How many members of a group are accepted: in time (they counted), and late (they did not)."""

    in_time: int = 0
    late: int = 0


def groups_accepted(groups: Sequence[TaskGroup]) -> dict[uuid.UUID, Accepted]:
    """Return the accepted counts of every group given, in one grouped query."""
    accepted = Q(verdict=Verdict.ACCEPTED)
    rows = (
        GroupMember.objects.filter(accepted, group_id__in=[group.id for group in groups])
        .order_by()  # group by the group only, never by the model's ordering
        .values_list("group_id")
        .annotate(in_time=Count("id", filter=Q(late=False)), late=Count("id", filter=Q(late=True)))
    )
    found = {group_id: Accepted(in_time, late) for group_id, in_time, late in rows}
    return {group.id: found.get(group.id, Accepted()) for group in groups}


def progress_text(group: TaskGroup, accepted: Accepted) -> str:
    """Return "accepted/threshold" for N_ACCEPTED, "accepted/members" otherwise.

    Only the verdicts that counted are in the fraction; late accepts (recorded after the
    decision, never changing it) are added apart, so a decided group's figure stays its own.
    """
    goal = group.threshold if group.condition == GroupCondition.N_ACCEPTED else group.member_count
    text = f"{accepted.in_time}/{goal}"
    return f"{text} (+{accepted.late} late)" if accepted.late else text


def _label(group: TaskGroup) -> str:
    # Not str(group): it carries the state read before the action changed it.
    return f"{group.name or 'group'} {group.id}"


def _decision(group: TaskGroup) -> str:
    """Return the group's state, with its outcome and reason once finalized."""
    if group.state != GroupState.FINALIZED:
        return group.state
    return f"{group.state} {group.outcome} ({group.outcome_reason})"


def _named(items: list[str]) -> str:
    more = len(items) - GROUPS_NAMED
    return "; ".join(items[:GROUPS_NAMED]) + (f"; and {more} more" if more > 0 else "")


@admin.register(TaskGroup)
class TaskGroupAdmin(ProjectScopedAdmin, ServiceBackedAdmin):
    list_display = (
        "name",
        "id",
        "mailbox",
        "condition",
        "threshold",
        "progress",
        "member_count",
        "state",
        "outcome",
        "outcome_reason",
        "created_at",
        "finalized_at",
    )
    list_filter = ("state", "condition", "outcome", "project")
    list_select_related = ("mailbox",)
    search_fields = ("name",)
    search_help_text = "A group id (exact match) or words of its name."
    ordering = ("-created_at", "-id")
    show_full_result_count = False
    actions = ("close_selected",)
    fieldsets = (
        (None, {"fields": ("id", "name", "project", "mailbox", "created_at")}),
        ("Condition", {"fields": ("condition", "threshold", "expected_members", "deadline", "progress")}),
        ("Decision", {"fields": ("state_detail", "outcome_detail", "closed_at", "finalized_at")}),
        ("Runs", {"fields": ("scope_link", "parent_scope_link")}),
        ("Members", {"fields": ("member_count", "members_table")}),
    )
    readonly_fields = tuple(name for _, options in fieldsets for name in options["fields"])

    def has_add_permission(self, request):  # noqa: D102
        return False  # groups are created through the API

    def has_change_permission(self, request, obj=None):  # noqa: D102
        # The action needs the change permission; a group's own page has nothing to edit, so
        # it is shown as a view (and a post to it is refused).
        return obj is None and super().has_change_permission(request)

    def has_delete_permission(self, request, obj=None):  # noqa: D102
        return False  # groups end by their decision, and stay readable

    # Changelist ----------------------------------------------------------------------------

    def get_changelist_instance(self, request):
        """Count the page's accepted members at once (one grouped query)."""
        changelist = super().get_changelist_instance(request)
        groups = list(changelist.result_list)
        changelist.result_list = groups  # the rows rendered are the ones annotated below
        accepted = groups_accepted(groups)
        for group in groups:
            setattr(group, ACCEPTED_ATTR, accepted[group.id])
        return changelist

    def get_search_results(self, request, queryset, search_term):
        """Match a group id exactly through the primary key, otherwise words of the name."""
        group_id = parse_uuid(search_term)
        if group_id is None:
            return super().get_search_results(request, queryset, search_term)
        return queryset.filter(id=group_id), False

    @admin.display(description="progress")
    def progress(self, group: TaskGroup) -> str:
        accepted = getattr(group, ACCEPTED_ATTR, None) or groups_accepted([group])[group.id]
        return progress_text(group, accepted)

    # Change page ---------------------------------------------------------------------------

    @admin.display(description="state")
    def state_detail(self, group: TaskGroup) -> str:
        if group_is_due(group):
            # An admin page is only read: the deadline sweep (or the next API read) decides it.
            return format_html(
                "{} — due: its deadline passed or its gate is inactive; the next sweep finalizes it", group.state
            )
        return group.state

    @admin.display(description="outcome")
    def outcome_detail(self, group: TaskGroup) -> str:
        if group.outcome is None:
            return "— (undecided)"
        return f"{group.outcome} ({group.outcome_reason})"

    @admin.display(description="gate run (scope)")
    def scope_link(self, group: TaskGroup) -> str:
        return change_link(group.scope)

    @admin.display(description="parent run")
    def parent_scope_link(self, group: TaskGroup) -> str:
        return change_link(group.parent_scope) if group.parent_scope_id else "none (the gate is a root run)"

    @admin.display(description="members")
    def members_table(self, group: TaskGroup) -> str:
        members = list(group.members.select_related("task").order_by("id"))  # at most MAX_MEMBERS
        if not members:
            return "none"
        empty = self.get_empty_value_display()
        rows = format_html_join(
            "",
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            (
                (
                    change_link(member.task, member.task_id),
                    member.task.key or empty,
                    member.task.state,
                    member.verdict or empty,
                    "late" if member.late else "no",
                    display_for_value(member.verdict_at, empty),
                )
                for member in members
            ),
        )
        return format_html(
            '<table class="group-members"><thead><tr><th>task</th><th>key</th><th>task state</th>'
            "<th>verdict</th><th>late</th><th>verdict at</th></tr></thead><tbody>{}</tbody></table>",
            rows,
        )

    # Actions -------------------------------------------------------------------------------

    @admin.action(description="Close selected groups", permissions=["change"])
    def close_selected(self, request, queryset):
        outcomes: dict[str, list[str]] = defaultdict(list)
        for group in _groups_of(queryset):
            try:
                after = group_close(project_id=group.project_id, group_id=group.id)
            except CoordinationError as error:
                outcomes["failed"].append(f"{_label(group)}: {error.code} ({error.message})")
                continue
            kind = "unchanged" if after.state == group.state else "closed"
            outcomes[kind].append(f"{_label(after)}: {_decision(after)}")
        for kind, level, text in (
            ("closed", messages.SUCCESS, "Closed {}"),
            ("unchanged", messages.INFO, "Left {} as they were (closed already)"),
            ("failed", messages.ERROR, "Could not close {}"),
        ):
            items = outcomes.get(kind)
            if items:
                self.message_user(request, f"{text.format(count_of(len(items), 'group'))}: {_named(items)}.", level)


def _groups_of(queryset) -> Iterable[TaskGroup]:
    """Return the selected groups, oldest first, with what the action reads."""
    return queryset.select_related(None).order_by("created_at", "id").only("id", "project_id", "name", "state")
