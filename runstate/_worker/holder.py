"""One claim held by hand (``claim.hold()``), renewed and recorded by the consume engine's methods.

What stops the claim is pushed to it by its client's shared claim watch (``SharedWatch``).
"""

import asyncio
import logging
from time import monotonic
from typing import Any

from runstate._async.http import AsyncHttp
from runstate._errors import RunstateError
from runstate._tracing import process_span
from runstate._worker.contexts import CancellationRequested, _HoldOutcome, _TaskContextBase
from runstate._worker.engine import Engine, _Held
from runstate._worker.protocols import Claim, Tasks
from runstate._worker.watch import SharedWatch, shared_watch

logger = logging.getLogger("runstate.worker")


class Holder:
    """One claim held by hand (``claim.hold()``): the consume engine's renewer around a block.

    The engine is used without its claim loop: the claim is adopted as a held task whose
    "handler" is the block (a placeholder future that stays pending while the block runs),
    so the same renewer renews it, trips its context on a cancel request or a lost lease,
    and the same record methods complete, fail or release it when the block ends.

    With ``watch`` (the default) the claim is also subscribed to its client's watch of the
    claim's ``workerId`` (``SharedWatch``) while it is held, and renewed once as soon as that
    watch is open: what stopped it before is told by that renewal, what stops it later is
    pushed at once, as ``consume`` is told.
    """

    def __init__(
        self,
        http: AsyncHttp,
        claim: Claim,
        ctx: _TaskContextBase,
        tasks: Tasks,
        *,
        lease_ttl_ms: int | None,
        renew_fraction: float,
        watch: bool = True,
    ) -> None:
        self.claim = claim
        self.ctx = ctx
        self._http = http
        self._watch = watch
        self.engine = Engine(
            http,
            str(claim.task.get("runId")),
            str(claim.task.get("mailbox")),
            tasks=tasks,
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
        self._shared: SharedWatch | None = None

    @staticmethod
    async def _never(ctx: _TaskContextBase) -> Any:
        raise AssertionError("a held claim has no handler")  # pragma: no cover

    async def enter(self) -> None:
        """Start renewing (every ``renew_fraction`` of the lease TTL: the given one, else the mailbox's)."""
        engine = self.engine
        engine._ttl_s = await engine._lease_ttl_ms(engine.lease_ttl_ms) / 1000
        held = self.held
        held.handler = asyncio.get_running_loop().create_future()  # pending while the block runs
        held.lease_until = monotonic() + engine._ttl_s
        held.started = monotonic()
        if self.claim.cancellation_requested:
            self.ctx._trip("cancellation_requested")
        # The block's ``process`` span, a child of the submitter's; the hold makes it current.
        held.trace = process_span(
            engine.mailbox,
            traceparent=self.claim.data.get("traceparent"),
            tracestate=self.claim.data.get("tracestate"),
            run_id=engine.run_id,
            task_id=self.claim.task_id,
            attempt=self.claim.attempt,
            group_id=self.claim.task.get("groupId"),
        )
        engine._held[self.claim.id] = held
        self._renewer = asyncio.create_task(engine._renew_loop(), name=f"runstate-hold-{self.claim.task_id}")
        worker_id = self.claim.task.get("workerId")
        if self._watch and isinstance(worker_id, str) and worker_id:
            try:
                self._shared = shared_watch(self._http, worker_id)
                await self._shared.subscribe(self.claim.id, engine._pushed)
                # The claim was taken before the watch was open for it: what stopped it meanwhile
                # (a cancel, the run's end) is told by one renewal now.
                await engine._renew([held])
            except BaseException:
                await self.stop()
                raise

    async def stop(self) -> None:
        """Stop renewing and forget the claim, recording nothing (idempotent)."""
        if self._renewer is not None:
            self._renewer.cancel()
            await asyncio.gather(self._renewer, return_exceptions=True)
        if self._shared is not None:
            self._shared.unsubscribe(self.claim.id)
            self._shared = None
        self.engine._held.pop(self.claim.id, None)
        if self.held.handler is not None and not self.held.handler.done():
            self.held.handler.cancel()

    async def exit(self, error: BaseException | None) -> RunstateError | None:
        """Stop renewing and record what the block did, as ``consume`` records a handler's end.

        Returns the service's refusal of that record (``None`` when it was recorded).
        """
        try:
            if isinstance(error, Exception) and not isinstance(error, CancellationRequested):
                self.held.trace.fail(error)
            return await self._record(error)
        finally:
            self.held.trace.end()

    async def _record(self, error: BaseException | None) -> RunstateError | None:
        # No renewal may race the record (a renewal after a complete would be refused and trip the signal).
        await self.stop()
        engine, held, ctx = self.engine, self.held, self.ctx
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
