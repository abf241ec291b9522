"""The worker loop behind ``consume``: claim, renew in the background, run handlers, record, stop.

One engine serves both clients. It runs on an asyncio loop; an async handler runs as a task
on that loop (and is cancelled when its claim is lost), a plain function runs in a daemon
thread (it cannot be cancelled: it is told through ``ctx.signal`` and its result is dropped).

Completions go through the completion buffer (``runstate/_worker/completer.py``). One
renewer tick renews every held claim in one ``POST /v1/claims/renew``. Failures and
releases have no batch endpoint and are sent one by one. The claim watch
(``runstate/_worker/watch.py``) tells the loop at once when something stops a claim it holds;
renewal reports the same, later, when the watch is down.
"""

import asyncio
import json
import logging
import traceback
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from time import monotonic
from typing import Any

from runstate._async.http import AsyncHttp
from runstate._batch import ClaimResult
from runstate._config import JsonDict, new_worker_id
from runstate._errors import (
    LeaseLostError,
    NotFoundError,
    RunstateError,
    ScopeInactiveError,
    TransportError,
)
from runstate._loop import MIN_RENEW_INTERVAL_S, TRANSIENT, FetchLoop, Held
from runstate._tracing import ProcessSpan, in_span, leave, process_span
from runstate._worker.completer import _Completer
from runstate._worker.contexts import CancellationRequested, _TaskContextBase
from runstate._worker.protocols import Claim, Tasks
from runstate._worker.signals import _sigterm_stops
from runstate._worker.watch import READY_TIMEOUT_S, ClaimWatch

logger = logging.getLogger("runstate.worker")

# The server's cap on ``max`` of one claim call.
MAX_CLAIMS_PER_CALL = 100

# Pushed events of claims not started yet (the watch's frame came before the claim call's
# answer), kept for them; the oldest are dropped past this many.
EARLY_EVENTS_MAX = 10_000

# Why a pushed event stops a claim, as renewal would say it (``_renewed``): the run refused
# (cancelled, completed, past its deadline), else the claim is gone.
_SCOPE_CAUSES = frozenset({"run_cancelled", "run_completed", "run_deadline"})


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


def describe_error(exc: BaseException) -> JsonDict:
    """Return the failure record of a handler's exception."""
    text = "".join(traceback.format_exception(exc))
    return {"type": type(exc).__name__, "message": str(exc), "traceback": text[-4000:]}


class _Held(Held[_TaskContextBase]):
    """A claimed task being worked on."""

    def __init__(self, claim: Claim, ctx: _TaskContextBase) -> None:
        super().__init__(ctx)
        self.claim = claim
        self.lease_until = monotonic()  # when the lease runs out at the latest, by this process's clock
        self.started = monotonic()  # for the duration in the task's log line
        self.refusal: RunstateError | None = None  # why the record of the result was refused, if it was
        self.trace = ProcessSpan(None)  # the handler's ``process`` span (a child of the submitter's)


class Engine(FetchLoop[ConsumeSummary]):
    """One worker loop on one run and mailbox."""

    def __init__(
        self,
        http: AsyncHttp,
        run_id: str,
        mailbox: str,
        *,
        tasks: Tasks,
        make_context: Callable[[Claim], _TaskContextBase],
        start_handler: Callable[[_TaskContextBase], Awaitable[Any]],
        concurrency: int,
        lease_ttl_ms: int | None,
        worker_id: str | None,
        claim_wait_ms: int,
        renew_fraction: float,
        drain_timeout: float,
        handle_signals: bool,
    ) -> None:
        super().__init__(
            http, run_id, mailbox, concurrency=concurrency, drain_timeout=drain_timeout, handle_signals=handle_signals
        )
        if not 0 < renew_fraction < 1:
            raise ValueError("renew_fraction must be between 0 and 1")
        self._tasks = tasks
        self._make_context = make_context
        self._start_handler = start_handler
        self.lease_ttl_ms = lease_ttl_ms
        self.worker_id = worker_id or new_worker_id()
        self.claim_wait_ms = max(0, min(claim_wait_ms, 30_000))
        self.renew_fraction = renew_fraction
        self.summary = ConsumeSummary()
        self._held: dict[str, _Held] = {}
        self._early: OrderedDict[str, tuple[str, JsonDict]] = OrderedDict()
        self._ttl_s = 30.0
        self._completer = _Completer(self._tasks)

    async def run(self) -> ConsumeSummary:
        """Work until the run refuses work or ``stop()``; return the summary."""
        loop = self._begin()
        self._ttl_s = await self._lease_ttl_ms(self.lease_ttl_ms) / 1000
        self._completer = _Completer(self._tasks)
        self._completer.start()
        renewer = asyncio.create_task(self._renew_loop(), name="runstate-renew")
        watch = ClaimWatch(self._http, self.worker_id, self._pushed)
        watcher = asyncio.create_task(watch.run(), name="runstate-claim-watch")
        with _sigterm_stops(self, loop):
            try:
                try:
                    # Claims taken before the watch opens hear a cancel at renewal only: wait for it, briefly.
                    ready = asyncio.ensure_future(watch.ready.wait())
                    await asyncio.wait({ready, watcher}, timeout=READY_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
                    ready.cancel()
                    await self._claim_loop()
                except BaseException:
                    # Cancelled from outside, or an error that ends the loop: hand everything back now.
                    await self._shutdown(drain_timeout=0)
                    raise
                await self._shutdown(drain_timeout=self.drain_timeout)
            finally:
                for background in (renewer, watcher):
                    background.cancel()
                await asyncio.gather(renewer, watcher, return_exceptions=True)
                await self._completer.close()  # every completion is sent before the loop returns
        return self.summary

    # Claiming ---------------------------------------------------------------------------

    async def _claim_loop(self) -> None:
        def claim(free: int) -> Awaitable[Sequence[Claim]]:
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

    def _start(self, claim: Claim) -> None:
        ctx = self._make_context(claim)
        held = _Held(claim, ctx)
        if claim.cancellation_requested:
            ctx._trip("cancellation_requested")
        held.lease_until = monotonic() + self._ttl_s
        held.trace = process_span(
            self.mailbox,
            traceparent=claim.data.get("traceparent"),
            tracestate=claim.data.get("tracestate"),
            run_id=self.run_id,
            task_id=claim.task_id,
            attempt=claim.attempt,
            group_id=claim.task.get("groupId"),
        )
        # The handler and its supervisor run in the process span's context (tasks copy it).
        token = in_span(held.trace.context)
        try:
            held.handler = asyncio.ensure_future(self._start_handler(ctx))
            held.handler.add_done_callback(self._slot_freed)
            self._held[claim.id] = held
            held.supervisor = asyncio.create_task(self._supervise(held), name=f"runstate-task-{claim.task_id}")
        finally:
            leave(token)
        early = self._early.pop(claim.id, None)
        if early is not None:
            self._stop_pushed(held, *early)

    def _lose(self, held: _Held, reason: str) -> None:
        """Mark the claim lost: set the signal and cancel the handler (its result can no longer count)."""
        held.lost = True
        held.ctx._trip(reason)
        if held.handler is not None and not held.handler.done():
            logger.info("task %s: claim lost (%s); cancelling its handler", held.claim.task_id, reason)
            held.handler.cancel()

    def _pushed(self, event_type: str, claim_id: str, data: JsonDict) -> None:
        """Apply what the claim watch says of one claim, as its renewal would say it later."""
        held = self._held.get(claim_id)
        if held is None:
            # Not started yet (its claim call's answer is still on its way), or not ours (another
            # loop with the same worker id, or a handler that returned): kept for ``_start``.
            self._early[claim_id] = (event_type, data)
            while len(self._early) > EARLY_EVENTS_MAX:
                self._early.popitem(last=False)
            return
        self._stop_pushed(held, event_type, data)

    def _stop_pushed(self, held: _Held, event_type: str, data: JsonDict) -> None:
        if held.lost or not held.running():
            return  # its handler returned already
        if event_type == "task.cancellation_requested":
            held.ctx._trip("cancellation_requested")
        else:
            self._lose(held, "scope_refused" if data.get("cause") in _SCOPE_CAUSES else "lease_lost")

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
            if batch:
                await self._renew(batch)

    async def _renew(self, batch: list[_Held]) -> None:
        """Renew ``batch`` in one call and apply each claim's answer."""
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
                held.trace.fail(exc)
                await self._record_failure(held, exc)
                return
            await self._record_outcome(held, outcome)
        finally:
            held.trace.end()
            self._held.pop(held.claim.id, None)
            if self._changed is not None:
                self._changed.set()

    async def _record_outcome(self, held: _Held, outcome: Any) -> None:
        try:
            json.dumps(outcome)
        except (TypeError, ValueError) as exc:
            error = {"type": type(exc).__name__, "message": f"The handler's return value is not JSON: {exc}"}
            with held.trace.settle(self.mailbox, outcome="fail"):
                await self._record(held, held.claim.fail(error, retry=False), failed=True)
            return
        with held.trace.settle(self.mailbox, outcome="complete"):
            await self._record(held, self._completer.complete(held.claim, outcome), failed=False)

    async def _record_failure(self, held: _Held, exc: BaseException) -> None:
        logger.warning("task %s attempt %d failed: %r", held.claim.task_id, held.claim.attempt, exc)
        with held.trace.settle(self.mailbox, outcome="fail"):
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

    async def _release(self, claim: Claim) -> None:
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
        await super()._shutdown(drain_timeout=drain_timeout)
