"""Safe production defaults (issue 25): DEBUG off unless set, no credential on the debug page, HTTPS and a CSP.

Settings are read once per process, so what the environment decides is checked in a child
process that loads them; what a request gets is checked in-process.
"""

import asyncio
import json
import os
import stat
import subprocess
import sys

import pytest
from asgiref.testing import ApplicationCommunicator
from django.test import RequestFactory, override_settings
from django.views.debug import technical_500_response

from tests.operator.live import ROOT, asgi_http_scope

SETTINGS_PROBE = (
    "import json, django; django.setup(); from django.conf import settings as s; "
    "print(json.dumps({name: getattr(s, name, None) for name in ("
    "'DEBUG', 'SECRET_KEY', 'SESSION_COOKIE_SECURE', 'CSRF_COOKIE_SECURE', 'SECURE_SSL_REDIRECT',"
    "'SECURE_HSTS_SECONDS', 'SECURE_HSTS_INCLUDE_SUBDOMAINS', 'SECURE_HSTS_PRELOAD', 'SECURE_PROXY_SSL_HEADER')}))"
)
# What a shell that set none of these has.
UNSET = (
    "DEBUG",
    "SECRET_KEY",
    "RUNSTATE_HTTPS",
    "RUNSTATE_PROXY_SSL_HEADER",
    "SESSION_COOKIE_SECURE",
    "CSRF_COOKIE_SECURE",
    "SECURE_SSL_REDIRECT",
    "SECURE_HSTS_SECONDS",
    "SECURE_HSTS_INCLUDE_SUBDOMAINS",
    "SECURE_HSTS_PRELOAD",
)


def settings_of(var_dir, **env) -> dict:
    """Return the settings a fresh process loads with ``env`` (and nothing of UNSET from this one)."""
    child_env = {name: value for name, value in os.environ.items() if name not in UNSET}
    child_env.update(DJANGO_SETTINGS_MODULE="runstate_project.settings", RUNSTATE_VAR_DIR=str(var_dir), **env)
    done = subprocess.run(
        [sys.executable, "-c", SETTINGS_PROBE], cwd=ROOT, env=child_env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_debug_is_off_and_a_private_secret_key_is_generated_when_nothing_is_set(tmp_path):
    first = settings_of(tmp_path)
    assert first["DEBUG"] is False
    key_file = tmp_path / "secret_key"
    assert first["SECRET_KEY"] == key_file.read_text().strip()
    assert len(first["SECRET_KEY"]) >= 50
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600, "only its owner reads the key"
    # Every process of the same var directory signs with the same key.
    assert settings_of(tmp_path)["SECRET_KEY"] == first["SECRET_KEY"]
    assert settings_of(tmp_path, DEBUG="1")["DEBUG"] is True
    assert settings_of(tmp_path, SECRET_KEY="x" * 60)["SECRET_KEY"] == "x" * 60


def test_plain_http_by_default_and_the_https_set_with_runstate_https(tmp_path):
    local = settings_of(tmp_path)
    assert (local["SESSION_COOKIE_SECURE"], local["CSRF_COOKIE_SECURE"], local["SECURE_SSL_REDIRECT"]) == (
        False,
        False,
        False,
    )
    assert local["SECURE_HSTS_SECONDS"] == 0
    assert local["SECURE_PROXY_SSL_HEADER"] is None

    https = settings_of(tmp_path, RUNSTATE_HTTPS="1", RUNSTATE_PROXY_SSL_HEADER="X-Forwarded-Proto")
    assert https["SESSION_COOKIE_SECURE"] and https["CSRF_COOKIE_SECURE"] and https["SECURE_SSL_REDIRECT"]
    assert https["SECURE_HSTS_SECONDS"] >= 31_536_000
    assert https["SECURE_HSTS_INCLUDE_SUBDOMAINS"] and https["SECURE_HSTS_PRELOAD"]
    assert https["SECURE_PROXY_SSL_HEADER"] == ["HTTP_X_FORWARDED_PROTO", "https"]
    # Each part can be turned back off on its own.
    assert settings_of(tmp_path, RUNSTATE_HTTPS="1", SECURE_HSTS_PRELOAD="0")["SECURE_HSTS_PRELOAD"] is False


def test_check_deploy_is_clean_under_the_documented_production_environment(tmp_path):
    """The same script CI runs (scripts/test): DEBUG=0, a fresh 50+ character key, RUNSTATE_HTTPS=1..."""
    env = {name: value for name, value in os.environ.items() if name not in UNSET}
    env.update(RUNSTATE_VAR_DIR=str(tmp_path), PATH=f"{os.path.dirname(sys.executable)}:{env.get('PATH', '')}")
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "check_deploy")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "System check identified no issues" in done.stdout, done.stdout + done.stderr


def test_check_deploy_warns_when_the_secret_key_is_the_generated_one(tmp_path):
    env = {name: value for name, value in os.environ.items() if name not in UNSET}
    env.update(RUNSTATE_VAR_DIR=str(tmp_path), RUNSTATE_HTTPS="1", ALLOWED_HOSTS="runstate.example.com")
    done = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode != 0
    assert "runstate.W001" in done.stderr + done.stdout


# Built, not written out: the debug page also shows the source lines around each frame.
SECRET = "s3" + "cret"
CREDENTIALS = {
    "DATABASE_URL": f"postgres://runstate:{SECRET}-db@db.internal:5432/runstate",
    "CELERY_BROKER_URL": f"redis://:{SECRET}-broker@broker.internal:6379/0",
    "CELERY_BROKER_TRANSPORT_OPTIONS": {"sentinels": [f"redis://user:{SECRET}-sentinel@sentinel:26379"]},
    "RUNSTATE_SOME_FALLBACK_URLS": [f"amqp://rabbit:{SECRET}:with@at@rabbit/vhost"],
}


def debug_page(accept: str) -> str:
    """Render Django's debug page for an error raised with a URL with a password in a local variable."""
    request = RequestFactory().get("/v1/runs", HTTP_ACCEPT=accept)
    # As a WSGI server passes the process environment in META (runserver --noasgi).
    request.META["DATABASE_URL"] = CREDENTIALS["DATABASE_URL"]
    request.META["CELERY_BROKER_URL"] = CREDENTIALS["CELERY_BROKER_URL"]
    connection_url = f"postgres://runstate:{SECRET}-local@db.internal/runstate"  # noqa: F841 - shown by the page
    conn_params = {"host": "db.internal", "password": f"{SECRET}-param"}  # noqa: F841 - shown by the page
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        return technical_500_response(request, *sys.exc_info()).content.decode()


@pytest.mark.parametrize("accept", ["text/html", "text/plain"])
def test_the_debug_page_hides_the_credentials_inside_url_valued_settings_and_environment(accept):
    with override_settings(DEBUG=True, **CREDENTIALS):
        page = debug_page(accept)
    assert "boom" in page and "db.internal" in page, "the page still shows what it shows"
    assert "DATABASE_URL" in page and "CELERY_BROKER_URL" in page
    assert SECRET not in page


def call(path: str, query: str = "", application=None) -> tuple[int, dict[bytes, bytes], bytes]:
    """GET ``path`` through the ASGI application (the API's own stack for /v1/)."""
    if application is None:
        from runstate_project.asgi import application

    async def scenario():
        communicator = ApplicationCommunicator(application, asgi_http_scope(path, query))
        await communicator.send_input({"type": "http.request", "body": b"", "more_body": False})
        start = await communicator.receive_output(10)
        body = b""
        while True:
            message = await communicator.receive_output(10)
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        return start["status"], {name.lower(): value for name, value in start["headers"]}, body

    return asyncio.run(scenario())


@pytest.mark.django_db(transaction=True)
def test_the_admin_and_the_api_docs_carry_a_csp_that_allows_no_inline_script():
    for path in ("/admin/login/", "/v1/docs", "/v1/healthz"):
        status, headers, body = call(path)
        assert status == 200, path
        policy = dict(part.strip().split(" ", 1) for part in headers[b"content-security-policy"].decode().split(";"))
        assert policy["script-src"] == "'self'", policy
        assert (policy["object-src"], policy["frame-ancestors"], policy["base-uri"]) == ("'none'",) * 3
        html = body.decode()
        assert html.count("<script") == html.count("<script src="), f"{path} has an inline script"
    # The docs page's own script is served apart, from the same origin, as JavaScript.
    status, headers, script = call("/v1/docs", "script=")
    assert status == 200 and headers[b"content-type"].startswith(b"application/javascript")
    assert b"SwaggerUIBundle" in script


@pytest.mark.django_db(transaction=True)
def test_with_https_plain_http_is_redirected_except_the_probes_a_balancer_and_prometheus_send():
    from django.core.asgi import get_asgi_application

    from runstate_project.asgi import ApiASGIHandler, _route

    # The middleware reads these settings when an application is built: build one under them.
    with override_settings(SECURE_SSL_REDIRECT=True):
        https_only = _route(ApiASGIHandler(), get_asgi_application())
        for path in ("/admin/login/", "/v1/runs", "/v1/docs"):
            status, headers, _ = call(path, application=https_only)
            assert (status, headers[b"location"]) == (301, f"https://testserver{path}".encode()), path
        for path in ("/v1/healthz", "/v1/readyz", "/v1/metrics"):
            status, _, _ = call(path, application=https_only)
            assert status != 301, path
