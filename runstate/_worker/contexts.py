"""What a handler gets: the task contexts of ``consume``, ``claim.hold()``'s contexts, and the abort.

``AsyncTaskContext`` (an ``asyncio.Event`` for ``signal``) serves async handlers,
``TaskContext`` (a ``threading.Event``) plain functions run in a thread. The engine trips a
context (sets its signal and ``stop_reason``) when cancellation is requested, the lease is
lost, the run refuses work or the worker stops; the handler decides what to do about it.
"""

import asyncio
import threading
from typing import Any, Protocol

from runstate._config import JsonDict
from runstate._worker.protocols import Claim


class CancellationRequested(Exception):  # noqa: N818 - named after what happened, like asyncio.CancelledError
    """Raised by ``ctx.cancel_on_request()`` when it aborted the block it wraps.

    ``reason`` is the context's ``stop_reason``: ``"cancellation_requested"``, ``"lease_lost"``,
    ``"scope_refused"`` or ``"stopping"``. A handler that lets it escape acknowledges the
    cancellation: the task is completed (``CANCELLED``) when cancellation was requested, and
    nothing is recorded when the claim is gone.
    """

    def __init__(self, reason: str | None) -> None:
        super().__init__(f"the block was aborted: {reason}")
        self.reason = reason


class _Signal(Protocol):
    def set(self) -> None: ...

    def is_set(self) -> bool: ...


class _HandlerContext:
    """What every handler context has, a task's or a message's: ``signal``, and why it was set."""

    signal: _Signal

    def __init__(self) -> None:
        # Why the signal was set (the first reason given): "cancellation_requested" (tasks only),
        # "lease_lost", "scope_refused" or "stopping".
        self.stop_reason: str | None = None

    def is_cancellation_requested(self) -> bool:
        """Return whether the handler should stop: ``stop_reason`` says why."""
        return self.signal.is_set()

    def _trip(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
        self.signal.set()


class _TaskContextBase(_HandlerContext):
    """What a handler gets: the claimed task, and whether it should stop."""

    def __init__(self, claim: Claim) -> None:
        super().__init__()
        self.task: JsonDict = claim.task
        self.task_id: str = claim.task_id
        self.claim_id: str = claim.id
        self.attempt: int = claim.attempt
        self.input: Any = claim.task.get("input")
        self.key: str | None = claim.task.get("key")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} task={self.task_id} attempt={self.attempt}>"


class AsyncTaskContext(_TaskContextBase):
    """The context of an ``AsyncRunstate`` handler; ``signal`` is an ``asyncio.Event``.

    A plain-function handler runs in a thread: it should poll ``is_cancellation_requested()``
    rather than wait on the ``asyncio.Event`` (and cannot use ``cancel_on_request``).
    """

    signal: asyncio.Event

    def __init__(self, claim: Claim) -> None:
        super().__init__(claim)
        self.signal = asyncio.Event()

    async def wait_cancelled(self, timeout: float | None = None) -> bool:
        """Wait until the signal is set (or ``timeout`` seconds); return whether it is."""
        if timeout is None:
            await self.signal.wait()
            return True
        try:
            await asyncio.wait_for(self.signal.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def cancel_on_request(self) -> "AbortOnSignal":
        """Return an async context manager that aborts its block when the signal is set.

        The block is cancelled (asyncio task cancellation, as an ``AbortSignal`` aborts a
        ``fetch``) and ``CancellationRequested`` is raised from the ``async with``; catch it
        to decide what to record. A block already past when the signal is set is untouched.
        """
        return AbortOnSignal(self)


class AbortOnSignal:
    """``async with ctx.cancel_on_request():`` (see ``AsyncTaskContext.cancel_on_request``).

    Built as ``asyncio.timeout`` is: the task is cancelled from a callback, and on the way
    out a ``CancelledError`` this block caused (and no one else's) becomes ``CancellationRequested``.
    """

    def __init__(self, ctx: AsyncTaskContext) -> None:
        self._ctx = ctx
        self._task: asyncio.Task[Any] | None = None
        self._watcher: asyncio.Task[Any] | None = None
        self._cancelling = 0
        self._fired = False
        self._active = False

    async def __aenter__(self) -> "AbortOnSignal":
        if self._ctx.signal.is_set():
            raise CancellationRequested(self._ctx.stop_reason)
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("cancel_on_request() must be used inside an asyncio task")
        self._task = task
        self._cancelling = task.cancelling()
        self._active = True
        self._watcher = asyncio.ensure_future(self._ctx.signal.wait())
        self._watcher.add_done_callback(self._on_signal)
        return self

    def _on_signal(self, watcher: "asyncio.Future[Any]") -> None:
        # Runs on the loop while the block's task waits at an ``await`` (never in between).
        if watcher.cancelled() or not self._active or self._task is None:
            return
        self._fired = True
        self._task.cancel()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        self._active = False
        if self._watcher is not None:
            self._watcher.cancel()
        if not self._fired or self._task is None:
            return
        if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise CancellationRequested(self._ctx.stop_reason) from exc


class TaskContext(_TaskContextBase):
    """The context of a ``Runstate`` handler (run in a thread); ``signal`` is a ``threading.Event``.

    A thread cannot be cancelled: there is no ``cancel_on_request`` here. Check the signal
    between steps, pass short timeouts to blocking calls, or block in ``wait_cancelled``.
    """

    signal: threading.Event

    def __init__(self, claim: Claim) -> None:
        super().__init__(claim)
        self.signal = threading.Event()

    def wait_cancelled(self, timeout: float | None = None) -> bool:
        """Block until the signal is set (or ``timeout`` seconds); return whether it is."""
        return self.signal.wait(timeout)


class _HoldOutcome:
    """What a ``claim.hold()`` block asked for: ``complete(value)`` or ``release()``."""

    def _init_outcome(self) -> None:
        self.outcome: Any = None
        self.released = False

    def complete(self, value: Any = None) -> None:
        """Record ``value`` as the outcome when the block ends (the default outcome is ``None``)."""
        self.outcome = value
        self.released = False

    def release(self) -> None:
        """Hand the task back to the queue when the block ends (acknowledge instead if cancellation was requested)."""
        self.released = True


class AsyncHoldContext(_HoldOutcome, AsyncTaskContext):
    """The context of ``async with claim.hold() as ctx``: a handler's context plus ``complete`` and ``release``."""

    def __init__(self, claim: Claim) -> None:
        super().__init__(claim)
        self._init_outcome()


class HoldContext(_HoldOutcome, TaskContext):
    """The context of ``with claim.hold() as ctx``: a handler's context plus ``complete`` and ``release``."""

    def __init__(self, claim: Claim) -> None:
        super().__init__(claim)
        self._init_outcome()
