"""``/v1/metrics`` keeps to its tenants (issue 25): a project key sees its project, the scrape token every project.

Each project below has names no other project shares (mailbox, pool, quota, budget, root
run id), so a series leaking across tenants shows up as a name where it must not be.
"""

import pytest
from django.test import override_settings
from rest_framework.test import APIClient

from coordination.domain.states import Permission
from coordination.services.budgets import budget_create
from coordination.services.keys import project_ensure
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.pools import pool_put
from coordination.services.quotas import quota_put
from coordination.services.runs import run_create
from tests.conftest import make_client

# The event fold reads committed events through the metrics view's own queries.
pytestmark = pytest.mark.django_db(transaction=True)

TOKEN = "scrape-token-for-tests-0123456789"


def tenant(name: str) -> dict[str, str]:
    """Create project ``name`` with a mailbox, pool, quota and budget named after it; return the names."""
    project = project_ensure(name=name)
    run = run_create(project_id=project.id)
    mailbox_ensure(project_id=project.id, name=f"{name}-mailbox", mode="WORK")
    mailbox_ensure(project_id=project.id, name=f"{name}-queue", mode="QUEUE")
    pool_put(project_id=project.id, name=f"{name}-pool", capacity=2)
    quota_put(project_id=project.id, name=f"{name}-quota", limit=10, period_ms=1000)
    budget_create(project_id=project.id, run_id=run.id, name=f"{name}-budget", limit=100)
    return {
        "project": project,
        "names": [f'project="{name}"', f"{name}-mailbox", f"{name}-queue", f"{name}-pool", f"{name}-quota"]
        + [f"{name}-budget", str(run.id)],
    }


@pytest.fixture
def tenants():
    return tenant("initech"), tenant("umbrella")


def get(client, **headers):
    return client.get("/v1/metrics", **headers)


def test_metrics_without_credentials_are_401_with_the_envelope(tenants):
    response = get(APIClient())
    assert response.status_code == 401
    assert response["Content-Type"] == "application/json"
    assert response.json()["error"]["code"] == "UNAUTHENTICATED"
    assert response["WWW-Authenticate"].startswith("Bearer")
    for tenant_ in tenants:
        for name in tenant_["names"]:
            assert name not in response.content.decode()


@override_settings(RUNSTATE_METRICS_TOKEN=TOKEN)
def test_a_wrong_token_or_key_is_401(tenants):
    for header in (f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", "Bearer rs_nope_nope", f"Basic {TOKEN}", "Bearer"):
        response = get(APIClient(), HTTP_AUTHORIZATION=header)
        assert response.status_code == 401, header
        assert response.json()["error"]["code"] == "UNAUTHENTICATED"


def test_a_project_key_sees_only_its_own_projects_series(tenants):
    mine, theirs = tenants
    client = make_client(mine["project"], permissions=[Permission.COORDINATION_READ])
    response = get(client)
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    text = response.content.decode()
    for name in mine["names"]:
        assert name in text, name
    for name in theirs["names"]:
        assert name not in text, name
    # Series of the whole service (request counts of the process, sweeps) are the operator's.
    assert "runstate_http_requests_total" not in text
    assert "runstate_sweep_lag_seconds" not in text
    # The state gauges are there, counted over this project only: one run each.
    assert 'runstate_runs{state="ACTIVE"} 1.0' in text


@override_settings(RUNSTATE_METRICS_TOKEN=TOKEN)
def test_the_scrape_token_sees_every_project(tenants):
    response = get(APIClient(), HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 200
    text = response.content.decode()
    for tenant_ in tenants:
        for name in tenant_["names"]:
            assert name in text, name
    assert "runstate_sweep_lag_seconds" in text
    assert 'runstate_runs{state="ACTIVE"} 2.0' in text


@override_settings(RUNSTATE_METRICS_TOKEN="")
def test_no_token_configured_lets_no_empty_bearer_in(tenants):
    for header in ("Bearer ", "Bearer  ", 'Bearer ""'):
        assert get(APIClient(), HTTP_AUTHORIZATION=header).status_code == 401, header


def test_a_key_without_coordination_read_is_403(tenants):
    mine, _ = tenants
    client = make_client(mine["project"], permissions=[Permission.COORDINATION_WRITE, Permission.RESOURCE_CONFIG])
    response = get(client)
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "PERMISSION_DENIED"


def test_a_key_bound_to_a_run_is_403(tenants):
    """Mailboxes, pools and quotas are the project's, wider than a bound key's subtree: refused."""
    mine, theirs = tenants
    run = run_create(project_id=mine["project"].id)
    client = make_client(mine["project"], permissions=[Permission.COORDINATION_READ], run_id=run.id)
    response = get(client)
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "PERMISSION_DENIED"
    for name in mine["names"] + theirs["names"]:
        assert name not in response.content.decode()


def test_the_schema_documents_the_credentials_and_their_errors(tenants):
    schema = APIClient().get("/v1/schema", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    operation = schema["paths"]["/v1/metrics"]["get"]
    schemes = {name for requirement in operation["security"] for name in requirement}
    assert schemes == {"bearerAuth", "metricsToken"}
    assert {"401", "403"} <= set(operation["responses"])
    assert schema["components"]["securitySchemes"]["metricsToken"]["scheme"] == "bearer"
