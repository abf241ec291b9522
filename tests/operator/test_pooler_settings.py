"""Settings behind a pooler in transaction mode (issue 30, item 1; docs/deploy.md, "Behind PgBouncer").

What the environment decides is read in a child process that loads the settings; the check
(``coordination/plumbing/checks.py``, runstate.E001-E003) and the LISTEN connection's parameters are
checked in-process against settings overridden as the environment would set them. The stack
itself runs behind a real PgBouncer in tests/reliability/test_pgbouncer.py.
"""

import json
import os
import re
import subprocess
import sys

import dj_database_url
import pytest
from django.test import override_settings

from coordination.plumbing.checks import database_route_errors, refuse_unsafe_database_routes
from coordination.plumbing.notify import listen_params
from tests.operator.live import ROOT

POOLED = "postgres://runstate:pw@pgbouncer.internal:6432/runstate"
DIRECT = "postgres://runstate:pw@db.internal:5432/runstate?application_name=runstate-listen"

SETTINGS_PROBE = (
    "import json, django; django.setup(); from django.conf import settings as s; "
    "d = s.DATABASES['default']; print(json.dumps({'options': {k: v for k, v in d.get('OPTIONS', {}).items() "
    "if k in ('prepare_threshold', 'server_side_binding')}, 'no_server_cursors': d.get('DISABLE_SERVER_SIDE_CURSORS'), "
    "'listen': s.RUNSTATE_LISTEN_DATABASE_URL, 'pooler': s.RUNSTATE_DB_POOLER}))"
)
ENVIRONMENT = ("RUNSTATE_DB_POOLER", "RUNSTATE_DB_PREPARE_THRESHOLD", "RUNSTATE_LISTEN_DATABASE_URL")


def settings_of(tmp_path, **env) -> dict:
    """Return what a fresh process's settings make of ``env`` (a PostgreSQL DATABASE_URL; nothing is connected to)."""
    child_env = {name: value for name, value in os.environ.items() if name not in ENVIRONMENT}
    child_env.update(
        DJANGO_SETTINGS_MODULE="runstate_project.settings", RUNSTATE_VAR_DIR=str(tmp_path), DATABASE_URL=POOLED, **env
    )
    done = subprocess.run(
        [sys.executable, "-c", SETTINGS_PROBE], cwd=ROOT, env=child_env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_direct_by_default_prepared_statements_on_and_listen_on_the_same_url(tmp_path):
    seen = settings_of(tmp_path)
    assert seen == {
        "options": {"prepare_threshold": 1, "server_side_binding": True},
        "no_server_cursors": False,
        "listen": POOLED,
        "pooler": "",
    }


def test_behind_a_transaction_pooler_nothing_is_prepared_and_no_server_side_cursor_is_used(tmp_path):
    seen = settings_of(
        tmp_path,
        RUNSTATE_DB_POOLER="transaction",
        RUNSTATE_DB_PREPARE_THRESHOLD="off",
        RUNSTATE_LISTEN_DATABASE_URL=DIRECT,
    )
    assert seen == {
        "options": {"prepare_threshold": None},  # psycopg never prepares; client-side binding
        "no_server_cursors": True,
        "listen": DIRECT,
        "pooler": "transaction",
    }


def routes(*, pooler="transaction", prepare="off", listen=DIRECT, database=POOLED):
    """Settings as the environment would make them (runstate_project/settings.py)."""
    return override_settings(
        DATABASE_URL=database,
        RUNSTATE_DB_POOLER=pooler,
        RUNSTATE_DB_PREPARE_THRESHOLD=prepare,
        RUNSTATE_LISTEN_DATABASE_URL=listen or database,
        RUNSTATE_LISTEN_DATABASE=dj_database_url.parse(listen or database),
    )


@pytest.mark.parametrize(
    ("environment", "refused"),
    [
        ({}, []),
        ({"prepare": "1"}, ["runstate.E002"]),
        ({"listen": ""}, ["runstate.E003"]),
        ({"prepare": "5", "listen": ""}, ["runstate.E002", "runstate.E003"]),
        # The same pooler, another database alias (a pool in session mode for LISTEN): allowed.
        ({"listen": "postgres://runstate:pw@pgbouncer.internal:6432/runstate_session"}, []),
        # The same host, port, database and user through a URL spelled otherwise: the same route.
        ({"listen": POOLED + "?application_name=listen"}, ["runstate.E003"]),
        # A direct connection, or a pooler in session mode, keeps sessions: anything goes.
        ({"pooler": "", "prepare": "1", "listen": ""}, []),
        ({"pooler": "session", "prepare": "1", "listen": ""}, []),
        ({"pooler": "statement"}, ["runstate.E001"]),
    ],
    ids=[
        "documented",
        "prepared",
        "listen-pooled",
        "both",
        "listen-session-alias",
        "listen-same-route",
        "direct",
        "session",
        "unknown-mode",
    ],
)
def test_the_check_refuses_what_breaks_behind_a_transaction_pooler(environment, refused):
    with routes(**environment):
        errors = database_route_errors()
        assert [error.id for error in errors] == refused
        if refused:
            with pytest.raises(Exception, match="runstate refuses to start") as raised:
                refuse_unsafe_database_routes()
            assert all(code in str(raised.value) for code in refused)
        else:
            refuse_unsafe_database_routes()


def test_sqlite_has_no_pooler_to_check():
    with override_settings(DATABASE_URL=""):
        assert database_route_errors() == []


@pytest.mark.postgres_only
def test_the_listen_connection_goes_to_its_own_url(db):
    with override_settings(RUNSTATE_LISTEN_DATABASE_URL=DIRECT, RUNSTATE_LISTEN_DATABASE=dj_database_url.parse(DIRECT)):
        params = listen_params()
    assert {key: params.get(key) for key in ("host", "port", "dbname", "user", "password", "application_name")} == {
        "host": "db.internal",
        "port": 5432,
        "dbname": "runstate",
        "user": "runstate",
        "password": "pw",
        "application_name": "runstate-listen",
    }
    assert not {"prepare_threshold", "server_side_binding", "pool", "cursor_factory"} & set(params)


@pytest.mark.postgres_only
def test_without_a_listen_url_the_listen_connection_goes_where_the_requests_go(db, settings):
    from django.db import connection

    settings.RUNSTATE_LISTEN_DATABASE_URL = settings.DATABASE_URL
    params = listen_params()
    assert params["dbname"] == connection.settings_dict["NAME"]  # the test database, as the requests
    assert not {"prepare_threshold", "server_side_binding", "pool", "cursor_factory"} & set(params)


def test_check_deploy_runs_the_pooler_check(tmp_path):
    """scripts/check_deploy fails on a configuration that would break behind the pooler."""
    env = {name: value for name, value in os.environ.items() if name not in ENVIRONMENT}
    env.update(
        RUNSTATE_VAR_DIR=str(tmp_path),
        PATH=f"{os.path.dirname(sys.executable)}:{env.get('PATH', '')}",
        DATABASE_URL=POOLED,
        RUNSTATE_DB_POOLER="transaction",
        RUNSTATE_LISTEN_DATABASE_URL=DIRECT,
    )
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "check_deploy")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode != 0
    assert "runstate.E002" in done.stdout + done.stderr


# What would keep state on a server session, which a transaction pool hands to another client
# between transactions (docs/deploy.md, "Behind PgBouncer"). The LISTEN connection
# (coordination/plumbing/notify.py) is the one session runstate keeps, on a connection of its own.
SESSION_STATE = {
    "a session-level advisory lock": re.compile(r"pg_(try_)?advisory_lock(_shared)?\s*\(", re.I),
    "a session setting": re.compile(r"""execute\(\s*f?["']+\s*SET\s+(?!LOCAL\b)(SESSION\s+)?\w+\s*(=|TO\b)""", re.I),
    "set_config for the session": re.compile(r"set_config\([^)]*,\s*false\s*\)", re.I),
    "a temporary table": re.compile(r"CREATE\s+(GLOBAL\s+|LOCAL\s+)?TEMP(ORARY)?\s+TABLE", re.I),
    "a cursor WITH HOLD": re.compile(r"CURSOR\s+WITH\s+HOLD\s+FOR\b", re.I),
    "an explicit prepared statement": re.compile(r"\bprepare\s*=\s*True|\bPREPARE\s+\w+\s+(\(|AS\b)", re.I),
    "a LISTEN outside the hub": re.compile(r"""execute\(\s*f?["']LISTEN\b""", re.I),
}
SESSION_STATE_ALLOWED = {("coordination/plumbing/notify.py", "a LISTEN outside the hub")}


def test_no_code_keeps_state_on_a_server_session():
    found = []
    for package in ("coordination", "workers", "runstate_project"):
        for path in sorted((ROOT / package).rglob("*.py")):
            source = path.read_text()
            name = str(path.relative_to(ROOT))
            for what, pattern in SESSION_STATE.items():
                if pattern.search(source) and (name, what) not in SESSION_STATE_ALLOWED:
                    found.append(f"{name}: {what}")
    assert not found, found
    # The patterns find what they look for (the hub's own LISTEN is one).
    assert SESSION_STATE["a LISTEN outside the hub"].search(
        (ROOT / "coordination" / "plumbing" / "notify.py").read_text()
    )
    assert SESSION_STATE["a session setting"].search('cursor.execute("SET statement_timeout = 5")')
    assert not SESSION_STATE["a session setting"].search('cursor.execute("SET LOCAL statement_timeout = 5")')
    assert SESSION_STATE["a session-level advisory lock"].search("SELECT pg_advisory_lock(1)")
    assert not SESSION_STATE["a session-level advisory lock"].search("SELECT pg_advisory_xact_lock(1)")
