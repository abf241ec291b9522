"""The event stream and the dashboard's live feed flush each frame under both servers the README names.

``python manage.py runserver`` (the development server) and ``uvicorn`` (``scripts/start``,
and production) run as child processes on the test database, started the README's way. A
reader opens the stream, an event commits after the stream has started, and its frame must
arrive within a bounded wait. Under a WSGI ``runserver`` Django consumes an async streaming
response whole before sending anything, so no frame ever came.
"""

import re

import httpx
import pytest
from django.contrib.auth.models import User

from coordination.services.keys import ALL_PERMISSIONS, api_key_create
from coordination.services.runs import run_create
from tests.operator.live import Reader, runserver, uvicorn_server
from tests.waiting import WAIT_S

# The servers read the test database through their own connections: the data must be committed.
pytestmark = pytest.mark.django_db(transaction=True)

SERVERS = {"runserver": runserver, "uvicorn": uvicorn_server}


@pytest.fixture(params=list(SERVERS))
def server(request, tmp_path):
    # A short heartbeat lets a reader thread notice its stop flag quickly.
    with SERVERS[request.param](tmp_path / request.param, RUNSTATE_SSE_HEARTBEAT_S="0.5") as server:
        yield server


def log_in(url: str, username: str, password: str) -> dict[str, str]:
    """Log in through the admin's form, as a browser does; return the session's cookies."""
    with httpx.Client(base_url=url, timeout=10) as client:
        form = client.get("/admin/login/")
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form.text).group(1)
        fields = {"username": username, "password": password, "csrfmiddlewaretoken": token, "next": "/admin/"}
        answer = client.post("/admin/login/", data=fields)
        assert answer.status_code == 302, answer.text
        return dict(client.cookies)


def test_the_event_stream_sends_each_event_as_it_commits(project, server):
    key = api_key_create(project_id=project.id, permissions=list(ALL_PERMISSIONS)).plaintext
    reader = Reader(f"{server.url}/v1/events/stream", key)
    try:
        assert reader.connected.wait(WAIT_S), f"no byte of the stream within {WAIT_S} s:\n{server.log()}"
        assert reader.error is None, (reader.error, server.log())
        created = httpx.post(
            f"{server.url}/v1/runs", json={"name": "live"}, headers={"Authorization": f"Bearer {key}"}, timeout=10
        )
        assert created.status_code == 201, created.text
        _, frame = reader.next()
        assert (frame["event"], frame["data"]["subjectId"]) == ("run.created", created.json()["id"])
    finally:
        reader.close()


def test_the_dashboard_live_feed_sends_each_event_as_it_commits(project, server):
    User.objects.create_superuser("operator", "operator@example.com", "secret")
    cookies = log_in(server.url, "operator", "secret")
    # The page and its script (a static file) are served too.
    page = httpx.get(f"{server.url}/admin/dashboard/", cookies=cookies, timeout=10)
    assert page.status_code == 200 and "/static/coordination/dashboard.js" in page.text
    assert httpx.get(f"{server.url}/static/coordination/dashboard.js", timeout=10).status_code == 200

    reader = Reader(f"{server.url}/admin/dashboard/stream", cookies=cookies)
    try:
        assert reader.connected.wait(WAIT_S), f"no byte of the stream within {WAIT_S} s:\n{server.log()}"
        assert reader.error is None, (reader.error, server.log())
        run = run_create(project_id=project.id, name="live")
        _, frame = reader.next()
        assert frame["event"] == "runstate"
        assert (frame["data"]["type"], frame["data"]["subjectId"]) == ("run.created", str(run.id))
    finally:
        reader.close()
