"""API keys never reach a log or a table in plaintext, wherever a caller puts them.

A real uvicorn (its access log on, as in a default deployment, and every logger at DEBUG)
serves requests carrying a valid key, a revoked one and bad ones: in ``Authorization``, with
the wrong scheme, in the query string, in odd headers (``X-API-Key``, ``X-Request-ID``,
cookies), in the path and in a refused body field. Afterwards neither any plaintext nor its
secret part appears in anything the server wrote, nor in any row of any table.
"""

import secrets

import httpx
import pytest
from django.db import connection

from coordination.services.keys import ALL_PERMISSIONS, api_key_create, api_key_revoke, project_ensure
from tests.conftest import secret_of
from tests.operator.live import uvicorn_server

pytestmark = pytest.mark.django_db(transaction=True)


def table_dump() -> str:
    """Return every row of every table as one string."""
    rows = []
    with connection.cursor() as cursor:
        for table in connection.introspection.table_names():
            cursor.execute(f'SELECT * FROM "{table}"')
            rows.extend(" ".join(str(value) for value in row) for row in cursor.fetchall())
    return "\n".join(rows)


def test_no_key_is_logged_or_stored_whatever_the_request(tmp_path):
    project = project_ensure(name="leaky")
    valid = api_key_create(project_id=project.id, permissions=list(ALL_PERMISSIONS), name="valid").plaintext
    revoked_key = api_key_create(project_id=project.id, permissions=list(ALL_PERMISSIONS), name="revoked")
    api_key_revoke(api_key_id=revoked_key.api_key.id)
    revoked = revoked_key.plaintext
    prefix = valid.split("_")[1]
    wrong_secret = f"rs_{prefix}_{secrets.token_urlsafe(32)}"
    unknown = f"rs_{secrets.token_hex(6)}_{secrets.token_urlsafe(32)}"
    keys = {"valid": valid, "revoked": revoked, "wrong secret": wrong_secret, "unknown prefix": unknown}

    env = {"LOG_LEVEL": "DEBUG", "RUNSTATE_DB_POOL_SIZE": "5"}
    with uvicorn_server(tmp_path / "uvicorn", log_level="info", **env) as server:
        statuses = []
        with httpx.Client(base_url=server.url, timeout=30) as client:

            def call(method, url, **kwargs):
                statuses.append(client.request(method, url, **kwargs).status_code)

            for key in keys.values():
                bearer = {"Authorization": f"Bearer {key}"}
                call("GET", "/v1/runs", headers=bearer)
                call("POST", "/v1/runs", headers=bearer, json={"name": "ok"})
                call("POST", "/v1/runs", headers=bearer, json={"apiKey": key})  # refused field
                call("POST", "/v1/runs", headers=bearer, content=b"{not json")
                call("GET", f"/v1/runs/{key}", headers=bearer)  # in the path
                call("GET", "/v1/tasks/nope/result?timeoutMs=10", headers=bearer)
                call("DELETE", "/v1/runs", headers=bearer)  # 405
                for header in (f"Token {key}", f"Bearer {key} extra", f"Basic {key}", key):
                    call("GET", "/v1/runs", headers={"Authorization": header})
                for query in (f"api_key={key}", f"key={key}", f"token={key}&access_token={key}", f"x={key}"):
                    call("GET", f"/v1/runs?{query}")
                    call("GET", f"/v1/runs?{query}", headers=bearer)
                    call("GET", f"/v1/healthz?{query}")
                    call("GET", f"/v1/no-such-endpoint?{query}")
                call("GET", "/v1/runs", headers={"X-API-Key": key})
                call("GET", "/v1/runs", headers={"X-Request-ID": key, **bearer})
                call("GET", "/v1/runs", headers={"Cookie": f"apiKey={key}; sessionid={key}"})
                call("GET", "/v1/runs", headers={"Proxy-Authorization": f"Bearer {key}"})
        log = server.log_path.read_text(errors="replace")
    assert {200, 201, 400, 401, 404, 405} <= set(statuses)
    assert '"logger": "runstate.request"' in log and "GET /v1/runs" in log, "the server logged the requests"

    stored = table_dump()
    for name, key in keys.items():
        for text, where in ((log, "the server's log"), (stored, "a table")):
            assert key not in text, f"the {name} key in plaintext in {where}"
            assert secret_of(key) not in text, f"the {name} key's secret in {where}"
