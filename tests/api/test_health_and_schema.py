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
