"""Issue 25: the dashboard, its stream and the admin show a staff user only the projects they may see.

Superusers, and staff holding ``coordination.view_every_project``, see every project; other
staff see the projects whose ``staff_groups`` hold one of their groups.
"""

import asyncio
import re

import pytest
from django.contrib import admin
from django.contrib.auth.models import Group, Permission, User
from django.test import AsyncClient, RequestFactory
from django.urls import reverse

from coordination.api.longpoll import db
from coordination.models import Run
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.runs import run_create
from coordination.services.tasks import task_submit

DASHBOARD = "/admin/dashboard/"
PANELS = "/admin/dashboard/panels"
STREAM = "/admin/dashboard/stream"


def make_staff(username: str, *, groups=(), permissions=()) -> User:
    user = User.objects.create_user(username, password="x", is_staff=True)
    user.groups.set(groups)
    user.user_permissions.set(Permission.objects.filter(codename__in=permissions))
    return User.objects.get(pk=user.pk)  # fresh: no permission cache


def every_view_permission() -> list[str]:
    """Every model's view permission (not view_every_project, which is what the tests withhold)."""
    views = Permission.objects.filter(codename__startswith="view_").exclude(codename="view_every_project")
    return list(views.values_list("codename", flat=True))


@pytest.fixture
def acme_operator(project):
    """A staff user in the group that operates ``acme`` (``project``), with every view permission."""
    operators = Group.objects.create(name="acme operators")
    project.staff_groups.add(operators)
    return make_staff("acme-operator", groups=[operators], permissions=every_view_permission())


@pytest.fixture
def two_tenants(project, other_project):
    """A run, a mailbox and a task in each project, each named after its project."""
    made = {}
    for tenant in (project, other_project):
        mailbox, _ = mailbox_ensure(project_id=tenant.id, name=f"{tenant.name}-jobs", mode="WORK")
        run = run_create(project_id=tenant.id, name=f"{tenant.name}-run")
        task_submit(project_id=tenant.id, mailbox=mailbox, run_id=run.id, input={})
        made[tenant.name] = run
    return made


def assert_shows_only_acme(html: str) -> None:
    assert "acme-jobs" in html and "acme-run" in html
    assert "globex" not in html


@pytest.mark.django_db
def test_the_dashboard_shows_a_staff_user_only_their_groups_projects(client, acme_operator, two_tenants):
    client.force_login(acme_operator)

    page = client.get(DASHBOARD)

    assert page.status_code == 200
    assert_shows_only_acme(page.content.decode())  # the panels, and the project picker
    assert [p.name for p in page.context["projects"]] == ["acme"]


@pytest.mark.django_db
def test_the_panels_show_a_staff_user_only_their_projects(client, acme_operator, two_tenants):
    client.force_login(acme_operator)

    panels = client.get(PANELS).json()["panels"]

    assert_shows_only_acme("".join(panels.values()))


@pytest.mark.django_db
def test_the_latest_events_show_a_staff_user_only_their_projects(client, acme_operator, two_tenants):
    client.force_login(acme_operator)

    for html in (client.get(DASHBOARD).content.decode(), client.get(PANELS).json()["panels"]["events"]):
        listed = re.search(r'<ol id="rs-events".*?</ol>', html, re.S).group(0)
        assert str(two_tenants["acme"].id) in listed
        assert str(two_tenants["globex"].id) not in listed


@pytest.mark.django_db
def test_choosing_a_project_one_may_not_see_shows_nothing_of_it(client, acme_operator, two_tenants):
    client.force_login(acme_operator)

    for url in (DASHBOARD, PANELS):
        html = client.get(url, {"project": "globex"}).content.decode()
        assert "globex-jobs" not in html and "globex-run" not in html
        assert "acme-jobs" not in html  # nor the other projects: it asked for one


@pytest.mark.django_db
def test_staff_without_a_group_see_no_project(client, two_tenants):
    client.force_login(make_staff("nobody-in-particular"))

    html = client.get(DASHBOARD).content.decode()

    assert "acme-jobs" not in html and "globex" not in html


@pytest.mark.django_db
@pytest.mark.parametrize("who", ["superuser", "view_every_project"])
def test_superusers_and_holders_of_view_every_project_see_every_project(client, two_tenants, who):
    if who == "superuser":
        user = User.objects.create_superuser("root", password="x")
    else:
        user = make_staff("overseer", permissions=["view_every_project"])
    client.force_login(user)

    html = client.get(DASHBOARD).content.decode()

    assert "acme-jobs" in html and "globex-jobs" in html


@pytest.mark.django_db(transaction=True)
def test_the_stream_sends_a_staff_user_only_their_projects_events(project, other_project):
    operators = Group.objects.create(name="acme operators")
    project.staff_groups.add(operators)
    user = make_staff("acme-operator", groups=[operators])

    async def scenario():
        client = AsyncClient()
        await client.aforce_login(user)
        response = await client.get(STREAM)
        assert response.status_code == 200
        chunks = aiter(response.streaming_content)
        try:
            assert (await anext(chunks)).startswith(b"retry:")
            theirs = await db(run_create, project_id=other_project.id, name="b")
            mine = await db(run_create, project_id=project.id, name="a")
            received = b""
            while str(mine.id).encode() not in received:
                received += await asyncio.wait_for(anext(chunks), 30)
            # A round reads each project's new events in turn: "theirs", committed before "mine",
            # is sent in mine's round or before it, so by the next round's event it would be here.
            later = await db(run_create, project_id=project.id, name="c")
            while str(later.id).encode() not in received:
                received += await asyncio.wait_for(anext(chunks), 30)
            return mine, theirs, received.decode()
        finally:
            await chunks.aclose()

    mine, theirs, received = asyncio.run(scenario())
    assert str(mine.id) in received
    assert str(theirs.id) not in received


# The admin -------------------------------------------------------------------------------


def project_owned_admins():
    for model, model_admin in admin.site._registry.items():
        if any(field.name == "project" for field in model._meta.get_fields()):
            yield pytest.param(model_admin, id=model.__name__)


@pytest.mark.django_db
@pytest.mark.parametrize("model_admin", list(project_owned_admins()))
def test_every_project_owned_admin_lists_only_the_users_projects(model_admin, acme_operator, project, other_project):
    request = RequestFactory().get("/admin/")
    request.user = acme_operator
    sql = str(model_admin.get_queryset(request).query)
    assert "project_id" in sql and " IN " in sql, sql


@pytest.mark.django_db
def test_the_admin_lists_and_opens_only_the_users_projects_rows(client, acme_operator, two_tenants):
    client.force_login(acme_operator)

    runs = client.get(reverse("admin:coordination_run_changelist"))
    assert {run.name for run in runs.context["cl"].result_list} == {"acme-run"}
    assert "globex" not in runs.content.decode()  # the project filter offers only acme
    # Nor do the filters on a related row name another project's mailboxes.
    tasks = client.get(reverse("admin:coordination_task_changelist"))
    assert tasks.status_code == 200
    assert "acme-jobs" in tasks.content.decode() and "globex" not in tasks.content.decode()
    projects = client.get(reverse("admin:coordination_project_changelist"))
    assert [p.name for p in projects.context["cl"].result_list] == ["acme"]

    foreign = client.get(reverse("admin:coordination_run_change", args=[two_tenants["globex"].pk]))
    assert foreign.status_code == 302  # "does not exist", as for a deleted row
    assert Run.objects.filter(pk=two_tenants["globex"].pk).exists()


@pytest.mark.django_db
def test_a_superuser_assigns_a_projects_staff_groups_in_the_admin(admin_client, project):
    operators = Group.objects.create(name="acme operators")
    url = reverse("admin:coordination_project_change", args=[project.pk])

    response = admin_client.post(url, {"staff_groups": [operators.pk], "name": "renamed"}, follow=True)

    assert response.status_code == 200
    project.refresh_from_db()
    assert list(project.staff_groups.all()) == [operators]
    assert project.name == "acme"  # the name stays read-only: create_api_key --project finds it by name
