"""A real API server for the SDK: uvicorn in a child process on the test database.

pytest-django's ``live_server`` is WSGI and cannot serve the async long-poll views, so the
tests start ``uvicorn runstate_project.asgi:application`` themselves, pointed at the test
database. Keys are created in the test process (committed: the tests are transactional) and
handed to the SDK through ``RUNSTATE_URL`` / ``RUNSTATE_API_KEY``, as a user would.
"""

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from django.db import connection

from coordination.services.keys import ALL_PERMISSIONS, api_key_create, project_ensure
from tests.operator.live import uvicorn_server
from tests.waiting import wait_until
from tests.workers.live import test_database_url

ROOT = Path(__file__).resolve().parents[2]


def server_env(**extra: str) -> dict[str, str]:
    """The environment of a child process that talks to the test database."""
    env = dict(os.environ)
    env.update(
        DATABASE_URL=test_database_url(),
        DJANGO_SETTINGS_MODULE="runstate_project.settings",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


@pytest.fixture(scope="session")
def sdk_server(django_db_setup, tmp_path_factory):
    """Start one uvicorn server on the test database for the whole session."""
    with uvicorn_server(tmp_path_factory.mktemp("sdk-server")) as server:
        yield server


@dataclass(frozen=True)
class Credentials:
    url: str
    api_key: str
    project_id: object


def wait_for_quiet_server() -> None:
    """Wait until no other connection to the test database is inside a statement or transaction.

    A worker stopped mid long-poll abandons its request; the server cancels the view, but a
    read already running in a thread finishes first. Letting it end keeps the flush that
    follows each transactional test from contending with it for locks. A server still busy
    after ``WAIT_S`` fails nothing: the flush then goes ahead and waits for its locks.
    """
    query = (
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND pid <> pg_backend_pid() AND state IN ('active', 'idle in transaction')"
    )
    if connection.vendor != "postgresql":  # SQLite has no pg_stat_activity (and one writer at a time)
        return
    with connection.cursor() as cursor:

        def quiet() -> bool:
            cursor.execute(query)
            return cursor.fetchone()[0] == 0

        with contextlib.suppress(AssertionError):
            wait_until(quiet, what="the other sessions of the test database to go quiet")


@pytest.fixture
def sdk(sdk_server, transactional_db, monkeypatch):
    """A project with an all-permission key, exported as RUNSTATE_URL / RUNSTATE_API_KEY."""
    project = project_ensure(name="sdk")
    issued = api_key_create(project_id=project.id, permissions=list(ALL_PERMISSIONS), name="sdk tests")
    monkeypatch.setenv("RUNSTATE_URL", sdk_server.url)
    monkeypatch.setenv("RUNSTATE_API_KEY", issued.plaintext)
    monkeypatch.delenv("RUNSTATE_SCOPE_ID", raising=False)
    yield Credentials(url=sdk_server.url, api_key=issued.plaintext, project_id=project.id)
    wait_for_quiet_server()


@pytest.fixture
def make_key(sdk):
    """Create another key of the same project with some permissions (optionally bound to a run)."""

    def make(permissions, run_id=None):
        return api_key_create(project_id=sdk.project_id, permissions=list(permissions), run_id=run_id).plaintext

    return make
