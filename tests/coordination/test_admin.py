"""The admin: runs, keys and events, every change made through the services."""

import re
import uuid

import pytest
from django.apps import apps
from django.contrib import messages
from django.contrib.messages.storage.cookie import CookieStorage
from django.db import connection
from django.http import HttpRequest
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from coordination.domain.states import Effective, RunState
from coordination.models import ApiKey, Event, Project, Run
from coordination.reads.selectors import runs_effective
from coordination.services.keys import api_key_authenticate, api_key_create
from coordination.services.runs import run_cancel, run_complete, run_create
from tests.conftest import secret_of

RUNS = reverse("admin:coordination_run_changelist")
KEYS = reverse("admin:coordination_apikey_changelist")
KEY_ADD = reverse("admin:coordination_apikey_add")
EVENTS = reverse("admin:coordination_event_changelist")
PLAINTEXT = re.compile(r"rs_[0-9a-f]{12}_[A-Za-z0-9_-]+")


def run_url(run):
    return reverse("admin:coordination_run_change", args=[run.pk])


def messages_of(response):
    return [(message.level, message.message) for message in response.context["messages"]]


def post_action(client, changelist, action, objects, **extra):
    return client.post(
        changelist, {"action": action, "_selected_action": [str(obj.pk) for obj in objects], **extra}, follow=True
    )


@pytest.fixture
def tree(project):
    parent = run_create(project_id=project.id, name="parent")
    child = run_create(project_id=project.id, parent_id=parent.id, name="child")
    return parent, child


# Runs ------------------------------------------------------------------------------------


def test_run_changelist_shows_stored_and_effective_state(admin_client, project, tree):
    parent, child = tree
    run_cancel(run_id=parent.id, project_id=project.id)

    response = admin_client.get(RUNS)

    assert response.status_code == 200
    rows = {run.id: run for run in response.context["cl"].result_list}
    assert rows.keys() == {parent.id, child.id}
    html = response.content.decode()
    assert html.count("INACTIVE (CANCELLED)") == 2
    assert run_url(parent) in html  # the child's parent column links to the parent


def test_run_changelist_costs_the_same_queries_for_more_runs(admin_client, project):
    root = run_create(project_id=project.id)
    middle = run_create(project_id=project.id, parent_id=root.id)

    def queries_for_pages():
        counts = []
        # The whole list, then only the grandchildren, whose ancestors are not on the page.
        for query in ({}, {"parent__exact": str(middle.pk)}):
            with CaptureQueriesContext(connection) as captured:
                assert admin_client.get(RUNS, query).status_code == 200
            counts.append(len(captured))
        return counts

    run_create(project_id=project.id, parent_id=middle.id)
    few = queries_for_pages()
    for _ in range(6):
        run_create(project_id=project.id, parent_id=middle.id)

    assert queries_for_pages() == few


def test_child_change_page_shows_it_inactive_because_its_parent_is_cancelled(admin_client, project, tree):
    parent, child = tree
    run_cancel(run_id=parent.id, project_id=project.id)

    response = admin_client.get(run_url(child))

    assert response.status_code == 200
    assert response.context["original"].stored_state == RunState.ACTIVE
    field = re.search(r"field-effective_detail.*?</div>\s*</div>", response.content.decode(), re.S).group(0)
    assert "INACTIVE" in field
    assert "CANCELLED" in field
    assert run_url(parent) in field  # names the ancestor that causes it


def test_parent_change_page_links_its_children_and_the_filtered_changelist(admin_client, project, tree):
    parent, child = tree
    other_root = run_create(project_id=project.id, name="unrelated")

    response = admin_client.get(run_url(parent))

    html = response.content.decode()
    assert response.status_code == 200
    assert run_url(child) in html
    filtered = f"{RUNS}?parent__exact={parent.pk}"
    assert filtered in html
    listed = admin_client.get(filtered)
    assert listed.status_code == 200
    assert [run.id for run in listed.context["cl"].result_list] == [child.id]
    assert other_root.id not in [run.id for run in listed.context["cl"].result_list]


def test_change_page_lists_fifty_children_and_counts_the_rest(admin_client, project):
    parent = run_create(project_id=project.id)
    for _ in range(53):
        run_create(project_id=project.id, parent_id=parent.id)

    html = admin_client.get(run_url(parent)).content.decode()

    children_field = re.search(r"field-children_links.*?</div>\s*</div>", html, re.S).group(0)
    assert children_field.count("<li>") == 50
    assert "and 3 more" in children_field


def test_run_search_matches_an_exact_id_or_the_name(admin_client, project, tree):
    parent, child = tree

    by_id = admin_client.get(RUNS, {"q": str(child.id)})
    by_name = admin_client.get(RUNS, {"q": "pare"})

    assert [run.id for run in by_id.context["cl"].result_list] == [child.id]
    assert [run.id for run in by_name.context["cl"].result_list] == [parent.id]


def test_runs_cannot_be_added_or_deleted_in_the_admin(admin_client, tree):
    parent, _ = tree

    assert admin_client.get(reverse("admin:coordination_run_add")).status_code == 403
    assert admin_client.get(reverse("admin:coordination_run_delete", args=[parent.pk])).status_code == 403


def test_run_change_form_saves_the_name_only(admin_client, project, tree):
    parent, _ = tree
    page = admin_client.get(run_url(parent))  # the form is read while the run is active…
    assert list(page.context["adminform"].form.fields) == ["name"]
    run_cancel(run_id=parent.id, project_id=project.id)  # …and cancelled before it is posted

    response = admin_client.post(run_url(parent), {"name": "renamed", "stored_state": "ACTIVE"})

    assert response.status_code == 302
    parent.refresh_from_db()
    assert parent.name == "renamed"
    assert parent.stored_state == RunState.CANCELLED


def test_cancel_action_cancels_the_run_and_makes_its_subtree_inactive(admin_client, project, tree):
    parent, child = tree

    response = post_action(admin_client, RUNS, "cancel_selected", [parent], confirm="yes")

    assert response.status_code == 200
    assert Run.objects.get(id=parent.id).stored_state == RunState.CANCELLED
    assert Run.objects.get(id=parent.id).cancel_reason == "cancelled by admin in admin"
    child = Run.objects.get(id=child.id)
    assert child.stored_state == RunState.ACTIVE  # a child's own state does not change…
    assert runs_effective([child])[child.id].effective == Effective.INACTIVE  # …but it stops
    assert Event.objects.filter(type="run.cancelled", run_id=parent.id).count() == 1
    assert messages_of(response) == [(messages.SUCCESS, f"Cancelled 1 run: {Run.objects.get(id=parent.id)}.")]


def test_complete_action_on_a_cancelled_run_reports_the_failure_and_changes_nothing(admin_client, project, tree):
    parent, _ = tree
    run_cancel(run_id=parent.id, project_id=project.id)

    response = post_action(admin_client, RUNS, "complete_selected", [parent], confirm="yes")

    assert Run.objects.get(id=parent.id).stored_state == RunState.CANCELLED
    assert not Event.objects.filter(type="run.completed", run_id=parent.id).exists()
    [(level, text)] = messages_of(response)
    assert level == messages.ERROR
    assert "SCOPE_CANCELLED" in text
    assert str(parent.id) in text


def test_complete_action_completes_an_active_run(admin_client, project, tree):
    parent, _ = tree

    post_action(admin_client, RUNS, "complete_selected", [parent], confirm="yes")

    assert Run.objects.get(id=parent.id).stored_state == RunState.COMPLETED
    assert Event.objects.filter(type="run.completed", run_id=parent.id).count() == 1


def test_cancel_action_on_a_completed_run_reports_scope_completed(admin_client, project, tree):
    parent, _ = tree
    run_complete(run_id=parent.id, project_id=project.id)

    response = post_action(admin_client, RUNS, "cancel_selected", [parent], confirm="yes")

    assert [level for level, _ in messages_of(response)] == [messages.ERROR]
    assert "SCOPE_COMPLETED" in messages_of(response)[0][1]
    assert Run.objects.get(id=parent.id).stored_state == RunState.COMPLETED


# API keys --------------------------------------------------------------------------------


def add_key(client, project, follow=True, **fields):
    data = {
        "project": str(project.pk),
        "name": "ci",
        "permissions": ["coordination_read", "coordination_write"],
        "run": "",
        "expires_at_0": "",
        "expires_at_1": "",
        **fields,
    }
    return client.post(KEY_ADD, data, follow=follow)


def every_stored_value():
    for model in apps.get_models():
        for row in model.objects.values_list(*[field.attname for field in model._meta.concrete_fields]):
            yield from (str(value) for value in row)


def shown_key(response) -> str:
    """Return the one plaintext key the page shows (it must show exactly one, exactly once)."""
    shown = PLAINTEXT.findall(response.content.decode())
    assert len(shown) == 1, shown
    return shown[0]


def test_add_form_creates_a_key_through_the_service_and_shows_it_once(admin_client, project):
    response = add_key(admin_client, project)

    assert response.status_code == 200
    plaintext = shown_key(response)
    assert "will not be shown again" in response.content.decode()
    api_key = api_key_authenticate(plaintext)
    assert api_key is not None
    assert api_key.project == project
    assert api_key.name == "ci"
    assert api_key.permissions == ["coordination_read", "coordination_write"]
    assert api_key.run_id is None
    assert ApiKey.objects.count() == 1
    # Shown once: the change page never has it again.
    change_page = admin_client.get(reverse("admin:coordination_apikey_change", args=[api_key.pk]))
    assert plaintext not in change_page.content.decode()
    # Stored nowhere: not in the key's row, nor in any column of any table.
    secret = secret_of(plaintext)
    for field in ApiKey._meta.concrete_fields:
        assert secret not in str(getattr(api_key, field.attname))
    assert not [value for value in every_stored_value() if secret in value]


def cookie_texts(response):
    """Yield every cookie the response sets, raw and, for the messages cookie, decoded."""
    messages_cookie = CookieStorage(HttpRequest())
    for morsel in response.cookies.values():
        yield morsel.value
        decoded = messages_cookie._decode(morsel.value)  # None unless it is a signed messages cookie
        if decoded:
            yield " ".join(str(message) for message in decoded)


def test_a_new_key_is_shown_on_a_page_of_its_own_never_in_a_cookie_or_the_session(admin_client, project):
    """Issue 25: the plaintext travelled in the signed, unencrypted ``messages`` cookie."""
    response = add_key(admin_client, project, follow=False)

    assert response.status_code == 200  # the page itself, not a redirect carrying a message
    assert "no-store" in response["Cache-Control"]
    plaintext = shown_key(response)
    secret = secret_of(plaintext)
    assert not [text for text in cookie_texts(response) if secret in text]
    session = admin_client.session
    assert secret not in str(dict(session.items()))
    assert secret not in str(session.encode(dict(session.items())))
    # The next page shows no message with it either.
    following = admin_client.get(KEYS)
    assert secret not in following.content.decode()
    assert not [text for text in cookie_texts(following) if secret in text]


def test_add_form_binds_the_key_to_a_run_of_the_project(admin_client, project, tree):
    parent, _ = tree

    response = add_key(admin_client, project, run=str(parent.pk))

    assert api_key_authenticate(shown_key(response)).run_id == parent.id


def test_add_form_refuses_a_run_of_another_project(admin_client, project, other_project):
    foreign_run = run_create(project_id=other_project.id)

    response = add_key(admin_client, project, run=str(foreign_run.pk))

    assert response.status_code == 200
    assert "This run belongs to another project." in response.content.decode()
    assert not ApiKey.objects.exists()


def test_add_form_refuses_a_past_expiry_and_no_permissions(admin_client, project):
    response = add_key(admin_client, project, permissions=[], expires_at_0="2000-01-01", expires_at_1="00:00:00")

    errors = response.context["adminform"].form.errors
    assert set(errors) == {"permissions", "expires_at"}
    assert not ApiKey.objects.exists()


def test_key_change_form_edits_the_name_only_and_never_shows_the_hash(admin_client, project):
    issued = api_key_create(project_id=project.id, permissions=["coordination_read"], name="before")
    url = reverse("admin:coordination_apikey_change", args=[issued.api_key.pk])

    page = admin_client.get(url)
    response = admin_client.post(url, {"name": "after", "permissions": '["resource_config"]'})

    assert list(page.context["adminform"].form.fields) == ["name"]
    assert issued.api_key.key_hash not in page.content.decode()
    assert issued.api_key.key_hash not in admin_client.get(KEYS).content.decode()
    assert response.status_code == 302
    api_key = ApiKey.objects.get(pk=issued.api_key.pk)
    assert api_key.name == "after"
    assert api_key.permissions == ["coordination_read"]


def test_revoke_action_makes_the_key_stop_authenticating(admin_client, project):
    issued = api_key_create(project_id=project.id, permissions=["coordination_read"])
    kept = api_key_create(project_id=project.id, permissions=["coordination_read"])

    response = post_action(admin_client, KEYS, "revoke_selected", [issued.api_key])

    assert api_key_authenticate(issued.plaintext) is None
    assert ApiKey.objects.get(pk=issued.api_key.pk).revoked_at is not None
    assert api_key_authenticate(kept.plaintext) is not None
    assert messages_of(response) == [(messages.SUCCESS, "Revoked 1 key.")]


def test_keys_cannot_be_deleted_in_the_admin(admin_client, project):
    issued = api_key_create(project_id=project.id, permissions=["coordination_read"])

    url = reverse("admin:coordination_apikey_delete", args=[issued.api_key.pk])

    assert admin_client.get(url).status_code == 403


# Projects and events ---------------------------------------------------------------------


def test_project_add_form_ensures_the_project(admin_client, db):
    response = admin_client.post(reverse("admin:coordination_project_add"), {"name": "initech"}, follow=True)

    assert response.status_code == 200
    assert Project.objects.filter(name="initech").count() == 1


def test_event_admin_is_read_only(admin_client, project, tree):
    parent, _ = tree
    event = Event.objects.filter(type="run.created", run_id=parent.id).get()

    assert admin_client.get(reverse("admin:coordination_event_add")).status_code == 403
    assert admin_client.get(reverse("admin:coordination_event_delete", args=[event.pk])).status_code == 403
    assert admin_client.get(EVENTS).status_code == 200
    view = admin_client.get(reverse("admin:coordination_event_change", args=[event.pk]))
    assert view.status_code == 200
    assert view.context["title"].startswith("View")
    assert admin_client.post(reverse("admin:coordination_event_change", args=[event.pk]), {}).status_code == 403


def test_event_search_matches_subject_or_run_id_exactly(admin_client, project, tree):
    parent, child = tree

    by_run = admin_client.get(EVENTS, {"q": str(child.id)})
    nothing = admin_client.get(EVENTS, {"q": str(uuid.uuid4())})

    assert {(event.type, event.run_id) for event in by_run.context["cl"].result_list} == {("run.created", child.id)}
    assert list(nothing.context["cl"].result_list) == []


@pytest.mark.django_db
def test_the_admin_says_runstate_not_django(client, admin_client):
    login = client.get("/admin/login/").content.decode()
    index = admin_client.get("/admin/").content.decode()
    for page in (login, index):
        assert "<title>" in page and "runstate" in page
        assert "Django administration" not in page and "Django site admin" not in page
