"""The tools past runs, work and groups: barriers, timers, shared limits and queue messages.

Pool leases and deliveries taken through a session are held for it like claims: renewed (or
kept invisible) in the background until ``pool_release`` / ``message_complete`` or the
session's end, when renewal stops and they expire as a crashed worker's would.
"""

import contextlib
from typing import Annotated, Any

from pydantic import Field

from runstate._async.budgets import AsyncReservation
from runstate._async.pools import AsyncPoolLease
from runstate._async.work import AsyncDelivery
from runstate._config import JsonDict
from runstate._errors import RunstateError
from runstate.mcp.common import CHANGE, CREATE, READ, Answer, Answerer, Ctx, RunId, TimeoutMs, ToolDecorator, wrap
from runstate.mcp.session import Session

BarrierId = Annotated[str, Field(description="The barrier's id.")]
TimerId = Annotated[str, Field(description="The timer's id.")]
WaitMs = Annotated[int, Field(ge=0, le=30_000, description="Wait up to this long (30 s at most); 0 answers at once.")]
ReservationId = Annotated[str, Field(description="The reservationId that budget_reserve answered.")]
QueueMailbox = Annotated[str, Field(description="The QUEUE mailbox's name.")]
IdempotencyKey = Annotated[
    str | None, Field(description="Makes the call idempotent: the same key answers the same object.")
]


def register(tool: ToolDecorator, answer: Answerer) -> None:
    """Register the barrier, timer, limit and message tools on the server."""
    _register_clock(tool, answer)
    _register_limits(tool, answer)
    _register_messages(tool, answer)


def _register_clock(tool: ToolDecorator, answer: Answerer) -> None:
    @tool("barrier_create", CREATE, "Create a barrier")
    async def barrier_create(
        ctx: Ctx,
        runId: RunId,
        target: Annotated[int, Field(ge=1, description="How many distinct keys must arrive to release it.")],
        name: Annotated[str | None, Field(description="A label.")] = None,
    ) -> Answer:
        """Create a barrier under a run: it releases once `target` distinct keys arrived. Answers the `barrier`."""

        async def do(s: Session) -> JsonDict:
            barrier = await s.rs.scope(runId).barriers.create(target=target, name=name)
            return {"barrier": await barrier.status()}

        return await answer(ctx, do)

    @tool("barrier_arrive", CHANGE, "Arrive at a barrier")
    async def barrier_arrive(
        ctx: Ctx,
        barrierId: BarrierId,
        key: Annotated[str, Field(description="Who arrives (your agent's name): one arrival per key.")],
    ) -> Answer:
        """Arrive at a barrier under `key` (arriving again with the same key changes nothing), then call barrier_wait.

        Answers the `barrier` with `arrivals` and `state` (RELEASED when this was the last arrival).
        """
        return await answer(ctx, lambda s: wrap("barrier", s.rs.barriers.get(barrierId).arrive(key)))

    @tool("barrier_wait", READ, "Wait at a barrier")
    async def barrier_wait(ctx: Ctx, barrierId: BarrierId, timeoutMs: TimeoutMs = 30_000) -> Answer:
        """Wait until the barrier releases (every participant arrived) and answer it.

        Answers TIMEOUT while it still waits after `timeoutMs` (call again), BARRIER_CANCELLED if its run was cancelled.
        """
        return await answer(
            ctx, lambda s: wrap("barrier", s.rs.barriers.get(barrierId).wait(timeout_ms=timeoutMs)), wait_ms=timeoutMs
        )

    @tool("timer_create", CREATE, "Arm a timer")
    async def timer_create(
        ctx: Ctx,
        runId: RunId,
        afterSeconds: Annotated[float | None, Field(gt=0, description="Fire this many seconds from now.")] = None,
        at: Annotated[str | None, Field(description="Or fire at this RFC 3339 UTC time.")] = None,
    ) -> Answer:
        """Arm a timer under a run that fires on the server at `at` or after `afterSeconds` (give exactly one).

        It fires whether or not anyone waits; wait for it with timer_wait. Answers the `timer`.
        """

        async def do(s: Session) -> JsonDict:
            timer = await s.rs.scope(runId).timers.create(at=at, after_seconds=afterSeconds)
            return {"timer": timer.data}

        return await answer(ctx, do)

    @tool("timer_wait", CHANGE, "Wait for a timer")
    async def timer_wait(ctx: Ctx, timerId: TimerId, timeoutMs: TimeoutMs = 30_000) -> Answer:
        """Wait until the timer fires and acknowledge it; answers the `timer` with `firedAt`.

        Answers TIMEOUT while it is still armed after `timeoutMs` (call again); INVALID_STATE if it was cancelled.
        """

        async def do(s: Session) -> JsonDict:
            timer = s.rs.timers.get(timerId)
            await timer.wait(timeout_ms=timeoutMs)
            return {"timer": timer.data}

        return await answer(ctx, do, wait_ms=timeoutMs)


def _register_limits(tool: ToolDecorator, answer: Answerer) -> None:
    @tool("pool_acquire", CREATE, "Acquire pool units")
    async def pool_acquire(
        ctx: Ctx,
        pool: Annotated[str, Field(description="The pool's name (GPUs, browser sessions...).")],
        runId: RunId,
        units: Annotated[int, Field(ge=1, description="How many units.")] = 1,
        waitMs: WaitMs = 0,
        leaseTtlMs: Annotated[int | None, Field(ge=1000, description="The lease's length (default 30 s).")] = None,
        key: IdempotencyKey = None,
    ) -> Answer:
        """Take units of a shared pool before using a scarce thing; first come, first served.

        Answers the `lease` (`leaseId`). This session renews it until you call pool_release (call
        it as soon as you are done). POOL_EXHAUSTED when no units came within `waitMs`.
        """
        got: list[AsyncPoolLease] = []

        async def do(s: Session) -> JsonDict:
            lease = await s.rs.pools.acquire(
                pool, run_id=runId, units=units, wait_ms=waitMs, lease_ttl_ms=leaseTtlMs, key=key
            )
            got.append(lease)
            s.hold_pool_lease(lease, leaseTtlMs)
            return {"lease": lease.data}

        async def undo(s: Session) -> None:  # cancelled after the grant: hand the units back
            for lease in got:
                await s.drop_pool_lease(lease.id)
                with contextlib.suppress(RunstateError):
                    await lease.release()

        return await answer(ctx, do, undo=undo, wait_ms=waitMs)

    @tool("pool_release", CHANGE, "Release pool units")
    async def pool_release(
        ctx: Ctx, leaseId: Annotated[str, Field(description="The leaseId that pool_acquire answered.")]
    ) -> Answer:
        """Hand a pool lease's units back for others (idempotent). Answers the `lease`."""

        async def do(s: Session) -> JsonDict:
            lease = await s.drop_pool_lease(leaseId) or s.rs.pools.lease(leaseId)
            return {"lease": await lease.release()}

        return await answer(ctx, do)

    @tool("quota_take", CREATE, "Take from a rate quota")
    async def quota_take(
        ctx: Ctx,
        quota: Annotated[str, Field(description="The quota's name (a provider's rate limit).")],
        runId: RunId,
        amount: Annotated[int, Field(ge=1, description="How many tokens of the bucket.")] = 1,
        waitMs: Annotated[int, Field(ge=0, le=600_000, description="Wait up to this long for the tokens.")] = 0,
    ) -> Answer:
        """Take tokens of a rate limit before a rate-limited call (an API request, a model call).

        Answers `{granted, remaining}`; QUOTA_EXHAUSTED with details.retryAfterMs when they were not there in time.
        """
        return await answer(
            ctx, lambda s: wrap("take", s.rs.quotas.take(quota, run_id=runId, amount=amount, wait_ms=waitMs))
        )

    @tool("budget_reserve", CREATE, "Reserve from a budget")
    async def budget_reserve(
        ctx: Ctx,
        budget: Annotated[str, Field(description="The budget's name (tokens, micro-dollars...).")],
        runId: RunId,
        amount: Annotated[int, Field(ge=1, description="The most the coming spend may cost.")],
        ttlMs: Annotated[
            int | None, Field(ge=1000, description="Unsettled, it expires after this (default 10 min).")
        ] = None,
        key: IdempotencyKey = None,
    ) -> Answer:
        """Reserve `amount` of every budget of that name on the run's chain before an expensive call.

        Then call budget_commit with what it actually cost, or budget_release. Answers the
        `reservation` (`reservationId`); BUDGET_EXHAUSTED when a budget lacks room.
        """

        async def do(s: Session) -> JsonDict:
            reservation = await s.rs.budgets.reserve(budget, amount=amount, run_id=runId, ttl_ms=ttlMs, key=key).open()
            return {"reservation": reservation.data or {}}

        return await answer(ctx, do)

    def reservation(s: Session, reservation_id: str) -> AsyncReservation:
        handle = AsyncReservation(s.http, {"amount": 0})
        handle.id = reservation_id
        return handle

    @tool("budget_commit", CREATE, "Commit a budget spend")
    async def budget_commit(
        ctx: Ctx,
        reservationId: ReservationId,
        amount: Annotated[int, Field(ge=0, description="What was actually spent (at most the reservation).")],
    ) -> Answer:
        """Record what the reserved call actually cost; the rest goes back to the budget. Answers the `reservation`."""
        return await answer(ctx, lambda s: wrap("reservation", reservation(s, reservationId).commit(amount)))

    @tool("budget_release", CHANGE, "Release a budget reservation")
    async def budget_release(ctx: Ctx, reservationId: ReservationId) -> Answer:
        """Hand a whole reservation back, nothing spent (idempotent). Answers the `reservation`."""
        return await answer(ctx, lambda s: wrap("reservation", reservation(s, reservationId).release()))


def _register_messages(tool: ToolDecorator, answer: Answerer) -> None:
    @tool("message_send", CREATE, "Send a message")
    async def message_send(
        ctx: Ctx,
        mailbox: QueueMailbox,
        runId: RunId,
        body: Annotated[Any, Field(description="The message (any JSON).")],
        key: IdempotencyKey = None,
    ) -> Answer:
        """Send a message to a QUEUE mailbox under a run, for one receiver to handle. Answers the `message`."""
        return await answer(ctx, lambda s: wrap("message", s.rs.scope(runId).messages.send(mailbox, body, key=key)))

    @tool("message_receive", CREATE, "Receive messages")
    async def message_receive(
        ctx: Ctx,
        mailbox: QueueMailbox,
        runId: RunId,
        max: Annotated[int, Field(ge=1, le=100, description="Receive up to this many.")] = 1,
        waitMs: WaitMs = 0,
        visibilityMs: Annotated[
            int | None, Field(ge=1000, description="How long others cannot see it (default 30 s).")
        ] = None,
    ) -> Answer:
        """Receive the next message(s) of a run from a QUEUE mailbox; handle each, then call message_complete.

        Answers `deliveries` (`deliveryId`, `body`). This session keeps them invisible to others
        until message_complete; if the session ends first, they are delivered again.
        """
        got: list[AsyncDelivery] = []

        async def do(s: Session) -> JsonDict:
            deliveries = await s.rs.scope(runId).messages.receive(
                mailbox, max=max, wait_ms=waitMs, visibility_ms=visibilityMs
            )
            got.extend(deliveries)
            for delivery in deliveries:
                s.hold_delivery(delivery, visibilityMs, mailbox=mailbox, run_id=runId)
            return {"deliveries": [delivery.data for delivery in deliveries]}

        async def undo(s: Session) -> None:  # cancelled after receiving: put the messages back at once
            for delivery in got:
                await s.drop_delivery(delivery.id)
                with contextlib.suppress(RunstateError):
                    await delivery.retry()

        return await answer(ctx, do, undo=undo, wait_ms=waitMs)

    @tool("message_complete", CHANGE, "Acknowledge a message")
    async def message_complete(
        ctx: Ctx, deliveryId: Annotated[str, Field(description="The deliveryId that message_receive answered.")]
    ) -> Answer:
        """Acknowledge a received message: it was handled and is never delivered again. Answers the `message`."""

        async def do(s: Session) -> JsonDict:
            async with s.settling_delivery(deliveryId, "completed") as held:
                delivery = (
                    held.delivery
                    if held is not None
                    else AsyncDelivery(s.http, {"deliveryId": deliveryId, "messageId": "", "body": None, "attempt": 0})
                )
                return {"message": await delivery.complete()}

        return await answer(ctx, do)
