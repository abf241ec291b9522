"""Long-polls that hold no database connection while they wait."""

import asyncio
from collections.abc import Callable, Iterable

from asgiref.sync import sync_to_async
from django.db import connection

from coordination.notify import SQLITE_POLL_S, hub

# Even with NOTIFY, re-read at least this often: a safety net for time-based changes
# (retry delays, deadlines) that no event announces.
RECHECK_S = 1.0


async def db[T](fn: Callable[..., T], *args, **kwargs) -> T:
    """Run ``fn`` in a worker thread, then close that thread's connection."""

    def call() -> T:
        try:
            return fn(*args, **kwargs)
        finally:
            connection.close()

    return await sync_to_async(call, thread_sensitive=False)()


async def release_request_connection() -> None:
    """Close the connection the request used for authentication before a long wait."""
    await sync_to_async(connection.close)()


async def long_poll[T](
    read: Callable[[], T], *, done: Callable[[T], bool], topics: Iterable[object], timeout_ms: int
) -> T:
    """Call ``read`` until ``done(value)`` or ``timeout_ms`` passes; return the last value.

    The waiter subscribes before the first read, so a commit that lands between a read and
    the wait still wakes it.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_ms / 1000
    waiter = hub.subscribe(topics)
    try:
        if timeout_ms > 0:
            await hub.ready()
        while True:
            value = await db(read)
            remaining = deadline - loop.time()
            if done(value) or remaining <= 0:
                return value
            if hub.enabled():
                await waiter.wait(min(remaining, RECHECK_S))
            else:
                await asyncio.sleep(min(remaining, SQLITE_POLL_S))
    finally:
        hub.unsubscribe(waiter)
