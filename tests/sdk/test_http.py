"""The HTTP layer on its own: error mapping, retry policy, long-poll loops and configuration.

These mock HTTP (``httpx.MockTransport``) and nothing else: no database, no broker. The live
tests (``test_client.py``, ``test_worker.py``, ``test_seed.py``) exercise the real service.
"""

import asyncio
import inspect
import json
import subprocess
import sys
from datetime import datetime

import httpx
import pytest

import runstate
from coordination.domain import exceptions as server_exceptions
from runstate import (
    AsyncRunstate,
    AuthenticationError,
    BudgetExhaustedError,
    ConflictError,
    DeadlineExceededError,
    LeaseLostError,
    NotFoundError,
    PermissionDeniedError,
    PoolExhaustedError,
    QuotaExhaustedError,
    RateLimitedError,
    Runstate,
    RunstateError,
    ScopeCancelledError,
    ScopeCompletedError,
    ScopeInactiveError,
    ServerError,
    ServiceUnavailableError,
    TransportError,
    ValidationError,
)
from tests.sdk.conftest import ROOT

CONFLICT_CODES = [
    "SCOPE_CANCELLED",
    "SCOPE_COMPLETED",
    "DEADLINE_EXCEEDED",
    "CHILD_LIMIT_REACHED",
    "KEY_CONFLICT",
    "MAILBOX_MODE_CONFLICT",
    "LEASE_LOST",
    "GROUP_CLOSED",
    "GROUP_FINALIZED",
    "GROUP_FULL",
    "TASK_NOT_SUCCEEDED",
    "TASK_NOT_FINISHED",
    "VERDICT_CONFLICT",
    "BARRIER_RELEASED",
    "BARRIER_CANCELLED",
    "BARRIER_NOT_RELEASED",
    "TIMER_FIRED",
    "POOL_EXHAUSTED",
    "QUOTA_EXHAUSTED",
    "BUDGET_EXHAUSTED",
    "INVALID_STATE",
]
SPECIFIC_CONFLICTS = {
    "SCOPE_CANCELLED": ScopeCancelledError,
    "SCOPE_COMPLETED": ScopeCompletedError,
    "DEADLINE_EXCEEDED": DeadlineExceededError,
    "LEASE_LOST": LeaseLostError,
    "POOL_EXHAUSTED": PoolExhaustedError,
    "QUOTA_EXHAUSTED": QuotaExhaustedError,
    "BUDGET_EXHAUSTED": BudgetExhaustedError,
}
# Every status/code pair of DESIGN.md's table (plus the service's 500 and 503), and the class it maps to.
PAIRS = [
    (400, "VALIDATION_ERROR", ValidationError),
    (413, "VALIDATION_ERROR", ValidationError),  # an oversized body
    (401, "UNAUTHENTICATED", AuthenticationError),
    (403, "PERMISSION_DENIED", PermissionDeniedError),
    (404, "NOT_FOUND", NotFoundError),
    *[(409, code, SPECIFIC_CONFLICTS.get(code, ConflictError)) for code in CONFLICT_CODES],
    (429, "RATE_LIMITED", RateLimitedError),
    (500, "INTERNAL", ServerError),
    (503, "SERVICE_UNAVAILABLE", ServiceUnavailableError),
    (405, "METHOD_NOT_ALLOWED", RunstateError),
]


def envelope(code, message="nope", **details):
    return {"error": {"code": code, "message": message, "details": details}}


def make_client(kind, handler, **options):
    """An async or sync client over a mock handler, without retry pauses."""
    options = {"base_url": "http://runstate.test", "api_key": "rs_test", "backoff_base": 0.001, **options}
    if kind == "async":
        return AsyncRunstate(transport=httpx.MockTransport(handler), **options)

    def sync_handler(request):
        result = handler(request)
        return asyncio.run(result) if inspect.iscoroutine(result) else result

    return Runstate(transport=httpx.MockTransport(sync_handler), **options)


def call_one(kind, handler, call, **options):
    """Run ``call(rs)`` with the ``kind`` client; return its result or the exception it raised."""
    rs = make_client(kind, handler, **options)
    if kind == "async":

        async def run():
            try:
                return await call(rs)
            except Exception as exc:  # noqa: BLE001 - compared by the test
                return exc
            finally:
                await rs.aclose()

        return asyncio.run(run())
    try:
        return call(rs)
    except Exception as exc:  # noqa: BLE001 - compared by the test
        return exc
    finally:
        rs.close()


def call_both(handler, call, **options):
    """Run ``call(rs)`` with the async client, then the sync one; return both outcomes."""
    return [call_one(kind, handler, call, **options) for kind in ("async", "sync")]


@pytest.mark.parametrize(("status", "code", "cls"), PAIRS, ids=[f"{s}-{c}" for s, c, _ in PAIRS])
def test_every_status_and_code_maps_to_its_error_class(status, code, cls):
    def handler(request):
        return httpx.Response(status, json=envelope(code, "refused", field="why"))

    for error in call_both(handler, lambda rs: rs.scope("r1").status()):
        assert type(error) is cls
        assert isinstance(error, RunstateError)
        assert error.code == code
        assert error.status_code == status
        assert error.message == "refused"
        assert error.details == {"field": "why"}


def test_the_conflict_hierarchy_of_design_md():
    assert issubclass(ScopeCancelledError, ConflictError)
    assert issubclass(DeadlineExceededError, ConflictError)
    assert issubclass(ScopeCompletedError, ScopeInactiveError)
    assert issubclass(LeaseLostError, ConflictError)
    for cls in (PoolExhaustedError, QuotaExhaustedError, BudgetExhaustedError):
        assert issubclass(cls, runstate.LimitExhaustedError) and issubclass(cls, ConflictError)
    for cls in (NotFoundError, ConflictError, PermissionDeniedError, AuthenticationError, ValidationError):
        assert issubclass(cls, RunstateError)
        assert getattr(runstate, cls.__name__) is cls


def server_error_classes():
    pending, found = [server_exceptions.CoordinationError], []
    while pending:
        cls = pending.pop()
        found.append(cls)
        pending.extend(cls.__subclasses__())
    return found


@pytest.mark.parametrize("server_cls", server_error_classes(), ids=lambda cls: cls.code)
def test_every_code_the_server_raises_is_mapped(server_cls):
    """Each error class of coordination/domain/exceptions.py comes back as the SDK class of its status and code."""

    def handler(request):
        error = server_cls()
        return httpx.Response(server_cls.http_status, json=envelope(error.code, error.message))

    (error, _) = call_both(handler, lambda rs: rs.scope("r1").status())
    expected = dict(((s, c), cls) for s, c, cls in PAIRS).get((server_cls.http_status, server_cls.code))
    if expected is None:  # the abstract bases (CoordinationError, Conflict)
        expected = ConflictError if server_cls.http_status == 409 else ServerError
    assert type(error) is expected
    assert error.code == server_cls.code


def test_a_rate_limit_carries_retry_after_and_a_non_json_error_still_maps():
    def limited(request):
        return httpx.Response(429, json=envelope("RATE_LIMITED"), headers={"Retry-After": "7"})

    for error in call_both(limited, lambda rs: rs.scopes.create(), max_retries=0):
        assert isinstance(error, RateLimitedError) and error.retry_after == 7.0

    def bad_gateway(request):
        return httpx.Response(502, text="<html>bad gateway</html>")

    for error in call_both(bad_gateway, lambda rs: rs.scopes.create(), max_retries=0):
        assert isinstance(error, ServerError) and error.code == "HTTP_502" and error.status_code == 502


class Recorder:
    """A mock server answering from a script, recording every request."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.requests = []

    def __call__(self, request):
        self.requests.append(request)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        # A fresh response each time: one object cannot be read twice.
        return httpx.Response(answer.status_code, headers=answer.headers, content=answer.content)


RUN = {"id": "r1", "storedState": "ACTIVE", "effective": "ACTIVE"}
TASK = {"id": "t1", "state": "QUEUED"}
COMPLETED = {"results": [{"claimId": "c1", "ok": True, "task": TASK}]}


def unavailable():
    return httpx.Response(503, json=envelope("SERVICE_UNAVAILABLE"), headers={"Retry-After": "0"})


def refused_connection():
    return httpx.ConnectError("connection refused")


@pytest.mark.parametrize(
    ("what", "call", "ok"),
    [
        ("read", lambda rs: rs.scope("r1").status(), RUN),
        ("cancel", lambda rs: rs.scope("r1").cancel(reason="x"), RUN),
        ("ensure", lambda rs: rs.mailboxes.ensure("jobs", mode="WORK"), {"name": "jobs"}),
        ("keyed submit", lambda rs: rs.scope("r1").tasks.submit("jobs", {}, key="k"), TASK),
        (
            "keyed submit_many",
            lambda rs: rs.scope("r1").tasks.submit_many("jobs", [{"input": {}, "key": "k"}]),
            {"tasks": [TASK]},
        ),
        ("complete_many", lambda rs: rs.tasks.complete_many([("c1", None)]), COMPLETED),
        ("renew_many", lambda rs: rs.tasks.renew_many(["c1"]), {"results": [{"claimId": "c1", "ok": True}]}),
        ("group close", lambda rs: rs.groups.by_id("g1").close(), {"state": "SEALED"}),
        ("verdict", lambda rs: rs.groups.by_id("g1").accept("t1"), {"verdict": "ACCEPTED"}),
        ("arrive", lambda rs: rs.barriers.get("b1").arrive(key="a"), {"state": "WAITING"}),
        ("task cancel", lambda rs: rs.tasks.get("t1").cancel(), TASK),
        ("timer wait", lambda rs: rs.timers.get("tm1").wait(), {"state": "ACKNOWLEDGED", "firedAt": None}),
    ],
)
@pytest.mark.parametrize("failure", [unavailable, refused_connection], ids=["503", "transport"])
def test_idempotent_calls_are_retried(what, call, ok, failure):
    for kind in ("async", "sync"):
        recorder = Recorder(failure(), failure(), httpx.Response(200, json=ok))
        result = call_one(kind, recorder, call)
        assert not isinstance(result, Exception), result
        assert len(recorder.requests) == 3


@pytest.mark.parametrize(
    ("what", "call"),
    [
        ("run create", lambda rs: rs.scopes.create()),
        ("child", lambda rs: rs.scope("r1").child()),
        ("submit without key", lambda rs: rs.scope("r1").tasks.submit("jobs", {})),
        (
            "submit_many with an item without key",
            lambda rs: rs.scope("r1").tasks.submit_many("jobs", [{"input": {}, "key": "k"}, {"input": 1}]),
        ),
        ("member submit without key", lambda rs: rs.groups.by_id("g1").submit({})),
        ("send without key", lambda rs: rs.scope("r1").messages.send("q", {})),
        ("claim", lambda rs: rs.scope("r1").tasks.claim("jobs")),
        ("receive", lambda rs: rs.scope("r1").messages.receive("q")),
        ("group create", lambda rs: rs.groups.create(mailbox="jobs", condition="ALL_TERMINAL")),
        ("barrier create", lambda rs: rs.scope("r1").barriers.create(target=2)),
        ("next epoch", lambda rs: rs.barriers.get("b1").next_epoch()),
        ("timer create", lambda rs: rs.scope("r1").timers.create(after_seconds=1)),
    ],
)
@pytest.mark.parametrize("failure", [unavailable, refused_connection], ids=["503", "transport"])
def test_calls_that_are_not_idempotent_are_never_retried(what, call, failure):
    for kind in ("async", "sync"):
        recorder = Recorder(failure(), httpx.Response(200, json={}))
        error = call_one(kind, recorder, call)
        assert isinstance(error, ServiceUnavailableError | TransportError)
        assert len(recorder.requests) == 1


def test_retries_stop_after_max_retries_and_honour_retry_after():
    recorder = Recorder(httpx.Response(429, json=envelope("RATE_LIMITED"), headers={"Retry-After": "0"}))
    errors = call_both(recorder, lambda rs: rs.scope("r1").status(), max_retries=2)
    assert all(isinstance(e, RateLimitedError) for e in errors)
    assert len(recorder.requests) == 6  # 1 + 2 retries, for each client
    recorder = Recorder(unavailable())
    call_both(recorder, lambda rs: rs.scope("r1").status(), max_retries=0)
    assert len(recorder.requests) == 2  # one per client


def test_a_transport_error_surfaces_as_a_runstate_error():
    for error in call_both(Recorder(refused_connection()), lambda rs: rs.scope("r1").status(), max_retries=1):
        assert isinstance(error, TransportError) and isinstance(error, RunstateError)
        assert isinstance(error.__cause__, httpx.ConnectError)


def test_waits_loop_over_the_server_cap_until_done():
    """The server caps a long-poll at 30 s: the SDK asks for at most that, and asks again."""
    recorder = Recorder(
        httpx.Response(200, json={"id": "g1", "state": "OPEN"}),
        httpx.Response(200, json={"id": "g1", "state": "SEALED"}),
        httpx.Response(200, json={"id": "g1", "state": "FINALIZED", "outcome": "SUCCESS"}),
    )
    async_result = call_one("async", recorder, lambda rs: rs.groups.by_id("g1").wait(timeout_ms=600_000))
    assert async_result["outcome"] == "SUCCESS"
    asked = [int(r.url.params["timeoutMs"]) for r in recorder.requests[:3]]
    assert asked == [30_000, 30_000, 30_000]
    assert all(r.url.path == "/v1/groups/g1/wait" for r in recorder.requests)


def test_a_wait_raises_the_builtin_timeout_error_at_the_callers_timeout():
    async def slow(request):
        await asyncio.sleep(min(int(request.url.params["timeoutMs"]), 100) / 1000)
        return httpx.Response(200, json={"id": "t1", "state": "RUNNING"})

    for error in call_both(slow, lambda rs: rs.tasks.get("t1").result(timeout_ms=250)):
        assert type(error) is TimeoutError


def test_a_timer_wait_answers_fired_at_as_a_datetime():
    timer = {"id": "tm1", "state": "ACKNOWLEDGED", "fireAt": "2030-01-01T00:00:00.000000Z"}
    timer["firedAt"] = "2030-01-01T00:00:00.250000Z"
    for fired in call_both(lambda r: httpx.Response(200, json=timer), lambda rs: rs.timers.get("tm1").wait()):
        assert fired["fired_at"] == datetime.fromisoformat("2030-01-01T00:00:00.250+00:00")
        assert fired["firedAt"] == timer["firedAt"]


def test_requests_carry_the_key_and_json_and_quote_path_segments():
    recorder = Recorder(httpx.Response(201, json={"name": "a b"}))
    call_both(recorder, lambda rs: rs.mailboxes.ensure("a b/c", mode="QUEUE", lease_ttl_ms=500))
    request = recorder.requests[0]
    assert request.method == "PUT"
    assert request.url.raw_path == b"/v1/mailboxes/a%20b%2Fc"
    assert request.headers["Authorization"] == "Bearer rs_test"
    assert json.loads(request.content) == {"mode": "QUEUE", "leaseTtlMs": 500}


def test_configuration_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("RUNSTATE_URL", "http://example.test:9000/v1/")
    monkeypatch.setenv("RUNSTATE_API_KEY", "rs_env")
    rs = Runstate()
    assert rs.config.base_url == "http://example.test:9000"
    assert rs.config.api_key == "rs_env"
    assert Runstate("http://other.test", "rs_arg").config.api_key == "rs_arg"
    rs.close()
    monkeypatch.setenv("RUNSTATE_SCOPE_ID", "run-from-env")
    assert rs.scope().id == "run-from-env"
    monkeypatch.delenv("RUNSTATE_SCOPE_ID")
    with pytest.raises(ValueError, match="RUNSTATE_SCOPE_ID"):
        rs.scope()


def test_naive_datetimes_are_refused():
    rs = Runstate(base_url="http://runstate.test", transport=httpx.MockTransport(lambda r: httpx.Response(500)))
    with pytest.raises(ValueError, match="aware"):
        rs.scopes.create(deadline=datetime(2030, 1, 1))
    with pytest.raises(ValueError, match="exactly one"):
        rs.scope("r1").timers.create()
    with pytest.raises(ValueError, match="needs a run"):
        rs.barriers.create(target=1)


def test_the_package_imports_nothing_from_django():
    code = "import sys, runstate; sys.exit(any(m == 'django' or m.startswith('django.') for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=False).returncode == 0


def batch_answer(request):
    """Answer a batch request as the server would: one item per item, in order."""
    body = json.loads(request.content)
    if "tasks" in body:
        return httpx.Response(201, json={"tasks": [{"id": f"t{task['input']}"} | task for task in body["tasks"]]})
    results = [{"claimId": item["claimId"], "ok": True, "task": TASK} for item in body["items"]]
    return httpx.Response(200, json={"results": results})


def test_batches_split_at_the_servers_limits_and_keep_the_input_order():
    sizes = []

    def handler(request):
        body = json.loads(request.content)
        sizes.append((request.url.path, len(body.get("tasks") or body.get("items"))))
        return batch_answer(request)

    items = [{"input": i, "priority": 1} for i in range(2_001)]
    for tickets in call_both(handler, lambda rs: rs.scope("r1").tasks.submit_many("jobs", items)):
        assert [ticket.id for ticket in tickets] == [f"t{i}" for i in range(2_001)]
    assert sizes == [("/v1/mailboxes/jobs/tasks/batch", n) for n in (1_000, 1_000, 1)] * 2
    sizes.clear()
    claims = [(f"c{i}", {"n": i}) for i in range(1_001)]
    for results in call_both(handler, lambda rs: rs.tasks.complete_many(claims)):
        assert [r.claim_id for r in results] == [claim_id for claim_id, _ in claims]
    for results in call_both(handler, lambda rs: rs.tasks.renew_many([claim_id for claim_id, _ in claims])):
        assert [r.claim_id for r in results] == [claim_id for claim_id, _ in claims]
    assert [n for _, n in sizes] == [500, 500, 1] * 4
    assert {path for path, _ in sizes} == {"/v1/claims/complete", "/v1/claims/renew"}


def test_a_refused_later_request_names_the_item_by_its_place_in_the_whole_list():
    def handler(request):
        if len(json.loads(request.content)["tasks"]) == 1_000:
            return batch_answer(request)
        details = {"index": 3, "tasks.3.maxAttempts": ["too small"], "runId": ["kept"]}
        return httpx.Response(400, json=envelope("VALIDATION_ERROR", **details))

    items = [{"input": i} for i in range(1_010)]
    for error in call_both(handler, lambda rs: rs.scope("r1").tasks.submit_many("jobs", items)):
        assert isinstance(error, ValidationError)
        assert error.details == {"index": 1_003, "tasks.1003.maxAttempts": ["too small"], "runId": ["kept"]}


def test_a_claim_listed_twice_is_refused_before_any_request():
    recorder = Recorder(httpx.Response(200, json=COMPLETED))
    twice = [(f"c{i}", None) for i in range(600)] + [("c1", None)]  # in different requests of 500
    for error in call_both(recorder, lambda rs: rs.tasks.complete_many(twice)):
        assert isinstance(error, ValueError)
    assert recorder.requests == []


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        ("LEASE_LOST", LeaseLostError),
        ("SCOPE_CANCELLED", ScopeCancelledError),
        ("DEADLINE_EXCEEDED", DeadlineExceededError),
        ("KEY_CONFLICT", ConflictError),
        ("NOT_FOUND", NotFoundError),
        ("PERMISSION_DENIED", PermissionDeniedError),
        ("SOMETHING_NEW", RunstateError),
    ],
)
def test_a_refused_item_of_a_batch_answer_is_the_exception_it_would_have_raised_alone(code, cls):
    answer = {"results": [{"claimId": "c1", "ok": False, "error": {"code": code, "message": "no"}}]}
    recorder = Recorder(httpx.Response(200, json=answer))
    for results in call_both(recorder, lambda rs: rs.tasks.complete_many([("c1", 1)])):
        (result,) = results
        assert not result.ok and result.task is None
        assert type(result.error) is cls
        assert (result.error.code, result.error.message, result.error.status_code) == (code, "no", None)
