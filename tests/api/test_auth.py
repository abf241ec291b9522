"""API keys over HTTP: authentication, permissions, project isolation, bound keys."""

from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection

from coordination.models import ApiKey
from coordination.services.keys import api_key_create, api_key_revoke
from coordination.services.runs import run_create
from tests.conftest import make_client, secret_of

pytestmark = pytest.mark.django_db


def code(response):
    return response.json()["error"]["code"]


def test_no_key_is_401(anon):
    response = anon.get("/v1/runs")
    assert response.status_code == 401
    assert code(response) == "UNAUTHENTICATED"
    assert response["WWW-Authenticate"].startswith("Bearer")


@pytest.mark.parametrize(
    "header",
    ["Bearer rs_000000000000_nope", "Bearer garbage", "Basic dXNlcjpwYXNz", "Bearer", "Bearer a b", "Bearer rs_ünï_x"],
)
def test_bad_keys_are_401(anon, project, header):
    anon.credentials(HTTP_AUTHORIZATION=header)
    response = anon.get("/v1/runs")
    assert response.status_code == 401
    assert code(response) == "UNAUTHENTICATED"


def test_right_prefix_wrong_secret_is_401(anon, api):
    plaintext = api.issued.plaintext
    anon.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext[:-2]}xx")
    assert anon.get("/v1/runs").status_code == 401


def test_revoked_key_is_401(api):
    assert api.get("/v1/runs").status_code == 200
    api_key_revoke(api_key_id=api.issued.api_key.id)
    response = api.get("/v1/runs")
    assert response.status_code == 401 and code(response) == "UNAUTHENTICATED"


def test_expired_key_is_401_and_unexpired_works(project):
    live = make_client(project, expires_at=datetime.now(UTC) + timedelta(hours=1))
    assert live.get("/v1/runs").status_code == 200
    ApiKey.objects.filter(id=live.issued.api_key.id).update(expires_at=datetime.now(UTC) - timedelta(seconds=1))
    response = live.get("/v1/runs")
    assert response.status_code == 401 and code(response) == "UNAUTHENTICATED"


@pytest.mark.parametrize(
    "permissions, method, url, body",
    [
        (["coordination_read"], "post", "/v1/runs", {}),
        (["coordination_write"], "get", "/v1/runs", None),
        (["coordination_write"], "get", "/v1/events", None),
        (["resource_config"], "post", "/v1/runs", {}),
    ],
)
def test_missing_permission_is_403(project, permissions, method, url, body):
    client = make_client(project, permissions=permissions)
    response = getattr(client, method)(url, body, format="json") if body is not None else client.get(url)
    assert response.status_code == 403
    assert code(response) == "PERMISSION_DENIED"


def test_permissions_allow_their_operations(project):
    writer = make_client(project, permissions=["coordination_write"])
    reader = make_client(project, permissions=["coordination_read"])
    run = writer.post("/v1/runs", {}, format="json").json()
    assert reader.get(f"/v1/runs/{run['id']}").status_code == 200
    assert writer.post(f"/v1/runs/{run['id']}/cancel", {}, format="json").status_code == 200
    assert reader.post(f"/v1/runs/{run['id']}/complete").status_code == 403


def test_other_projects_run_is_404_not_403(api, other_project):
    theirs = run_create(project_id=other_project.id)
    for response in (
        api.get(f"/v1/runs/{theirs.id}"),
        api.post(f"/v1/runs/{theirs.id}/cancel", {}, format="json"),
        api.get(f"/v1/events?runId={theirs.id}"),
    ):
        assert response.status_code == 404 and code(response) == "NOT_FOUND"


def test_plaintext_key_is_stored_in_no_table(api, project):
    plaintext = api.issued.plaintext
    secret = secret_of(plaintext)
    tables = connection.introspection.table_names()
    with connection.cursor() as cursor:
        for table in tables:
            cursor.execute(f'SELECT * FROM "{table}"')
            for row in cursor.fetchall():
                dump = " ".join(str(value) for value in row)
                assert plaintext not in dump, table
                assert secret not in dump, table


@pytest.mark.django_db(transaction=True)  # on PostgreSQL events are readable once committed
def test_bound_key_sees_only_its_subtree(project, api):
    root = run_create(project_id=project.id)
    scoped = run_create(project_id=project.id, parent_id=root.id)
    sibling = run_create(project_id=project.id, parent_id=root.id)
    bound = make_client(project, run_id=scoped.id)

    assert bound.get(f"/v1/runs/{scoped.id}").status_code == 200
    below = bound.post(f"/v1/runs/{scoped.id}/children", {}, format="json")
    assert below.status_code == 201
    assert bound.get(f"/v1/runs/{below.json()['id']}").status_code == 200

    for response in (
        bound.get(f"/v1/runs/{root.id}"),
        bound.get(f"/v1/runs/{sibling.id}"),
        bound.post(f"/v1/runs/{sibling.id}/cancel", {}, format="json"),
        bound.post(f"/v1/runs/{root.id}/children", {}, format="json"),
        bound.post("/v1/runs", {"parentId": str(sibling.id)}, format="json"),
    ):
        assert response.status_code == 404 and code(response) == "NOT_FOUND"
    listed = {r["id"] for r in bound.get("/v1/runs").json()["results"]}
    assert listed == {str(scoped.id), below.json()["id"]}
    events = bound.get("/v1/events").json()["events"]
    assert {e["runId"] for e in events} <= {str(scoped.id), below.json()["id"]}
    assert events, "the bound key sees the events of its own subtree"
    root_create = bound.post("/v1/runs", {}, format="json")
    assert root_create.status_code == 403 and code(root_create) == "PERMISSION_DENIED"


def test_key_creation_validates_permissions(project):
    from coordination.domain.exceptions import ValidationFailed

    with pytest.raises(ValidationFailed):
        api_key_create(project_id=project.id, permissions=["root"])
    with pytest.raises(ValidationFailed):
        api_key_create(project_id=project.id, permissions=[])
