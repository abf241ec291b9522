"""Probes, the OpenAPI schema and the docs page need no key."""

import pytest

pytestmark = pytest.mark.django_db


def test_healthz_answers_without_a_key(anon):
    response = anon.get("/v1/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_readyz_checks_database_and_broker(anon):
    response = anon.get("/v1/readyz")
    assert response.status_code == 200, response.json()
    assert response.json()["checks"] == {"database": "ok", "broker": "ok"}


def test_readyz_is_503_with_an_envelope_when_the_broker_is_down(anon, monkeypatch):
    from runstate_project.celery import app

    original = app.conf.broker_url
    # Celery reads CELERY_BROKER_URL from the environment ahead of its configuration.
    monkeypatch.setenv("CELERY_BROKER_URL", "redis://127.0.0.1:1/0")
    app.conf.broker_url = "redis://127.0.0.1:1/0"
    try:
        response = anon.get("/v1/readyz")
    finally:
        app.conf.broker_url = original
    assert response.status_code == 503
    body = response.json()
    assert body["checks"]["database"] == "ok"
    assert body["checks"]["broker"] != "ok"
    assert body["error"]["code"] == "SERVICE_UNAVAILABLE"


def test_schema_lists_the_endpoints(anon):
    response = anon.get("/v1/schema", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert response.status_code == 200
    schema = response.json()
    paths = schema["paths"]
    for path in [
        "/v1/runs",
        "/v1/runs/{run_id}",
        "/v1/runs/{run_id}/children",
        "/v1/runs/{run_id}/cancel",
        "/v1/runs/{run_id}/complete",
        "/v1/events",
        "/v1/healthz",
        "/v1/readyz",
    ]:
        assert path in paths, path
    assert paths["/v1/runs"]["post"]["responses"]["201"]
    assert "409" in paths["/v1/runs/{run_id}/cancel"]["post"]["responses"]


def test_docs_page_is_served_without_a_cdn(anon):
    response = anon.get("/v1/docs")
    assert response.status_code == 200
    html = response.content.decode()
    assert "swagger" in html.lower()
    assert "cdn." not in html and "unpkg" not in html


def test_schema_declares_bearer_auth_and_leaves_probes_open(anon):
    schema = anon.get("/v1/schema", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    assert schema["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"
    assert schema["paths"]["/v1/runs"]["post"]["security"] == [{"bearerAuth": []}]
    assert schema["paths"]["/v1/healthz"]["get"].get("security") in (None, [], [{}])


def test_schema_generates_without_warnings():
    from io import StringIO

    from django.core.management import call_command

    out = StringIO()
    call_command("spectacular", "--validate", "--fail-on-warn", stdout=out)
    assert "/v1/groups/{group_id}/close" in out.getvalue()


def test_schema_lists_long_polls_and_every_operation_of_work_and_groups(anon):
    paths = anon.get("/v1/schema", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()["paths"]
    for path, method in [
        ("/v1/tasks/{task_id}/result", "get"),
        ("/v1/mailboxes/{name}/claims", "post"),
        ("/v1/groups/{group_id}/wait", "get"),
        ("/v1/groups/{group_id}/members/{task_id}/accept", "post"),
        ("/v1/mailboxes/{name}/deliveries", "post"),
        ("/v1/events", "get"),
    ]:
        assert method in paths[path], path


def test_every_keyed_operation_documents_the_transport_errors(anon):
    """406, 429 and 503 can answer any keyed operation, 413 and 415 any body: the schema says so."""
    paths = anon.get("/v1/schema", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()["paths"]
    for path, item in paths.items():
        for method, operation in item.items():
            documented = set(operation["responses"])
            if operation.get("security") == [{"bearerAuth": []}]:
                assert {"400", "401", "403", "404", "429", "503"} <= documented, (method, path)
                assert "Retry-After" in operation["responses"]["429"]["headers"]
                # The event stream answers whatever the Accept header says; every JSON operation may 406.
                assert ("406" in documented) == (path != "/v1/events/stream"), (method, path)
            if "requestBody" in operation:
                assert {"413", "415"} <= documented, (method, path)


def test_an_accept_header_without_json_is_406_with_an_envelope(api):
    response = api.get("/v1/runs", HTTP_ACCEPT="text/html")
    assert response.status_code == 406
    assert response.json()["error"]["code"] == "NOT_ACCEPTABLE"
