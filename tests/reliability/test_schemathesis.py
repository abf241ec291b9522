"""Schemathesis over every operation of ``/v1/schema``, against a real uvicorn on the test database.

Every operation (every method of every path) is called with a valid key (all permissions),
with no key and with a bad key. Every answer must be below 500 and conform to the schema: a
documented status code and content type, a body of the documented shape (the error envelope
on every 4xx), and a refusal of data the schema forbids. Without a valid key, every
operation that needs one answers 401 ``UNAUTHENTICATED``.

With the valid key, Schemathesis' coverage phase (boundary values, missing fields, wrong
types) runs before its fuzzing; without one, a few fuzzed examples suffice, as every answer
is the same 401. Generated ids are mostly unknown, so a positive case swaps some of them (a
choice fixed by the generated values, so a case is reproducible) for objects seeded for the
test: a run and its child, WORK and QUEUE mailboxes, a queued and a claimed task, a
delivery, a group with a member, a barrier, a timer and an event cursor. Each test gets a
fresh world, so one operation's changes (a cancelled run) never decide another's answers.

Long-polls are called with a tiny timeout and the streams (events, claim watch) are read for half a second;
examples are bounded and derandomized, and Hypothesis keeps no example database.

The operations the hot path serves (``coordination/api/hot``: ``hot.ENDPOINTS``) are fuzzed a
second time in-process, through the ASGI application itself (Schemathesis' ASGI transport)
with the hot path on and the world's key, mailboxes and run cached as a running API process
holds them: the same checks, with the coverage phase. ``hot.SERVED`` shows that every
request entered the hot path (served there, or handed to its view), and that the hot path
itself answered some of each operation's.
"""

import asyncio
import json
import re
import uuid
import zlib
from collections import Counter

import httpx
import pytest
import schemathesis
from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.renderers import OpenApiJsonRenderer
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from coordination.api import hot
from coordination.api.hot import db as hot_db
from coordination.models import Event, Run
from coordination.reads import selectors
from coordination.reads.selectors import event_cursor
from coordination.services.admissions import admission_request
from coordination.services.barriers import barrier_create
from coordination.services.claims import task_claim
from coordination.services.groups import group_create, group_submit
from coordination.services.keys import ALL_PERMISSIONS, api_key_create, project_ensure
from coordination.services.mailboxes import mailbox_ensure, mailbox_get
from coordination.services.messages import message_receive, message_send
from coordination.services.runs import run_create
from coordination.services.tasks import task_submit
from coordination.services.timers import timer_create
from tests.api.test_hot_path import (
    _cached_key,
    api_process,  # noqa: F401 - the fixture, for the hot path's run
    hot_endpoint,
)
from tests.operator.live import uvicorn_server

# Long enough for a slow shared machine, short enough for the whole file to run in minutes.
MAX_EXAMPLES = 10
KEYLESS_MAX_EXAMPLES = 5
# The hot operations through the ASGI application (after the coverage phase's examples).
HOT_MAX_EXAMPLES = 10
# A long-poll waits at most this long (ms); generated values above it are lowered to it.
TINY_WAIT_MS = 20
# The endless streams (Server-Sent Events), each read for this long (s) before the client lets it go.
STREAMS = frozenset({"/v1/events/stream", "/v1/claims/watch"})
STREAM_READ_S = 0.5
REQUEST_TIMEOUT_S = 30

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


def served_schema() -> dict:
    """Return the OpenAPI document exactly as ``GET /v1/schema`` renders it."""
    document = SchemaGenerator().get_schema(request=None, public=True)
    return json.loads(OpenApiJsonRenderer().render(document, renderer_context={}))


def load_schema(*, max_examples: int, coverage: bool):
    """Load the served schema with bounded, derandomized generation and no example database."""
    config = schemathesis.Config.from_dict(
        {
            "seed": 20261129,
            "generation": {
                "max-examples": max_examples,
                "deterministic": True,
                "database": "none",
                # The key is each test's own business: Schemathesis sends no Authorization header.
                "with-security-parameters": False,
            },
            # Coverage: boundary values, missing fields and wrong types of every parameter.
            "phases": {"coverage": {"enabled": coverage}},
        }
    )
    return schemathesis.openapi.from_dict(served_schema(), config=config)


def hot_operation_ids() -> set[str]:
    """The operationIds of the operations the hot path serves."""
    return {
        operation["operationId"]
        for path, item in served_schema()["paths"].items()
        for method, operation in item.items()
        if hot_endpoint(method, path) is not None
    }


schema = load_schema(max_examples=MAX_EXAMPLES, coverage=True)
# Without a valid key every answer is the same 401: fewer examples say as much.
keyless_schema = load_schema(max_examples=KEYLESS_MAX_EXAMPLES, coverage=False)
hot_schema = load_schema(max_examples=HOT_MAX_EXAMPLES, coverage=True).include(operation_id=sorted(hot_operation_ids()))

# Requests made and answers by status class, per key kind (printed at the end of the module).
FIGURES: Counter = Counter()


# Committed rows, so that the server sees them; each test's rows are flushed after it. (Not
# the keyless test's: its answers touch no row, so one key serves all its cases, unflushed.)
committed = pytest.mark.django_db(transaction=True)


@pytest.fixture(scope="module")
def server(django_db_setup, tmp_path_factory):
    """One uvicorn on the test database for the whole module."""
    log_dir = tmp_path_factory.mktemp("schemathesis-server")
    env = {"RUNSTATE_DB_POOL_SIZE": "5", "RUNSTATE_SSE_HEARTBEAT_S": "0.1", "LOG_LEVEL": "WARNING"}
    try:
        with uvicorn_server(log_dir, **env) as running:
            yield running
    finally:
        print(f"\nschemathesis figures: {dict(sorted(FIGURES.items()))}")


def seed_world() -> dict:
    """Commit a project, an all-permission key and one of each object; return their ids."""
    project = project_ensure(name=f"fuzz-{uuid.uuid4().hex[:12]}")
    pid = project.id
    key = api_key_create(project_id=pid, permissions=list(ALL_PERMISSIONS), name="schemathesis").plaintext
    run = run_create(project_id=pid, name="fuzz")
    run_create(project_id=pid, parent_id=run.id, name="child")
    work, _ = mailbox_ensure(project_id=pid, name="work", mode="WORK")
    queue, _ = mailbox_ensure(project_id=pid, name="queue", mode="QUEUE")
    task_submit(project_id=pid, mailbox=work, run_id=run.id, input={"n": 1})
    (claim,) = task_claim(project_id=pid, mailbox=work, run_id=run.id, worker_id="fuzz")
    queued, _ = task_submit(project_id=pid, mailbox=work, run_id=run.id, input={"n": 2})
    message_send(project_id=pid, mailbox=queue, run_id=run.id, body={"n": 1})
    message_send(project_id=pid, mailbox=queue, run_id=run.id, body={"n": 2})
    (delivery,) = message_receive(project_id=pid, mailbox=queue, run_id=run.id)
    group = group_create(project_id=pid, mailbox_name="work", condition="ALL_TERMINAL", parent_scope_id=run.id)
    member, _, _ = group_submit(project_id=pid, group_id=group.id, input={"m": 1})
    barrier = barrier_create(project_id=pid, run_id=run.id, target=2)
    timer = timer_create(project_id=pid, run_id=run.id, after_seconds=3600)
    first_event = Event.objects.filter(project_id=pid).order_by("txid", "id").first()
    return {
        "key": key,
        "run_id": str(run.id),
        "task_id": str(queued.id),
        "member_id": str(member.id),
        "claim_id": claim.claim_id,
        "message_id": str(delivery.message.id),
        "delivery_id": delivery.delivery_id,
        "group_id": str(group.id),
        "barrier_id": str(barrier.id),
        "timer_id": str(timer.id),
        "admission_id": str(admission_request(project_id=pid, run_id=run.id, key="fuzz").admission.id),
        "event_cursor": event_cursor(first_event),
    }


@pytest.fixture
def world(server, transactional_db):
    """A fresh project with one of each object (one operation's changes never decide another's)."""
    return seed_world()


@pytest.fixture(scope="module")
def keyless_world(server, django_db_blocker):
    """One committed project and key for every keyless case (a bad key may name its prefix), removed after.

    A 401 is answered before anything is read or written, so the cases share it: seeding a
    world and flushing every table around each of ~150 cases took most of a minute.
    """
    with django_db_blocker.unblock():
        project = project_ensure(name=f"fuzz-keyless-{uuid.uuid4().hex[:12]}")
        key = api_key_create(project_id=project.id, permissions=list(ALL_PERMISSIONS), name="schemathesis").plaintext
    try:
        yield {"key": key}
    finally:
        with django_db_blocker.unblock():
            project.delete()


def real_path_value(path: str, name: str, world: dict) -> str | None:
    """Return the seeded id that fits the path parameter ``name`` of ``path``."""
    if name == "name":
        return "queue" if path.endswith(("/messages", "/deliveries")) else "work"
    if name == "task_id":
        return world["member_id"] if path.startswith("/v1/groups/") else world["task_id"]
    return world.get(name)


# Body and query fields that name an object, and the seeded object that fits them.
REAL_FIELD = {
    "runId": "run_id",
    "parentId": "run_id",
    "parentScopeId": "run_id",
    "taskId": "task_id",
    "after": "event_cursor",
}


def coin(*values) -> bool:
    """Flip a coin decided by the generated values, so that a case always makes the same choices."""
    return zlib.crc32(repr(values).encode()) % 2 == 0


def use_real_ids(case, world: dict, swap=coin) -> None:
    """Swap generated ids for seeded ones where ``swap`` (a coin) says so (positive cases only)."""
    if case.meta is not None and case.meta.generation.mode != GenerationMode.POSITIVE:
        return
    path = case.operation.path
    for name in list(case.path_parameters or {}):
        value = real_path_value(path, name, world)
        if value is not None and swap(name, case.path_parameters[name]):
            case.path_parameters[name] = value
    for container in (case.query, case.body):
        if not isinstance(container, dict):
            continue
        for field, world_name in REAL_FIELD.items():
            if field in container and swap(field, container[field]):
                container[field] = world[world_name]
        if container is case.body and "mailbox" in container and swap("mailbox", container["mailbox"]):
            container["mailbox"] = "work"


def keep_waits_tiny(case) -> None:
    """Lower every long-poll wait to a few milliseconds (a negated, invalid value stays as sent)."""
    for container in (case.query, case.body):
        if not isinstance(container, dict):
            continue
        for field in ("timeoutMs", "waitMs"):
            value = container.get(field)
            if type(value) is int and value > TINY_WAIT_MS:
                container[field] = TINY_WAIT_MS


BAD_KEYS = [
    "Bearer rs_{prefix}_" + "x" * 43,  # a real key's prefix, a wrong secret
    "Bearer rs_000000000000_" + "y" * 43,  # an unknown prefix
    "Bearer garbage",
    "Bearer",
    "Bearer a b",
    "Basic dXNlcjpwYXNz",
    "bearer {key}x",
]


def authorization_for(case, key_kind: str, world: dict) -> dict:
    """Return the Authorization header of a valid, missing or bad key."""
    if key_kind == "valid":
        return {"Authorization": f"Bearer {world['key']}"}
    if key_kind == "none":
        return {}
    prefix = world["key"].split("_")[1]
    choice = zlib.crc32(repr((case.path_parameters, case.query, case.body)).encode()) % len(BAD_KEYS)
    return {"Authorization": BAD_KEYS[choice].format(prefix=prefix, key=world["key"])}


def needs_key(case) -> bool:
    """Whether the operation declares the bearer scheme (the probes do not; metrics take a key or the scrape token)."""
    return any("bearerAuth" in requirement for requirement in case.operation.definition.raw.get("security", []))


def call_and_validate(case, key_kind: str, server, world: dict):
    """Send the case with the key kind's header; check the answer against the schema.

    A case with a valid key names the world's objects where a coin says so (``use_real_ids``).
    """
    if key_kind == "valid":
        use_real_ids(case, world)
    keep_waits_tiny(case)
    headers = authorization_for(case, key_kind, world)
    timeout = STREAM_READ_S if case.operation.path in STREAMS else REQUEST_TIMEOUT_S
    FIGURES[f"requests ({key_kind} key)"] += 1
    response = case.call(base_url=server.url, headers=headers, timeout=timeout)
    FIGURES[f"{response.status_code // 100}xx ({key_kind} key)"] += 1
    case.validate_response(response, checks=CHECKS, headers=headers, transport_kwargs={"base_url": server.url})
    return response


HYPOTHESIS = {"derandomize": True, "database": None, "deadline": None, "suppress_health_check": list(HealthCheck)}


@committed
@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, **HYPOTHESIS)
def test_with_a_valid_key_every_answer_conforms(case, server, world):
    call_and_validate(case, "valid", server, world)


@pytest.mark.parametrize("key_kind", ["none", "bad"])
@keyless_schema.parametrize()
@settings(max_examples=KEYLESS_MAX_EXAMPLES, **HYPOTHESIS)
def test_without_a_valid_key_every_answer_is_401_and_conforms(case, key_kind, server, keyless_world):
    response = call_and_validate(case, key_kind, server, keyless_world)
    if not needs_key(case):
        return
    body = response.json()
    if response.status_code == 404:
        # Only when the request no longer routes: a generated id holding a "/".
        assert body["error"]["message"] == "No such endpoint.", (case.operation.label, body)
        return
    assert response.status_code == 401, (case.operation.label, response.status_code, body)
    assert body["error"]["code"] == "UNAUTHENTICATED"


def test_every_operation_of_the_schema_is_covered():
    """The file fuzzes what /v1/schema lists: every method of every path."""
    operations = [result.ok() for result in schema.get_all_operations()]
    labels = {operation.label for operation in operations}
    raw = served_schema()["paths"]
    expected = {f"{method.upper()} {path}" for path, item in raw.items() for method in item}
    assert labels == expected
    assert len(labels) >= 46


@committed
def test_a_method_no_path_documents_is_405_with_an_envelope(server, world):
    headers = {"Authorization": f"Bearer {world['key']}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=REQUEST_TIMEOUT_S) as client:
        for path, item in served_schema()["paths"].items():
            url = re.sub(r"\{[^}]+\}", "x", path)
            for method in sorted({"get", "put", "post", "patch", "delete"} - set(item)):
                response = client.request(method.upper(), url)
                FIGURES["requests (valid key, method sweep)"] += 1
                assert response.status_code == 405, (method, path, response.status_code)
                assert response.headers["Content-Type"] == "application/json", (method, path, response.text[:200])
                assert response.json()["error"]["code"] == "METHOD_NOT_ALLOWED", (method, path)
                assert {m.upper() for m in item} <= set(response.headers["Allow"].split(", ")), (method, path)


# The hot path's run --------------------------------------------------------------------------


class HotApplication:
    """``runstate_project.asgi.application``, noting the event loops it runs on (their hot pools are closed after)."""

    def __init__(self) -> None:
        from runstate_project.asgi import application

        self.application = application
        self.loops: set[asyncio.AbstractEventLoop] = set()

    async def __call__(self, scope, receive, send):  # noqa: D102 - the application's
        self.loops.add(asyncio.get_running_loop())
        if scope.get("path") in STREAMS:
            receive = _leaving_after(receive, STREAM_READ_S)
        return await self.application(scope, receive, send)

    def close_pools(self) -> None:
        """Close the hot pool of each loop (Schemathesis keeps its loop running; the test database is dropped)."""
        for loop in self.loops:
            asyncio.run_coroutine_threadsafe(hot_db.close(), loop).result(timeout=30)
        self.loops.clear()


def _leaving_after(receive, seconds: float):
    """Return ``receive`` for a client that reads an endless stream for ``seconds``, then goes away."""
    started = False

    async def leaving():
        nonlocal started
        if not started:
            started = True
            return await receive()  # the request
        await asyncio.sleep(seconds)
        return {"type": "http.disconnect"}

    return leaving


@pytest.fixture(scope="module")
def hot_app():
    app = HotApplication()
    try:
        yield app
    finally:
        app.close_pools()
        print(f"\nschemathesis figures (hot path): {dict(sorted(FIGURES.items()))}")


@pytest.fixture
def hot_world(api_process, hot_app):  # noqa: F811 - the fixture imported above
    """``world``, its key and what its requests name cached as a running API process has them.

    Yields the world and the tally of what the hot path did with the test's requests; at the
    end at least one of them was answered by the hot path itself.
    """
    world = seed_world()
    run = Run.objects.get(id=world["run_id"])
    world["key"] = _cached_key(run.project, permissions=ALL_PERMISSIONS)
    work = mailbox_get(project_id=run.project_id, name="work")
    mailbox_get(project_id=run.project_id, name="queue")
    for n in range(5):  # tasks left to claim after the examples that may wait (the view's) took some
        task_submit(project_id=run.project_id, mailbox=work, run_id=run.id, input={"n": n})
    selectors.run_ref(selectors.Visibility(project_id=run.project_id), run.id)
    tally: Counter = Counter()
    yield world, tally
    assert tally["served"] > 0, f"the hot path answered none of the requests itself: {dict(tally)}"


@pytest.mark.postgres_only
@committed
@hot_schema.parametrize()
@settings(max_examples=HOT_MAX_EXAMPLES, **HYPOTHESIS)
def test_through_the_hot_path_every_answer_conforms(case, hot_app, hot_world):
    world, tally = hot_world
    # Every positive case names the seeded objects: unknown ids on the hot path are the
    # business of its equivalence suite (tests/api/test_hot_path.py) and the isolation matrix.
    use_real_ids(case, world, swap=lambda *values: True)
    keep_waits_tiny(case)
    headers = authorization_for(case, "valid", world)
    before = Counter(hot.SERVED)
    FIGURES["requests (hot path)"] += 1
    response = case.call(app=hot_app, headers=headers, timeout=REQUEST_TIMEOUT_S)
    FIGURES[f"{response.status_code // 100}xx (hot path)"] += 1
    served = Counter(hot.SERVED)
    served.subtract(before)
    kinds = sorted(+served)
    if (
        hot_endpoint(case.method, case.operation.path) is None  # the coverage phase's other methods
        or (response.status_code == 404 and response.json()["error"]["message"] == "No such endpoint.")
        or response.status_code == 413  # refused before a byte is read, as ApiASGIHandler refuses it
    ):
        assert kinds == [], (case.operation.label, case.method, kinds)
    else:
        assert sum(served.values()) == 1, (case.operation.label, dict(served))
        (kind,) = kinds
        tally["served" if kind not in ("declined", "careful") else kind] += 1
        FIGURES[f"{case.operation.label} (hot path): {kind}"] += 1
    case.validate_response(response, checks=CHECKS, headers=headers, transport_kwargs={"app": hot_app})
