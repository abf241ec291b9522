"""What the dashboard shows, read in a few grouped queries per panel.

Every function takes the projects to cover (``ProjectScope``): every project (None), one,
or the ones the staff user may see (``coordination.reads.project_scope``).
"""

import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db.models import Count, Min
from django.db.models.functions import TruncMinute
from django.utils import timezone

from coordination.admin.groups import groups_accepted, progress_text
from coordination.admin.work import Depth, mailboxes_depth
from coordination.domain.states import (
    TASK_HELD,
    BarrierState,
    GroupOutcome,
    GroupState,
    MessageState,
    RunState,
    TaskState,
    TimerState,
)
from coordination.models import Barrier, Event, Mailbox, Message, Project, Run, Task, TaskGroup, Timer
from coordination.reads.project_scope import ProjectScope, of_projects
from coordination.reads.selectors import EffectiveState, runs_effective

# Panels list at most this many rows; the admin's changelists have the rest.
ROWS = 50
# The charts cover this long, one bar per minute.
CHART_MINUTES = 60
FINISHED_EVENTS = ("task.succeeded", "task.failed", "task.cancelled", "task.expired")
# The "Latest events" panel lists this many, as does the page's script as new ones stream in.
LATEST_EVENTS = 30


# Counts by state ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StateCounts:
    """One aggregate's rows by state, every state listed (zeros included)."""

    kind: str  # "runs", "tasks", ...
    model: type
    field: str
    counts: dict[str, int]

    @property
    def total(self) -> int:
        """Return the number of rows in every state."""
        return sum(self.counts.values())


COUNTED = (
    ("runs", Run, "stored_state", RunState),
    ("tasks", Task, "state", TaskState),
    ("messages", Message, "state", MessageState),
    ("groups", TaskGroup, "state", GroupState),
    ("barriers", Barrier, "state", BarrierState),
    ("timers", Timer, "state", TimerState),
)


def state_counts(projects: ProjectScope = None) -> list[StateCounts]:
    """Return runs, tasks, messages, groups, barriers and timers by state (one query each)."""
    result = []
    for kind, model, field_name, states in COUNTED:
        counts = dict.fromkeys((str(state) for state in states), 0)
        rows = of_projects(model.objects.all(), projects).order_by().values_list(field_name).annotate(n=Count("pk"))
        counts.update(dict(rows))
        result.append(StateCounts(kind, model, field_name, counts))
    return result


# Queues and leases -------------------------------------------------------------------------


@dataclass(frozen=True)
class MailboxDepth:
    mailbox: Mailbox
    depth: Depth

    @property
    def queued(self) -> int:
        """Return how many tasks or messages wait in the mailbox."""
        return next(iter(self.depth.counts.values()))


def mailbox_depths(projects: ProjectScope = None) -> list[MailboxDepth]:
    """Return the mailboxes with their depth, the most queued first (at most ``ROWS``)."""
    mailboxes = list(of_projects(Mailbox.objects.select_related("project"), projects).order_by("name")[:500])
    depths = mailboxes_depth(mailboxes)
    rows = [MailboxDepth(mailbox, depths[mailbox.id]) for mailbox in mailboxes]
    rows.sort(key=lambda row: (-row.queued, row.depth.oldest_queued_at or timezone.now(), row.mailbox.name))
    return rows[:ROWS]


@dataclass(frozen=True)
class WorkerLeases:
    worker_id: str
    held: int
    cancellation_requested: int
    next_expiry: datetime | None
    oldest_start: datetime | None


def leases_by_worker(projects: ProjectScope = None) -> list[WorkerLeases]:
    """Return the workers holding leases, the busiest first (at most ``ROWS``)."""
    rows = (
        of_projects(Task.objects.filter(state__in=TASK_HELD), projects)
        .order_by()
        .values_list("worker_id", "state")
        .annotate(n=Count("id"), next_expiry=Min("lease_expires_at"), oldest=Min("started_at"))
    )
    found: dict[str, dict] = {}
    for worker_id, state, n, next_expiry, oldest in rows:
        entry = found.setdefault(worker_id, {"held": 0, "requested": 0, "expiry": [], "start": []})
        entry["held"] += n
        if state == TaskState.CANCELLATION_REQUESTED:
            entry["requested"] += n
        entry["expiry"].append(next_expiry)
        entry["start"].append(oldest)
    workers = [
        WorkerLeases(
            worker_id,
            entry["held"],
            entry["requested"],
            min((at for at in entry["expiry"] if at is not None), default=None),
            min((at for at in entry["start"] if at is not None), default=None),
        )
        for worker_id, entry in found.items()
    ]
    workers.sort(key=lambda w: (-w.held, w.worker_id))
    return workers[:ROWS]


# Groups awaiting a decision ----------------------------------------------------------------


@dataclass(frozen=True)
class PendingGroup:
    group: TaskGroup
    progress: str
    accepted: int
    goal: int


def groups_awaiting(projects: ProjectScope = None) -> list[PendingGroup]:
    """Return undecided groups, oldest first, with their accepted/threshold progress."""
    groups = list(
        of_projects(TaskGroup.objects.exclude(state=GroupState.FINALIZED), projects)
        .select_related("mailbox")
        .order_by("created_at", "id")[:ROWS]
    )
    accepted = groups_accepted(groups)
    rows = []
    for group in groups:
        goal = group.threshold if group.threshold is not None else group.member_count
        rows.append(PendingGroup(group, progress_text(group, accepted[group.id]), accepted[group.id].in_time, goal))
    return rows


# Charts ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Series:
    """Per-minute values over the last ``CHART_MINUTES`` minutes, oldest first."""

    starts: list[datetime]
    values: dict[str, list[float]] = field(default_factory=dict)


def _minutes(now: datetime) -> list[datetime]:
    last = now.replace(second=0, microsecond=0)
    return [last - timedelta(minutes=CHART_MINUTES - 1 - i) for i in range(CHART_MINUTES)]


def throughput(projects: ProjectScope = None, now: datetime | None = None) -> Series:
    """Return tasks finished per second, averaged over each minute of the last hour (from events)."""
    now = now or timezone.now()
    starts = _minutes(now)
    rows = (
        of_projects(Event.objects.filter(type__in=FINISHED_EVENTS, created_at__gte=starts[0]), projects)
        .annotate(minute=TruncMinute("created_at"))
        .order_by()
        .values_list("minute", "type")
        .annotate(n=Count("id"))
    )
    index = {start: i for i, start in enumerate(starts)}
    values = {event_type.split(".", 1)[1]: [0.0] * len(starts) for event_type in FINISHED_EVENTS}
    for minute, event_type, n in rows:
        if minute in index:
            values[event_type.split(".", 1)[1]][index[minute]] += n / 60
    return Series(starts, values)


def decisions(projects: ProjectScope = None, now: datetime | None = None) -> Series:
    """Return groups decided per minute of the last hour, by outcome."""
    now = now or timezone.now()
    starts = _minutes(now)
    rows = (
        of_projects(TaskGroup.objects.filter(finalized_at__gte=starts[0]), projects)
        .annotate(minute=TruncMinute("finalized_at"))
        .order_by()
        .values_list("minute", "outcome")
        .annotate(n=Count("id"))
    )
    index = {start: i for i, start in enumerate(starts)}
    values = {str(outcome): [0.0] * len(starts) for outcome in GroupOutcome}
    for minute, outcome, n in rows:
        if minute in index and outcome in values:
            values[outcome][index[minute]] += n
    return Series(starts, values)


# The run tree ------------------------------------------------------------------------------


@dataclass
class RunNode:
    run: Run
    effective: EffectiveState
    cause: Run | None
    unfinished_tasks: int
    expanded: bool
    children: list["RunNode"] = field(default_factory=list)
    more_children: int = 0


def _nodes(runs: list[Run], expanded: set[uuid.UUID], depth_left: int) -> list[RunNode]:
    if not runs:
        return []
    states = runs_effective(runs)
    causes = {s.cause_run_id for s in states.values() if s.cause_run_id is not None} - {run.id for run in runs}
    cause_runs = {run.id: run for run in runs}
    cause_runs.update({run.id: run for run in Run.objects.filter(id__in=causes).only("id", "name")})
    unfinished = dict(
        Task.objects.filter(run_id__in=[run.id for run in runs], state__in=[TaskState.QUEUED, *TASK_HELD])
        .order_by()
        .values_list("run_id")
        .annotate(n=Count("id"))
    )
    nodes = []
    for run in runs:
        state = states[run.id]
        node = RunNode(
            run=run,
            effective=state,
            cause=cause_runs.get(state.cause_run_id) if state.cause_run_id else None,
            unfinished_tasks=unfinished.get(run.id, 0),
            expanded=run.id in expanded and run.child_count > 0 and depth_left > 0,
        )
        if node.expanded:
            children = list(run.children.order_by("created_at", "id")[: ROWS + 1])
            node.children = _nodes(children[:ROWS], expanded, depth_left - 1)
            node.more_children = max(0, run.child_count - ROWS) if len(children) > ROWS else 0
        nodes.append(node)
    return nodes


def run_tree(projects: ProjectScope = None, expanded: Iterable[uuid.UUID] = (), roots: int = 20) -> list[RunNode]:
    """Return the newest root runs (groups' gates aside) with the ``expanded`` runs' children below them."""
    queryset = of_projects(Run.objects.filter(parent__isnull=True, gated_group__isnull=True), projects)
    newest = list(queryset.order_by("-created_at", "-id")[:roots])
    return _nodes(newest, set(expanded), depth_left=16)


# Latest events ---------------------------------------------------------------------------


def latest_events(projects: ProjectScope = None, limit: int = LATEST_EVENTS) -> list[Event]:
    """Return the newest ``limit`` events of ``projects``, newest first, in the event log's order.

    Each project's newest are read from the end of its ``(project_id, txid, id)`` index, then
    merged: one short index scan per project instead of a sort of every project's events.
    """
    if projects is None:
        project_ids = list(Project.objects.values_list("id", flat=True))
    elif isinstance(projects, uuid.UUID):
        project_ids = [projects]
    else:
        project_ids = list(projects)
    newest: list[Event] = []
    for project_id in project_ids:
        newest += Event.objects.filter(project_id=project_id).order_by("-txid", "-id")[:limit]
    newest.sort(key=lambda event: (event.txid, event.id), reverse=True)
    return newest[:limit]
