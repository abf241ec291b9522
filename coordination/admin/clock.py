"""Barriers and timers: watch arrivals and wake-ups; cancel or fire timers through the services.

Both are created through the API only and are read-only here. Nothing here writes
``Barrier.state`` or ``Timer.state``: the timer actions call ``timer_cancel`` and
``timer_fire``, which keep their rules (a fired timer cannot be cancelled, a timer fires
only once it is due, one due after its run's deadline is cancelled instead).
"""

from collections import defaultdict
from collections.abc import Iterable

from django.contrib import admin, messages
from django.contrib.admin.utils import display_for_value
from django.utils import timezone
from django.utils.html import format_html, format_html_join

from coordination.domain.exceptions import CoordinationError
from coordination.domain.states import TimerState
from coordination.models import Barrier, BarrierArrival, Timer
from coordination.services.timers import timer_cancel, timer_fire

from .base import ProjectScopedAdmin, ServiceBackedAdmin, change_link, count_of, parse_uuid

# A barrier's change page lists this many arrivals of the current epoch, then counts the rest.
ARRIVALS_SHOWN = 200
# An action's message names this many timers, then counts the others.
TIMERS_NAMED = 10


def _named(items: list[str]) -> str:
    more = len(items) - TIMERS_NAMED
    return "; ".join(items[:TIMERS_NAMED]) + (f"; and {more} more" if more > 0 else "")


def _search_id(queryset, search_term: str):
    """Match an id exactly through the primary key; anything else matches nothing."""
    term = search_term.strip()
    if not term:
        return queryset, False
    object_id = parse_uuid(term)
    # "=id" would build id__iexact, which compares every row's id as text.
    return (queryset.none() if object_id is None else queryset.filter(id=object_id)), False


# Barriers --------------------------------------------------------------------------------


@admin.register(Barrier)
class BarrierAdmin(ProjectScopedAdmin):
    """Barriers: read-only here (arrivals and next epoch go through the API)."""

    list_display = (
        "name",
        "id",
        "run_link",
        "target",
        "epoch",
        "progress",
        "state",
        "released_at",
        "created_at",
    )
    list_filter = ("state", "project")
    list_select_related = ("run",)
    search_fields = ("name",)
    search_help_text = "A barrier id (exact match) or words of its name."
    ordering = ("-created_at", "-id")
    show_full_result_count = False
    fieldsets = (
        (None, {"fields": ("id", "name", "project", "run_link", "created_at")}),
        ("State", {"fields": ("state", "target", "epoch", "progress", "released_at")}),
        ("Arrivals of the current epoch", {"fields": ("arrivals_table",)}),
    )
    readonly_fields = tuple(name for _, options in fieldsets for name in options["fields"])

    def has_add_permission(self, request):  # noqa: D102
        return False  # barriers are created through the API

    def has_change_permission(self, request, obj=None):  # noqa: D102
        return False

    def has_delete_permission(self, request, obj=None):  # noqa: D102
        return False  # barriers end with their run, and stay readable

    def get_search_results(self, request, queryset, search_term):
        """Match a barrier id exactly through the primary key, otherwise words of the name."""
        barrier_id = parse_uuid(search_term)
        if barrier_id is None:
            return super().get_search_results(request, queryset, search_term)
        return queryset.filter(id=barrier_id), False

    @admin.display(description="run", ordering="run")
    def run_link(self, barrier: Barrier) -> str:
        return change_link(barrier.run)

    @admin.display(description="arrivals/target")
    def progress(self, barrier: Barrier) -> str:
        return f"{barrier.arrivals}/{barrier.target}"

    @admin.display(description="arrivals")
    def arrivals_table(self, barrier: Barrier) -> str:
        # The epoch's rows and the barrier's counter move together under the barrier's row
        # lock, so the counter says how many rows are not shown without a second query.
        arrivals = list(
            BarrierArrival.objects.filter(barrier_id=barrier.id, epoch=barrier.epoch)
            .order_by("id")
            .only("key", "arrived_at")[:ARRIVALS_SHOWN]
        )
        if not arrivals:
            return f"none yet in epoch {barrier.epoch}"
        empty = self.get_empty_value_display()
        rows = format_html_join(
            "",
            "<tr><td>{}</td><td>{}</td></tr>",
            ((arrival.key, display_for_value(arrival.arrived_at, empty)) for arrival in arrivals),
        )
        more = ""
        if barrier.arrivals > len(arrivals):
            more = format_html("<p>… and {} more.</p>", barrier.arrivals - len(arrivals))
        return format_html(
            '<table class="barrier-arrivals"><thead><tr><th>key</th><th>arrived at</th></tr></thead>'
            "<tbody>{}</tbody></table>{}",
            rows,
            more,
        )


# Timers ----------------------------------------------------------------------------------


def lateness_ms(timer: Timer) -> int | None:
    """Return how late the timer fired (``fired_at - fire_at``) in milliseconds, or None."""
    if timer.fired_at is None:
        return None
    return int((timer.fired_at - timer.fire_at).total_seconds() * 1000)


def _label(timer: Timer) -> str:
    # Not str(timer): it carries the state read before the action changed it.
    return f"timer {timer.id}"


@admin.register(Timer)
class TimerAdmin(ProjectScopedAdmin, ServiceBackedAdmin):
    list_display = (
        "id",
        "run_link",
        "state",
        "due",
        "fired_at",
        "acknowledged_at",
        "lateness",
        "created_at",
    )
    list_filter = ("state", "project")
    list_select_related = ("run",)
    search_fields = ("id",)  # get_search_results matches the id exactly
    search_help_text = "A timer id (exact match)."
    ordering = ("-created_at", "-id")
    show_full_result_count = False
    actions = ("cancel_selected", "fire_due_selected")
    fieldsets = (
        (None, {"fields": ("id", "project", "run_link", "run_deadline", "created_at")}),
        ("State", {"fields": ("state", "due", "fired_at", "acknowledged_at", "lateness")}),
    )
    readonly_fields = tuple(name for _, options in fieldsets for name in options["fields"])

    def has_add_permission(self, request):  # noqa: D102
        return False  # timers are created through the API

    def has_change_permission(self, request, obj=None):  # noqa: D102
        # The actions need the change permission; a timer's own page has nothing to edit, so
        # it is shown as a view (and a post to it is refused).
        return obj is None and super().has_change_permission(request)

    def has_delete_permission(self, request, obj=None):  # noqa: D102
        return False  # timers end by firing or cancel, and stay readable

    def get_search_results(self, request, queryset, search_term):
        """Match a timer id exactly through the primary key."""
        return _search_id(queryset, search_term)

    @admin.display(description="run", ordering="run")
    def run_link(self, timer: Timer) -> str:
        return change_link(timer.run)

    @admin.display(description="fire at (due)", ordering="fire_at")
    def due(self, timer: Timer) -> str:
        text = display_for_value(timer.fire_at, self.get_empty_value_display())
        if timer.state == TimerState.ARMED and timer.fire_at <= timezone.now():
            # An admin page is only read: the sweep (or the fire action) fires it.
            return f"{text} — due, not fired yet"
        return text

    @admin.display(description="lateness")
    def lateness(self, timer: Timer) -> str | None:
        late = lateness_ms(timer)
        return None if late is None else f"{late} ms"

    # Actions -------------------------------------------------------------------------------

    @admin.action(description="Cancel selected timers", permissions=["change"])
    def cancel_selected(self, request, queryset):
        outcomes: dict[str, list[str]] = defaultdict(list)
        for timer in _timers_of(queryset):
            try:
                after = timer_cancel(project_id=timer.project_id, timer_id=timer.id)
            except CoordinationError as error:
                outcomes["failed"].append(f"{_label(timer)}: {error.code} ({error.message})")
                continue
            outcomes["unchanged" if after.state == timer.state else "cancelled"].append(_label(after))
        self._report(
            request,
            outcomes,
            {
                "cancelled": (messages.SUCCESS, "Cancelled {}"),
                "unchanged": (messages.INFO, "Left {} as they were (cancelled already)"),
                "failed": (messages.ERROR, "Could not cancel {}"),
            },
        )

    @admin.action(description="Fire selected due timers", permissions=["change"])
    def fire_due_selected(self, request, queryset):
        outcomes: dict[str, list[str]] = defaultdict(list)
        for timer in _timers_of(queryset):
            try:
                after = timer_fire(timer_id=timer.id)
            except CoordinationError as error:
                outcomes["failed"].append(f"{_label(timer)}: {error.code} ({error.message})")
                continue
            if after is None:
                outcomes["failed"].append(f"{_label(timer)}: not found")
            elif after.state == TimerState.FIRED and timer.state == TimerState.ARMED:
                outcomes["fired"].append(f"{_label(after)} ({lateness_ms(after)} ms late)")
            elif after.state == TimerState.CANCELLED and timer.state == TimerState.ARMED:
                outcomes["cancelled"].append(_label(after))
            elif after.state == TimerState.ARMED:
                due = display_for_value(after.fire_at, self.get_empty_value_display())
                outcomes["not_due"].append(f"{_label(after)} (due {due})")
            else:
                outcomes["unchanged"].append(f"{_label(after)}: {after.state}")
        self._report(
            request,
            outcomes,
            {
                "fired": (messages.SUCCESS, "Fired {}"),
                "cancelled": (
                    messages.WARNING,
                    "Cancelled {} instead of firing them (due at or after their run's deadline)",
                ),
                "not_due": (messages.WARNING, "Did not fire {} not due yet"),
                "unchanged": (messages.INFO, "Left {} as they were (not armed)"),
                "failed": (messages.ERROR, "Could not fire {}"),
            },
        )

    def _report(self, request, outcomes: dict[str, list[str]], texts: dict[str, tuple[int, str]]) -> None:
        """Send one message per kind of outcome, naming the timers."""
        for kind, (level, text) in texts.items():
            items = outcomes.get(kind)
            if items:
                self.message_user(request, f"{text.format(count_of(len(items), 'timer'))}: {_named(items)}.", level)


def _timers_of(queryset) -> Iterable[Timer]:
    """Return the selected timers, earliest due first, with what the actions read."""
    return queryset.select_related(None).order_by("fire_at", "id").only("id", "project_id", "state", "fire_at")
