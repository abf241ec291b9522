"""The hot path (coordination/api/hot) answers exactly what the DRF views answer.

Each request goes through the real ASGI application (``runstate_project.asgi.application``),
once with the hot path on and once with it off (every request through DRF), each time on
fresh state built the same way: a project, its keys cached in the process as a running API
process has them, a mailbox, a run, queued tasks and one claimed. Status, body and headers
must be equal, after the values that differ by construction (ids, times, the request id)
are replaced by placeholders in order of appearance. ``SERVED`` shows that the hot path, not
DRF, answered the requests it serves, so the comparison cannot pass by both going through DRF.
"""

import asyncio
import json
import logging
import re
import threading
import uuid
from dataclasses import dataclass

import httpx
import pytest
from django.db import connection, transaction
from django.urls import resolve
from django.utils import timezone
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from coordination.api import hot
from coordination.api.auth import Principal
from coordination.api.hot import db as hot_db
from coordination.domain.states import MailboxMode, Permission
from coordination.models import ApiKey, Run, Task
from coordination.plumbing import process_cache
from coordination.plumbing.logging import JsonFormatter
from coordination.reads import selectors
from coordination.services.claims import claim_id_for, task_claim
from coordination.services.keys import api_key_authenticate, api_key_create, project_ensure
from coordination.services.mailboxes import mailbox_ensure, mailbox_get
from coordination.services.runs import run_create
from coordination.services.tasks import task_submit
from tests.api.test_process_cache import caches_on
from tests.concurrency.util import run_closing
from tests.tracing.conftest import spans  # noqa: F401 - the fixture: tracing on, an in-memory exporter
from tests.waiting import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres_only]

WRITE = [Permission.COORDINATION_READ, Permission.COORDINATION_WRITE]


@dataclass
class State:
    """What one side of a comparison starts from."""

    key: str
    foreign_key: str
    bound_key: str
    read_only_key: str
    run_id: str
    foreign_run_id: str
    claim_id: str
    task_id: str
    second_claim_id: str


def _cached_key(project, run_id=None, permissions=WRITE) -> str:
    """Issue a key and have this process cache it as a running API process would (used a moment ago)."""
    issued = api_key_create(project_id=project.id, permissions=list(permissions), run_id=run_id)
    generation = process_cache.api_keys.generation
    ApiKey.objects.filter(id=issued.api_key.id).update(last_used_at=timezone.now())
    # The update's notification forgets the key: wait for it before the key is read again.
    wait_until(lambda: process_cache.api_keys.generation > generation, what="the key's notification")
    api_key_authenticate(issued.plaintext)
    return issued.plaintext


def fresh_state() -> State:
    """Build a project with a mailbox, a run, two queued tasks and two claimed; cache what an API process would."""
    project = project_ensure(name=f"hot-{uuid.uuid4().hex[:12]}")
    foreign = project_ensure(name=f"hot-{uuid.uuid4().hex[:12]}")
    run = run_create(project_id=project.id, name="r")
    foreign_run = run_create(project_id=foreign.id, name="r")
    mailbox, _ = mailbox_ensure(project_id=project.id, name="work", mode=MailboxMode.WORK)
    for index in range(-1, 3):
        task_submit(project_id=project.id, mailbox=mailbox, run_id=run.id, input={"n": index}, priority=index)
    [claim] = task_claim(project_id=project.id, mailbox=mailbox, run_id=run.id, worker_id="w1")
    [second] = task_claim(project_id=project.id, mailbox=mailbox, run_id=run.id, worker_id="w1")
    state = State(
        key=_cached_key(project),
        foreign_key=_cached_key(foreign),
        bound_key=_cached_key(project, run_id=run.id),
        read_only_key=_cached_key(project, permissions=[Permission.COORDINATION_READ]),
        run_id=str(run.id),
        foreign_run_id=str(foreign_run.id),
        claim_id=claim.claim_id,
        task_id=str(claim.task.id),
        second_claim_id=second.claim_id,
    )
    # What the first requests of a running process have read: the mailbox, its name, the run.
    mailbox_get(project_id=project.id, name="work")
    selectors.mailbox_names([claim.task])
    visibility = Principal(ApiKey.objects.get(prefix=state.key.split("_")[1])).visibility
    selectors.run_ref(visibility, run.id)
    return state


# A request: (path, body, headers), built from a state. ``body`` None: no body; bytes: as is.
def complete(state, body=b'{"outcome": {"ok": true}}', **kwargs):
    return request(f"/v1/claims/{state.claim_id}/complete", body, state.key, **kwargs)


def request(path, body, key, *, content_type="application/json", accept=None, auth=None, extra=None):
    headers = dict(extra or {})
    if key is not None:
        headers["Authorization"] = auth or f"Bearer {key}"
    if body is not None:
        headers["Content-Type"] = content_type
    if accept is not None:
        headers["Accept"] = accept
    return path, body, headers


def claims(state, body: dict | bytes, key=None):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return request("/v1/mailboxes/work/claims", raw, key or state.key)


def submit(state, body: dict, key=None, extra=None):
    return request("/v1/mailboxes/work/tasks", json.dumps(body).encode(), key or state.key, extra=extra)


def batch(path: str, items: list, key: str | None = None, state=None):
    return request(path, json.dumps({"items": items}).encode(), key or state.key)


def complete_many(state, items: list, key=None):
    return batch("/v1/claims/complete", items, key, state)


def renew_many(state, items: list, key=None):
    return batch("/v1/claims/renew", items, key, state)


def submit_many(state, tasks: list, key=None, run_id=None, extra=None):
    body = json.dumps({"runId": run_id or state.run_id, "tasks": tasks}).encode()
    return request("/v1/mailboxes/work/tasks/batch", body, key or state.key, extra=extra)


def both(state) -> list[dict]:
    return [{"claimId": state.claim_id, "outcome": {"ok": True}}, {"claimId": state.second_claim_id}]


# A W3C trace context as a caller sends it (issue 29): the task stores it and its claim answers it.
TRACED = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tracestate": "vendor=1"}


def lost(state) -> str:
    task_hex = state.claim_id.split("_")[1]
    return claim_id_for(uuid.UUID(task_hex), 2)


CASES = {
    "complete": lambda s: [complete(s)],
    "complete null outcome": lambda s: [complete(s, b"{}")],
    "complete twice (second: lease lost)": lambda s: [complete(s), complete(s)],
    "complete unknown field": lambda s: [complete(s, b'{"outcome": 1, "bogus": 2}')],
    "complete malformed JSON": lambda s: [complete(s, b'{"outcome": ')],
    "complete NaN": lambda s: [complete(s, b'{"outcome": NaN}')],
    "complete form body": lambda s: [complete(s, b"outcome=1", content_type="application/x-www-form-urlencoded")],
    "complete unknown claim": lambda s: [request(f"/v1/claims/{claim_id_for(uuid.uuid4(), 1)}/complete", b"{}", s.key)],
    "complete malformed claim id": lambda s: [request("/v1/claims/nonsense/complete", b"{}", s.key)],
    "complete lost lease": lambda s: [request(f"/v1/claims/{lost(s)}/complete", b"{}", s.key)],
    "complete without a key": lambda s: [request(f"/v1/claims/{s.claim_id}/complete", b"{}", None)],
    "complete with a wrong key": lambda s: [complete(s, auth="Bearer rs_000000000000_nope")],
    "complete with a malformed header": lambda s: [complete(s, auth="Token abc")],
    "complete foreign project": lambda s: [request(f"/v1/claims/{s.claim_id}/complete", b"{}", s.foreign_key)],
    "complete bound key": lambda s: [request(f"/v1/claims/{s.claim_id}/complete", b"{}", s.bound_key)],
    "complete read-only key": lambda s: [request(f"/v1/claims/{s.claim_id}/complete", b"{}", s.read_only_key)],
    "complete accept html": lambda s: [complete(s, accept="text/html")],
    "complete accept json": lambda s: [complete(s, accept="application/json")],
    "fail": lambda s: [request(f"/v1/claims/{s.claim_id}/fail", b'{"error": {"why": "x"}}', s.key)],
    "fail and retry": lambda s: [
        request(f"/v1/claims/{s.claim_id}/fail", b'{"error": "x", "retry": true, "retryDelayMs": 10}', s.key)
    ],
    "fail negative delay": lambda s: [request(f"/v1/claims/{s.claim_id}/fail", b'{"retryDelayMs": -1}', s.key)],
    "release": lambda s: [request(f"/v1/claims/{s.claim_id}/release", None, s.key)],
    "release with a body": lambda s: [request(f"/v1/claims/{s.claim_id}/release", b"{nonsense", s.key)],
    "release lost lease": lambda s: [request(f"/v1/claims/{lost(s)}/release", None, s.key)],
    "renew": lambda s: [request(f"/v1/claims/{s.claim_id}/renew", b'{"leaseTtlMs": 60000}', s.key)],
    "renew default": lambda s: [request(f"/v1/claims/{s.claim_id}/renew", b"{}", s.key)],
    "renew too short": lambda s: [request(f"/v1/claims/{s.claim_id}/renew", b'{"leaseTtlMs": 5}', s.key)],
    "renew after complete": lambda s: [complete(s), request(f"/v1/claims/{s.claim_id}/renew", b"{}", s.key)],
    "claim": lambda s: [claims(s, {"runId": s.run_id, "workerId": "w2"})],
    "claim two": lambda s: [claims(s, {"runId": s.run_id, "max": 2, "leaseTtlMs": 1000})],
    "claim until empty": lambda s: [claims(s, {"runId": s.run_id, "max": 5}), claims(s, {"runId": s.run_id})],
    "claim waitMs 0": lambda s: [claims(s, {"runId": s.run_id, "waitMs": 0})],
    "claim unknown run": lambda s: [claims(s, {"runId": str(uuid.uuid4())})],
    "claim foreign run": lambda s: [claims(s, {"runId": s.foreign_run_id})],
    "claim malformed run": lambda s: [claims(s, {"runId": "x"})],
    "claim unknown mailbox": lambda s: [
        request("/v1/mailboxes/nope/claims", json.dumps({"runId": s.run_id}).encode(), s.key)
    ],
    "claim max 0": lambda s: [claims(s, {"runId": s.run_id, "max": 0})],
    "claim bound key": lambda s: [claims(s, {"runId": s.run_id}, key=s.bound_key)],
    "claim foreign key": lambda s: [claims(s, {"runId": s.run_id}, key=s.foreign_key)],
    "claim not a dict": lambda s: [claims(s, b"[1, 2]")],
    "submit": lambda s: [submit(s, {"runId": s.run_id, "input": {"a": [1, 2]}, "priority": 3})],
    "submit with a key twice": lambda s: [
        submit(s, {"runId": s.run_id, "key": "k"}),
        submit(s, {"runId": s.run_id, "key": "k"}),
    ],
    "submit key conflict": lambda s: [
        submit(s, {"runId": s.run_id, "key": "k", "input": 1}),
        submit(s, {"runId": s.run_id, "key": "k", "input": 2}),
    ],
    "submit expired": lambda s: [submit(s, {"runId": s.run_id, "expiresAt": "2001-01-01T00:00:00Z"})],
    "submit expiring": lambda s: [submit(s, {"runId": s.run_id, "expiresAt": "2100-01-01T00:00:00Z"})],
    "submit bad attempts": lambda s: [submit(s, {"runId": s.run_id, "maxAttempts": 0})],
    "submit unknown run": lambda s: [submit(s, {"runId": str(uuid.uuid4())})],
    "submit foreign run": lambda s: [submit(s, {"runId": s.foreign_run_id})],
    "submit without a run": lambda s: [submit(s, {"input": 1})],
    "submit foreign key": lambda s: [submit(s, {"runId": s.run_id}, key=s.foreign_key)],
    "submit bound key": lambda s: [submit(s, {"runId": s.run_id}, key=s.bound_key)],
    "submit without a key": lambda s: [request("/v1/mailboxes/work/tasks", b"{}", None)],
    "submit with a trace context, then claim it": lambda s: [
        submit(s, {"runId": s.run_id, "priority": 9}, extra=TRACED),
        claims(s, {"runId": s.run_id}),
    ],
    "submit with an invalid traceparent": lambda s: [
        submit(s, {"runId": s.run_id, "priority": 9}, extra={"traceparent": "00-nonsense"}),
        claims(s, {"runId": s.run_id}),
    ],
    # A value of another JSON type than the schema's is refused, never converted.
    "submit a number as key": lambda s: [submit(s, {"runId": s.run_id, "key": 5})],
    "submit a string as priority": lambda s: [submit(s, {"runId": s.run_id, "priority": "3"})],
    "submit true as priority": lambda s: [submit(s, {"runId": s.run_id, "priority": True})],
    "submit 3.0 as priority": lambda s: [submit(s, {"runId": s.run_id, "priority": 3.0})],  # an integer to JSON
    "claim a number as workerId": lambda s: [claims(s, {"runId": s.run_id, "workerId": 7})],
    "claim a string as max": lambda s: [claims(s, {"runId": s.run_id, "max": "2"})],
    "renew a string as leaseTtlMs": lambda s: [
        request(f"/v1/claims/{s.claim_id}/renew", b'{"leaseTtlMs": "60000"}', s.key)
    ],
    "fail 1 as retry": lambda s: [request(f"/v1/claims/{s.claim_id}/fail", b'{"error": {}, "retry": 1}', s.key)],
    "complete batch": lambda s: [complete_many(s, both(s))],
    "complete batch, some claims lost": lambda s: [complete_many(s, [*both(s), {"claimId": lost(s)}])],
    "complete batch, every claim lost": lambda s: [complete_many(s, [{"claimId": lost(s)}])],
    "complete batch twice": lambda s: [complete_many(s, both(s)), complete_many(s, both(s))],
    "complete batch, a malformed claim id": lambda s: [complete_many(s, [{"claimId": "nonsense"}, *both(s)])],
    "complete batch, only malformed claim ids": lambda s: [complete_many(s, [{"claimId": "nonsense"}])],
    "complete batch, an unknown claim": lambda s: [
        complete_many(s, [{"claimId": claim_id_for(uuid.uuid4(), 1)}, {"claimId": s.claim_id}])
    ],
    "complete batch, a claim twice": lambda s: [complete_many(s, [{"claimId": s.claim_id}] * 2)],
    "complete batch, an invalid item": lambda s: [complete_many(s, [{"claimId": 1}])],
    "complete batch, an unknown field": lambda s: [complete_many(s, [{"claimId": s.claim_id, "bogus": 1}])],
    "complete batch, empty": lambda s: [complete_many(s, [])],
    "complete batch, too many items": lambda s: [
        complete_many(s, [{"claimId": claim_id_for(uuid.uuid4(), 1)} for _ in range(501)])
    ],
    "complete batch, items not a list": lambda s: [request("/v1/claims/complete", b'{"items": {}}', s.key)],
    "complete batch foreign key": lambda s: [complete_many(s, both(s), key=s.foreign_key)],
    "complete batch bound key": lambda s: [complete_many(s, both(s), key=s.bound_key)],
    "complete batch read-only key": lambda s: [complete_many(s, both(s), key=s.read_only_key)],
    # Batch renew: POST /v1/claims/renew.
    "renew batch": lambda s: [
        renew_many(s, [{"claimId": s.claim_id, "leaseTtlMs": 60000}, {"claimId": s.second_claim_id}])
    ],
    "renew batch, some claims lost": lambda s: [
        renew_many(s, [{"claimId": s.claim_id}, {"claimId": lost(s)}, {"claimId": "nonsense"}])
    ],
    "renew batch, every claim lost": lambda s: [renew_many(s, [{"claimId": lost(s)}])],
    "renew batch after complete": lambda s: [
        complete(s),
        renew_many(s, [{"claimId": s.claim_id}, {"claimId": s.second_claim_id, "leaseTtlMs": None}]),
    ],
    "renew batch, too short": lambda s: [renew_many(s, [{"claimId": s.claim_id, "leaseTtlMs": 5}])],
    "renew batch, empty": lambda s: [renew_many(s, [])],
    "renew batch foreign key": lambda s: [renew_many(s, [{"claimId": s.claim_id}], key=s.foreign_key)],
    "renew batch bound key": lambda s: [renew_many(s, [{"claimId": s.claim_id}], key=s.bound_key)],
    # Batch submit: POST /v1/mailboxes/{name}/tasks/batch.
    "submit batch": lambda s: [submit_many(s, [{"input": {"a": 1}, "priority": 2}, {"key": "k", "maxAttempts": 2}])],
    "submit batch, a number as an item's key": lambda s: [submit_many(s, [{"input": 1}, {"key": 1}])],
    "complete batch, a number as a claim id": lambda s: [complete_many(s, [{"claimId": 5}])],
    "submit batch, then claim": lambda s: [
        submit_many(s, [{"priority": 9, "input": 1}, {"priority": 8, "input": 2}], extra=TRACED),
        claims(s, {"runId": s.run_id, "max": 2}),
    ],
    "submit batch twice (idempotent resubmit)": lambda s: [
        submit_many(s, [{"key": "a", "input": 1}, {"key": "b"}]),
        submit_many(s, [{"key": "a", "input": 1}, {"key": "b"}]),
    ],
    "submit batch, a key used before": lambda s: [
        submit(s, {"runId": s.run_id, "key": "a", "input": 1}),
        submit_many(s, [{"key": "a", "input": 1}, {"key": "b"}]),
    ],
    "submit batch, key conflict": lambda s: [
        submit_many(s, [{"key": "a", "input": 1}]),
        submit_many(s, [{"key": "a", "input": 2}, {"key": "b"}]),
    ],
    "submit batch, a key twice": lambda s: [submit_many(s, [{"key": "a", "input": 1}, {"key": "a", "input": 1}])],
    "submit batch, a key twice with other inputs": lambda s: [
        submit_many(s, [{"key": "a", "input": 1}, {"key": "a", "input": 2}])
    ],
    "submit batch, an expired item": lambda s: [submit_many(s, [{"input": 1}, {"expiresAt": "2001-01-01T00:00:00Z"}])],
    "submit batch, an invalid item": lambda s: [submit_many(s, [{"input": 1}, {"maxAttempts": 0}])],
    "submit batch, empty": lambda s: [submit_many(s, [])],
    "submit batch, too many items": lambda s: [submit_many(s, [{}] * 1001)],
    "submit batch unknown run": lambda s: [submit_many(s, [{}], run_id=str(uuid.uuid4()))],
    "submit batch foreign run": lambda s: [submit_many(s, [{}], run_id=s.foreign_run_id)],
    "submit batch foreign key": lambda s: [submit_many(s, [{}], key=s.foreign_key)],
    "submit batch bound key": lambda s: [submit_many(s, [{}], key=s.bound_key)],
}

# Values that differ between two fresh states by construction.
_TIME = re.compile(rb"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")
_ID = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|[0-9a-f]{32}")
_PER_REQUEST_HEADERS = {"x-request-id", "date"}
_THROTTLED = re.compile(rb"Expected available in (\d+) seconds?\.")


def _window_hidden(body: bytes, headers: dict[str, str]) -> tuple[bytes, dict[str, str]]:
    """Return a 429's body and headers with the seconds until its window ends replaced by ``<s>``.

    Both paths take them from the same window, but how long ago it opened is the machine's
    timing: one slow request before the 429 makes 60 s 59 s on one path only (a loaded
    run's failure). The header and the message must agree and be positive.
    """
    if "retry-after" not in headers:
        return body, headers
    seconds = int(headers["retry-after"])
    message = _THROTTLED.search(body)
    assert seconds > 0 and message is not None and int(message[1]) == seconds, (headers, body)
    return _THROTTLED.sub(b"Expected available in <s> seconds.", body), headers | {"retry-after": "<s>"}


def normalized(answers: list[httpx.Response]) -> list[tuple]:
    """Return (status, body, headers) of each answer with ids, times and a 429's window replaced, consistently."""
    seen: dict[bytes, bytes] = {}

    def placeholder(match) -> bytes:
        return seen.setdefault(match[0], b"<id%d>" % len(seen))

    out = []
    for answer in answers:
        body, named = _window_hidden(answer.content, dict(answer.headers.items()))
        body = _ID.sub(placeholder, _TIME.sub(b"<time>", body))
        kept = [(k, v) for k, v in named.items() if k not in _PER_REQUEST_HEADERS]
        headers = sorted((k, _ID.sub(placeholder, v.encode())) for k, v in kept)
        out.append((answer.status_code, body, headers))
    return out


def with_method(sent: tuple) -> tuple:
    """Return a request as ``(path, body, headers, method)``: POST unless it names its method (a wait's GET)."""
    return sent if len(sent) == 4 else (*sent, "POST")


async def _send(requests) -> list[httpx.Response]:
    from runstate_project.asgi import application

    transport = httpx.ASGITransport(app=application)
    # The hot pool's first connection, opened before the first request: on a loaded machine it
    # can take longer than the grace a request waits for one (db.READY_GRACE_S), and the view
    # would answer (the right answer, but not the hot path's).
    await (await hot_db.pool()).wait(timeout=30)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            return [
                await client.request(method, path, content=body, headers=headers)
                for path, body, headers, method in map(with_method, requests)
            ]
    finally:
        await hot_db.close()


def hot_endpoint(method: str, path: str) -> hot.endpoints.Endpoint | None:
    """Return the hot path's endpoint of a request, or None when DRF alone serves it.

    ``path`` may hold a query, or be a schema's template (its ``{parameters}`` are filled).
    """
    view = getattr(resolve(re.sub(r"\{[^}]+\}", "x", path.split("?")[0])).func, "cls", None)
    endpoint = hot.ENDPOINTS.get(view)
    return endpoint if endpoint is not None and endpoint.method == method.upper() else None


class AsgiClient:
    """What DRF's ``APIClient`` offers the matrices (``get``, ``post``, ``put``, ``patch``), through the ASGI app.

    Each request goes through ``runstate_project.asgi.application`` on one event loop kept for
    the client's life, with ``key`` (which the caller caches: ``_cached_key``), so the hot path
    serves what it would in a running API process. Its answers are ``httpx.Response`` objects (the
    ``status_code``, ``content`` and ``json()`` the matrices read). ``close`` closes the hot pool.
    """

    def __init__(self, key: str) -> None:
        self._runner = asyncio.Runner()
        self._authorization = f"Bearer {key}"
        self._client = self._runner.run(self._open())

    @staticmethod
    async def _open() -> httpx.AsyncClient:
        from runstate_project.asgi import application

        # The pool's first connection before the first request (see ``_send``).
        await (await hot_db.pool()).wait(timeout=30)
        transport = httpx.ASGITransport(app=application)
        return httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=60)

    def request(self, method: str, path: str, data=None, format=None) -> httpx.Response:
        """Send ``data`` as JSON (None: no body), as ``APIClient`` does with ``format="json"``."""
        headers = {"Authorization": self._authorization}
        content = None
        if data is not None:
            content = json.dumps(data).encode()
            headers["Content-Type"] = "application/json"
        return self._runner.run(self._client.request(method.upper(), path, content=content, headers=headers))

    def get(self, path: str, data=None, format=None) -> httpx.Response:  # noqa: D102 - as APIClient's
        return self.request("GET", path, data)

    def post(self, path: str, data=None, format=None) -> httpx.Response:  # noqa: D102
        return self.request("POST", path, data)

    def put(self, path: str, data=None, format=None) -> httpx.Response:  # noqa: D102
        return self.request("PUT", path, data)

    def patch(self, path: str, data=None, format=None) -> httpx.Response:  # noqa: D102
        return self.request("PATCH", path, data)

    def close(self) -> None:
        """Close the client, the hot pool and the event loop."""
        try:
            self._runner.run(self._client.aclose())
            self._runner.run(hot_db.close())
        finally:
            self._runner.close()


def answered(settings, hot_on: bool, build, fresh=fresh_state) -> tuple[list[tuple], int]:
    """Answer ``build(fresh())``'s requests with the hot path on or off; return them and how many it served."""
    settings.RUNSTATE_HOT_PATH = hot_on
    # The application's first request turns the caches on with a LISTEN connection on its
    # event loop, which ends with each asyncio.run here: serve them from this thread's again.
    caches_on(settings)
    requests = build(fresh())
    before = sum(n for name, n in hot.SERVED.items() if name not in ("declined", "careful"))
    answers = asyncio.run(_send(requests))
    served = sum(n for name, n in hot.SERVED.items() if name not in ("declined", "careful")) - before
    return normalized(answers), served


@pytest.fixture
def api_process(settings, transactional_db):
    """This process as a running API process: caches on, rate limit generous, no Celery wake-ups to send."""
    caches_on(settings)
    settings.RUNSTATE_RATE_LIMIT = "100000/min"
    yield settings
    process_cache.disable()


# The cases the hot path answers itself (the rest it hands to DRF before anything).
SERVED_BY_HOT = {
    "submit with a trace context, then claim it",
    "submit with an invalid traceparent",
    "complete",
    "complete null outcome",
    "complete accept json",
    "fail",
    "fail and retry",
    "release",
    "release with a body",
    "renew",
    "renew default",
    "claim",
    "claim two",
    "claim waitMs 0",
    "submit",
    "submit expiring",
    "submit expired",  # refused by the service's check, after the statement was built
    "complete batch",
    "complete batch, some claims lost",  # the lost claim by the careful path, in one thread hop
    "complete batch, a malformed claim id",
    "complete batch, only malformed claim ids",  # decided without a statement
    "complete batch, an unknown claim",
    "complete batch, a claim twice",  # refused by the service's check
    "renew batch",
    "renew batch, some claims lost",
    "renew batch after complete",
    "submit batch",
    "submit batch, then claim",
    "submit batch, an expired item",  # refused by the service's check
}
# Cases the hot path answers in part: how many of their requests it answered itself.
PARTLY_SERVED = {
    "complete batch twice": 1,  # the second decides nothing by the statement: the view answers
    "submit batch twice (idempotent resubmit)": 1,  # the resubmit inserts nothing: the view answers
    "submit batch, a key used before": 1,  # the single submit
    "submit batch, key conflict": 1,
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_hot_path_answers_what_drf_answers(api_process, case):
    hot_answers, hot_served = answered(api_process, True, CASES[case])
    drf_answers, drf_served = answered(api_process, False, CASES[case])
    assert hot_answers == drf_answers
    assert drf_served == 0
    if case in SERVED_BY_HOT:
        assert hot_served == len(hot_answers), "the hot path did not answer"
    if case in PARTLY_SERVED:
        assert hot_served == PARTLY_SERVED[case]


def test_rate_limited_requests_are_answered_alike(api_process):
    api_process.RUNSTATE_RATE_LIMIT = "2/min"

    def build(state):
        return [complete(state), request(f"/v1/claims/{state.claim_id}/renew", b"{}", state.key), complete(state)]

    hot_answers, hot_served = answered(api_process, True, build)
    drf_answers, _ = answered(api_process, False, build)
    assert [status for status, _, _ in hot_answers] == [200, 409, 429]
    assert hot_answers == drf_answers
    # The 429 came from the hot path; the lost lease went to the view and was counted once.
    assert hot_served == 2


def test_rate_limited_batches_count_their_items_alike(api_process):
    api_process.RUNSTATE_RATE_LIMIT = "5/min"

    def build(state):  # 2 items, 2 tasks, then 2 items over the limit (5)
        return [
            complete_many(state, both(state)),
            submit_many(state, [{"input": 1}, {"input": 2}]),
            renew_many(state, [{"claimId": state.claim_id}, {"claimId": state.second_claim_id}]),
            submit_many(state, [{"input": 3}]),
        ]

    hot_answers, hot_served = answered(api_process, True, build)
    drf_answers, _ = answered(api_process, False, build)
    assert [status for status, _, _ in hot_answers] == [200, 201, 429, 429]
    assert hot_answers == drf_answers
    assert hot_served == 4


def test_a_request_the_hot_path_hands_to_the_view_is_counted_once(api_process):
    api_process.RUNSTATE_RATE_LIMIT = "2/min"

    def build(state):  # a lost lease (the view answers) then a valid complete: both within the limit
        return [request(f"/v1/claims/{lost(state)}/complete", b"{}", state.key), complete(state)]

    hot_answers, _ = answered(api_process, True, build)
    assert [status for status, _, _ in hot_answers] == [409, 200]


def test_the_switch_off_sends_everything_to_drf(api_process):
    _, served = answered(api_process, False, CASES["complete"])
    assert served == 0
    _, served = answered(api_process, True, CASES["complete"])
    assert served == 1


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=6,
)


def _bodies(fields: list[str]):
    return st.dictionaries(st.sampled_from([*fields, "bogus"]), json_values, max_size=4) | json_values


@hypothesis_settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=_bodies(["outcome"]))
def test_generated_complete_bodies_are_answered_alike(api_process, body):
    def build(state):
        return [complete(state, json.dumps(body).encode())]

    assert answered(api_process, True, build)[0] == answered(api_process, False, build)[0]


@hypothesis_settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=_bodies(["runId", "workerId", "leaseTtlMs", "max", "waitMs"]), valid_run=st.booleans())
def test_generated_claim_bodies_are_answered_alike(api_process, body, valid_run):
    def build(state):
        sent = dict(body, runId=state.run_id) if valid_run and isinstance(body, dict) else body
        return [claims(state, json.dumps(sent).encode())]

    assert answered(api_process, True, build)[0] == answered(api_process, False, build)[0]


def test_a_request_that_finds_no_pooled_connection_is_answered_by_the_view(api_process):
    api_process.RUNSTATE_HOT_POOL_SIZE = 1
    caches_on(api_process)
    state = fresh_state()
    path, body, headers = complete(state)

    async def scenario():
        from runstate_project.asgi import application

        transport = httpx.ASGITransport(app=application)
        try:
            async with (await hot_db.pool()).connection():  # the pool's only connection, held
                async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
                    return await client.post(path, content=body, headers=headers)
        finally:
            await hot_db.close()

    careful = hot.SERVED["careful"]
    answer = asyncio.run(scenario())
    assert answer.status_code == 200, answer.content
    assert answer.json()["state"] == "SUCCEEDED"
    assert hot.SERVED["careful"] == careful + 1


def _terminate_backend(pid: int) -> None:
    """End a session from the server's side, as a restart or a failover does (waiting until it has ended)."""
    from django.db import connection

    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s, 10000)", [pid])
            assert cursor.fetchone() == (True,)
    finally:
        connection.close()


def test_a_pooled_connection_the_server_ended_is_replaced_not_answered_503(api_process):
    """After a restart each connection left in the hot pool would fail its first request with 503:
    the pool's check sees the server's goodbye on the socket and opens another instead."""
    state = fresh_state()
    path, body, headers = complete(state)

    async def scenario():
        from runstate_project.asgi import application

        pool = await hot_db.pool()
        await pool.wait(timeout=30)
        try:
            async with pool.connection() as conn:
                old_pid = conn.info.backend_pid
            await asyncio.to_thread(_terminate_backend, old_pid)
            transport = httpx.ASGITransport(app=application)
            async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
                answer = await client.post(path, content=body, headers=headers)
            async with pool.connection() as conn:
                return answer, old_pid, conn.info.backend_pid
        finally:
            await hot_db.close()

    answer, old_pid, new_pid = asyncio.run(scenario())
    assert answer.status_code == 200, answer.content
    assert answer.json()["state"] == "SUCCEEDED"
    assert new_pid != old_pid


def test_a_submit_on_the_hot_path_stores_the_callers_trace_context(api_process):
    answers, served = answered(api_process, True, CASES["submit with a trace context, then claim it"])
    assert served == 2
    (_, _, _), (status, body, _) = answers
    assert status == 200
    claimed = json.loads(body)["claims"]
    assert [c["traceparent"].split("-")[2] for c in claimed] == ["b7ad6b7169203331"]
    assert [c["tracestate"] for c in claimed] == ["vendor=1"]


@pytest.mark.parametrize("round_", range(3))
def test_a_key_taken_while_the_batch_statement_runs_leaves_the_batch_to_the_view(api_process, round_):
    """A submit holds key "a" uncommitted: the batch statement waits on it, fails, writes nothing; the view answers."""
    state = fresh_state()
    run = Run.objects.get(id=state.run_id)
    mailbox = mailbox_get(project_id=run.project_id, name="work")
    holding, release, errors = threading.Event(), threading.Event(), []

    def first():
        with transaction.atomic():
            task_submit(project_id=run.project_id, mailbox=mailbox, run_id=run.id, input=1, key="a")
            holding.set()
            assert release.wait(30), "the test never let the first submit commit"

    thread = threading.Thread(target=run_closing(first, errors))
    thread.start()
    assert holding.wait(30), errors
    path, body, headers = submit_many(state, [{"key": "a", "input": 1}, {"key": "b", "input": 2}])

    async def scenario():
        from runstate_project.asgi import application

        transport = httpx.ASGITransport(app=application)
        await (await hot_db.pool()).wait(timeout=30)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
                sent = asyncio.ensure_future(client.post(path, content=body, headers=headers))
                for _ in range(3000):  # until the batch's statement waits on the uncommitted key
                    waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    if sent.done() or (await hot_db.fetch(waiting + " AND datname = current_database()", {}))[0][0]:
                        break
                    await asyncio.sleep(0.01)
                assert not sent.done(), "the batch did not wait for the key"
                release.set()
                return await sent
        finally:
            release.set()
            await hot_db.close()

    careful = hot.SERVED["careful"]
    answer = asyncio.run(scenario())
    thread.join(30)
    assert not errors, errors
    assert answer.status_code == 201, answer.content
    assert [(t["key"], t["input"]) for t in answer.json()["tasks"]] == [("a", 1), ("b", 2)]
    assert hot.SERVED["careful"] == careful + 1
    assert Task.objects.filter(run_id=run.id, key__in=["a", "b"]).count() == 2


# Issue 29: with tracing on, the hot path serves the endpoints that make their views' spans and
# makes the same trace: a submit's ``send`` span (child of the caller's), the statement's span
# from the psycopg instrumentation (under it, or a root of its own as on the DRF path), and the
# task storing the ``send`` span's context.
CALLER_SPAN_ID = TRACED["traceparent"].split("-")[2]
# Each case: how many of its requests the hot path answers itself, and how many are submits.
TRACED_CASES = {
    "complete": (1, 0),
    "fail": (1, 0),
    "fail and retry": (1, 0),
    "release": (1, 0),
    "renew": (1, 0),
    "claim two": (1, 0),
    "submit": (1, 1),
    "submit expired": (1, 1),  # refused inside the span: the error is recorded on it
    "submit with a trace context, then claim it": (2, 1),
    "complete batch": (1, 0),
    "complete batch, some claims lost": (1, 0),
    "renew batch": (1, 0),
    "submit batch, then claim": (2, 1),
    "submit with a key twice": (1, 2),  # the second by the view, inside the hot path's span
    "submit key conflict": (1, 2),  # the second refused by the view, inside the hot path's span
    "submit batch twice (idempotent resubmit)": (1, 2),
}
# Cases whose trees are compared without the statements' spans: the hot path runs a statement
# the DRF path does not. The batch submit's is its own (SUBMIT_BATCH_SQL; the view locks the
# chain, then SUBMIT_MANY_SQL: docs/internals.md, "The hot path"); a statement that touched no
# row runs before the view answers, inside the same ``send`` span.
RUNSTATE_SPANS_ONLY = {
    "submit batch, then claim",
    "submit with a key twice",
    "submit key conflict",
    "submit batch twice (idempotent resubmit)",
}


@pytest.fixture
def statements(request):
    """Tracing on (``spans``: yielded), and the psycopg instrumentation as ``setup_tracing`` turns it on."""
    from opentelemetry.instrumentation.psycopg import PsycopgInstrumentor

    exporter = request.getfixturevalue("spans")

    def fresh_connections():  # the process's pooled connections were made by the connect of before
        connection.close()
        connection.close_pool()

    instrumentor = PsycopgInstrumentor()
    instrumentor.instrument(tracer_provider=trace.get_tracer_provider(), skip_dep_check=True)
    fresh_connections()
    try:
        yield exporter
    finally:
        instrumentor.uninstrument()
        fresh_connections()


# What a connection runs when it is made (the time zone) or starts listening: not a request's.
_CONNECTION_STATEMENTS = re.compile(r"SET TIME ZONE |SELECT set_config\('TimeZone'|LISTEN ")


def _kept(span, statements: bool) -> bool:
    if span.instrumentation_scope.name in ("runstate", "opentelemetry.instrumentation.asgi"):
        return True
    return statements and not _CONNECTION_STATEMENTS.match(span.attributes.get("db.statement", ""))


def span_tree(finished, *, statements: bool = True) -> list[tuple]:
    """The spans in the order they started: name, kind, parent, attributes, status, events (ids and times aside).

    ``parent`` is the parent's place in the list, ``caller`` for the caller's span (``TRACED``),
    None for a root. Ids in attribute values become placeholders in order of appearance.
    ``statements=False`` leaves the statements' spans out.
    """
    kept = sorted((span for span in finished if _kept(span, statements)), key=lambda span: span.start_time)
    place = {span.context.span_id: index for index, span in enumerate(kept)}
    seen: dict[bytes, bytes] = {}

    def plain(value) -> bytes:
        return _ID.sub(lambda match: seen.setdefault(match[0], b"<id%d>" % len(seen)), str(value).encode())

    tree = []
    for span in kept:
        parent = None if span.parent is None else place.get(span.parent.span_id, f"{span.parent.span_id:016x}")
        events = [(event.name, plain(event.attributes.get("exception.message"))) for event in span.events]
        attributes = sorted((name, plain(value)) for name, value in span.attributes.items())
        tree.append((span.name, span.kind, parent, attributes, span.status.status_code, events))
    return [(*rest[:2], "caller" if rest[2] == CALLER_SPAN_ID else rest[2], *rest[3:]) for rest in tree]


def stored_contexts(state: State, finished) -> list[tuple]:
    """What each task the requests submitted stores: its flags, the span its ``traceparent`` names, its tracestate."""
    named = {format(span.context.span_id, "016x"): span for span in finished}
    shapes = []
    for traceparent, tracestate in (
        Task.objects.filter(run_id=state.run_id).exclude(traceparent="").values_list("traceparent", "tracestate")
    ):
        version, trace_id, span_id, flags = traceparent.split("-")
        span = named.get(span_id)
        same_trace = span is not None and format(span.context.trace_id, "032x") == trace_id
        shape = (span.name, span.kind, same_trace) if span is not None else (span_id, None, None)
        shapes.append((version, flags, *shape, tracestate))
    return sorted(shapes, key=repr)


def traced(settings, hot_on: bool, case: str, exporter) -> tuple:
    """Answer a case as ``answered`` does with tracing on; also return the requests' spans and stored contexts."""
    states = []

    def build(state):
        states.append(state)
        requests = CASES[case](state)
        exporter.clear()  # the state's own statements are not the requests'
        return requests

    answers, served = answered(settings, hot_on, build)
    finished = exporter.get_finished_spans()
    # A span id the answer carries (a claim's traceparent) differs by construction, as the ids do.
    answers = [(status, _SPAN_IN_TRACEPARENT.sub(rb"\1<span>", body), headers) for status, body, headers in answers]
    return answers, served, finished, stored_contexts(states[0], finished)


_SPAN_IN_TRACEPARENT = re.compile(rb"(<id\d+>-)[0-9a-f]{16}")


@pytest.mark.parametrize("case", list(TRACED_CASES))
def test_with_tracing_on_the_hot_path_serves_and_makes_the_views_trace(api_process, statements, case):
    hot_answers, hot_served, hot_spans, hot_stored = traced(api_process, True, case, statements)
    drf_answers, drf_served, drf_spans, drf_stored = traced(api_process, False, case, statements)
    served, submits = TRACED_CASES[case]
    assert hot_answers == drf_answers
    assert (hot_served, drf_served) == (served, 0), "the hot path did not answer"
    with_statements = case not in RUNSTATE_SPANS_ONLY
    assert span_tree(hot_spans, statements=with_statements) == span_tree(drf_spans, statements=with_statements)
    assert hot_stored == drf_stored
    assert [span.name for span in hot_spans].count("send work") == submits  # one per submit, whichever path


def test_a_traced_submit_on_the_hot_path_is_a_send_span_over_its_statement(api_process, statements):
    answers, served, finished, stored = traced(
        api_process, True, "submit with a trace context, then claim it", statements
    )
    assert served == 2
    tree = span_tree(finished)
    # Each request a server span (the submit's under the caller's), the send span under the
    # submit's, the submit's statement under that; the claim's statement under its request's.
    assert [(name, kind, parent) for name, kind, parent, *_ in tree] == [
        ("POST v1/mailboxes/<str:name>/tasks", SpanKind.SERVER, "caller"),
        ("send work", SpanKind.PRODUCER, 0),
        ("WITH", SpanKind.CLIENT, 1),
        ("POST v1/mailboxes/<str:name>/claims", SpanKind.SERVER, None),
        ("WITH", SpanKind.CLIENT, 3),
    ]
    server_attributes = dict(tree[0][3])
    assert server_attributes["http.route"] == b"v1/mailboxes/<str:name>/tasks"
    assert server_attributes["http.method"] == b"POST"
    assert server_attributes["http.status_code"] == b"201"
    send_attributes = dict(tree[1][3])
    assert send_attributes["messaging.system"] == b"runstate"
    assert send_attributes["messaging.operation.type"] == b"send"
    assert send_attributes["messaging.destination.name"] == b"work"
    assert set(send_attributes) >= {"runstate.run_id", "runstate.task_id"}
    assert dict(tree[2][3])["db.system"] == b"postgresql"
    # The task stores the send span's context, in the caller's trace, with the caller's tracestate.
    assert stored == [("00", "01", "send work", SpanKind.PRODUCER, True, "vendor=1")]


def test_a_hot_pool_opened_in_a_span_keeps_its_connections_statements_out_of_it(statements, monkeypatch):
    monkeypatch.setenv("PGTZ", "Europe/Paris")  # a new connection then sets the time zone (db._configure)
    tracer = trace.get_tracer("test")

    async def scenario():
        try:
            with tracer.start_as_current_span("the request that opens the pool"):
                await (await hot_db.pool()).wait(timeout=30)
        finally:
            await hot_db.close()

    asyncio.run(scenario())
    set_up = [span for span in statements.get_finished_spans() if span.name == "SET"]
    assert set_up, "no connection set its time zone"
    assert [span.parent for span in set_up] == [None] * len(set_up)


def logged(settings, hot_on: bool, build, caplog) -> list[dict]:
    """Answer ``build``'s requests as ``answered`` does; return the request log's lines (and Django's 4xx lines).

    Each as ``JsonFormatter`` writes it, without what differs per request by construction
    (time, duration, request id) and with ids replaced in order of appearance.
    """
    # Loading the application configures logging (Django's setup), which takes the capturing
    # handler off the root logger: load it before the capture starts.
    import runstate_project.asgi  # noqa: F401

    caplog.clear()
    with caplog.at_level(logging.INFO):
        logging.getLogger().addHandler(caplog.handler)  # at most once: a handler is added once
        answered(settings, hot_on, build)
    seen: dict[str, str] = {}
    lines = []
    for record in caplog.records:
        if record.name not in ("runstate.request", "django.request"):
            continue
        line = json.loads(JsonFormatter().format(record))
        for varying in ("time", "durationMs", "requestId"):
            line.pop(varying, None)
        text = _ID.sub(lambda match: seen.setdefault(match[0], b"<id%d>" % len(seen)), json.dumps(line).encode())
        lines.append(json.loads(text))
    return lines


LOGGED_CASES = ["complete", "claim", "submit", "complete batch", "fail", "complete twice (second: lease lost)"]


@pytest.mark.parametrize("case", LOGGED_CASES)
def test_the_hot_path_logs_the_lines_drf_logs(api_process, case, caplog):
    hot_lines = logged(api_process, True, CASES[case], caplog)
    drf_lines = logged(api_process, False, CASES[case], caplog)
    assert hot_lines == drf_lines
    assert "runstate.request" in [line["logger"] for line in hot_lines]
    assert {"method", "path", "route", "status", "message", "level"} <= set(hot_lines[0])


def test_rate_limited_requests_log_the_lines_drf_logs(api_process, caplog):
    api_process.RUNSTATE_RATE_LIMIT = "1/min"

    def build(state):
        return [complete(state), complete(state)]

    hot_lines = logged(api_process, True, build, caplog)
    drf_lines = logged(api_process, False, build, caplog)
    assert hot_lines == drf_lines
    assert [line.get("status") for line in hot_lines if line["logger"] == "runstate.request"] == [200, 429]
    assert any(line["logger"] == "django.request" for line in hot_lines)
