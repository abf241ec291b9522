"""The API's hot path: the hot endpoints answered on the event loop, with one statement and no thread hop.

``HotRouter`` sits in front of ``runstate_project.asgi.ApiASGIHandler`` in the same ASGI
application. It serves, on PostgreSQL, ``POST /v1/claims/{id}/complete|fail|release|renew``
and ``POST /v1/mailboxes/{name}/claims`` (a claim that may wait parked on the event loop, on
the view's watch of rounds) and ``POST /v1/mailboxes/{name}/tasks``,
and the batch forms ``POST /v1/claims/complete|renew`` and
``POST /v1/mailboxes/{name}/tasks/batch`` (``endpoints``); and the waits
``GET /v1/tasks/{id}/result``, ``GET /v1/groups/{id}/wait``, ``GET /v1/barriers/{id}/wait``,
``POST /v1/timers/{id}/wait`` and the event long-poll ``GET /v1/events`` (``waits``: the
query checked by its serializer's fields, a place among the key's waits, the first read one
statement, and a wait parked on the event loop on the watch the view's waiters use,
answered with the bytes rendered once for every waiter of the same read; the client going
away cancels it, as Django's handler cancels an async view); and the event stream
``GET /v1/events/stream`` (``stream``: the same checks, the head of the log one statement,
then the frames of the process's shared feed written to the ASGI ``send`` piece by piece,
the place given back however the stream ends). For each request:

1. the route is Django's own (``routes.HotRoutes``: ``resolve()``'s answer from a table of the
   hot views' URL patterns, built once), and the key is the process cache's
   (``services.keys.cached_key``: one immutable ``CachedKey`` per cached key, not a copy per
   request) with the permission the view needs;
2. the body is read within ``DATA_UPLOAD_MAX_MEMORY_SIZE`` (``edge.bounded``), parsed as DRF
   parses JSON and validated by the serializer's own fields (``bodies.plain_body``);
3. the request counts against its key's rate limit (``throttling.rate_wait_async``: Redis
   asked without blocking the loop; a batch counts its items), and the service's own statement
   (``coordination.services.claims.operations.*_statement``, ``tasks.submit_statement``)
   runs on a psycopg async pool (``db``), on the event loop;
4. the answer is a DRF ``Response`` rendered by DRF's renderer, with the view's headers, and
   passes through ``API_MIDDLEWARE`` (request id, log line, metrics, security headers) built
   as an async chain: the same functions as the DRF path, no thread hop.

**The fallback rule.** Anything the hot path cannot decide from what it holds in memory goes
to the DRF path unchanged, before anything is counted or written: a key not in the cache, a
key bound to a run (its visibility needs a read), a key whose ``last_used_at`` is due, a
missing permission, a body or a wait's query the plain validators do not accept (the
serializer writes the exact error), a malformed id of a waited object, an unusual
``Content-Type`` or ``Accept``, a body sent to a wait, a mailbox or run not cached, a claim
that may wait in a process that traces. When the statement touches no row (lease lost, nothing to claim, a group
member, an inactive run, a key used before, a waited object that is not there or another
project's), a wait's first read finds what only a write answers (a group due to be
finalized, a timer fired, due or cancelled), or no pooled connection is ready within
``db.READY_GRACE_S`` (the server down: the DRF path's pool answers 503 at once), the request,
already read and counted, is answered by its DRF view in one thread hop inside the same
middleware chain (its throttle does not count it again). A claim batch whose statement
decided some items (committed) and left others answers those others through the service's
careful path in one thread hop; a batch submit inserts every task or none. A claim that may
wait answers no row itself: the careful path claims in one thread hop (or refuses), and
if it claims nothing either, the claim parks. A claim in flight when its client leaves runs
to its end and is handed back (``Endpoint.abandon``): nothing stays held for a client gone.

**Tracing.** In a process that traces (``OTEL_*``) the hot path serves the endpoints that
make their views' spans (``Endpoint.traced``: the claim operations, the claims without a
wait, the submits) and leaves the others' requests to their views, untouched. A served
request makes the trace its view makes: a submit's ``send`` span (``Endpoint.spans``:
``coordination.plumbing.tracing.send_span``, the child of the request's ``traceparent``), open around
the statement, an error recorded on it, its context the one the tasks store; the statement's
span from the psycopg instrumentation, which covers the pool's ``AsyncConnection`` (under the
``send`` span; a root of its own for a claim's operation, as on the DRF path). A request
handed to the view is answered inside that span and the view's ``send_span`` joins it: one
``send`` span per request, whichever path answers.
Both paths run under the request's SERVER span, the ASGI instrumentation's around the whole
``/v1`` application (``runstate_project.tracing.server_spans``), found through the scope
(``coordination.plumbing.tracing.request_trace``).

**Equivalence.** ``tests/api/test_hot_path.py`` sends a fixed table of requests (valid,
invalid, unknown claim, lost lease, unauthorized, foreign project, bound key, rate limited)
and Hypothesis-generated bodies to the application with the hot path on and off, on identical
fresh state, and compares status, body and headers; a counter (``SERVED``) shows that the hot
path, not DRF, answered. With tracing on (an in-memory exporter, the psycopg instrumentation)
it compares the span trees and the contexts the tasks store as well.
``tests/api/test_hot_waits.py`` does the same for the waits (decided before, decided while
waiting with a DRF waiter on the same watch, timeout, unknown, foreign project, bound key,
invalid query, rate limited, the waits cap), and races waiters against a decision;
``tests/api/test_hot_stream.py`` for the event stream (status, headers and the bytes streamed);
``tests/api/test_hot_claim_waits.py`` for claims that wait (woken by a submit, the wait run
out, a cancelled run, rate limited, the waits cap), racing claimers against submits, and a
client leaving while parked or while its claim commits. The isolation matrix's
foreign-project column and a Schemathesis run of the hot operations pass through the hot path
as well (``tests/reliability``), asserting through ``SERVED`` that it took each request.
"""

import asyncio
import contextlib
import io
from collections import Counter

from django.conf import settings
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIRequest, get_script_prefix
from django.core.handlers.base import BaseHandler
from django.db import DEFAULT_DB_ALIAS, InterfaceError, OperationalError, connections
from django.http import QueryDict
from django.urls import get_resolver, set_script_prefix, set_urlconf
from django.utils import timezone
from django.utils.log import log_response
from rest_framework import exceptions as drf
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response
from rest_framework.utils import json as drf_json

from coordination.api import edge, errors
from coordination.api.auth import bearer_key, last_used_due, permission_needed
from coordination.api.bodies import plain_body
from coordination.api.hot import db, endpoints, stream, waits
from coordination.api.hot.endpoints import Call, Endpoint
from coordination.api.hot.routes import HotRoutes
from coordination.api.throttling import COUNTED_ATTRIBUTE, body_cost, rate_wait_async
from coordination.domain import exceptions
from coordination.plumbing.tracing import request_trace, tracing_on
from coordination.services.keys import cached_key

# What the hot path answered (by endpoint; ``throttled``; ``refused``: a service's error) and
# handed to the views (``careful``, after its statement touched no row; ``declined``, before
# anything): tests read it.
SERVED: Counter = Counter()
ENDPOINTS: dict[type, Endpoint] = {**endpoints.ENDPOINTS, **waits.ENDPOINTS, **stream.ENDPOINTS}
_SUFFIXES = (
    *("/complete", "/fail", "/release", "/renew", "/claims", "/tasks", "/batch"),
    *("/result", "/wait", "/events", "/stream"),
)
_METHODS = {endpoint.method for endpoint in ENDPOINTS.values()}
_renderer = JSONRenderer()
_abandoning: set[asyncio.Future] = set()  # ``Endpoint.abandon`` of answers not sent, running


def enabled() -> bool:
    """Tell whether the hot path serves (``RUNSTATE_HOT_PATH``, PostgreSQL, fast paths on).

    In a process that traces (``OTEL_*``) it serves the endpoints that make their views' spans
    (``Endpoint.traced``) and leaves the others to their views.
    """
    return (
        settings.RUNSTATE_HOT_PATH
        and getattr(settings, "RUNSTATE_FAST_PATHS", True)
        and connections.settings[DEFAULT_DB_ALIAS]["ENGINE"].endswith("postgresql")
    )


class _Declined(Exception):
    """The hot path does not serve this request: the DRF path answers it."""


class _HotHandler(BaseHandler):
    """``API_MIDDLEWARE`` as an async chain around the hot path's own answer."""

    def __init__(self, load_middleware, serve) -> None:
        super().__init__()
        self._serve = serve
        load_middleware(self, is_async=True)

    async def _get_response_async(self, request):  # the innermost handler of the chain
        return await self._serve(request)

    async def respond(self, request):
        """Answer ``request`` through the middleware, as ``BaseHandler.get_response`` does, on the event loop."""
        set_urlconf(settings.ROOT_URLCONF)
        response = await self._middleware_chain(request)
        response._resource_closers.append(request.close)
        if response.status_code >= 400:
            log_response("%s: %s", response.reason_phrase, request.path, response=response, request=request)
        return response


class HotRouter:
    """An ASGI application: the hot endpoints here, every other request (and every declined one) to ``fallback``."""

    def __init__(self, fallback, load_middleware) -> None:
        self.fallback = fallback
        self._handler = _HotHandler(load_middleware, self._serve)
        self._allow = {view: _allowed(view) for view in ENDPOINTS}
        self._routes: tuple = (None, None)

    async def __call__(self, scope, receive, send):  # noqa: D102 - see the class
        found = self._endpoint(scope) if scope["type"] == "http" and scope["method"] in _METHODS else None
        if found is None or not enabled():
            return await self.fallback(scope, receive, send)
        endpoint, match = found
        if not endpoint.traced and tracing_on():  # its view makes spans it does not
            return await self.fallback(scope, receive, send)
        api_key = self._caller(scope, endpoint)
        if api_key is None or not self._plain_headers(scope, endpoint):
            SERVED["declined"] += 1
            return await self.fallback(scope, receive, send)
        try:
            body = await _read_body(receive)
        except RequestAborted:
            return None
        except edge.BodyTooLarge:  # as ApiASGIHandler answers it
            return await self.fallback.send_response(edge.too_large(), send)
        try:
            trace = request_trace(
                scope,
                edge.header(scope, b"traceparent").decode("latin-1") or None,
                edge.header(scope, b"tracestate").decode("latin-1") or None,
            )
            data = self._query(endpoint, scope) if endpoint.waits else self._body(endpoint, body)
            call = Call(api_key, match.kwargs, data, trace, scope=scope)
            if not endpoint.accepts(call):
                raise _Declined()
        except _Declined:
            SERVED["declined"] += 1
            return await self.fallback(scope, _replaying(body, receive), send)
        set_script_prefix(get_script_prefix(scope))
        request = ASGIRequest(scope, io.BytesIO(body))
        request.resolver_match = match
        request.runstate_hot = (endpoint, call)
        if endpoint.parks(call):
            return await self._answer_while_connected(request, receive, send)
        response = await self._handler.respond(request)
        await self.fallback.send_response(response, send)
        response.close()
        return None

    async def _answer_while_connected(self, request, receive, send) -> None:
        """Answer a wait; the client going away first cancels it, as Django's handler cancels an async view.

        An answer not sent (cancelled, or failed) leaves its endpoint to hand back what it took
        (``Endpoint.abandon``: a waiting claim's tasks), even if this request is cancelled meanwhile.
        """
        sent = False

        async def answer():
            nonlocal sent
            response = await self._handler.respond(request)
            try:
                frames = getattr(response, "frames", None)
                if frames is None:
                    await self.fallback.send_response(response, send)
                else:
                    await _send_stream(response, frames, send)
                sent = True
            finally:
                response.close()

        answering = asyncio.create_task(answer())
        listening = asyncio.create_task(self.fallback.listen_for_disconnect(receive))
        try:
            await asyncio.wait([answering, listening], return_when=asyncio.FIRST_COMPLETED)
        finally:
            try:
                for task in (answering, listening):
                    task.cancel()
                for task in (answering, listening):  # the wait has left its watch and place after this
                    with contextlib.suppress(asyncio.CancelledError, RequestAborted):
                        await task  # an error of the answer is the server's
            finally:
                if not sent:
                    endpoint, call = request.runstate_hot
                    abandoning = asyncio.ensure_future(endpoint.abandon(call))
                    _abandoning.add(abandoning)  # kept until done, even if this request is cancelled
                    abandoning.add_done_callback(_abandoning.discard)
                    await asyncio.shield(abandoning)

    def _endpoint(self, scope) -> tuple[Endpoint, object] | None:
        path = scope["path"]
        if not path.endswith(_SUFFIXES) or scope.get("root_path"):
            return None
        resolver = get_resolver()
        if self._routes[0] is not resolver:  # built once per URLconf (a test may switch it)
            self._routes = (resolver, HotRoutes(ENDPOINTS, resolver))
        match = self._routes[1].match(path)  # ``resolve(path)`` if it is a hot view's, else None
        if match is None:
            return None
        endpoint = ENDPOINTS.get(getattr(match.func, "cls", None))
        return None if endpoint is None or endpoint.method != scope["method"] else (endpoint, match)

    @staticmethod
    def _caller(scope, endpoint: Endpoint):
        """Return the request's key if the cache knows it and the view would let it through unwritten, else None."""
        try:
            plaintext = bearer_key(edge.header(scope, b"authorization"))
        except drf.AuthenticationFailed:
            return None
        api_key = cached_key(plaintext) if plaintext is not None else None
        if (
            api_key is None
            or api_key.run_id is not None  # a bound key: what it may see needs a read
            or last_used_due(api_key, timezone.now())  # the view records the use (a write)
            or not api_key.has_permission(permission_needed(endpoint.view, endpoint.method))
        ):
            return None
        return api_key

    @staticmethod
    def _plain_headers(scope, endpoint: Endpoint) -> bool:
        """Tell whether the request asks for plain JSON and, where a body is read, sends it; and fits the limit."""
        if edge.header(scope, b"accept").strip().lower() not in endpoint.media:
            return False
        declared = edge.header(scope, b"content-length")
        if endpoint.waits:  # no body at all (a GET without Content-Length, a POST with 0)
            return declared in (b"", b"0") and not edge.header(scope, b"transfer-encoding")
        limit = edge.body_limit()
        if not declared.isdigit() or (limit is not None and int(declared) > limit):
            return False  # chunked, or a refusal ApiASGIHandler gives
        if endpoint.serializer is None:
            return True
        return edge.header(scope, b"content-type").strip().lower() == b"application/json" and int(declared) > 0

    @staticmethod
    def _query(endpoint: Endpoint, scope) -> dict:
        """Return the query string validated by ``endpoint.serializer``'s fields, as the view's ``query`` reads it."""
        try:
            # As ASGIRequest decodes it, and ``ApiView.query`` takes it (the last value of each name).
            query = QueryDict(scope.get("query_string", b"").decode()).dict()
        except UnicodeDecodeError:
            raise _Declined() from None
        validated = plain_body(endpoint.serializer, query)
        if validated is None:
            raise _Declined()
        return validated

    @staticmethod
    def _body(endpoint: Endpoint, body: bytes) -> dict:
        if endpoint.serializer is None:
            return {}
        try:
            # As DRF's JSONParser reads it (strict: no NaN or Infinity).
            data = drf_json.loads(body.decode("utf-8"))
        except (ValueError, RecursionError):
            raise _Declined() from None
        validated = plain_body(endpoint.serializer, data)
        if validated is None:
            raise _Declined()
        return validated

    async def _serve(self, request):
        """Answer inside the middleware: rate limit, statement, answer; the view when the statement touched no row."""
        endpoint, call = request.runstate_hot
        wait = await rate_wait_async(call.api_key.id, body_cost(endpoint.view, call.data))  # a batch: its items
        if wait is not None:
            SERVED["throttled"] += 1
            return self._response(endpoint, errors.exception_handler(drf.Throttled(wait), {}))
        try:
            # The view's own spans (a submit's ``send``), open until the request is answered: an
            # error is recorded on them as on the view's, and a view that answers joins them.
            with endpoint.spans(call):
                try:
                    answer = await endpoint.answer(call, self.fallback.in_thread)
                except db.NoConnection:  # the server down or the pool busy: the DRF path's pool decides
                    answer = None
                if answer is None:
                    SERVED["careful"] += 1
                    setattr(request, COUNTED_ATTRIBUTE, True)
                    return await self.fallback.view_response(request)
        except (exceptions.CoordinationError, drf.APIException, OperationalError, InterfaceError) as error:
            SERVED["refused"] += 1
            return self._response(endpoint, errors.exception_handler(error, {}))
        SERVED[type(endpoint).__name__] += 1
        return self._response(endpoint, answer)

    def _response(self, endpoint: Endpoint, response):
        """Render ``response`` as the view's ``finalize_response`` and DRF's renderer would (a wait's is rendered)."""
        response["Allow"] = self._allow[endpoint.view]
        if not isinstance(response, Response):
            return response
        response.accepted_renderer = _renderer
        response.accepted_media_type = _renderer.media_type
        response.renderer_context = {}
        return response.render()


def _allowed(view_class: type) -> str:
    """Return the view's ``Allow`` header, as a view set up by ``as_view`` gives it (with ``get``, ``HEAD`` too)."""
    view = view_class()
    view.setup(None)
    return ", ".join(view.allowed_methods)


async def _read_body(receive) -> bytes:
    """Read the whole body within the limit (``edge.BodyTooLarge`` past it, ``RequestAborted`` if the client left)."""
    bounded = edge.bounded(receive, edge.body_limit())
    chunks = []
    while True:
        message = await bounded()
        if message["type"] == "http.disconnect":
            raise RequestAborted()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _send_stream(response, frames, send) -> None:
    """Send a stream's head (as Django's ``send_response`` would), then each piece of ``frames`` as it comes.

    No wrapper between the shared feed and ``send``: one message per piece. ``frames`` is
    closed however the stream ends (the client gone: this is cancelled), which gives its
    place back and leaves the feed.
    """
    headers = [(key.encode("ascii"), value.encode("latin1")) for key, value in response.items()]
    headers += [(b"Set-Cookie", cookie.OutputString().encode("ascii")) for cookie in response.cookies.values()]
    async with contextlib.aclosing(frames):
        await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        async for piece in frames:
            await send({"type": "http.response.body", "body": piece, "more_body": True})
    await send({"type": "http.response.body"})


def _replaying(body: bytes, receive):
    """Return a ``receive`` that gives ``body`` again, then what ``receive`` gives (a disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay():
        return pending.pop() if pending else await receive()

    return replay


__all__ = ["ENDPOINTS", "SERVED", "HotRouter", "enabled"]
