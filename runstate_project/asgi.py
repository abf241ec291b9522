"""ASGI entry point: uvicorn (``scripts/start``, production) and ``manage.py runserver`` (daphne) serve it.

Requests under ``/v1/`` go through a handler of their own (``ApiASGIHandler``):

- a middleware stack of their own (``API_MIDDLEWARE``: request id and logging, security
  headers): the API authenticates with keys, so sessions, CSRF, the admin's user and
  messages stay on the admin's stack (``MIDDLEWARE``). Under ASGI each synchronous
  middleware costs a thread hop per request, so the API's stack is short and async;
- a request to a synchronous view (every view but the long-polls and the event stream)
  crosses to a thread once: the request-started signal, the middleware, the view and the
  request-finished signal (which gives the database connection back to the pool) run in
  one call there. Django's own handler crosses three times (the signals and the view each
  on their own) and watches for a disconnect that cannot stop a synchronous view anyway.
  Asynchronous views (the waits, the event stream) take Django's path, but a wait's shared
  answer (``SharedAnswerResponse``: already rendered, its request holding nothing on a
  thread) is finished on the event loop instead of in a thread hop;
- that thread is taken from a small pool of idle ones, rather than started for the request
  and ended with it; a wait gives it back while it waits (``longpoll.thread_release``), so
  a parked waiter holds no thread;
- the process caches of API keys and mailboxes are on (``coordination/plumbing/process_cache.py``);
- a body is checked before it is read, and read no further than the limit
  (``coordination/api/edge.py``): a declared size over the limit is a 413, a body to an
  endpoint that needs a key is a 401 without a usable one, both before a byte of it is read.
"""

import asyncio
import contextlib
import functools
import os
import re
from concurrent.futures import Executor, ThreadPoolExecutor

from asgiref.sync import ThreadSensitiveContext, iscoroutinefunction, sync_to_async
from django.conf import settings
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler
from django.core import signals
from django.core.asgi import get_asgi_application
from django.core.exceptions import RequestAborted, SuspiciousFileOperation
from django.core.handlers.asgi import ASGIHandler, get_script_prefix
from django.core.handlers.base import BaseHandler
from django.core.handlers.exception import convert_exception_to_response, response_for_exception
from django.db import close_old_connections
from django.http import Http404
from django.urls import set_script_prefix

from runstate_project.tracing import server_spans, setup_tracing

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "runstate_project.settings")

API_PREFIX = "/v1/"
# Idle request threads a process keeps for the next requests; a burst beyond it (long-polls
# waiting by the hundred) gets threads of its own that end with their requests.
IDLE_REQUEST_THREADS = 32


def _load_api_middleware(handler: BaseHandler, is_async: bool) -> None:
    """Build ``handler``'s middleware chain from ``API_MIDDLEWARE`` instead of ``MIDDLEWARE``."""
    # BaseHandler reads settings.MIDDLEWARE while it builds the chain, once, at start-up.
    full = settings.MIDDLEWARE
    settings.MIDDLEWARE = settings.API_MIDDLEWARE
    try:
        BaseHandler.load_middleware(handler, is_async)
    finally:
        settings.MIDDLEWARE = full


class _SyncApiHandler(BaseHandler):
    """The API's middleware chain in its synchronous form, for synchronous views."""

    def __init__(self) -> None:
        super().__init__()
        _load_api_middleware(self, is_async=False)


class _RequestThread(Executor):
    """The thread of one request's synchronous work: an idle one, taken at its first call.

    Every call of the request runs on that thread (the request's database connection lives
    there) until ``let_go`` gives it back: a wait does so once its connection is closed, and
    a later call takes an idle thread again. The request gives back what it holds when it
    ends.
    """

    def __init__(self, handler: "ApiASGIHandler") -> None:
        self._handler = handler
        self._executor: ThreadPoolExecutor | None = None

    def submit(self, fn, /, *args, **kwargs):  # noqa: D102 - see the class
        if self._executor is None:
            self._executor = self._handler.take_thread()
        return self._executor.submit(fn, *args, **kwargs)

    def let_go(self) -> None:
        """Give the thread back (nothing of the request may be left on it)."""
        executor, self._executor = self._executor, None
        if executor is not None:
            self._handler.give_thread(executor)


class ApiASGIHandler(ASGIHandler):
    """Django's ASGI handler for ``/v1/``: ``API_MIDDLEWARE``, one thread hop per synchronous view, pooled threads."""

    def __init__(self) -> None:
        super().__init__()
        self._sync = _SyncApiHandler()
        self._idle: list[ThreadPoolExecutor] = []
        self._caches_on = False

    def take_thread(self) -> ThreadPoolExecutor:
        """Return an idle request thread, or a new one."""
        return self._idle.pop() if self._idle else ThreadPoolExecutor(1, thread_name_prefix="runstate-api")

    def give_thread(self, executor: ThreadPoolExecutor) -> None:
        """Keep ``executor`` for a later request, or end it beyond ``IDLE_REQUEST_THREADS``."""
        if len(self._idle) < IDLE_REQUEST_THREADS:
            self._idle.append(executor)
        else:
            executor.shutdown(wait=False)

    async def __call__(self, scope, receive, send):  # noqa: D102 - see the class
        if scope["type"] != "http":
            raise ValueError(f"The API serves only HTTP connections, not {scope['type']}.")
        if not self._caches_on:
            from coordination.plumbing import process_cache

            self._caches_on = True
            process_cache.enable()
        async with self.request_thread():
            await self.handle(scope, receive, send)

    @contextlib.asynccontextmanager
    async def request_thread(self):
        """Run the synchronous work inside on one thread, as Django's own handler does (ThreadSensitiveContext).

        The thread is one that served an earlier request, and a wait gives it back while it
        waits (``longpoll.thread_release``).
        """
        thread = _RequestThread(self)
        token = longpoll.thread_release.set(thread.let_go)
        try:
            async with ThreadSensitiveContext(executor=thread):
                yield
        finally:
            longpoll.thread_release.reset(token)
            thread.let_go()

    async def view_response(self, request):
        """Answer a request built and read already by its view, without the middleware (the hot path's fallback).

        A synchronous view runs in one thread hop, which gives its database connection back
        when it is done; an ``async`` view is awaited, its connection given back after it.
        """
        async with self.request_thread():
            if not _view_is_async(request.path):
                return await sync_to_async(self._view_in_thread, thread_sensitive=True)(request)
            try:
                return await self._get_response_async(request)
            finally:
                await sync_to_async(close_old_connections, thread_sensitive=True)()

    async def in_thread(self, fn, *args):
        """Call ``fn(*args)`` in a request thread, and give its database connection back after (one hop)."""

        def call():
            try:
                return fn(*args)
            finally:
                close_old_connections()

        async with self.request_thread():
            return await sync_to_async(call, thread_sensitive=True)()

    def _view_in_thread(self, request):
        try:
            return convert_exception_to_response(self._sync._get_response)(request)
        finally:
            close_old_connections()

    def load_middleware(self, is_async=False):  # noqa: D102
        _load_api_middleware(self, is_async)

    async def handle(self, scope, receive, send):  # noqa: D102 - see the class
        refusal = await edge.refusal(scope, needs_key=_needs_key(scope["path"]))
        if refusal is not None:
            return await self.send_response(refusal, send)
        receive = edge.bounded(receive, edge.body_limit())
        if _view_is_async(scope["path"]):
            try:
                return await self._handle_async_view(scope, receive, send)
            except edge.BodyTooLarge:  # raised while reading the body, before anything was sent
                return await self.send_response(edge.too_large(), send)
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:
            return
        except edge.BodyTooLarge:
            return await self.send_response(edge.too_large(), send)
        try:
            set_script_prefix(get_script_prefix(scope))
            response = await sync_to_async(self._respond, thread_sensitive=True)(scope, body_file)
            await self.send_response(response, send)
            if response.streaming:
                await sync_to_async(response.close, thread_sensitive=True)()
        finally:
            body_file.close()

    async def _handle_async_view(self, scope, receive, send):
        """Django's ``ASGIHandler.handle``, but a ``close_on_loop`` response is closed without a thread hop.

        A wait's shared answer (``SharedAnswerResponse``) has nothing left on a thread: its
        ``close`` (the request-finished signal: the connections and caches of the calling
        thread, which the event loop's thread has none of) runs here. An event stream's frames
        are closed as soon as sending ends (Django closes only its own wrappers). Everything else is
        Django's: the request-started signal, the disconnect watch that cancels a wait whose
        client left, and ``close`` in a hop for any other response.
        """
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:
            return
        set_script_prefix(get_script_prefix(scope))
        await signals.request_started.asend(sender=self.__class__, scope=scope)
        request, error_response = self.create_request(scope, body_file)
        if request is None:
            body_file.close()
            await self.send_response(error_response, send)
            await sync_to_async(error_response.close)()
            return

        async def process_request(request, send):
            response = await self.run_get_response(request)
            try:
                await self.send_response(response, send)
            except asyncio.CancelledError:
                pass  # the client left while it was sent, or the event feed dropped the stream
            finally:
                frames = getattr(response, "frames", None)  # an event stream's (``sse.event_stream_response``)
                if frames is not None:
                    await frames.aclose()  # now, not when collected: it gives back its place in the feed
            return response

        tasks = [
            asyncio.create_task(self.listen_for_disconnect(receive)),
            asyncio.create_task(process_request(request, send)),
        ]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            if task.done():
                try:
                    task.result()
                except RequestAborted:
                    pass  # the client left
                except AssertionError:
                    body_file.close()
                    raise
            else:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        try:
            response = tasks[1].result()
        except asyncio.CancelledError:
            await signals.request_finished.asend(sender=self.__class__)
        else:
            if getattr(response, "close_on_loop", False):
                response.close()
            else:
                await sync_to_async(response.close)()
        body_file.close()

    def _respond(self, scope, body_file):
        """Answer a request to a synchronous view, from the request-started signal to the request-finished one."""
        signals.request_started.send(sender=self.__class__, scope=scope)
        request, response = self.create_request(scope, body_file)
        if request is not None:
            response = self._sync.get_response(request)
        response._handler_class = self.__class__
        if not response.streaming:
            # The body is rendered: finish the request here (request_finished gives the
            # thread's database connection back to the pool) rather than in another hop.
            response.close()
        return response


def _view_is_async(path: str) -> bool:
    """Tell whether the view at ``path`` is ``async`` (a long-poll, the event stream)."""
    return _async_routes().match(path) is not None


def _needs_key(path: str) -> bool:
    """Tell whether the view at ``path`` authenticates with an API key (all but health, metrics, schema, docs)."""
    return _keyed_routes().match(path) is not None


def routes():
    """Yield ``(full path regex, view)`` for every URL pattern of the project."""
    from coordination.api.hot.routes import url_patterns

    for regex, chain in url_patterns():
        yield regex, chain[-1].callback


def _routes_of(views) -> re.Pattern:
    """One pattern matching the paths of ``views`` (resolving each path costs more)."""
    # Named groups would clash between alternatives; only whether one matches counts.
    found = [re.sub(r"\(\?P<\w+>", "(?:", regex) for regex, view in routes() if view in views]
    return re.compile("|".join(f"(?:{regex})" for regex in found) or r"(?!)")


@functools.cache
def _async_routes() -> re.Pattern:
    """One pattern matching the paths of every ``async`` view."""
    return _routes_of({view for _, view in routes() if iscoroutinefunction(view)})


@functools.cache
def _keyed_routes() -> re.Pattern:
    """One pattern matching the paths of every view that authenticates with an API key."""
    from coordination.api.auth import ApiKeyAuthentication

    def keyed(view) -> bool:
        view_class = getattr(view, "cls", None)  # DRF's ``as_view`` keeps the class there
        classes = getattr(view_class, "authentication_classes", None) or ()
        return any(issubclass(each, ApiKeyAuthentication) for each in classes)

    return _routes_of({view for _, view in routes() if keyed(view)})


class StaticFilesHandler(ASGIStaticFilesHandler):
    """Django's static files handler, answering a path outside the static files 404 (it was an unhandled error)."""

    async def get_response_async(self, request):  # noqa: D102 - see the class
        try:
            return await super().get_response_async(request)
        except SuspiciousFileOperation:  # ``/static/../../etc/passwd``: refused by the storage
            return await sync_to_async(response_for_exception)(request, Http404("No such static file."))


def _route(api, site, first_call=None):
    """Send ``/v1/`` requests to ``api`` and everything else (admin, static, lifespan) to ``site``.

    ``first_call()``, when given, runs on the event loop at the app's first call (the server's
    signal handlers are installed by then: ``coordination.api.draining.install``).
    """
    pending = [first_call] if first_call is not None else []

    async def app(scope, receive, send):
        if pending:
            pending.pop()()
        if scope["type"] == "http" and scope["path"].startswith(API_PREFIX):
            return await api(scope, receive, send)
        return await site(scope, receive, send)

    return app


setup_tracing("api")  # before Django loads its middleware: the Django instrumentation adds one
site = get_asgi_application()  # sets Django up
from coordination.api import draining, edge, longpoll  # noqa: E402 - its models need Django set up
from coordination.api.hot import HotRouter  # noqa: E402 - as edge
from coordination.plumbing.checks import refuse_unsafe_database_routes  # noqa: E402

# A database route that would break behind a pooler in transaction mode stops the process here.
refuse_unsafe_database_routes()

if settings.RUNSTATE_SERVE_STATIC:
    site = StaticFilesHandler(site)
# The hot endpoints answered on the event loop, everything else (and every case the hot path
# declines) by ApiASGIHandler (coordination/api/hot/__init__.py).
# On SIGTERM / SIGINT its streams end and its waits answer, so the server stops at once.
application = _route(server_spans(HotRouter(ApiASGIHandler(), _load_api_middleware)), site, draining.install)
