"""The operator dashboard and the admin's confirmation pages, through Django's test client.

The browser tests (tests/browser/) drive the same pages in Chromium, live updates included.
"""

import asyncio
import datetime as dt
import re

import pytest
from django.contrib.auth.models import User
from django.test import AsyncClient, override_settings
from django.utils import timezone

from coordination.api.longpoll import db
from coordination.domain.states import GroupState, RunState, TaskState, TimerState
from coordination.models import Run, Task, TaskGroup, Timer
from coordination.services.barriers import barrier_create
from coordination.services.claims import task_claim
from coordination.services.groups import group_create
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.messages import message_send
from coordination.services.runs import run_cancel, run_create
from coordination.services.tasks import task_submit
from coordination.services.timers import timer_create
from tests.conftest import make_client

DASHBOARD = "/admin/dashboard/"
PANELS = "/admin/dashboard/panels"
STREAM = "/admin/dashboard/stream"


def text_of(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


def count_in(html: str, key: str) -> int:
    return int(re.search(rf'data-count="{re.escape(key)}">(\d+)<', html).group(1))


@pytest.fixture
def swarm(project):
    """A root run with a child holding queued and running tasks, a message, a timer, a barrier, a group."""
    jobs, _ = mailbox_ensure(project_id=project.id, name="jobs", mode="WORK")
    inbox, _ = mailbox_ensure(project_id=project.id, name="inbox", mode="QUEUE")
    root = run_create(project_id=project.id, name="swarm")
    child = run_create(project_id=project.id, parent_id=root.id, name="worker-1")
    for n in range(3):
        task_submit(project_id=project.id, mailbox=jobs, run_id=child.id, input={"n": n})
    task_claim(project_id=project.id, mailbox=jobs, run_id=child.id, worker_id="w-7")
    message_send(project_id=project.id, mailbox=inbox, run_id=child.id, body={})
    timer_create(project_id=project.id, run_id=child.id, at=timezone.now() + dt.timedelta(hours=1))
    barrier_create(project_id=project.id, run_id=root.id, target=2)
    group = group_create(
        project_id=project.id,
        mailbox_name="jobs",
        condition="N_ACCEPTED",
        threshold=2,
        parent_scope_id=root.id,
        name="vote",
    )
    return root, child, group


def test_the_dashboard_shows_counts_queues_leases_groups_charts_and_the_tree(admin_client, swarm):
    root, child, group = swarm
    response = admin_client.get(DASHBOARD)
    assert response.status_code == 200
    html = response.content.decode()
    assert count_in(html, "tasks.QUEUED") == 2
    assert count_in(html, "tasks.RUNNING") == 1
    assert count_in(html, "runs.ACTIVE") == 3  # the root, its child and the group's gate
    assert count_in(html, "timers.ARMED") == 1
    assert count_in(html, "barriers.WAITING") == 1
    assert count_in(html, "groups.OPEN") == 1
    assert count_in(html, "messages.QUEUED") == 1
    assert "/admin/coordination/task/?state__exact=QUEUED" in html
    text = text_of(html)
    assert "jobs" in text and "inbox" in text  # queues
    assert "w-7" in text  # leases per worker
    assert "vote" in text and "0/2" in text  # groups awaiting a decision, accepted/threshold
    assert html.count('<svg class="rs-chart"') == 2  # throughput and decisions, drawn on the server
    assert f'data-run="{root.id}"' in html and f'href="/admin/coordination/run/{root.id}/change/"' in html
    assert f'data-run="{child.id}"' not in html  # closed until opened
    assert "/static/coordination/dashboard.js" in html and "http" not in re.findall(r'src="([^"]+)"', html)[0]


def test_the_panels_show_opened_runs_with_their_effective_state(admin_client, project, swarm):
    root, child, _ = swarm
    run_cancel(run_id=root.id, project_id=project.id)
    response = admin_client.get(PANELS, {"expanded": str(root.id)})
    assert response.status_code == 200
    panels = response.json()["panels"]
    assert set(panels) == {
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
    }
    tree = panels["tree"]
    node = re.search(rf'<li class="rs-node" data-run="{child.id}".*?</li>', tree, re.S).group(0)
    assert "INACTIVE: CANCELLED" in text_of(node) and "swarm" in text_of(node)  # why, and which run
    assert count_in(panels["counts"], "tasks.CANCELLED") == 3


def test_the_dashboard_can_show_one_project(admin_client, project, other_project, swarm):
    run_create(project_id=other_project.id, name="elsewhere")
    html = admin_client.get(DASHBOARD, {"project": other_project.name}).content.decode()
    assert count_in(html, "runs.ACTIVE") == 1
    assert count_in(html, "tasks.QUEUED") == 0


@pytest.mark.django_db
def test_the_dashboard_is_for_staff_only(client, project):
    assert client.get(DASHBOARD).status_code == 302
    user = User.objects.create_user("viewer", password="x")
    client.force_login(user)
    for url in (DASHBOARD, PANELS, STREAM):
        response = client.get(url)
        assert response.status_code in (302, 403), url
    api = make_client(project)  # an API key is no way in
    assert api.get(STREAM).status_code == 302


@pytest.mark.django_db(transaction=True)
def test_the_staff_stream_sends_every_projects_events(admin_user, project, other_project):
    async def scenario():
        client = AsyncClient()
        await client.aforce_login(admin_user)
        response = await client.get(STREAM)
        assert response.status_code == 200 and response["Content-Type"] == "text/event-stream"
        chunks = aiter(response.streaming_content)
        try:
            assert (await anext(chunks)).startswith(b"retry:")
            mine = await db(run_create, project_id=project.id, name="a")
            theirs = await db(run_create, project_id=other_project.id, name="b")
            received = b""
            while received.count(b"event: runstate") < 2:
                received += await asyncio.wait_for(anext(chunks), 30)
            return mine, theirs, received.decode()
        finally:
            await chunks.aclose()

    mine, theirs, received = asyncio.run(scenario())
    assert str(mine.id) in received and str(theirs.id) in received
    assert '"type":"run.created"' in received


def events_panel(html: str) -> str:
    """Return the "Latest events" list of a page or a panel."""
    return re.search(r'<ol id="rs-events".*?</ol>', html, re.S).group(0)


def test_the_dashboard_lists_the_latest_events_on_load(admin_client, project, swarm):
    root, child, group = swarm
    for n in range(40):
        run_create(project_id=project.id, parent_id=child.id, name=f"late-{n}")
    newest = run_create(project_id=project.id, parent_id=child.id, name="newest")

    listed = events_panel(admin_client.get(DASHBOARD).content.decode())

    items = re.findall(r"<li[^>]*data-event-id=[^>]*>(.*?)</li>", listed, re.S)
    assert len(items) == 30  # as many as the page's script keeps when new ones arrive
    assert "run.created" in items[0] and str(newest.id) in items[0]  # newest first
    assert str(root.id) not in listed  # the oldest are left to the admin's event list
    # The panels the page swaps in after each streamed event carry the same list.
    assert str(newest.id) in events_panel(admin_client.get(PANELS).json()["panels"]["events"])


def test_the_events_panel_says_so_when_there_is_none(admin_client, db):
    listed = events_panel(admin_client.get(DASHBOARD).content.decode())
    assert "data-event-id" not in listed and "No event yet" in listed


@pytest.mark.django_db(transaction=True)
def test_a_quiet_staff_stream_sends_keepalive_comments(admin_user, project):
    async def scenario():
        client = AsyncClient()
        await client.aforce_login(admin_user)
        with override_settings(RUNSTATE_SSE_HEARTBEAT_S=0.2):
            response = await client.get(STREAM)
            chunks = aiter(response.streaming_content)
            try:
                assert (await anext(chunks)).startswith(b"retry:")
                return await asyncio.wait_for(anext(chunks), 5)
            finally:
                await chunks.aclose()

    assert asyncio.run(scenario()) == b": keepalive\n\n"


def test_cancelling_a_subtree_shows_how_much_work_it_ends_then_ends_it(admin_client, swarm):
    root, child, group = swarm
    url = f"/admin/coordination/run/{root.id}/end/cancel/"
    page = admin_client.get(url, {"next": DASHBOARD})
    assert page.status_code == 200
    row = re.search(rf'<tr data-run="{root.id}">.*?</tr>', page.content.decode(), re.S).group(0)
    work = dict(re.findall(r'data-work="(\w+)">(?:<strong>)?([^<]+)<', row))
    assert work == {
        "runs": "3 (3)",
        "queued_tasks": "2",
        "running_tasks": "1",
        "queued_messages": "1",
        "armed_timers": "1",
        "waiting_barriers": "1",
        "open_groups": "1",
        "total": "7",
    }
    assert Run.objects.get(id=root.id).stored_state == RunState.ACTIVE  # looking changes nothing

    done = admin_client.post(url, {"confirm": "yes", "next": DASHBOARD, "reason": "operator stop"})
    assert done.status_code == 302 and done["Location"] == DASHBOARD
    root.refresh_from_db()
    assert (root.stored_state, root.cancel_reason) == (RunState.CANCELLED, "operator stop")
    assert not Task.objects.filter(run_id=child.id, state__in=[TaskState.QUEUED, TaskState.RUNNING]).exists()
    assert TaskGroup.objects.get(id=group.id).state == GroupState.FINALIZED
    assert Timer.objects.get(run_id=child.id).state == TimerState.CANCELLED


def test_the_run_action_confirms_first_and_a_foreign_next_is_ignored(admin_client, swarm):
    root, _, _ = swarm
    changelist = "/admin/coordination/run/"
    selected = {"action": "complete_selected", "_selected_action": [str(root.id)]}
    page = admin_client.post(changelist, selected)
    assert page.status_code == 200 and b"rs-subtree-work" in page.content
    assert Run.objects.get(id=root.id).stored_state == RunState.ACTIVE
    admin_client.post(changelist, {**selected, "confirm": "yes"})
    assert Run.objects.get(id=root.id).stored_state == RunState.COMPLETED

    other = run_create(project_id=root.project_id, name="x")
    done = admin_client.post(
        f"/admin/coordination/run/{other.id}/end/cancel/", {"confirm": "yes", "next": "https://elsewhere.example/"}
    )
    assert done["Location"] == f"/admin/coordination/run/{other.id}/change/"


def test_cancelling_a_task_takes_a_grace_from_the_intermediate_form(admin_client, project, swarm):
    _, child, _ = swarm
    running = Task.objects.get(run_id=child.id, state=TaskState.RUNNING)
    changelist = "/admin/coordination/task/"
    selected = {"action": "cancel_selected", "_selected_action": [str(running.id)]}
    form = admin_client.post(changelist, selected)
    assert form.status_code == 200 and b'name="grace_ms"' in form.content
    refused = admin_client.post(changelist, {**selected, "apply": "1", "grace_ms": "-5"})
    assert refused.status_code == 200 and b"errorlist" in refused.content
    assert Task.objects.get(id=running.id).state == TaskState.RUNNING

    admin_client.post(changelist, {**selected, "apply": "1", "grace_ms": "2500", "reason": "too slow"})
    running.refresh_from_db()
    assert running.state == TaskState.CANCELLATION_REQUESTED
    assert running.cancel_reason == "too slow"
    grace = (running.cancel_grace_until - running.cancel_requested_at).total_seconds()
    assert grace == pytest.approx(2.5)


def test_every_admin_page_links_the_dashboard(admin_client):
    assert b'href="/admin/dashboard/"' in admin_client.get("/admin/").content


def test_a_runs_page_links_its_confirmation_pages(admin_client, swarm):
    root, _, _ = swarm
    html = admin_client.get(f"/admin/coordination/run/{root.id}/change/").content.decode()
    assert f'href="/admin/coordination/run/{root.id}/end/cancel/"' in html
    assert f'href="/admin/coordination/run/{root.id}/end/complete/"' in html
