"""Prometheus metrics (``runstate_*``), served at ``/v1/metrics`` to a scrape token or a project key.

Who sees what (``coordination.api.views.metrics``): the scrape token
(``RUNSTATE_METRICS_TOKEN``) gets every series of every project, as ``render()`` gives them;
a project's key gets ``render(project_id=...)``: the series read from the database, counted
over its project only. The series of the whole service (request counts of the processes,
sweep lag, the event fold's counters) are the operator's and not in a project's scrape.

Three sources, chosen so that every API process answers a scrape with the same figures:

- **HTTP requests** (rate, latency) are counted in-process by ``RequestContextMiddleware``
  with prometheus-client. With ``PROMETHEUS_MULTIPROC_DIR`` set (before the processes
  start), prometheus-client's multiprocess mode adds up the processes of one machine;
  without it each process reports its own requests.
- **State** (runs, tasks, messages, groups, barriers and timers by state; queue depth and
  oldest queued age per mailbox; cancellation requests waiting and stuck per mailbox; held
  leases; sweep lag; group decisions by outcome and reason) is read from the database at
  scrape time: the database is the source of truth, so any process reports the same
  numbers. Groups are never deleted, so their decision count is a true counter.
- **History** that no row keeps (tasks finished, lease expiries, claim latency, timer
  lateness) is folded from the event log: each process reads the events after its own
  cursor (one per project) at every scrape and adds them to its counters. A process starts
  from the oldest retained event (``RUNSTATE_EVENT_RETENTION_DAYS``), so processes agree
  once they have caught up; a restart is a counter reset, which Prometheus handles.
"""

import os
import threading
import time
import uuid
from bisect import bisect_left
from collections import defaultdict
from datetime import datetime

from django.db.models import Count, Min
from django.utils import timezone
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from coordination.domain.states import (
    TASK_HELD,
    BarrierState,
    GroupState,
    MailboxMode,
    MessageState,
    RunState,
    TaskState,
    TimerState,
)
from coordination.domain.task_errors import error_code
from coordination.models import Barrier, Mailbox, Message, Project, Run, Task, TaskGroup, Timer
from coordination.reads.selectors import EVENT_CURSOR_START, Visibility, event_list
from coordination.reads.stuck_cancellations import cancellations_by_mailbox

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# HTTP requests -----------------------------------------------------------------------------

HTTP_REQUESTS = Counter(
    "runstate_http_requests_total",
    "HTTP requests answered, by method, route and status.",
    ["method", "route", "status"],
)
HTTP_LATENCY = Histogram(
    "runstate_http_request_duration_seconds",
    "Time to answer an HTTP request (to the response headers, for streams), by method and route.",
    ["method", "route"],
    buckets=LATENCY_BUCKETS,
)


# Waits, in this process (with PROMETHEUS_MULTIPROC_DIR, the live processes added up).
WAITS_HELD = Gauge(
    "runstate_waits_held",
    "Long-polls and event streams holding a place under RUNSTATE_MAX_WAITS_PER_KEY.",
    multiprocess_mode="livesum",
)
WAITERS_PARKED = Gauge(
    "runstate_waiters_parked",
    "Long-polls parked on a watch (no thread, no connection), waiting for its next read.",
    multiprocess_mode="livesum",
)
WATCHES = Gauge(
    "runstate_watches", "Watches: objects long-polled, each read once per wake-up.", multiprocess_mode="livesum"
)
WAIT_ANSWERS_RENDERED = Counter(
    "runstate_wait_answers_rendered_total",
    "Wait answers rendered to bytes, by wait; each rendering is sent to every waiter the same read answers.",
    ["wait"],
)


def observe_request(*, method: str, route: str, status: int, seconds: float) -> None:
    """Count one answered request."""
    children = _request_children.get((method, route, status))
    if children is None:  # ``labels`` looks its child up under a lock: once per (method, route, status)
        children = (HTTP_REQUESTS.labels(method, route, str(status)), HTTP_LATENCY.labels(method, route))
        if len(_request_children) < MAX_REQUEST_CHILDREN:
            _request_children[(method, route, status)] = children
    children[0].inc()
    children[1].observe(seconds)


# The request metrics' children by (method, route, status); routes are the URLconf's, so few.
_request_children: dict[tuple, tuple] = {}
MAX_REQUEST_CHILDREN = 1000


def _process_registry() -> CollectorRegistry:
    """Return the registry of in-process metrics (every process's, in multiprocess mode)."""
    from prometheus_client import REGISTRY

    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return REGISTRY
    from prometheus_client import multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    return registry


# State, read at scrape time ----------------------------------------------------------------


def _scoped(rows, project_id: uuid.UUID | None):
    """Return ``rows`` of one project (every project's when ``project_id`` is None)."""
    return rows if project_id is None else rows.filter(project_id=project_id)


def _by_state(model, field: str, states, project_id: uuid.UUID | None) -> dict[str, int]:
    counts = dict.fromkeys((str(state) for state in states), 0)
    for state, count in _scoped(model.objects, project_id).order_by().values_list(field).annotate(count=Count("pk")):
        counts[state] = count
    return counts


def _state_gauge(name: str, documentation: str, counts: dict[str, int]) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily(name, documentation, labels=["state"])
    for state, count in counts.items():
        gauge.add_metric([state], count)
    return gauge


def _age_s(since: datetime | None, now: datetime) -> float:
    return max(0.0, (now - since).total_seconds()) if since is not None else 0.0


def sweep_lags(now: datetime) -> dict[str, float]:
    """Return, per sweep, how overdue its oldest due item is (0 when nothing is due)."""
    held = Task.objects.filter(state__in=TASK_HELD)
    oldest_lease = held.filter(lease_expires_at__lte=now).aggregate(at=Min("lease_expires_at"))["at"]
    oldest_grace = held.filter(cancel_grace_until__lte=now).aggregate(at=Min("cancel_grace_until"))["at"]
    leases = min((at for at in (oldest_lease, oldest_grace) if at is not None), default=None)
    return {
        "timers": _age_s(
            Timer.objects.filter(state=TimerState.ARMED, fire_at__lte=now).aggregate(at=Min("fire_at"))["at"], now
        ),
        "leases": _age_s(leases, now),
        "deadlines": _age_s(
            Run.objects.filter(deadline__lte=now, deadline_swept_at__isnull=True).aggregate(at=Min("deadline"))["at"],
            now,
        ),
        "group_deadlines": _age_s(
            TaskGroup.objects.exclude(state=GroupState.FINALIZED)
            .filter(deadline__lte=now)
            .aggregate(at=Min("deadline"))["at"],
            now,
        ),
        "task_expiries": _age_s(
            Task.objects.filter(state=TaskState.QUEUED, expires_at__lte=now).aggregate(at=Min("expires_at"))["at"], now
        ),
    }


def _mailbox_families(now: datetime, project_id: uuid.UUID | None) -> list:
    depth = GaugeMetricFamily(
        "runstate_mailbox_queue_depth",
        "Queued tasks (WORK) or messages (QUEUE) per mailbox.",
        labels=["project", "mailbox"],
    )
    oldest = GaugeMetricFamily(
        "runstate_mailbox_oldest_queued_age_seconds",
        "Age of the oldest queued task or message per mailbox (0 when empty).",
        labels=["project", "mailbox"],
    )
    found: dict[uuid.UUID, tuple[int, datetime | None]] = {}
    for model, queued in ((Task, TaskState.QUEUED), (Message, MessageState.QUEUED)):
        rows = (
            _scoped(model.objects.filter(state=queued), project_id)
            .order_by()
            .values_list("mailbox_id")
            .annotate(count=Count("id"), since=Min("created_at"))
        )
        found.update({mailbox_id: (count, since) for mailbox_id, count, since in rows})
    mailboxes = _scoped(Mailbox.objects, project_id).order_by("project__name", "name")
    for mailbox_id, project_name, name in mailboxes.values_list("id", "project__name", "name"):
        count, since = found.get(mailbox_id, (0, None))
        depth.add_metric([project_name, name], count)
        oldest.add_metric([project_name, name], _age_s(since, now))
    return [depth, oldest]


def _cancellation_families(now: datetime, project_id: uuid.UUID | None) -> list:
    oldest = GaugeMetricFamily(
        "runstate_cancellation_requested_oldest_seconds",
        "Age of the oldest task still CANCELLATION_REQUESTED per WORK mailbox (0 when none).",
        labels=["project", "mailbox"],
    )
    stuck = GaugeMetricFamily(
        "runstate_cancellation_stuck_tasks",
        "Tasks still CANCELLATION_REQUESTED longer than their claim's lease TTL, per WORK mailbox "
        "(see docs/operations.md, Stuck cancellations).",
        labels=["project", "mailbox"],
    )
    found = cancellations_by_mailbox(now, project_id)
    mailboxes = _scoped(Mailbox.objects.filter(mode=MailboxMode.WORK), project_id).order_by("project__name", "name")
    for mailbox_id, project_name, name in mailboxes.values_list("id", "project__name", "name"):
        entry = found.get(mailbox_id)
        oldest.add_metric([project_name, name], _age_s(entry.oldest_requested_at if entry else None, now))
        stuck.add_metric([project_name, name], entry.stuck if entry else 0)
    return [oldest, stuck]


class DatabaseCollector:
    """Gauges (and the group decision counter) read from the database at each scrape.

    With a ``project_id``, every series counts that project's rows only, and the sweep lag
    (the service's sweeps, over every project) is left out.
    """

    def __init__(self, project_id: uuid.UUID | None = None) -> None:
        self.project_id = project_id

    def collect(self):  # noqa: D102
        now, pid = timezone.now(), self.project_id
        yield _state_gauge("runstate_runs", "Runs by stored state.", _by_state(Run, "stored_state", RunState, pid))
        yield _state_gauge("runstate_tasks", "Tasks by state.", _by_state(Task, "state", TaskState, pid))
        messages = _by_state(Message, "state", MessageState, pid)
        yield _state_gauge("runstate_messages", "Queue messages by state.", messages)
        yield _state_gauge("runstate_groups", "Task groups by state.", _by_state(TaskGroup, "state", GroupState, pid))
        yield _state_gauge("runstate_barriers", "Barriers by state.", _by_state(Barrier, "state", BarrierState, pid))
        yield _state_gauge("runstate_timers", "Timers by state.", _by_state(Timer, "state", TimerState, pid))
        yield GaugeMetricFamily(
            "runstate_leases_active",
            "Claims holding a lease (tasks RUNNING or CANCELLATION_REQUESTED).",
            value=_scoped(Task.objects.filter(state__in=TASK_HELD), pid).count(),
        )
        yield from _mailbox_families(now, pid)
        yield from _cancellation_families(now, pid)
        decisions = CounterMetricFamily(
            "runstate_group_decisions", "Groups finalized, by outcome and reason.", labels=["outcome", "reason"]
        )
        rows = (
            _scoped(TaskGroup.objects.filter(state=GroupState.FINALIZED), pid)
            .order_by()
            .values_list("outcome", "outcome_reason")
            .annotate(count=Count("id"))
        )
        for outcome, reason, count in rows:
            decisions.add_metric([outcome or "", reason or ""], count)
        yield decisions
        if pid is None:
            lag = GaugeMetricFamily(
                "runstate_sweep_lag_seconds",
                "How overdue the oldest item a sweep should have acted on is (0 when none is due).",
                labels=["sweep"],
            )
            for sweep, seconds in sweep_lags(now).items():
                lag.add_metric([sweep], seconds)
            yield lag
        from coordination.plumbing.metrics_limits import limit_families

        yield from limit_families(now, pid)


# History, folded from the event log ---------------------------------------------------------

FINISHED_TYPES = {
    "task.succeeded": TaskState.SUCCEEDED,
    "task.failed": TaskState.FAILED,
    "task.cancelled": TaskState.CANCELLED,
    "task.expired": TaskState.EXPIRED,
}
FOLD_TYPES = [*FINISHED_TYPES, "task.claimed", "task.requeued", "timer.fired"]
FOLD_BATCH = 5000
# A scrape folds for at most this long; a process far behind catches up over a few scrapes.
FOLD_BUDGET_S = 2.0


class _Histogram:
    """Cumulative bucket counts and a sum, exposed as a HistogramMetricFamily."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.bounds = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def family(self, name: str, documentation: str) -> HistogramMetricFamily:
        cumulative, buckets = 0, []
        for bound, count in zip([*map(str, self.bounds), "+Inf"], self.counts, strict=True):
            cumulative += count
            buckets.append((bound, cumulative))
        return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=self.total)


class EventFold:
    """Counters and histograms of this process, advanced from the event log at each scrape."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cursors: dict[uuid.UUID, str] = {}
        self.finished: dict[str, int] = dict.fromkeys(FINISHED_TYPES.values(), 0)
        self.lease_expiries: dict[str, int] = defaultdict(int)
        self.claim_latency = _Histogram(LATENCY_BUCKETS)
        self.timer_lateness = _Histogram(LATENCY_BUCKETS)

    def advance(self, budget_s: float = FOLD_BUDGET_S) -> None:
        """Fold the events committed since the last call (for at most ``budget_s``)."""
        with self._lock:
            stop_at = time.monotonic() + budget_s
            for project_id in Project.objects.order_by("id").values_list("id", flat=True):
                while time.monotonic() < stop_at:
                    cursor = self._cursors.get(project_id, EVENT_CURSOR_START)
                    events, next_cursor = event_list(
                        Visibility(project_id=project_id), after=cursor, types=FOLD_TYPES, limit=FOLD_BATCH
                    )
                    self._fold(events)
                    self._cursors[project_id] = next_cursor
                    if len(events) < FOLD_BATCH:
                        break

    def _fold(self, events) -> None:
        first_claims: dict[str, datetime] = {}
        for event in events:
            data = event.data or {}
            if event.type in FINISHED_TYPES:
                self.finished[FINISHED_TYPES[event.type]] += 1
            if event.type == "task.requeued" and data.get("cause") == "lease_expired":
                self.lease_expiries["requeued"] += 1
            elif event.type == "task.failed" and error_code(data.get("error")) == "lease_expired":
                self.lease_expiries["failed"] += 1
            elif event.type == "task.cancelled" and data.get("cause") == "cancellation_finalized":
                self.lease_expiries["cancelled"] += 1
            elif event.type == "timer.fired" and isinstance(data.get("lateMs"), int | float):
                self.timer_lateness.observe(max(0.0, data["lateMs"] / 1000))
            elif event.type == "task.claimed" and data.get("attempt") == 1:
                first_claims[event.subject_id] = event.created_at
        if first_claims:
            submitted = Task.objects.filter(id__in=list(first_claims)).values_list("id", "created_at")
            for task_id, created_at in submitted:
                self.claim_latency.observe(_age_s(created_at, first_claims[str(task_id)]))

    def collect(self):  # noqa: D102
        with self._lock:
            finished = CounterMetricFamily(
                "runstate_tasks_finished", "Tasks that reached a terminal state, by state.", labels=["state"]
            )
            for state, count in self.finished.items():
                finished.add_metric([state], count)
            yield finished
            expiries = CounterMetricFamily(
                "runstate_lease_expiries",
                "Leases that ran out before their claim ended, by what became of the task.",
                labels=["outcome"],
            )
            for outcome in ("requeued", "failed", "cancelled"):
                expiries.add_metric([outcome], self.lease_expiries[outcome])
            yield expiries
            yield self.claim_latency.family(
                "runstate_claim_latency_seconds", "Time from a task's submit to its first claim."
            )
            yield self.timer_lateness.family(
                "runstate_timer_lateness_seconds", "How late timers fired after their due time."
            )


fold = EventFold()
_registry = CollectorRegistry(auto_describe=False)
_registry.register(DatabaseCollector())
_registry.register(fold)


class AdmissionCollector:
    """Admissions admitted (children still active) and waiting, summed over every run's line (of one project)."""

    def __init__(self, project_id: uuid.UUID | None = None) -> None:
        self.project_id = project_id

    def collect(self):  # noqa: D102
        from coordination.services.admissions import admissions_counts

        counts = admissions_counts(project_id=self.project_id)
        yield GaugeMetricFamily(
            "runstate_admissions_admitted", "Admitted child runs still active.", value=counts["admitted"]
        )
        yield GaugeMetricFamily("runstate_admissions_waiting", "Admissions waiting in line.", value=counts["waiting"])


_registry.register(AdmissionCollector())


def render(project_id: uuid.UUID | None = None) -> bytes:
    """Return the ``runstate_*`` metrics in Prometheus' text format.

    Without ``project_id``: every series of every project (folding new events first). With
    it: the series read from the database, over that project only; the process's request
    counts and the event fold's counters, which count every project together, are left out.
    """
    if project_id is not None:
        return generate_latest(_project_registry(project_id))
    fold.advance()
    return generate_latest(_process_registry()) + generate_latest(_registry)


def _project_registry(project_id: uuid.UUID) -> CollectorRegistry:
    """Return a registry of the database-read collectors, each limited to ``project_id``."""
    registry = CollectorRegistry(auto_describe=False)
    for collector in (DatabaseCollector, AdmissionCollector, PoolCollector):
        registry.register(collector(project_id))
    return registry


# Pools ------------------------------------------------------------------------------------


class PoolCollector:
    """Per pool: capacity, units in use and waiters, read at each scrape (never an expired lease)."""

    def __init__(self, project_id: uuid.UUID | None = None) -> None:
        self.project_id = project_id

    def collect(self):  # noqa: D102
        from coordination.models import Pool
        from coordination.services.pools import pool_stats

        labels = ["project", "pool"]
        capacity = GaugeMetricFamily("runstate_pool_capacity", "A pool's capacity in units.", labels=labels)
        in_use = GaugeMetricFamily("runstate_pool_in_use", "Units held by unexpired pool leases.", labels=labels)
        waiting = GaugeMetricFamily("runstate_pool_waiting", "Requests waiting in a pool's queue.", labels=labels)
        pools = list(_scoped(Pool.objects, self.project_id).select_related("project").order_by("project__name", "name"))
        stats = pool_stats(pools)
        for pool in pools:
            key = [pool.project.name, pool.name]
            capacity.add_metric(key, pool.capacity)
            in_use.add_metric(key, stats[pool.id][0])
            waiting.add_metric(key, stats[pool.id][1])
        yield from (capacity, in_use, waiting)


_registry.register(PoolCollector())
