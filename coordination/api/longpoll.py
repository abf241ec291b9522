"""Long-polls that hold no database connection while they wait."""

import asyncio
from collections.abc import Callable, Iterable

from asgiref.sync import sync_to_async
from django.db import connection

from coordination.notify import SQLITE_POLL_S, hub

# Even with NOTIFY, re-read at least this often: a safety net for time-based changes
# (retry delays, deadlines) that no event announces.
RECHECK_S = 1.0


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


async def long_poll[T](
    read: Callable[[], T],
    *,
    done: Callable[[T], bool],
    topics: Iterable[object],
    timeout_ms: int,
    due_in_s: Callable[[T], float | None] | None = None,
) -> T:
    """Call ``read`` until ``done(value)`` or ``timeout_ms`` passes; return the last value.

    The first read runs like any request. Before waiting, the request's connection is
    closed and every later read borrows one only for its own duration. The waiter
    subscribes before the first read, so a commit between a read and the wait still wakes it.
    ``due_in_s(value)``, when given, says when a time-based change is due (a timer), so the
    next read happens then rather than at the next recheck.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_ms / 1000
    waiter = hub.subscribe(topics)
    try:
        value = await in_request(read)
        if done(value) or timeout_ms <= 0:
            return value
        await sync_to_async(_close_connection)()
        await hub.ready()
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return value
            pause = min(remaining, RECHECK_S if hub.enabled() else SQLITE_POLL_S)
            due = due_in_s(value) if due_in_s is not None else None
            if due is not None:
                pause = min(pause, max(due, 0.0))
            if hub.enabled():
                await waiter.wait(pause)
            else:
                await asyncio.sleep(pause)
            value = await db(read)
            if done(value):
                return value
    finally:
        hub.unsubscribe(waiter)
