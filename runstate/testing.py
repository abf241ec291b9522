"""Unit-test handlers without a server: ``FakeContext`` and ``AsyncFakeContext``.

They are the real handler contexts (``TaskContext`` / ``AsyncTaskContext``, with the
``complete``/``release`` of ``claim.hold()``'s context) built on a made-up task, so
``signal``, ``is_cancellation_requested()``, ``wait_cancelled()``, ``cancel_on_request()``
(async) and ``stop_reason`` behave exactly as in production. A test decides when the stop
comes::

    from runstate.testing import AsyncFakeContext

    async def test_rebuild_stops_when_cancelled():
        ctx = AsyncFakeContext({"indexId": "products"})
        ctx.request_cancellation(after=0.05)          # or at_check=3, or lose_lease(...)
        record = await ctx.run(rebuild_index)         # as consume() would run and record it
        assert record.state == "CANCELLED"

``run(handler)`` runs the handler as ``consume`` does and returns what ``consume`` would
record (``FakeRecord``): ``SUCCEEDED`` with the return value, ``CANCELLED`` when cancellation
was requested and the handler returned (or let ``CancellationRequested`` escape), ``FAILED``
with the exception, or ``LOST`` (nothing recorded) when the lease was lost; with
``AsyncFakeContext`` an async handler whose lease is lost is cancelled, as ``consume`` does.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from runstate._config import JsonDict
from runstate._worker import (
    AsyncHoldContext,
    CancellationRequested,
    HoldContext,
    describe_error,
    is_async_callable,
)

__all__ = ["AsyncFakeContext", "FakeContext", "FakeRecord"]


@dataclass
class FakeRecord:
    """What ``consume`` would have recorded for the handler's run.

    ``state``: ``SUCCEEDED``, ``CANCELLED``, ``FAILED`` or ``LOST``; ``outcome``: the return
    value (or ``ctx.complete``'s); ``error``: the failure record (``type``, ``message``,
    ``traceback``); ``exception``: the exception itself.
    """

    state: str
    outcome: Any = None
    error: JsonDict | None = None
    exception: BaseException | None = None


class _FakeClaim:
    """Just what a context reads from a claim."""

    def __init__(self, input: Any, task_id: str, attempt: int, key: str | None, task: JsonDict | None) -> None:
        self.id = f"{task_id}:{attempt}"
        self.attempt = attempt
        self.task: JsonDict = {
            "id": task_id,
            "input": input,
            "key": key,
            "state": "RUNNING",
            "attempts": attempt,
            "mailbox": "fake",
            "runId": "fake-run",
        } | (task or {})
        self.task_id = str(self.task["id"])
        self.cancellation_requested = False


class _FakeMixin:
    """Triggers shared by both fakes: a stop now, after a delay, or at the N-th check."""

    stop_reason: str | None
    checks: int

    def _init_fake(self) -> None:
        self.checks = 0  # how many times is_cancellation_requested() was asked
        self._at_check: dict[int, str] = {}

    def request_cancellation(self, *, after: float | None = None, at_check: int | None = None) -> None:
        """Set the signal as a cancel request would: now, ``after`` seconds, or at the ``at_check``-th check."""
        self._arm("cancellation_requested", after, at_check)

    def lose_lease(self, *, after: float | None = None, at_check: int | None = None) -> None:
        """Set the signal as a lost lease would (``stop_reason == "lease_lost"``); same timing options."""
        self._arm("lease_lost", after, at_check)

    def _arm(self, reason: str, after: float | None, at_check: int | None) -> None:
        if at_check is not None:
            self._at_check[at_check] = reason
        elif after is not None:
            self._later(reason, after)
        else:
            self._stop(reason)

    def is_cancellation_requested(self) -> bool:
        """Return whether the handler should stop (counts the checks for ``at_check``)."""
        self.checks += 1
        reason = self._at_check.pop(self.checks, None)
        if reason is not None:
            self._stop(reason)
        return bool(self.signal.is_set())  # type: ignore[attr-defined]

    def _stop(self, reason: str) -> None:
        self._trip(reason)  # type: ignore[attr-defined]

    def _later(self, reason: str, after: float) -> None:
        raise NotImplementedError

    def _record(self, outcome: Any, error: BaseException | None) -> FakeRecord:
        lost = self.stop_reason in ("lease_lost", "scope_refused")
        cancelled = self.stop_reason == "cancellation_requested"
        if isinstance(error, CancellationRequested):
            return FakeRecord("LOST" if lost else "CANCELLED", None, None, error)
        if error is not None:
            return FakeRecord("LOST" if lost else "FAILED", None, describe_error(error), error)
        if lost:
            return FakeRecord("LOST", outcome)
        return FakeRecord("CANCELLED" if cancelled else "SUCCEEDED", outcome)


class FakeContext(_FakeMixin, HoldContext):
    """A sync handler's context (``signal`` is a ``threading.Event``) on a made-up task."""

    def __init__(
        self,
        input: Any = None,
        *,
        task_id: str = "task-1",
        attempt: int = 1,
        key: str | None = None,
        task: JsonDict | None = None,
    ) -> None:
        super().__init__(_FakeClaim(input, task_id, attempt, key, task))  # type: ignore[arg-type]
        self._init_fake()

    def _later(self, reason: str, after: float) -> None:
        timer = threading.Timer(after, self._stop, args=(reason,))
        timer.daemon = True
        timer.start()

    def run(self, handler: Callable[[FakeContext], Any]) -> FakeRecord:
        """Call ``handler(self)`` and return what ``consume`` would record."""
        try:
            outcome = handler(self)
        except Exception as exc:  # noqa: BLE001 - recorded, as consume records it
            return self._record(None, exc)
        return self._record(outcome, None)


class AsyncFakeContext(_FakeMixin, AsyncHoldContext):
    """An async handler's context (``signal`` is an ``asyncio.Event``) on a made-up task.

    ``after=`` needs the event loop: called outside one, the delay starts when ``run`` does.
    """

    def __init__(
        self,
        input: Any = None,
        *,
        task_id: str = "task-1",
        attempt: int = 1,
        key: str | None = None,
        task: JsonDict | None = None,
    ) -> None:
        super().__init__(_FakeClaim(input, task_id, attempt, key, task))  # type: ignore[arg-type]
        self._init_fake()
        self._pending: list[tuple[str, float]] = []
        self._lost = asyncio.Event()

    def _stop(self, reason: str) -> None:
        super()._stop(reason)
        if reason == "lease_lost":
            self._lost.set()

    def _later(self, reason: str, after: float) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._pending.append((reason, after))
            return
        loop.call_later(after, self._stop, reason)

    async def _call(self, handler: Callable[[AsyncFakeContext], Any]) -> Any:
        # As consume: an async callable on the loop, anything else in a thread (awaiting what it returns).
        if is_async_callable(handler):
            return await handler(self)
        result = await asyncio.to_thread(handler, self)
        if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
            return await result
        return result

    async def run(self, handler: Callable[[AsyncFakeContext], Any]) -> FakeRecord:
        """Run ``handler(self)`` as ``consume`` does and return what it would record.

        An async handler runs as a task, cancelled if the lease is lost; a plain function runs in a thread.
        """
        for reason, after in self._pending:
            self._later(reason, after)
        self._pending.clear()
        running: asyncio.Future[Any] = asyncio.ensure_future(self._call(handler))
        lost = asyncio.ensure_future(self._lost.wait())
        try:
            await asyncio.wait({running, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
        if not running.done():
            running.cancel()  # the claim is gone: consume cancels the handler
            await asyncio.gather(running, return_exceptions=True)
            return FakeRecord("LOST")
        if running.cancelled():
            return FakeRecord("LOST" if self._lost.is_set() else "FAILED", None, None, asyncio.CancelledError())
        error = running.exception()
        if error is not None:
            return self._record(None, error)
        return self._record(running.result(), None)
