"""Mailboxes, tasks and queue deliveries: watch the queues, cancel or release through the services.

Mailboxes are ensured through the API; here only their two plain settings are edited. Tasks
and messages are read-only: the task actions call ``task_cancel`` and ``claim_release``,
the only writers of ``Task.state``, and ``task_rerun`` (``reruns.py``), a submit; nothing
here writes ``Message.state``.
"""

import uuid
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.db.models import Count, Min, Q
from django.template.response import TemplateResponse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode
from django.utils.timesince import timesince

from coordination.domain.exceptions import CoordinationError, ValidationFailed
from coordination.domain.states import TASK_HELD, MailboxMode, MessageState, TaskState
from coordination.models import Mailbox, Message, Task
from coordination.plumbing.tracing import TraceContext
from coordination.services.claims import claim_id_for, claim_release
from coordination.services.mailboxes import validate_lease_ttl_ms, validate_max_attempts
from coordination.services.tasks import task_cancel

from .base import (
    ProjectScopedAdmin,
    ServiceBackedAdmin,
    VisibleRelatedFilter,
    change_link,
    changelist_url,
    count_of,
    parse_uuid,
    trace_link,
)
from .reruns import rerun_selected

# The states a mailbox's depth counts, per mode: what waits (first), what is held, what needs a look.
DEPTH_STATES = {
    MailboxMode.WORK: (TaskState.QUEUED, TaskState.RUNNING, TaskState.CANCELLATION_REQUESTED),
    MailboxMode.QUEUE: (MessageState.QUEUED, MessageState.IN_FLIGHT, MessageState.DEAD_LETTERED),
}
ROWS_OF_MODE = {MailboxMode.WORK: Task, MailboxMode.QUEUE: Message}
# Where get_changelist_instance leaves each listed mailbox's depth for its columns.
DEPTH_ATTR = "_admin_depth"
# An action's message names this many tasks, then counts the others.
TASKS_NAMED = 10


@dataclass(frozen=True)
class Depth:
    """How many of a mailbox's tasks (or messages) are in each counted state."""

    counts: dict[str, int]
    oldest_queued_at: datetime | None

    def oldest_queued_age(self, now: datetime) -> str:
        """Return how long the oldest queued item has existed ("3 minutes"), or "—"."""
        return "—" if self.oldest_queued_at is None else timesince(self.oldest_queued_at, now)


def mailboxes_depth(mailboxes: Sequence[Mailbox]) -> dict[uuid.UUID, Depth]:
    """Return the depth of every mailbox given: one grouped query per mode present."""
    found: dict[uuid.UUID, dict[str, tuple[int, datetime | None]]] = {mailbox.id: {} for mailbox in mailboxes}
    for mode, model in ROWS_OF_MODE.items():
        ids = [mailbox.id for mailbox in mailboxes if mailbox.mode == mode]
        if not ids:
            continue
        rows = (
            model.objects.filter(mailbox_id__in=ids, state__in=DEPTH_STATES[mode])
            .order_by()  # group by (mailbox, state) only, never by the model's ordering
            .values_list("mailbox_id", "state")
            .annotate(count=Count("id"), oldest=Min("created_at"))
        )
        for mailbox_id, state, count, oldest in rows:
            found[mailbox_id][state] = (count, oldest)
    depths = {}
    for mailbox in mailboxes:
        states = found[mailbox.id]
        depths[mailbox.id] = Depth(
            counts={state: states.get(state, (0, None))[0] for state in DEPTH_STATES[mailbox.mode]},
            oldest_queued_at=states.get(DEPTH_STATES[mailbox.mode][0], (0, None))[1],
        )
    return depths


def _rows_list_url(mailbox: Mailbox, **filters: str) -> str:
    """Return the changelist of the mailbox's tasks (or messages), with ``filters``."""
    return f"{changelist_url(ROWS_OF_MODE[mailbox.mode])}?{urlencode({'mailbox__id__exact': mailbox.pk, **filters})}"


class MailboxOfModeFilter(VisibleRelatedFilter):
    """Offer only the mailboxes that can hold the listed rows (WORK for tasks, QUEUE for messages)."""

    mode: MailboxMode

    def limit_choices(self, field, request) -> dict:  # noqa: D102
        return {**super().limit_choices(field, request), "mode": self.mode}


class WorkMailboxFilter(MailboxOfModeFilter):
    mode = MailboxMode.WORK


class QueueMailboxFilter(MailboxOfModeFilter):
    mode = MailboxMode.QUEUE


def _named(items: list[str]) -> str:
    more = len(items) - TASKS_NAMED
    return "; ".join(items[:TASKS_NAMED]) + (f"; and {more} more" if more > 0 else "")


# Mailboxes -------------------------------------------------------------------------------


class MailboxSettingsForm(forms.ModelForm):
    """The change form: the two settings, checked with the same ranges as ``mailbox_ensure``."""

    class Meta:
        model = Mailbox
        fields = ("lease_ttl_ms", "max_attempts")
        help_texts = {
            "lease_ttl_ms": "Lease of claims and renewals that ask for none, in milliseconds (100 to 86400000).",
            "max_attempts": "Given to tasks submitted from now on (1 to 1000); a submitted task keeps its own.",
        }

    def clean_lease_ttl_ms(self):  # noqa: D102
        return _checked(validate_lease_ttl_ms, self.cleaned_data.get("lease_ttl_ms"))

    def clean_max_attempts(self):  # noqa: D102
        return _checked(validate_max_attempts, self.cleaned_data.get("max_attempts"))


def _checked(validate, value: int | None) -> int | None:
    """Return ``value`` if the service's ``validate`` accepts it, else raise a form error."""
    try:
        validate(value)
    except ValidationFailed as error:
        raise forms.ValidationError("; ".join(str(text) for text in error.details.values()) or error.message) from None
    return value


@admin.register(Mailbox)
class MailboxAdmin(ProjectScopedAdmin, ServiceBackedAdmin):
    form = MailboxSettingsForm
    list_display = ("name", "project", "mode", "lease_ttl", "attempts_setting", "depth", "oldest_queued")
    list_filter = ("mode", "project")
    list_select_related = ("project",)
    search_fields = ("name",)
    show_full_result_count = False
    editable_on_change = ("lease_ttl_ms", "max_attempts")
    fieldsets = (
        (None, {"fields": ("name", "project", "mode", "id", "created_at")}),
        ("Settings", {"fields": ("lease_ttl_ms", "max_attempts")}),
        ("Depth", {"fields": ("depth_table",)}),
    )

    def get_readonly_fields(self, request, obj=None):  # noqa: D102
        # The name and mode are what `PUT /v1/mailboxes/{name}` ensures against: changing
        # them here would make the next ensure create a second mailbox or conflict.
        return tuple(
            name for _, options in self.fieldsets for name in options["fields"] if name not in self.editable_on_change
        )

    def has_add_permission(self, request):  # noqa: D102
        return False  # mailboxes are ensured through the API

    def has_delete_permission(self, request, obj=None):  # noqa: D102
        return False  # its tasks and messages keep it (PROTECT), and stay readable

    def get_changelist_instance(self, request):
        """Count the page's tasks and messages by state at once (one grouped query per mode)."""
        changelist = super().get_changelist_instance(request)
        mailboxes = list(changelist.result_list)
        changelist.result_list = mailboxes  # the rows rendered are the ones annotated below
        depths = mailboxes_depth(mailboxes)
        for mailbox in mailboxes:
            setattr(mailbox, DEPTH_ATTR, depths[mailbox.id])
        return changelist

    def _depth_of(self, mailbox: Mailbox) -> Depth:
        return getattr(mailbox, DEPTH_ATTR, None) or mailboxes_depth([mailbox])[mailbox.id]

    @admin.display(description="leaseTtlMs", ordering="lease_ttl_ms")
    def lease_ttl(self, mailbox: Mailbox) -> int:
        return mailbox.lease_ttl_ms

    @admin.display(description="maxAttempts", ordering="max_attempts")
    def attempts_setting(self, mailbox: Mailbox) -> int:
        return mailbox.max_attempts

    @admin.display(description="depth")
    def depth(self, mailbox: Mailbox) -> str:
        counts = self._depth_of(mailbox).counts
        return format_html_join(
            " · ",
            '{} <a href="{}">{}</a>',
            ((state, _rows_list_url(mailbox, state__exact=state), count) for state, count in counts.items()),
        )

    @admin.display(description="oldest queued")
    def oldest_queued(self, mailbox: Mailbox) -> str:
        return self._depth_of(mailbox).oldest_queued_age(timezone.now())

    @admin.display(description="depth by state")
    def depth_table(self, mailbox: Mailbox) -> str:
        depth = self._depth_of(mailbox)
        rows = format_html_join(
            "",
            '<tr><td>{}</td><td><a href="{}">{}</a></td></tr>',
            ((state, _rows_list_url(mailbox, state__exact=state), count) for state, count in depth.counts.items()),
        )
        noun = "tasks" if mailbox.mode == MailboxMode.WORK else "messages"
        return format_html(
            "<table><thead><tr><th>state</th><th>{}</th></tr></thead><tbody>{}</tbody></table>"
            '<p>Oldest queued: {}. <a href="{}">All its {}</a></p>',
            noun,
            rows,
            depth.oldest_queued_age(timezone.now()),
            _rows_list_url(mailbox),
            noun,
        )


# Tasks -----------------------------------------------------------------------------------

# The cancel page lists this many of the selected tasks.
TASKS_NAMED_ON_FORM = 50


class TaskCancelForm(forms.Form):
    """The cancel action's intermediate form: what ``task_cancel`` takes besides the task."""

    reason = forms.CharField(
        required=False, max_length=500, help_text="Recorded on the task and its event; blank names you and the admin."
    )
    grace_ms = forms.IntegerField(
        label="graceMs",
        required=False,
        min_value=0,
        max_value=86_400_000,
        help_text="Optional. A running task that has not returned this many milliseconds after the request is "
        "recorded CANCELLED and its claim is lost from then on; blank waits for the worker (or its lease).",
    )


@admin.register(Task)
class TaskAdmin(ProjectScopedAdmin, ServiceBackedAdmin):
    list_display = (
        "id",
        "mailbox",
        "run_link",
        "state",
        "attempts_of_max",
        "priority",
        "worker_id",
        "lease_expires_at",
        "created_at",
        "finished_at",
    )
    list_filter = ("state", ("mailbox", WorkMailboxFilter), "project")
    list_select_related = ("mailbox", "run")
    search_fields = ("key",)  # get_search_results matches ids and keys exactly
    search_help_text = "A task id or a key (exact match)."
    ordering = ("-created_at", "-id")
    show_full_result_count = False
    actions = ("cancel_selected", "release_selected", rerun_selected)
    fieldsets = (
        (None, {"fields": ("id", "project", "mailbox", "run_link", "key", "priority", "created_at", "rerun_of")}),
        ("Input and result", {"fields": ("input", "outcome", "error")}),
        (
            "State",
            {
                "fields": (
                    "state",
                    "attempts",
                    "max_attempts",
                    "available_at",
                    "expires_at",
                    "started_at",
                    "finished_at",
                )
            },
        ),
        ("Claim", {"fields": ("current_claim", "worker_id", "last_renewed_at", "lease_expires_at")}),
        ("Cancellation", {"fields": ("cancel_requested_at", "cancel_grace_until", "cancel_reason")}),
        ("Tracing", {"fields": ("trace",)}),
    )
    readonly_fields = tuple(name for _, options in fieldsets for name in options["fields"])

    def has_add_permission(self, request):  # noqa: D102
        return False  # tasks are submitted through the API

    def has_change_permission(self, request, obj=None):  # noqa: D102
        # The actions need the change permission; a task's own page has nothing to edit, so
        # it is shown as a view (and a post to it is refused).
        return obj is None and super().has_change_permission(request)

    def has_delete_permission(self, request, obj=None):  # noqa: D102
        return False  # tasks end by their claim or a cancel, and stay readable

    def get_search_results(self, request, queryset, search_term):
        """Match a task id or a key exactly."""
        return _search_id_or_key(queryset, search_term)

    @admin.display(description="run", ordering="run")
    def run_link(self, task: Task) -> str:
        return change_link(task.run)

    @admin.display(description="attempts/maxAttempts")
    def attempts_of_max(self, task: Task) -> str:
        return f"{task.attempts}/{task.max_attempts}"

    @admin.display(description="trace id")
    def trace(self, task: Task) -> str:
        """Show the trace the task belongs to; a link to it where ``RUNSTATE_TRACE_URL`` is set."""
        return trace_link(TraceContext(task.traceparent, task.tracestate).trace_id)

    @admin.display(description="current claim")
    def current_claim(self, task: Task) -> str:
        return claim_id_for(task.id, task.attempts) if task.state in TASK_HELD else "—"

    # Actions -------------------------------------------------------------------------------

    @admin.action(description="Cancel selected tasks (cooperative, with grace)…", permissions=["change"])
    def cancel_selected(self, request, queryset):
        form = TaskCancelForm(request.POST if "apply" in request.POST else None)
        if not form.is_valid():
            return self._cancel_form(request, queryset, form)
        reason = form.cleaned_data["reason"] or f"cancelled by {request.user.get_username()} in admin"
        grace_ms = form.cleaned_data["grace_ms"]
        outcomes: dict[str, list[str]] = defaultdict(list)
        for task in _tasks_of(queryset):
            try:
                after = task_cancel(project_id=task.project_id, task_id=task.id, reason=reason, grace_ms=grace_ms)
            except CoordinationError as error:
                outcomes["failed"].append(f"{task}: {error.code} ({error.message})")
                continue
            if after.state == task.state:
                kind = "unchanged"  # finished already, or asked to stop before
            elif after.state == TaskState.CANCELLED:
                kind = "cancelled"
            else:
                kind = "requested"
            outcomes[kind].append(str(after))
        grace = "" if grace_ms is None else f"; recorded CANCELLED if still running after {grace_ms} ms"
        self._report(
            request,
            outcomes,
            {
                "cancelled": (messages.SUCCESS, "Cancelled {} (they were queued)"),
                "requested": (
                    messages.SUCCESS,
                    "Asked {} to stop (running: the worker learns it at its next renewal" + grace + ")",
                ),
                "unchanged": (messages.INFO, "Left {} unchanged (finished, or already asked to stop)"),
                "failed": (messages.ERROR, "Could not cancel {}"),
            },
        )
        return None

    def _cancel_form(self, request, queryset, form):
        """Render the intermediate page: the selected tasks, a reason and the grace."""
        tasks = list(queryset.select_related(None).order_by("id")[:TASKS_NAMED_ON_FORM])
        context = {
            **self.admin_site.each_context(request),
            "title": f"Cancel {count_of(queryset.count(), 'task')}?",
            "opts": self.opts,
            "form": form,
            "tasks": tasks,
            "more": max(0, queryset.count() - len(tasks)),
            "selected_ids": [str(pk) for pk in queryset.values_list("pk", flat=True)],
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(request, "admin/runstate/task_cancel_form.html", context)

    @admin.action(description="Release selected claims (put running tasks back in the queue)", permissions=["change"])
    def release_selected(self, request, queryset):
        outcomes: dict[str, list[str]] = defaultdict(list)
        for task in _tasks_of(queryset):
            if task.state not in TASK_HELD:
                outcomes["skipped"].append(str(task))
                continue
            # The attempt read above fences the release: if a worker has claimed the task
            # again since, this old claim is LEASE_LOST and the new one is left alone.
            try:
                after = claim_release(project_id=task.project_id, claim_id=claim_id_for(task.id, task.attempts))
            except CoordinationError as error:
                outcomes["failed"].append(f"{task}: {error.code} ({error.message})")
                continue
            outcomes["requeued" if after.state == TaskState.QUEUED else "ended"].append(str(after))
        self._report(
            request,
            outcomes,
            {
                "requeued": (
                    messages.SUCCESS,
                    "Released {} back to the queue (their old claims are LEASE_LOST from now on)",
                ),
                "ended": (messages.SUCCESS, "Released {} that had been asked to stop, so they ended"),
                "skipped": (messages.INFO, "Skipped {} not running"),
                "failed": (messages.ERROR, "Could not release {}"),
            },
        )

    def _report(self, request, outcomes: dict[str, list[str]], texts: dict[str, tuple[int, str]]) -> None:
        """Send one message per kind of outcome, naming the tasks."""
        for kind, (level, text) in texts.items():
            items = outcomes.get(kind)
            if items:
                self.message_user(request, f"{text.format(count_of(len(items), 'task'))}: {_named(items)}.", level)


def _tasks_of(queryset) -> Iterable[Task]:
    """Return the selected tasks in id order, with what the actions read."""
    return queryset.select_related(None).order_by("id").only("id", "project_id", "state", "attempts")


def _search_id_or_key(queryset, search_term: str):
    """Match an id (through the primary key) or a key, exactly."""
    term = search_term.strip()
    if not term:
        return queryset, False
    match = Q(key=term)
    object_id = parse_uuid(term)
    if object_id is not None:
        match |= Q(id=object_id)
    return queryset.filter(match), False


# Queue deliveries ------------------------------------------------------------------------


@admin.register(Message)
class MessageAdmin(ProjectScopedAdmin):
    """Deliveries of QUEUE mailboxes: read-only here."""

    list_display = (
        "id",
        "mailbox",
        "run_link",
        "state",
        "attempts",
        "visible_at",
        "created_at",
        "dead_letter_reason",
    )
    list_filter = ("state", ("mailbox", QueueMailboxFilter))
    list_select_related = ("mailbox", "run")
    search_fields = ("key",)  # get_search_results matches ids and keys exactly
    search_help_text = "A message id or a key (exact match)."
    ordering = ("-created_at", "-id")
    show_full_result_count = False
    fields = (
        "id",
        "project",
        "mailbox",
        "run_link",
        "key",
        "body",
        "state",
        "attempts",
        "created_at",
        "visible_at",
        "finished_at",
        "dead_letter_reason",
    )
    readonly_fields = fields

    def get_search_results(self, request, queryset, search_term):
        """Match a message id or a key exactly."""
        return _search_id_or_key(queryset, search_term)

    @admin.display(description="run", ordering="run")
    def run_link(self, message: Message) -> str:
        return change_link(message.run)

    def has_add_permission(self, request):  # noqa: D102
        return False

    def has_change_permission(self, request, obj=None):  # noqa: D102
        return False

    def has_delete_permission(self, request, obj=None):  # noqa: D102
        return False
