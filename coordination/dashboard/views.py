"""The operator dashboard: an admin page, its panels as JSON, and a staff-only event stream.

The page renders every panel on the server. Its script (``coordination/dashboard.js``,
served from static files) listens to ``stream`` (Server-Sent Events, session auth, staff
only) and, after events arrive, fetches ``panels`` to replace the panels' HTML: the counts
change without a reload. If the stream drops, the browser reconnects on its own and the
script polls meanwhile.
"""

import json
import uuid
from dataclasses import dataclass

from asgiref.sync import sync_to_async
from django.contrib import admin
from django.contrib.auth.views import redirect_to_login
from django.http import HttpResponseForbidden, JsonResponse
from django.shortcuts import render
from django.template.loader import render_to_string
from django.utils import timezone
from django.utils.http import urlencode
from django.views.decorators.cache import never_cache

from coordination.admin.base import change_url, changelist_url
from coordination.admin.work import ROWS_OF_MODE
from coordination.api.longpoll import _close_connection
from coordination.api.sse import event_frames, event_stream_response
from coordination.dashboard import selectors
from coordination.dashboard.admissions import admission_lines
from coordination.dashboard.charts import stacked_bars
from coordination.dashboard.limits import quota_budget_rows
from coordination.models import Event, Project, Task
from coordination.reads.project_scope import (
    ProjectScope,
    of_projects,
    project_scope,
    sees_every_project,
    visible_projects,
)
from coordination.reads.selectors import EVENT_CURSOR_START, Visibility, event_head, event_list
from coordination.reads.stuck_cancellations import stuck_cancellations

PANELS = (
    "counts",
    "queues",
    "leases",
    "groups",
    "charts",
    "tree",
    "stuck",
    "admissions",
    "pools",
    "quotas_budgets",
    "events",
)
THROUGHPUT_COLORS = {"succeeded": "#2e7d32", "failed": "#c62828", "cancelled": "#f9a825", "expired": "#6d4c41"}
DECISION_COLORS = {"SUCCESS": "#2e7d32", "FAILURE": "#c62828"}
# Events the stream reads per project per round trip.
STREAM_BATCH = 200


@dataclass(frozen=True)
class Scope:
    """What the panels cover: the project chosen (if the user may see it), and every project covered."""

    project: Project | None
    projects: ProjectScope  # None: every project; otherwise the ids the user may see (or the chosen one)


def _scope(request) -> Scope:
    """Return the panels' scope: the chosen project, else every project the user may see."""
    name = request.GET.get("project") or ""
    if not name:
        return Scope(None, project_scope(request.user))
    # One the user may not see is answered as one that does not exist: nothing.
    project = visible_projects(request.user).filter(name=name).first()
    return Scope(project, [] if project is None else project.id)


def _expanded(request) -> list[uuid.UUID]:
    ids = []
    for part in (request.GET.get("expanded") or "").split(","):
        try:
            ids.append(uuid.UUID(part.strip()))
        except ValueError:
            continue
    return ids[:200]


def _filtered(url: str, **filters: object) -> str:
    return f"{url}?{urlencode({k: str(v) for k, v in filters.items() if v is not None})}"


def _counts_rows(scope: Scope) -> list[dict]:
    project = scope.project
    rows = []
    for counted in selectors.state_counts(scope.projects):
        url = changelist_url(counted.model)
        in_project = {"project__id__exact": project.id if project else None}
        rows.append(
            {
                "kind": counted.kind,
                "total": counted.total,
                "url": _filtered(url, **in_project),
                "states": [
                    (state, count, _filtered(url, **{f"{counted.field}__exact": state}, **in_project))
                    for state, count in counted.counts.items()
                ],
            }
        )
    return rows


def _queue_rows(scope: Scope, now) -> list[dict]:
    rows = []
    for row in selectors.mailbox_depths(scope.projects):
        rows_url = changelist_url(ROWS_OF_MODE[row.mailbox.mode])
        rows.append(
            {
                "mailbox": row.mailbox,
                "url": change_url(row.mailbox),
                "project": row.mailbox.project.name,
                "states": [
                    (state, count, _filtered(rows_url, mailbox__id__exact=row.mailbox.id, state__exact=state))
                    for state, count in row.depth.counts.items()
                ],
                "oldest": row.depth.oldest_queued_age(now),
            }
        )
    return rows


def _worker_rows(scope: Scope, now) -> list[dict]:
    project = scope.project
    tasks_url = changelist_url(Task)
    return [
        {
            "worker": worker,
            "url": _filtered(tasks_url, worker_id=worker.worker_id, project__id__exact=project.id if project else None),
            "next_expiry_s": None
            if worker.next_expiry is None
            else round((worker.next_expiry - now).total_seconds(), 1),
        }
        for worker in selectors.leases_by_worker(scope.projects)
    ]


def _stuck_rows(scope: Scope, now) -> list[dict]:
    return [
        {
            "stuck": stuck,
            "url": change_url(stuck.task),
            "requested_s": (now - stuck.task.cancel_requested_at).total_seconds(),
            "renewed_s": None
            if stuck.task.last_renewed_at is None
            else (now - stuck.task.last_renewed_at).total_seconds(),
            "expiry_s": None
            if stuck.task.lease_expires_at is None
            else (stuck.task.lease_expires_at - now).total_seconds(),
        }
        for stuck in stuck_cancellations(now, scope.projects, limit=selectors.ROWS)
    ]


def _pool_rows(scope: Scope) -> list[dict]:
    from coordination.models import Pool, PoolLease
    from coordination.services.pools import pool_stats

    pools = list(of_projects(Pool.objects.select_related("project").order_by("project__name", "name"), scope.projects))
    stats = pool_stats(pools)
    leases_url = changelist_url(PoolLease)
    return [
        {
            "pool": pool,
            "url": change_url(pool),
            "in_use": stats[pool.id][0],
            "waiting": stats[pool.id][1],
            "leases_url": _filtered(leases_url, pool__id__exact=pool.id, state__exact="HELD"),
            "waiting_url": _filtered(leases_url, pool__id__exact=pool.id, state__exact="WAITING"),
        }
        for pool in pools
    ]


def _panel_context(request) -> dict:
    scope = _scope(request)
    project, projects = scope.project, scope.projects
    now = timezone.now()
    throughput = selectors.throughput(projects, now)
    decided = selectors.decisions(projects, now)
    finished = sum(sum(values) for values in throughput.values.values()) * 60
    return {
        "project": project,
        "now": now,
        "counts": _counts_rows(scope),
        "queues": _queue_rows(scope, now),
        "workers": _worker_rows(scope, now),
        "pending_groups": selectors.groups_awaiting(projects),
        "throughput_chart": stacked_bars(
            throughput,
            colors=THROUGHPUT_COLORS,
            title="Tasks finished per second",
            unit="tasks/s",
            caption=f"{finished:.0f} tasks finished in the last hour; per second, averaged over each minute",
        ),
        "decisions_chart": stacked_bars(
            decided,
            colors=DECISION_COLORS,
            title="Group decisions per minute",
            unit="decisions/min",
            caption=f"{sum(sum(v) for v in decided.values.values()):.0f} groups decided in the last hour",
        ),
        "tree": selectors.run_tree(projects, _expanded(request)),
        "stuck": _stuck_rows(scope, now),
        "admission_lines": admission_lines(projects),
        "pools": _pool_rows(scope),
        "quotas_budgets": quota_budget_rows(projects),
        "events": selectors.latest_events(projects),
    }


def render_panels(request) -> dict[str, str]:
    """Return the HTML of every panel."""
    context = _panel_context(request)
    return {
        name: render_to_string(f"admin/runstate/dashboard/_{name}.html", context, request=request) for name in PANELS
    }


@never_cache
def dashboard(request):
    """Render the dashboard page with every panel."""
    context = {
        **admin.site.each_context(request),
        "title": "Dashboard",
        "projects": visible_projects(request.user).order_by("name"),
        "sees_every_project": sees_every_project(request.user),
        "panels": render_panels(request),
        "selected_project": request.GET.get("project") or "",
        "events_shown": selectors.LATEST_EVENTS,
    }
    return render(request, "admin/runstate/dashboard/page.html", context)


@never_cache
def panels(request):
    """Answer every panel's HTML as JSON, for the page to swap in."""
    return JsonResponse({"panels": render_panels(request), "at": timezone.now().isoformat()})


# The staff-only event stream -----------------------------------------------------------------


def _streamed_projects(user, project_name: str):
    """Return the projects the stream covers: the ones ``user`` may see (or the chosen one among them)."""
    projects = visible_projects(user).order_by("id")
    return projects.filter(name=project_name) if project_name else projects


def _stream_start(user, project_name: str) -> str:
    """Return the composite cursor at the head of every visible project's log (or the chosen one's)."""
    projects = _streamed_projects(user, project_name)
    return json.dumps({str(p.id): event_head(Visibility(project_id=p.id)) for p in projects})


def _stream_read(user, project_name: str):
    """Return ``read(cursor)`` over every visible project's events (or one's), a JSON cursor per project."""

    def read(cursor: str) -> tuple[list[Event], str]:
        cursors = json.loads(cursor)
        # Asked again each round: a project created (or a group granted) since counts from then on.
        projects = _streamed_projects(user, project_name).values_list("id", flat=True)
        events: list[Event] = []
        for project_id in projects:
            # A project created after the stream started: every event of it is new.
            after = cursors.get(str(project_id), EVENT_CURSOR_START)
            found, cursors[str(project_id)] = event_list(
                Visibility(project_id=project_id), after=after, limit=STREAM_BATCH
            )
            events.extend(found)
        return events, json.dumps(cursors)

    return read


def _present(event: Event):
    return (
        None,
        "runstate",
        {
            "type": event.type,
            "runId": str(event.run_id) if event.run_id else None,
            "subjectId": event.subject_id,
            "createdAt": event.created_at,
        },
    )


@never_cache
async def stream(request):
    """Stream the events' types and ids of the projects a logged-in staff member may see (never to an API key)."""
    user = await request.auser()
    if not user.is_authenticated:
        return redirect_to_login(request.get_full_path())
    if not (user.is_active and user.is_staff):
        return HttpResponseForbidden("Staff only.")
    project_name = request.GET.get("project") or ""
    start = await sync_to_async(_stream_start)(user, project_name)
    await sync_to_async(_close_connection)()
    return event_stream_response(event_frames(_stream_read(user, project_name), after=start, present=_present))
