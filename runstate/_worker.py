"""The worker loop behind ``consume``: claim, renew in the background, run handlers, record, stop.

One engine serves both clients. It runs on an asyncio loop; an async handler runs as a task
on that loop (and is cancelled when its claim is lost), a plain function runs in a daemon
thread (it cannot be cancelled: it is told through ``ctx.signal`` and its result is dropped).

Completions are buffered and sent through ``POST /v1/claims/complete`` by one flusher task
when ``FLUSH_SIZE`` are waiting or the oldest has waited ``FLUSH_DELAY_S`` (pgqueuer's and
River's batch completers work the same way); each waiter gets its own item's answer. One
renewer tick renews every held claim in one ``POST /v1/claims/renew``. Failures and
releases have no batch endpoint and are sent one by one.
"""

import asyncio
import inspect
import json
import logging
import os
import signal
import socket
import threading
import traceback
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from time import monotonic
from typing import Any, Protocol

from runstate._async.http import AsyncHttp
from runstate._async.work import AsyncClaim, AsyncTasks
from runstate._batch import ClaimResult
from runstate._config import JsonDict, segment
from runstate._errors import (
    LeaseLostError,
    NotFoundError,
    RunstateError,
    ScopeInactiveError,
    TransportError,
)
from runstate._loop import TRANSIENT, FetchLoop

logger = logging.getLogger("runstate.worker")

# A renewal must leave room to reach the server before the lease runs out.
MIN_RENEW_INTERVAL_S = 0.05
# The server's cap on ``max`` of one claim call.
MAX_CLAIMS_PER_CALL = 100
# Buffered completions are sent when this many wait, or when the oldest has waited this long.
FLUSH_SIZE = 50
FLUSH_DELAY_S = 0.02


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


class _TaskContextBase:
    """What a handler gets: the claimed task, and whether it should stop."""

    signal: _Signal

    def __init__(self, claim: AsyncClaim) -> None:
        self.task: JsonDict = claim.task
        self.task_id: str = claim.task_id
        self.claim_id: str = claim.id
        self.attempt: int = claim.attempt
        self.input: Any = claim.task.get("input")
        self.key: str | None = claim.task.get("key")
        # Why the signal was set: "cancellation_requested", "lease_lost", "scope_refused" or "stopping".
        self.stop_reason: str | None = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} task={self.task_id} attempt={self.attempt}>"

    def is_cancellation_requested(self) -> bool:
        """Return whether the handler should stop (cancellation requested, lease lost or run refused)."""
        return self.signal.is_set()

    def _trip(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
        self.signal.set()


class AsyncTaskContext(_TaskContextBase):
    """The context of an ``AsyncRunstate`` handler; ``signal`` is an ``asyncio.Event``.

    A plain-function handler runs in a thread: it should poll ``is_cancellation_requested()``
    rather than wait on the ``asyncio.Event`` (and cannot use ``cancel_on_request``).
    """

    signal: asyncio.Event

    def __init__(self, claim: AsyncClaim) -> None:
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

    def __init__(self, claim: AsyncClaim) -> None:
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

    def __init__(self, claim: AsyncClaim) -> None:
        super().__init__(claim)
        self._init_outcome()


class HoldContext(_HoldOutcome, TaskContext):
    """The context of ``with claim.hold() as ctx``: a handler's context plus ``complete`` and ``release``."""

    def __init__(self, claim: AsyncClaim) -> None:
        super().__init__(claim)
        self._init_outcome()


@dataclass
class ConsumeSummary:
    """What a worker loop did before it returned.

    ``completed``: outcomes recorded (``SUCCEEDED``, or ``CANCELLED`` when cancellation was
    requested); ``failed``: failures recorded; ``lost``: claims lost (lease lost, run refused,
    or the record refused); ``released``: tasks handed back on stop. ``stop_reason`` is
    ``"stopped"`` (``stop()``/``SIGTERM``) or the run's refusal code (``SCOPE_CANCELLED``,
    ``SCOPE_COMPLETED``, ``DEADLINE_EXCEEDED``).
    """

    completed: int = 0
    failed: int = 0
    lost: int = 0
    released: int = 0
    stop_reason: str = ""


def _settle(future: "asyncio.Future[Any]", result: object, error: BaseException | None) -> None:
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

    def target() -> None:
        result: object = None
        error: BaseException | None = None
        try:
            result = fn(ctx)
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


def describe_error(exc: BaseException) -> JsonDict:
    """Return the failure record of a handler's exception."""
    text = "".join(traceback.format_exception(exc))
    return {"type": type(exc).__name__, "message": str(exc), "traceback": text[-4000:]}


class _Held:
    """A claimed task being worked on."""

    def __init__(self, claim: AsyncClaim, ctx: _TaskContextBase) -> None:
        self.claim = claim
        self.ctx = ctx
        self.lost = False  # the claim is gone: nothing may be recorded, the handler is cancelled
        self.abandoned = False  # the worker is stopping: the handler is cancelled, the task released
        self.handler: asyncio.Future[Any] | None = None
        self.supervisor: asyncio.Task[None] | None = None
        self.lease_until = monotonic()  # when the lease runs out at the latest, by this process's clock
        self.started = monotonic()  # for the duration in the task's log line
        self.refusal: RunstateError | None = None  # why the record of the result was refused, if it was

    def running(self) -> bool:
        """Return whether the handler is still running (it takes a slot of ``concurrency``)."""
        return self.handler is not None and not self.handler.done()


class _Completer:
    """Buffered completions, keyed by claim, sent in batches by one flusher task.

    A completion waits until ``FLUSH_SIZE`` are waiting or the oldest has waited
    ``FLUSH_DELAY_S``, then all that wait go in one ``complete_many`` (at once while stopping).
    ``complete`` answers what ``claim.complete`` would have: the task, or the item's own
    error raised (``LeaseLostError``, ``NotFoundError``, ``ScopeCancelledError``...); an error
    of the whole request (transport, 5xx after the retries) is raised to each of its waiters.
    """

    def __init__(self, tasks: AsyncTasks) -> None:
        self._tasks = tasks
        self._pending: dict[str, tuple[Any, asyncio.Future[ClaimResult]]] = {}
        self._oldest = 0.0
        self._wake = asyncio.Event()
        self._hurry = False
        self._closed = False
        self._flusher: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._flusher = asyncio.create_task(self._run(), name="runstate-completer")

    def hurry(self) -> None:
        """Send what waits, and each later completion, at once (the worker is stopping)."""
        self._hurry = True
        self._wake.set()

    async def close(self) -> None:
        """Send what still waits, then end the flusher."""
        self._closed = True
        self.hurry()
        if self._flusher is not None:
            await self._flusher

    async def complete(self, claim: AsyncClaim, outcome: Any) -> JsonDict:
        """Buffer the completion of ``claim`` and return the completed task once it is sent."""
        if self._closed or self._flusher is None or self._flusher.done():
            return await claim.complete(outcome)
        if claim.id in self._pending:
            raise RuntimeError(f"claim {claim.id} is already waiting to be completed")
        future: asyncio.Future[ClaimResult] = asyncio.get_running_loop().create_future()
        if not self._pending:
            self._oldest = monotonic()
        self._pending[claim.id] = (outcome, future)
        if len(self._pending) == 1 or len(self._pending) >= FLUSH_SIZE:
            self._wake.set()
        result = await future
        if result.error is not None:
            raise result.error
        assert result.task is not None
        return result.task

    async def _run(self) -> None:
        while True:
            if not self._pending:
                if self._closed:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            left = self._oldest + FLUSH_DELAY_S - monotonic()
            if len(self._pending) < FLUSH_SIZE and not self._hurry and left > 0:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), left)
                except TimeoutError:
                    pass
                continue
            await self._flush()

    async def _flush(self) -> None:
        # A waiter cancelled before the send withdraws its completion.
        batch = [
            (claim_id, outcome, future) for claim_id, (outcome, future) in self._pending.items() if not future.done()
        ]
        self._pending = {}
        if not batch:
            return
        try:
            results = await self._tasks.complete_many([(claim_id, outcome) for claim_id, outcome, _ in batch])
        except Exception as exc:  # noqa: BLE001 - the whole request failed: each waiter hears it
            for _, _, future in batch:
                _settle(future, None, exc)
            return
        except BaseException:
            for _, _, future in batch:
                future.cancel()
            raise
        for (_, _, future), result in zip(batch, results, strict=True):
            _settle(future, result, None)


class Stoppable(Protocol):
    """A worker loop that ``SIGTERM`` can stop (the task engine and the message engine)."""

    handle_signals: bool

    def stop(self) -> None: ...


# SIGTERM stops every worker running on a loop; the handler is installed by the first one
# and the previous disposition restored by the last one.
_sigterm_workers: dict[asyncio.AbstractEventLoop, set[Stoppable]] = {}
_sigterm_previous: dict[asyncio.AbstractEventLoop, Any] = {}


def _stop_all(loop: asyncio.AbstractEventLoop) -> None:
    logger.info("SIGTERM: stopping %d worker(s)", len(_sigterm_workers.get(loop, ())))
    for engine in list(_sigterm_workers.get(loop, ())):
        engine.stop()


@contextmanager
def _sigterm_stops(engine: Stoppable, loop: asyncio.AbstractEventLoop) -> Iterator[None]:
    if not engine.handle_signals or threading.current_thread() is not threading.main_thread():
        yield
        return
    workers = _sigterm_workers.get(loop)
    if workers is None:
        previous = signal.getsignal(signal.SIGTERM)
        try:
            loop.add_signal_handler(signal.SIGTERM, _stop_all, loop)
        except (NotImplementedError, RuntimeError):  # no signal support on this loop/platform
            yield
            return
        workers = _sigterm_workers[loop] = set()
        _sigterm_previous[loop] = previous
    workers.add(engine)
    try:
        yield
    finally:
        workers.discard(engine)
        if not workers:
            del _sigterm_workers[loop]
            previous = _sigterm_previous.pop(loop)
            loop.remove_signal_handler(signal.SIGTERM)
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)


class Engine(FetchLoop[ConsumeSummary]):
    """One worker loop on one run and mailbox."""

    def __init__(
        self,
        http: AsyncHttp,
        run_id: str,
        mailbox: str,
        *,
        make_context: Callable[[AsyncClaim], _TaskContextBase],
        start_handler: Callable[[_TaskContextBase], Awaitable[Any]],
        concurrency: int,
        lease_ttl_ms: int | None,
        worker_id: str | None,
        claim_wait_ms: int,
        renew_fraction: float,
        drain_timeout: float,
        handle_signals: bool,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if not 0 < renew_fraction < 1:
            raise ValueError("renew_fraction must be between 0 and 1")
        super().__init__()
        self._http = http
        self._tasks = AsyncTasks(http, run_id)
        self.run_id = run_id
        self.mailbox = mailbox
        self._make_context = make_context
        self._start_handler = start_handler
        self.concurrency = concurrency
        self.lease_ttl_ms = lease_ttl_ms
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        self.claim_wait_ms = max(0, min(claim_wait_ms, 30_000))
        self.renew_fraction = renew_fraction
        self.drain_timeout = drain_timeout
        self.handle_signals = handle_signals
        self.summary = ConsumeSummary()
        self._held: dict[str, _Held] = {}
        self._ttl_s = 30.0
        self._completer = _Completer(self._tasks)

    async def run(self) -> ConsumeSummary:
        """Work until the run refuses work or ``stop()``; return the summary."""
        loop = self._begin()
        ttl_ms = self.lease_ttl_ms
        if ttl_ms is None:
            mailbox = await self._http.request("GET", f"/mailboxes/{segment(self.mailbox)}", idempotent=True)
            ttl_ms = int(mailbox["leaseTtlMs"])
        self._ttl_s = ttl_ms / 1000
        self._completer = _Completer(self._tasks)
        self._completer.start()
        renewer = asyncio.create_task(self._renew_loop(), name="runstate-renew")
        with _sigterm_stops(self, loop):
            try:
                try:
                    await self._claim_loop()
                except BaseException:
                    # Cancelled from outside, or an error that ends the loop: hand everything back now.
                    await self._shutdown(drain_timeout=0)
                    raise
                await self._shutdown(drain_timeout=self.drain_timeout)
            finally:
                renewer.cancel()
                await asyncio.gather(renewer, return_exceptions=True)
                await self._completer.close()  # every completion is sent before the loop returns
        return self.summary

    # Claiming ---------------------------------------------------------------------------

    async def _claim_loop(self) -> None:
        def claim(free: int) -> Awaitable[list[AsyncClaim]]:
            return self._tasks.claim(
                self.mailbox,
                max=free,
                wait_ms=self.claim_wait_ms,
                lease_ttl_ms=self.lease_ttl_ms,
                worker_id=self.worker_id,
            )

        await self._fetch_loop(
            claim, self._release, max_per_call=MAX_CLAIMS_PER_CALL, wait_ms=self.claim_wait_ms, verb="claim"
        )

    # Running one task -------------------------------------------------------------------

    def _start(self, claim: AsyncClaim) -> None:
        ctx = self._make_context(claim)
        held = _Held(claim, ctx)
        if claim.cancellation_requested:
            ctx._trip("cancellation_requested")
        held.lease_until = monotonic() + self._ttl_s
        held.handler = asyncio.ensure_future(self._start_handler(ctx))
        held.handler.add_done_callback(self._slot_freed)
        self._held[claim.id] = held
        held.supervisor = asyncio.create_task(self._supervise(held), name=f"runstate-task-{claim.task_id}")

    def _lose(self, held: _Held, reason: str) -> None:
        """Mark the claim lost: set the signal and cancel the handler (its result can no longer count)."""
        held.lost = True
        held.ctx._trip(reason)
        if held.handler is not None and not held.handler.done():
            logger.info("task %s: claim lost (%s); cancelling its handler", held.claim.task_id, reason)
            held.handler.cancel()

    async def _renew_loop(self) -> None:
        """Every ``renew_fraction`` of the TTL, renew every held claim in one call.

        A claim is renewed at most one interval after it was claimed or last renewed, as a
        loop per claim would; a renewal that fails in transit is retried at the next tick
        until the lease would have run out.
        """
        interval = max(MIN_RENEW_INTERVAL_S, self._ttl_s * self.renew_fraction)
        while True:
            await asyncio.sleep(interval)
            batch = [held for held in self._held.values() if not held.lost]
            if not batch:
                continue
            sent = monotonic()
            try:
                results = await self._tasks.renew_many([held.claim for held in batch], lease_ttl_ms=self.lease_ttl_ms)
            except Exception as exc:  # noqa: BLE001 - the whole request failed: each claim hears it
                error = exc if isinstance(exc, RunstateError) else TransportError(f"renewal failed: {exc!r}")
                if isinstance(error, TRANSIENT):
                    logger.warning("renewal of %d claim(s) failed (%s); retrying", len(batch), error)
                results = [ClaimResult(held.claim.id, False, error=error) for held in batch]
            for held, result in zip(batch, results, strict=True):
                self._renewed(held, result, sent)

    def _renewed(self, held: _Held, result: ClaimResult, sent: float) -> None:
        """Apply one claim's renewal answer: extend its lease, or trip its context (that task only)."""
        error = result.error
        if error is None:
            held.lease_until = sent + self._ttl_s
            if held.claim.cancellation_requested and held.running():
                held.ctx._trip("cancellation_requested")
            return
        if not held.running():
            return  # the handler returned: the record of its result says what became of the claim
        if isinstance(error, ScopeInactiveError):
            self._lose(held, "scope_refused")
        elif isinstance(error, TRANSIENT):
            if monotonic() >= held.lease_until:
                self._lose(held, "lease_lost")
        else:  # LEASE_LOST, NOT_FOUND, or anything else: the claim is gone
            self._lose(held, "lease_lost")

    async def _supervise(self, held: _Held) -> None:
        assert held.handler is not None
        try:
            try:
                outcome = await held.handler
            except asyncio.CancelledError:
                if held.lost:
                    logger.info(
                        "task %s attempt %d: lost (%s) after %.3f s",
                        held.claim.task_id,
                        held.claim.attempt,
                        held.ctx.stop_reason,
                        monotonic() - held.started,
                    )
                    self.summary.lost += 1
                elif held.abandoned:
                    await self._release(held.claim)
                else:  # the handler cancelled itself: a failure like any other
                    await self._record_failure(held, asyncio.CancelledError("handler cancelled"))
                return
            except CancellationRequested:
                # The handler let cancel_on_request's abort escape: it acknowledges the request.
                if held.lost:
                    self.summary.lost += 1
                else:
                    await self._record_outcome(held, None)
                return
            except Exception as exc:  # noqa: BLE001 - the handler's failure is recorded, not raised
                await self._record_failure(held, exc)
                return
            await self._record_outcome(held, outcome)
        finally:
            self._held.pop(held.claim.id, None)
            if self._changed is not None:
                self._changed.set()

    async def _record_outcome(self, held: _Held, outcome: Any) -> None:
        try:
            json.dumps(outcome)
        except (TypeError, ValueError) as exc:
            error = {"type": type(exc).__name__, "message": f"The handler's return value is not JSON: {exc}"}
            await self._record(held, held.claim.fail(error, retry=False), failed=True)
            return
        await self._record(held, self._completer.complete(held.claim, outcome), failed=False)

    async def _record_failure(self, held: _Held, exc: BaseException) -> None:
        logger.warning("task %s attempt %d failed: %r", held.claim.task_id, held.claim.attempt, exc)
        await self._record(held, held.claim.fail(describe_error(exc), retry=True), failed=True)

    async def _record(self, held: _Held, call: Awaitable[JsonDict], *, failed: bool) -> None:
        took = monotonic() - held.started
        try:
            task = await call
        except (LeaseLostError, ScopeInactiveError, NotFoundError) as exc:
            logger.info(
                "task %s attempt %d: result not recorded (%s) after %.3f s",
                held.claim.task_id,
                held.claim.attempt,
                exc.code,
                took,
            )
            held.refusal = exc
            self.summary.lost += 1
            return
        except RunstateError as exc:
            logger.error(
                "task %s attempt %d: result not recorded: %s after %.3f s",
                held.claim.task_id,
                held.claim.attempt,
                exc,
                took,
            )
            held.refusal = exc
            self.summary.lost += 1
            return
        # One line per task: what the handler did, what the task became, how long it took.
        logger.info(
            "task %s attempt %d: %s -> %s in %.3f s",
            held.claim.task_id,
            held.claim.attempt,
            "failed" if failed else "returned",
            task.get("state") if isinstance(task, dict) else "?",
            took,
        )
        if failed:
            self.summary.failed += 1
        else:
            self.summary.completed += 1

    async def _release(self, claim: AsyncClaim) -> None:
        try:
            await claim.release()
        except RunstateError as exc:
            logger.info("task %s: release refused (%s)", claim.task_id, exc)
            return
        logger.info("task %s attempt %d: released (stopping)", claim.task_id, claim.attempt)
        self.summary.released += 1

    async def _shutdown(self, *, drain_timeout: float) -> None:
        """Let running handlers finish for ``drain_timeout`` s, then cancel them and release their tasks.

        Buffered completions are sent at once from here on.
        """
        self._completer.hurry()
        running = [held.supervisor for held in self._held.values() if held.supervisor is not None]
        if running and drain_timeout > 0:
            logger.info("stopping: waiting up to %.1f s for %d handler(s)", drain_timeout, len(running))
            await asyncio.wait(running, timeout=drain_timeout)
        for held in list(self._held.values()):
            if held.handler is not None and not held.handler.done():
                held.abandoned = True
                held.ctx._trip("stopping")
                held.handler.cancel()
        remaining = [held.supervisor for held in self._held.values() if held.supervisor is not None]
        if remaining:
            await asyncio.wait(remaining)


class Holder:
    """One claim held by hand (``claim.hold()``): the consume engine's renewer around a block.

    The engine is used without its claim loop: the claim is adopted as a held task whose
    "handler" is the block (a placeholder future that stays pending while the block runs),
    so the same renewer renews it, trips its context on a cancel request or a lost lease,
    and the same record methods complete, fail or release it when the block ends.
    """

    def __init__(
        self,
        http: AsyncHttp,
        claim: AsyncClaim,
        ctx: _TaskContextBase,
        *,
        lease_ttl_ms: int | None,
        renew_fraction: float,
    ) -> None:
        self.claim = claim
        self.ctx = ctx
        self.engine = Engine(
            http,
            str(claim.task.get("runId")),
            str(claim.task.get("mailbox")),
            make_context=lambda _: ctx,
            start_handler=self._never,
            concurrency=1,
            lease_ttl_ms=lease_ttl_ms,
            worker_id=None,
            claim_wait_ms=0,
            renew_fraction=renew_fraction,
            drain_timeout=0,
            handle_signals=False,
        )
        self.held = _Held(claim, ctx)
        self._renewer: asyncio.Task[None] | None = None

    @staticmethod
    async def _never(ctx: _TaskContextBase) -> Any:
        raise AssertionError("a held claim has no handler")  # pragma: no cover

    async def enter(self) -> None:
        """Start renewing (every ``renew_fraction`` of the lease TTL: the given one, else the mailbox's)."""
        engine = self.engine
        ttl_ms = engine.lease_ttl_ms
        if ttl_ms is None:
            mailbox = await engine._http.request("GET", f"/mailboxes/{segment(engine.mailbox)}", idempotent=True)
            ttl_ms = int(mailbox["leaseTtlMs"])
        engine._ttl_s = ttl_ms / 1000
        held = self.held
        held.handler = asyncio.get_running_loop().create_future()  # pending while the block runs
        held.lease_until = monotonic() + engine._ttl_s
        held.started = monotonic()
        if self.claim.cancellation_requested:
            self.ctx._trip("cancellation_requested")
        engine._held[self.claim.id] = held
        self._renewer = asyncio.create_task(engine._renew_loop(), name=f"runstate-hold-{self.claim.task_id}")

    async def exit(self, error: BaseException | None) -> RunstateError | None:
        """Stop renewing and record what the block did, as ``consume`` records a handler's end.

        Returns the service's refusal of that record (``None`` when it was recorded).
        """
        if self._renewer is not None:
            # No renewal may race the record (a renewal after a complete would be refused and trip the signal).
            self._renewer.cancel()
            await asyncio.gather(self._renewer, return_exceptions=True)
        engine, held, ctx = self.engine, self.held, self.ctx
        engine._held.pop(self.claim.id, None)
        if held.handler is not None and not held.handler.done():
            held.handler.cancel()
        released = isinstance(ctx, _HoldOutcome) and ctx.released
        cancel_requested = ctx.stop_reason == "cancellation_requested" or self.claim.cancellation_requested
        if error is not None and not isinstance(error, Exception):
            # Cancelled from outside (or KeyboardInterrupt): hand the task back, as a stopping worker does.
            await engine._release(self.claim)
        elif isinstance(error, CancellationRequested):
            if ctx.stop_reason == "cancellation_requested":
                await engine._record_outcome(held, None)  # the abort acknowledges the request
        elif error is not None:
            await engine._record_failure(held, error)
        elif released and not cancel_requested:
            try:
                await self.claim.release()
            except RunstateError as exc:
                held.refusal = exc
            else:
                logger.info("task %s attempt %d: released", self.claim.task_id, self.claim.attempt)
        else:
            outcome = ctx.outcome if isinstance(ctx, _HoldOutcome) and not released else None
            await engine._record_outcome(held, outcome)
        return held.refusal
