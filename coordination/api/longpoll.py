"""Long-polls that hold no database connection while they wait, and share their re-reads.

Every long-poll reads once on the request's own connection, as any request does, then
closes that connection and waits. Waits on the same object in one process share a
*watch* (``share=`` names it: the object and everything the read depends on, such as the
caller's visibility): one subscription to the object's topics and one re-read per wake-up,
on a small thread pool of its own, whose result answers every waiter of the object. A read
that answers returns its body as an ``Answer``: the view renders it to bytes once
(``AsyncApiView.shared_answer``) and every waiter answered by the same read is sent those
bytes. A thousand waiters on one group cost one read and one rendering per wake-up per
process, not a thousand. A wait without ``share`` has a watch of its own.

A parked waiter holds no database connection and no thread: its connection is closed before
it waits, and the thread of its request goes back to the handler's idle ones
(``thread_release``, set by ``runstate_project/asgi.py``) until the request needs one again.
"""

import asyncio
import logging
import weakref
from collections.abc import Awaitable, Callable, Hashable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from typing import Any, NamedTuple

from asgiref.sync import sync_to_async
from django.db import connection

from coordination.api import draining
from coordination.plumbing import metrics
from coordination.plumbing.notify import RECHECK_S, SQLITE_POLL_S, hub

logger = logging.getLogger(__name__)

# Threads for the watches' re-reads: each borrows a pooled connection only for its read.
READ_THREADS = 8

_read_executor = ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="runstate-read")

# Gives the current request's thread back while the request waits (it holds nothing there:
# its connection is closed). Set per request by the API's ASGI handler; None elsewhere (the
# test client, the dashboard), where a waiter keeps its thread.
thread_release: ContextVar[Callable[[], None] | None] = ContextVar("runstate_thread_release", default=None)


# Whether the current request's wait parked: its connection was closed and its thread given
# back, so nothing of the request is left on a thread (``AsyncApiView.shared_answer``).
_parked: ContextVar[bool] = ContextVar("runstate_wait_parked", default=False)


async def park() -> None:
    """Close the request's connection and give its thread back for the wait (a long-poll, a stream)."""
    await sync_to_async(_close_connection)()
    _parked.set(True)
    release = thread_release.get()
    if release is not None:
        release()


def parked() -> bool:
    """Tell whether the current request's last wait parked (its connection closed, its thread given back)."""
    return _parked.get()


class Answer:
    """A wait's answer body, shared by every waiter answered by the same read.

    ``rendered(key, render)`` keeps each rendering (by renderer, media type and status), so
    the body is rendered to bytes once however many waiters it answers.
    """

    __slots__ = ("data", "_rendered")

    def __init__(self, data: object) -> None:
        self.data = data
        self._rendered: dict[Hashable, object] = {}

    def rendered[R](self, key: Hashable, render: Callable[[], R]) -> R:
        """Return the rendering of ``key``, calling ``render`` only the first time."""
        try:
            return self._rendered[key]  # type: ignore[return-value]
        except KeyError:
            value = self._rendered[key] = render()
            return value


class Watched(NamedTuple):
    """What a wait on one object watches, the same for its DRF view and the hot path (``long_poll``'s arguments).

    ``read`` returns ``(object, Answer)``; ``share`` names the watch (the object and what
    ``read`` depends on), so the DRF view's waiters and the hot path's of the same object
    share one watch, one re-read and one rendering per wake-up.
    """

    read: Callable[[], Any]
    done: Callable[[Any], bool]
    topics: list
    share: Hashable
    due_in_s: Callable[[Any], float | None] | None = None


async def in_request[T](fn: Callable[..., T], *args, **kwargs) -> T:
    """Run ``fn`` on the request's own thread and connection (no wait follows)."""
    return await sync_to_async(fn)(*args, **kwargs)


def _close_connection() -> None:
    # Resolve the proxy here, in the thread whose connection is to be closed.
    connection.close()


async def db[T](fn: Callable[..., T], *args, **kwargs) -> T:
    """Run ``fn`` on the request's own thread, then close its connection (a read between waits).

    Not on the event loop's default executor: its few threads are shared by the whole process,
    and Django answers every 4xx through one of them (``log_response``) while that request
    still holds its pooled connection. Rechecks blocked there waiting for the pool would
    then wait on connections that can only come back through the same blocked threads: with
    the pool exhausted, the process stood still until the pool's timeout.
    """

    def call() -> T:
        try:
            return fn(*args, **kwargs)
        finally:
            connection.close()

    return await sync_to_async(call)()


async def shared_db[T](fn: Callable[..., T], *args, **kwargs) -> T:
    """Run ``fn`` on the watches' own threads (never the default executor, see ``db``), then close the connection."""

    def call() -> T:
        try:
            return fn(*args, **kwargs)
        finally:
            connection.close()

    return await sync_to_async(call, thread_sensitive=False, executor=_read_executor)()


class Watch:
    """The waiters of one object in one process: one subscription, one re-read per wake-up.

    ``read`` None makes a watch of *rounds* (claims): each wake-up only starts a round, and
    its waiters then act on their own (see ``claim_long_poll``).
    """

    def __init__(self, key: Hashable, read: Callable | None, topics: Iterable[object], due_in_s) -> None:
        self.key = key
        self.read = read
        self.due_in_s = due_in_s
        self.subscription = hub.subscribe(topics)
        self.members = 0
        self.reads = 0
        self.value: object = None
        self.primed = asyncio.Event()  # a first value is known (a waiter's own first read)
        self.next: asyncio.Future = asyncio.get_running_loop().create_future()
        self.lock = asyncio.Lock()  # claim rounds: one claimer at a time
        self.spent_round = -1  # the last round in which a claimer found nothing
        self.first_pending: asyncio.Future | None = None  # a first read not sent yet (``first_read``)
        self.task = asyncio.get_running_loop().create_task(self._run(), name=f"runstate-watch {key!r}")

    def offer(self, value: object) -> None:
        """Give the watch a waiter's first value, for ``due_in_s`` (the first one wins)."""
        if not self.primed.is_set():
            self.value = value
            self.primed.set()

    def pause_s(self) -> float:
        pause = RECHECK_S if hub.enabled() else SQLITE_POLL_S
        if self.due_in_s is not None:
            due = self.due_in_s(self.value)
            if due is not None:
                pause = min(pause, max(due, 0.0))
        return pause

    async def _run(self) -> None:
        await self.primed.wait()
        await hub.ready()
        while True:
            if hub.enabled():
                woken = await self.subscription.wait(self.pause_s())
            else:
                await asyncio.sleep(self.pause_s())
                woken = False
            outcome: tuple[object, BaseException | None] = (None, None)
            if self.read is not None:
                try:
                    outcome = (await shared_db(self.read), None)
                    self.value = outcome[0]
                except Exception as error:  # noqa: BLE001 - answered to every waiter
                    outcome = (None, error)
            self.reads += 1
            logger.debug("watch %r: read %d (%s)", self.key, self.reads, "notified" if woken else "recheck")
            future, self.next = self.next, asyncio.get_running_loop().create_future()
            future.set_result(outcome)

    async def first_read(self, first: Callable[[Callable[[], None]], Awaitable[object]]) -> object:
        """Return a first read of the object for a waiter that has joined: ``first``'s, or one shared.

        A first read that has not sent its statement yet (``first(sent)`` calls ``sent`` just
        before) answers every waiter that joins meanwhile: each joined before the read's
        snapshot, so a commit after it still wakes them. A burst of waits on one object (the
        hot path's, ``coordination/api/hot/waits.py``) then costs a few statements, not one
        per waiter, and a burst's first reads do not queue for the hot pool's connections.
        """
        pending = self.first_pending
        if pending is None:
            loop = asyncio.get_running_loop()
            pending = self.first_pending = loop.create_future()
            pending.add_done_callback(_retrieved)

            def sent() -> None:
                if self.first_pending is pending:
                    self.first_pending = None

            async def run() -> None:
                try:
                    pending.set_result(await first(sent))
                except asyncio.CancelledError:
                    pending.cancel()
                    raise
                except Exception as error:  # noqa: BLE001 - each waiter sharing it raises it
                    pending.set_exception(error)
                finally:
                    sent()

            loop.create_task(run(), name=f"runstate-first-read {self.key!r}")
        return await asyncio.shield(pending)

    async def next_read(self, timeout_s: float) -> tuple[bool, object]:
        """Wait for the next re-read (at most ``timeout_s``); return (whether it came, its value).

        While the process drains (``draining``) none comes: the wait answers as if it had run out.
        """
        if draining.draining():
            return False, None
        future = self.next
        try:
            outcome = await asyncio.wait_for(asyncio.shield(future), max(timeout_s, 0))
        except TimeoutError:
            return False, None
        if outcome is _DRAINED:
            return False, None
        value, error = outcome
        if error is not None:
            raise error
        return True, value

    def drain(self) -> None:
        """Answer the waiters now: the process is stopping (``draining``)."""
        future, self.next = self.next, asyncio.get_running_loop().create_future()
        future.set_result(_DRAINED)


# What a watch's ``next`` is resolved with when the process drains: its waiters answer as timed out.
_DRAINED = object()


def _retrieved(future: asyncio.Future) -> None:
    """Mark a shared first read's error as retrieved: the waiters it answered raised it, or had left."""
    if not future.cancelled():
        future.exception()


_watches: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Hashable, Watch]] = weakref.WeakKeyDictionary()


def watches() -> dict[Hashable, Watch]:
    """Return the running loop's watches, by key (tests look at them)."""
    return _watches.setdefault(asyncio.get_running_loop(), {})


def _drain_watches() -> None:
    for watch in list(watches().values()):
        watch.drain()


draining.on_drain(_drain_watches)


def _join(key: Hashable, read: Callable | None, topics: Iterable[object], due_in_s) -> Watch:
    by_key = watches()
    watch = by_key.get(key)
    if watch is None:
        watch = by_key[key] = Watch(key, read, topics, due_in_s)
        metrics.WATCHES.inc()
    watch.members += 1
    return watch


def _leave(watch: Watch) -> None:
    watch.members -= 1
    if watch.members == 0:
        by_key = watches()
        if by_key.get(watch.key) is watch:
            del by_key[watch.key]
        metrics.WATCHES.dec()
        watch.task.cancel()
        hub.unsubscribe(watch.subscription)


async def long_poll[T](
    read: Callable[[], T],
    *,
    done: Callable[[T], bool],
    topics: Iterable[object],
    timeout_ms: int,
    due_in_s: Callable[[T], float | None] | None = None,
    share: Hashable | None = None,
    first: Callable[[Callable[[], None]], Awaitable[T]] | None = None,
) -> T:
    """Call ``read`` until ``done(value)`` or ``timeout_ms`` passes; return the last value.

    The first read runs like any request, after the wait joined its watch (subscribed), so a
    commit between that read and the wait still wakes it. Then the request's connection is
    closed, its thread given back (``parked()`` tells), and the wait takes the watch's
    re-reads: shared with every wait of the same ``share`` key in the process (``read`` must
    then depend on nothing else than the key says), or its own without a key.
    ``due_in_s(value)``, when given, says when a time-based change is due (a timer), so the
    next re-read happens then rather than at the next recheck.

    ``first``, when given, is the first read instead of ``read`` on the request's thread: a
    coroutine on the event loop (the hot path's one statement on its async pool,
    ``coordination/api/hot/waits.py``), with no connection or thread to give back before the
    wait, and shared by the waiters of the watch that join before its statement is sent
    (``Watch.first_read``); the watch's re-reads are ``read``'s all the same. An exception
    it raises leaves the watch, as any other.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_ms / 1000
    watch = _join(share if share is not None else object(), read, topics, due_in_s)
    _parked.set(False)
    try:
        value = await (in_request(read) if first is None else watch.first_read(first))
        if done(value) or timeout_ms <= 0:
            return value
        watch.offer(value)
        logger.debug("watch %r: a waiter parked (%d waiting)", watch.key, watch.members)
        if first is None:
            await park()
        metrics.WAITERS_PARKED.inc()
        try:
            while True:
                came, new_value = await watch.next_read(deadline - loop.time())
                if not came:
                    return value
                value = new_value
                if done(value):
                    return value
        finally:
            metrics.WAITERS_PARKED.dec()
    finally:
        _leave(watch)


async def claim_long_poll[T](
    claim: Callable[[], list[T]] | None,
    *,
    topics: Iterable[object],
    timeout_ms: int,
    share: Hashable,
    on_loop: Callable[[bool], Awaitable[list[T]]] | None = None,
) -> list[T]:
    """Call ``claim`` until it claims something or ``timeout_ms`` passes; return the last answer.

    Claims cannot share one read: each claimer takes its own tasks. The claimers of one run
    and mailbox in a process share a watch of rounds instead: after a wake-up they claim one
    at a time, and the first to find nothing ends the round for the others, who wait for the
    next one. One submitted task then costs one claim, plus one that finds nothing, not one
    per waiting claimer. A refusal (the run cancelled) is each claimer's own answer.

    ``on_loop(first)``, when given, claims instead of ``claim`` (None then): a coroutine on the
    event loop (the hot path's statement on its async pool, ``coordination/api/hot/endpoints.py``),
    ``first`` telling whether it is the request's first claim. The view's claimers and the
    hot path's of one run and mailbox share the watch (the same ``share`` key) and its rounds;
    a claimer on the loop has no connection or thread to give back before it parks.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_ms / 1000
    watch = _join(share, None, topics, None)

    async def claiming(first: bool) -> list[T]:
        if on_loop is not None:
            return await on_loop(first)
        return await (in_request(claim) if first else shared_db(claim))

    try:
        claims = await claiming(True)
        if claims or timeout_ms <= 0:
            return claims
        watch.offer(None)
        if on_loop is None:
            await park()
        metrics.WAITERS_PARKED.inc()
        try:
            while True:
                came, _ = await watch.next_read(deadline - loop.time())
                if not came:
                    return claims
                async with watch.lock:
                    # Every wake-up counted so far was notified before this claim starts, so an
                    # empty answer covers them all.
                    latest = watch.reads
                    if watch.spent_round >= latest:
                        continue  # another claimer found nothing since the last wake-up
                    claims = await claiming(False)
                    if claims:
                        return claims
                    watch.spent_round = max(watch.spent_round, latest)
        finally:
            metrics.WAITERS_PARKED.dec()
    finally:
        _leave(watch)
