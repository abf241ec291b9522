"""Run a plain-function handler in a daemon thread, and tell async handlers from plain ones."""

import asyncio
import contextvars
import inspect
import threading
from collections.abc import Callable
from typing import Any


def _settle(future: "asyncio.Future[Any]", result: object, error: BaseException | None) -> None:
    """Give ``future`` its result or error, unless its waiter already gave up (it is done)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def run_in_thread(loop: asyncio.AbstractEventLoop, fn: Callable[[Any], object], ctx: object) -> "asyncio.Future[Any]":
    """Run ``fn(ctx)`` in a daemon thread and return a future of its result on ``loop``.

    Daemon, so a handler that ignores its signal cannot keep the process alive after the
    worker returned; cancelling the future abandons the thread's result.
    """
    future: asyncio.Future[Any] = loop.create_future()
    # The handler sees the caller's context variables (its trace span, for one).
    context = contextvars.copy_context()

    def target() -> None:
        result: object = None
        error: BaseException | None = None
        try:
            result = context.run(fn, ctx)
        except Exception as exc:  # noqa: BLE001 - handed to the loop, recorded as a failure
            error = exc
        except BaseException as exc:  # noqa: BLE001 - SystemExit and the like in a handler thread
            error = RuntimeError(f"handler raised {exc!r}")
        try:
            loop.call_soon_threadsafe(_settle, future, result, error)
        except RuntimeError:  # the loop is closed: nobody waits for this result any more
            pass

    threading.Thread(target=target, name="runstate-handler", daemon=True).start()
    return future


def is_async_callable(fn: object) -> bool:
    """Return whether calling ``fn`` returns a coroutine (async functions and async ``__call__``)."""
    call = type(fn).__call__ if callable(fn) else None
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)
