"""The operator dashboard: an admin page, its panels as JSON, and a staff-only event stream.

The page renders every panel on the server. Its script (``coordination/dashboard.js``,
served from static files) listens to ``stream`` (Server-Sent Events, session auth, staff
only) and, after events arrive, fetches ``panels`` to replace the panels' HTML: the counts
change without a reload. If the stream drops, the browser reconnects on its own and the
script polls meanwhile.
"""

import json
import uuid

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
from coordination.selectors import EVENT_CURSOR_START, Visibility, event_head, event_list
from coordination.stuck_cancellations import stuck_cancellations

PANELS = ("counts", "queues", "leases", "groups", "charts", "tree", "stuck", "admissions", "pools", "quotas_budgets")
THROUGHPUT_COLORS = {"succeeded": "#2e7d32", "failed": "#c62828", "cancelled": "#f9a825", "expired": "#6d4c41"}
DECISION_COLORS = {"SUCCESS": "#2e7d32", "FAILURE": "#c62828"}
# Events the stream reads per project per round trip.
STREAM_BATCH = 200


def _project(request) -> Project | None:
    name = request.GET.get("project") or ""
    return Project.objects.filter(name=name).first() if name else None


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


def _counts_rows(project: Project | None) -> list[dict]:
    rows = []
    for counted in selectors.state_counts(project.id if project else None):
        url = changelist_url(counted.model)
        scope = {"project__id__exact": project.id if project else None}
        rows.append(
            {
                "kind": counted.kind,
                "total": counted.total,
                "url": _filtered(url, **scope),
                "states": [
                    (state, count, _filtered(url, **{f"{counted.field}__exact": state}, **scope))
                    for state, count in counted.counts.items()
                ],
            }
        )
    return rows


def _queue_rows(project: Project | None, now) -> list[dict]:
    rows = []
    for row in selectors.mailbox_depths(project.id if project else None):
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


def _worker_rows(project: Project | None, now) -> list[dict]:
    tasks_url = changelist_url(Task)
    return [
        {
            "worker": worker,
            "url": _filtered(tasks_url, worker_id=worker.worker_id, project__id__exact=project.id if project else None),
            "next_expiry_s": None
            if worker.next_expiry is None
            else round((worker.next_expiry - now).total_seconds(), 1),
        }
        for worker in selectors.leases_by_worker(project.id if project else None)
    ]


def _stuck_rows(project: Project | None, now) -> list[dict]:
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
        for stuck in stuck_cancellations(now, project.id if project else None, limit=selectors.ROWS)
    ]


def _pool_rows(project: Project | None) -> list[dict]:
    from coordination.models import Pool, PoolLease
    from coordination.services.pools import pool_stats

    queryset = Pool.objects.select_related("project").order_by("project__name", "name")
    pools = list(queryset if project is None else queryset.filter(project=project))
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
    project = _project(request)
    project_id = project.id if project else None
    now = timezone.now()
    throughput = selectors.throughput(project_id, now)
    decided = selectors.decisions(project_id, now)
    finished = sum(sum(values) for values in throughput.values.values()) * 60
    return {
        "project": project,
        "now": now,
        "counts": _counts_rows(project),
        "queues": _queue_rows(project, now),
        "workers": _worker_rows(project, now),
        "pending_groups": selectors.groups_awaiting(project_id),
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
        "tree": selectors.run_tree(project_id, _expanded(request)),
        "stuck": _stuck_rows(project, now),
        "admission_lines": admission_lines(project_id),
        "pools": _pool_rows(project),
        "quotas_budgets": quota_budget_rows(project_id),
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
        "projects": Project.objects.order_by("name"),
        "panels": render_panels(request),
        "selected_project": request.GET.get("project") or "",
    }
    return render(request, "admin/runstate/dashboard/page.html", context)


@never_cache
def panels(request):
    """Answer every panel's HTML as JSON, for the page to swap in."""
    return JsonResponse({"panels": render_panels(request), "at": timezone.now().isoformat()})


# The staff-only event stream -----------------------------------------------------------------


def _stream_start(project_name: str) -> str:
    """Return the composite cursor at the head of every project's log (or the chosen one's)."""
    projects = Project.objects.order_by("id")
    if project_name:
        projects = projects.filter(name=project_name)
    return json.dumps({str(p.id): event_head(Visibility(project_id=p.id)) for p in projects})


def _stream_read(project_name: str):
    """Return ``read(cursor)`` over every project's events (or one's), a JSON cursor per project."""

    def read(cursor: str) -> tuple[list[Event], str]:
        cursors = json.loads(cursor)
        projects = Project.objects.order_by("id").values_list("id", flat=True)
        if project_name:
            projects = Project.objects.filter(name=project_name).values_list("id", flat=True)
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
    """Stream every event's type and ids to a logged-in staff member (never to an API key)."""
    user = await request.auser()
    if not user.is_authenticated:
        return redirect_to_login(request.get_full_path())
    if not (user.is_active and user.is_staff):
        return HttpResponseForbidden("Staff only.")
    project_name = request.GET.get("project") or ""
    start = await sync_to_async(_stream_start)(project_name)
    await sync_to_async(_close_connection)()
    return event_stream_response(event_frames(_stream_read(project_name), after=start, present=_present))
