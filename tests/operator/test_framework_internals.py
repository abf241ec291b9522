"""The Django, asgiref, DRF, adrf, Celery and kombu internals our code relies on still have the shape it expects.

The API's ASGI handler (``runstate_project/asgi.py``) reuses parts of Django's handler that
are not documented API, its middleware replaces a method Django's ``MiddlewareMixin`` swaps
in, the Celery set-up patches kombu's Redis channel, and a few places read DRF attributes.
An upgrade that changes any of them would break a request path quietly (a middleware stack
built from the wrong setting, a thread per request again, a response that never gives its
connection back). Each test here checks one fact and, when it fails, names the place in our
code to revisit. The versions are pinned in ``requirements.in`` (locked in ``requirements.txt``);
bump them together with this file.
"""

import asyncio
import hashlib
import inspect
import io
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import pytest
from asgiref.sync import ThreadSensitiveContext, iscoroutinefunction, sync_to_async
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler
from django.core import signals
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIHandler, ASGIRequest, get_script_prefix
from django.core.handlers.base import BaseHandler
from django.http import HttpResponse
from django.middleware.csp import ContentSecurityPolicyMiddleware
from django.middleware.security import SecurityMiddleware
from django.urls import URLPattern, URLResolver, get_resolver
from django.utils.deprecation import MiddlewareMixin
from rest_framework import fields, serializers
from rest_framework.exceptions import Throttled
from rest_framework.views import APIView, set_rollback

from coordination.api.middleware import ApiContentSecurityPolicyMiddleware, ApiSecurityMiddleware
from runstate_project import asgi
from tests.operator.live import asgi_http_scope

pytestmark = pytest.mark.single_backend  # no database: the same on both

ASGI = "runstate_project/asgi.py"
Recorded = []


def revisit(where: str, what: str) -> str:
    """The message of a failed check: what changed upstream, and where our code relies on it."""
    return f"{what}. Revisit {where}, which relies on it, before upgrading."


def params(function) -> list[str]:
    return list(inspect.signature(function).parameters)


class RecordingMiddleware:
    """A middleware that records that a handler built it (``load_middleware`` read its setting)."""

    def __init__(self, get_response):
        Recorded.append(type(self))
        self.get_response = get_response

    def __call__(self, request):
        return self.get_response(request)


RECORDING = f"{__name__}.RecordingMiddleware"


def http_scope(path="/v1/health", **extra):
    return {**asgi_http_scope(path), **extra}


# -- Django's ASGI handler (runstate_project/asgi.py, ApiASGIHandler) -------------------------


@pytest.mark.parametrize(
    ("owner", "name", "expected", "is_async", "where"),
    [
        (ASGIHandler, "handle", ["self", "scope", "receive", "send"], True, f"{ASGI} ApiASGIHandler.handle"),
        (ASGIHandler, "read_body", ["self", "receive"], True, f"{ASGI} ApiASGIHandler.handle (read_body)"),
        (
            ASGIHandler,
            "send_response",
            ["self", "response", "send"],
            True,
            f"{ASGI} ApiASGIHandler.handle (send_response)",
        ),
        (
            ASGIHandler,
            "create_request",
            ["self", "scope", "body_file"],
            False,
            f"{ASGI} ApiASGIHandler._respond (create_request)",
        ),
        (
            BaseHandler,
            "load_middleware",
            ["self", "is_async"],
            False,
            f"{ASGI} _load_api_middleware and ApiASGIHandler.load_middleware",
        ),
        (BaseHandler, "get_response", ["self", "request"], False, f"{ASGI} ApiASGIHandler._respond (get_response)"),
        (
            ASGIStaticFilesHandler,
            "get_response_async",
            ["self", "request"],
            True,
            f"{ASGI} StaticFilesHandler.get_response_async",
        ),
    ],
)
def test_django_handler_methods_keep_their_signatures(owner, name, expected, is_async, where):
    method = getattr(owner, name, None)
    assert method is not None, revisit(where, f"{owner.__qualname__}.{name} is gone")
    assert params(method) == expected, revisit(
        where, f"{owner.__qualname__}.{name} now takes {params(method)}, not {expected}"
    )
    assert iscoroutinefunction(method) is is_async, revisit(
        where, f"{owner.__qualname__}.{name} is {'no longer' if is_async else 'now'} a coroutine function"
    )


def test_get_script_prefix_takes_the_scope_and_returns_its_root_path():
    where = f"{ASGI} ApiASGIHandler.handle (set_script_prefix(get_script_prefix(scope)))"
    assert params(get_script_prefix) == ["scope"], revisit(where, "django.core.handlers.asgi.get_script_prefix changed")
    assert get_script_prefix(http_scope(root_path="/behind")) == "/behind", revisit(
        where, "get_script_prefix no longer returns the scope's root_path"
    )


def test_the_asgi_handler_builds_its_async_chain_through_load_middleware():
    calls = []

    class Probe(ASGIHandler):
        def load_middleware(self, is_async=False):
            calls.append(is_async)

    Probe()
    assert calls == [True], revisit(
        f"{ASGI} ApiASGIHandler.load_middleware",
        "ASGIHandler.__init__ no longer builds its chain with self.load_middleware(is_async=True): "
        "the API's async chain would be built from MIDDLEWARE (sessions, CSRF) instead of API_MIDDLEWARE",
    )


def test_load_middleware_reads_settings_middleware_while_it_builds(settings):
    settings.MIDDLEWARE = [RECORDING]
    Recorded.clear()
    handler = BaseHandler()
    handler.load_middleware(is_async=False)
    assert Recorded == [RecordingMiddleware], revisit(
        f"{ASGI} _load_api_middleware",
        "BaseHandler.load_middleware no longer builds the chain from settings.MIDDLEWARE at the call",
    )
    assert getattr(handler, "_middleware_chain", None) is not None, revisit(
        f"{ASGI} _SyncApiHandler", "load_middleware no longer leaves the chain that get_response calls"
    )


def test_the_api_handlers_take_api_middleware_and_leave_middleware_as_it_was(settings):
    settings.API_MIDDLEWARE = [RECORDING]
    admin_stack = list(settings.MIDDLEWARE)
    Recorded.clear()
    asgi.ApiASGIHandler()  # its async chain, and its _SyncApiHandler's synchronous one
    assert Recorded == [RecordingMiddleware, RecordingMiddleware], revisit(
        f"{ASGI} _load_api_middleware", "the API handlers no longer build their chains from API_MIDDLEWARE"
    )
    assert list(settings.MIDDLEWARE) == admin_stack, revisit(
        f"{ASGI} _load_api_middleware", "settings.MIDDLEWARE is not restored after the API chain is built"
    )


def test_create_request_returns_a_request_and_no_error():
    where = f"{ASGI} ApiASGIHandler._respond (request, response = self.create_request(...))"
    result = asgi.ApiASGIHandler().create_request(http_scope(), io.BytesIO(b""))
    assert isinstance(result, tuple) and len(result) == 2, revisit(where, f"create_request returned {result!r}")
    request, error = result
    assert isinstance(request, ASGIRequest) and error is None, revisit(where, "create_request's pair changed order")


def test_read_body_reads_to_the_end_and_lets_receive_errors_through():
    handler = asgi.ApiASGIHandler()
    where = f"{ASGI} ApiASGIHandler.handle and coordination/api/edge.py bounded()"
    messages = iter(
        [
            {"type": "http.request", "body": b"ab", "more_body": True},
            {"type": "http.request", "body": b"cd", "more_body": False},
        ]
    )

    async def receive():
        return next(messages)

    body = asyncio.run(handler.read_body(receive))
    assert body.read() == b"abcd", revisit(where, "read_body no longer returns the whole body, rewound")

    class Refused(Exception):
        pass

    async def refusing():
        raise Refused()

    with pytest.raises(Refused):  # edge.BodyTooLarge is raised inside receive and caught by the handler
        asyncio.run(handler.read_body(refusing))

    async def disconnect():
        return {"type": "http.disconnect"}

    with pytest.raises(RequestAborted):
        asyncio.run(handler.read_body(disconnect))


def test_send_response_sends_the_start_and_the_body():
    sent = []

    async def send(message):
        sent.append(message)

    asyncio.run(asgi.ApiASGIHandler().send_response(HttpResponse(b"ok", status=201), send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 201, revisit(
        f"{ASGI} ApiASGIHandler.handle", f"send_response's first message is {sent[0]!r}"
    )
    assert b"".join(m.get("body", b"") for m in sent[1:]) == b"ok", revisit(
        f"{ASGI} ApiASGIHandler.handle", "send_response no longer sends the body"
    )


def test_closing_a_response_sends_request_finished_as_its_handler_class():
    where = f"{ASGI} ApiASGIHandler._respond (response._handler_class, response.close())"
    senders = []

    def finished(sender, **kwargs):
        senders.append(sender)

    # Ours alone: Django's own receiver (close_old_connections) would reach for the database.
    with mock.patch.object(signals.request_finished, "receivers", []):
        signals.request_finished.connect(finished)
        response = HttpResponse(b"ok")
        response._handler_class = asgi.ApiASGIHandler
        response.close()
    assert senders == [asgi.ApiASGIHandler], revisit(
        where,
        "HttpResponse.close() no longer sends request_finished with sender=response._handler_class: "
        "a request's database connection would not go back to the pool",
    )


# -- asgiref (runstate_project/asgi.py, coordination/api/longpoll.py) -------------------------


def test_thread_sensitive_context_runs_on_the_given_executor_and_leaves_it_running():
    where = f"{ASGI} ApiASGIHandler.__call__ (ThreadSensitiveContext(executor=...))"
    assert "executor" in inspect.signature(ThreadSensitiveContext).parameters, revisit(
        where, "ThreadSensitiveContext no longer accepts executor= (the asgiref pinned in requirements.in does)"
    )
    executor = ThreadPoolExecutor(1, thread_name_prefix="internals-probe")
    try:

        async def twice():
            names = []
            for _ in range(2):  # a new context per request, the same executor
                async with ThreadSensitiveContext(executor=executor):
                    names.append(await sync_to_async(lambda: threading.current_thread().name)())
            return names

        names = asyncio.run(twice())
        assert all(name.startswith("internals-probe") for name in names), revisit(
            where, f"thread-sensitive calls inside the context ran on {names}, not the given executor"
        )
        assert executor.submit(lambda: 1).result(timeout=5) == 1, revisit(
            where, "the context shut the executor down; the handler reuses it for the next request"
        )
    finally:
        executor.shutdown()


def test_a_request_thread_lease_serves_a_context_and_goes_back_to_the_idle_threads():
    where = f"{ASGI} _RequestThread (ThreadSensitiveContext(executor=...) given an Executor that is no pool)"
    handler = asgi.ApiASGIHandler()

    async def request():
        lease = asgi._RequestThread(handler)
        async with ThreadSensitiveContext(executor=lease):
            first = await sync_to_async(threading.get_ident)()
            again = await sync_to_async(threading.get_ident)()
            lease.let_go()  # a wait parks: the thread goes back
            idle_while_parked = len(handler._idle)
            await sync_to_async(threading.get_ident)()  # a later call takes one again
        lease.let_go()
        return first, again, idle_while_parked

    first, again, idle_while_parked = asyncio.run(request())
    assert first == again, revisit(where, "two thread-sensitive calls of one context ran on different threads")
    assert idle_while_parked == 1, revisit(where, "the thread given back did not reach the idle ones")
    assert len(handler._idle) == 1
    handler._idle.pop().shutdown()


# The hash of Django's ASGIHandler.handle as ``_handle_async_view`` copies it (Django 6.0.x).
DJANGO_HANDLE_SHA256 = "98faeb5bef800331e6a8002fbc96b30e4122a23438ae45a047190a531ea11323"


def test_django_handle_is_the_one_our_async_view_branch_copies():
    where = f"{ASGI} ApiASGIHandler._handle_async_view (a copy of ASGIHandler.handle)"
    source = inspect.getsource(ASGIHandler.handle)
    assert hashlib.sha256(source.encode()).hexdigest() == DJANGO_HANDLE_SHA256, revisit(
        where, "django.core.handlers.asgi.ASGIHandler.handle changed: bring the copy in line, then its hash here"
    )
    assert params(ASGIHandler.listen_for_disconnect) == ["self", "receive"], revisit(where, "listen_for_disconnect")
    assert params(ASGIHandler.run_get_response) == ["self", "request"], revisit(where, "run_get_response")


def test_sync_to_async_takes_an_executor_when_not_thread_sensitive():
    where = "coordination/api/longpoll.py shared_db (sync_to_async(..., thread_sensitive=False, executor=...))"
    signature = inspect.signature(sync_to_async)
    assert {"thread_sensitive", "executor"} <= set(signature.parameters), revisit(
        where, f"sync_to_async now takes {list(signature.parameters)}"
    )
    executor = ThreadPoolExecutor(1, thread_name_prefix="internals-read")
    try:
        name = asyncio.run(
            sync_to_async(lambda: threading.current_thread().name, thread_sensitive=False, executor=executor)()
        )
    finally:
        executor.shutdown()
    assert name.startswith("internals-read"), revisit(where, f"the call ran on {name}, not the given executor")


# -- Django's middleware mixin (coordination/api/middleware.py) -------------------------------


@pytest.mark.parametrize(
    ("ours", "django_class"),
    [
        (ApiSecurityMiddleware, SecurityMiddleware),
        (ApiContentSecurityPolicyMiddleware, ContentSecurityPolicyMiddleware),
    ],
)
def test_an_async_middleware_call_goes_through_our_acall(ours, django_class):
    where = f"coordination/api/middleware.py {ours.__name__}.__acall__"
    assert issubclass(django_class, MiddlewareMixin), revisit(where, f"{django_class.__name__} left MiddlewareMixin")
    for hook in ("process_request", "process_response"):
        method = getattr(django_class, hook, None)
        assert method is not None and not iscoroutinefunction(method), revisit(
            where, f"{django_class.__name__}.{hook} is gone or async: we call it inline on the event loop"
        )

    async def get_response(request):
        return HttpResponse()

    middleware = ours(get_response)
    call = middleware(object())
    try:
        assert inspect.iscoroutine(call) and call.cr_code is ours.__acall__.__code__, revisit(
            where, "MiddlewareMixin.__call__ no longer hands an async request to self.__acall__"
        )
    finally:
        call.close()


# -- URL patterns, DRF and adrf views (runstate_project/asgi.py routes, coordination/api) -----


def test_url_patterns_expose_their_regex_and_callback():
    where = f"{ASGI} routes() and _routes_of()"
    resolver = get_resolver()
    assert isinstance(resolver.url_patterns, list | tuple), revisit(where, "URLResolver.url_patterns changed")
    seen = 0
    for regex, view in asgi.routes():
        assert isinstance(regex, str) and callable(view), revisit(where, f"a route yielded {regex!r}, {view!r}")
        re.compile(regex)
        seen += 1
    assert seen > 10, revisit(where, f"only {seen} routes found")
    for pattern in resolver.url_patterns:
        assert isinstance(pattern, URLPattern | URLResolver)
        assert isinstance(pattern.pattern.regex, re.Pattern), revisit(where, "pattern.pattern.regex is no regex")


def test_drf_and_adrf_views_are_told_apart_by_their_callbacks():
    where = f"{ASGI} _keyed_routes (view.cls) and _async_routes (iscoroutinefunction(view))"
    assert asgi._needs_key("/v1/runs"), revisit(where, "DRF's as_view() no longer keeps the view class as view.cls")
    assert not asgi._needs_key("/v1/health")
    assert asgi._view_is_async("/v1/events/stream"), revisit(
        where, "adrf's as_view() no longer returns a coroutine function for an async view"
    )
    assert not asgi._view_is_async("/v1/runs")


def test_adrf_dispatches_through_async_dispatch():
    from adrf.views import APIView as AsyncAPIView

    where = "coordination/api/views/base.py AsyncApiView.async_dispatch"
    method = getattr(AsyncAPIView, "async_dispatch", None)
    assert method is not None and iscoroutinefunction(method), revisit(where, "adrf's APIView.async_dispatch is gone")
    assert params(method) == ["self", "request", "args", "kwargs"], revisit(where, f"it takes {params(method)}")


def test_drf_sets_auth_header_and_wait_on_the_exceptions_our_handler_reads():
    where = "coordination/api/errors.py exception_handler (exc.auth_header, exc.wait, set_rollback())"
    assert "exc.auth_header" in inspect.getsource(APIView.handle_exception), revisit(
        where, "APIView.handle_exception no longer sets exc.auth_header: 401s would lose WWW-Authenticate"
    )
    assert Throttled(wait=3).wait == 3, revisit(where, "Throttled no longer keeps wait")
    assert params(set_rollback) == [], revisit(where, f"rest_framework.views.set_rollback takes {params(set_rollback)}")


def test_an_optional_field_without_default_raises_skip_field():
    where = "coordination/api/bodies.py plain_body (field.get_default() raising SkipField)"
    with pytest.raises(fields.SkipField):
        serializers.CharField(required=False).get_default()
    assert serializers.CharField(required=False, default="x").get_default() == "x", revisit(
        where, "Field.get_default no longer returns the default"
    )
    assert serializers.Serializer.__module__.startswith("rest_framework."), revisit(
        where, "DRF's serializers moved out of rest_framework.*"
    )


# -- Celery and kombu (runstate_project/celery.py) --------------------------------------------


def test_celerys_django_fixup_closes_the_database_through_close_database():
    from runstate_project.celery import app

    where = "runstate_project/celery.py _keep_database_connections (app._fixups, worker_fixup.close_database)"
    fixups = getattr(app, "_fixups", None)
    assert fixups, revisit(where, "Celery's app._fixups is gone or empty")
    worker_fixups = [getattr(fixup, "worker_fixup", None) for fixup in fixups]
    assert any(hasattr(each, "close_database") for each in worker_fixups), revisit(
        where, "Celery's Django worker fixup has no close_database any more"
    )


def test_kombus_redis_channel_builds_its_client_through_connparams():
    from kombu.transport import redis as kombu_redis

    where = "runstate_project/celery.py _survive_broker_loss_with_unacked_messages (Channel._connparams)"
    method = getattr(kombu_redis.Channel, "_connparams", None)
    assert method is not None, revisit(where, "kombu's redis Channel._connparams is gone")
    assert params(method) == ["self", "asynchronous"], revisit(where, f"Channel._connparams takes {params(method)}")
    error = kombu_redis.get_redis_ConnectionError()
    assert isinstance(error, type) and issubclass(error, Exception), revisit(
        where, "kombu's get_redis_ConnectionError() no longer returns an exception class"
    )


# -- The hot path (coordination/api/hot) ---------------------------------------------------------

HOT = "coordination/api/hot/__init__.py"


def test_an_async_chain_ends_in_the_handlers_own_get_response_async(settings):
    settings.API_MIDDLEWARE = []
    seen = []

    class Innermost(BaseHandler):
        async def _get_response_async(self, request):
            seen.append(request)
            return HttpResponse("inner")

    handler = Innermost()
    asgi._load_api_middleware(handler, is_async=True)
    request = ASGIRequest(http_scope(), io.BytesIO(b""))
    response = asyncio.run(handler._middleware_chain(request))
    assert seen == [request] and response.content == b"inner", revisit(
        f"{HOT} _HotHandler", "an async chain no longer ends in self._get_response_async, or is not _middleware_chain"
    )


def test_the_sync_inner_handler_resolves_and_calls_the_view():
    where = f"{ASGI} ApiASGIHandler._view_in_thread (self._sync._get_response)"
    assert params(BaseHandler._get_response) == ["self", "request"], revisit(where, "BaseHandler._get_response changed")
    assert params(BaseHandler._get_response_async) == ["self", "request"], revisit(
        f"{ASGI} ApiASGIHandler.view_response", "BaseHandler._get_response_async changed"
    )


def test_a_drf_response_renders_with_the_renderer_set_on_it():
    from rest_framework.renderers import JSONRenderer
    from rest_framework.response import Response

    response = Response({"a": "é"}, status=201, headers={"Location": "/x"})
    response.accepted_renderer = JSONRenderer()
    response.accepted_media_type = "application/json"
    response.renderer_context = {}
    rendered = response.render()
    assert (rendered.status_code, rendered.content, rendered["Content-Type"], rendered["Location"]) == (
        201,
        '{"a":"é"}'.encode(),
        "application/json",
        "/x",
    ), revisit(f"{HOT} HotRouter._response", "a DRF Response no longer renders from accepted_renderer as before")


def test_drf_views_name_their_allowed_methods():
    from coordination.api.views.work import ClaimCompleteView

    assert ClaimCompleteView().allowed_methods == ["POST", "OPTIONS"], revisit(
        f"{HOT} HotRouter (the Allow header)", "APIView.allowed_methods changed"
    )
