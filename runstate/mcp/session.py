"""One MCP session's runstate state: its client, the claims it holds, the runs it touched.

A session is one MCP connection (stdio: the process; HTTP: one ``Mcp-Session-Id``). Its claims
are renewed in the background by the SDK's hold machinery (``claim.hold()``) until the agent
completes, fails or releases them, or the session ends: then renewal stops, and the service
takes the work over after its lease as after any crashed worker.
"""

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from time import monotonic
from typing import Any

from runstate._async.client import AsyncRunstate
from runstate._async.hold import AsyncHold
from runstate._async.http import AsyncHttp
from runstate._async.pools import AsyncPoolLease
from runstate._async.work import AsyncClaim, AsyncDelivery, AsyncTasks
from runstate._config import JsonDict
from runstate._errors import LeaseLostError, RunstateError, ScopeInactiveError
from runstate._tracing import ProcessSpan, process_span

logger = logging.getLogger("runstate.mcp")

STOP = "Stop working on it and call task_complete for it (the task is recorded CANCELLED), or task_release."
STOP_POOL = "Stop using these units and call pool_release."
STOP_MESSAGE = "Stop handling this message: its run stopped, so message_complete is refused; drop it."
DEFAULT_VISIBILITY_MS = 30_000
# Claims in flight when their call was cancelled (see ``ClaimCall``): an event page's size, how
# often a run's claim log cursor is brought forward, and how long after the cancel a claim that
# commits late (its statement still running when the request was abandoned) is still looked for.
EVENT_PAGE = 1000
CLAIM_LOG_REFRESH_S = 30.0
LATE_CLAIM_GRACE_S = 10.0
WORKER_ID_MAX = 200  # the API's limit on a claim's workerId
# A call answered while its ``notifications/cancelled`` was on its way: the client drops the
# answer, so what the call took is handed back when the late cancel arrives. How long after its
# answer a call is still remembered for that, and how many calls a session remembers at most.
LATE_CANCEL_S = 60.0
LATE_CANCEL_MAX = 1000


@dataclass
class ClaimLog:
    """Where a scan of one run's ``task.claimed`` events may start, for a claim call that starts now.

    ``cursor`` is the event log's end as read at some past moment (None: the log's start): a
    claim committed after that read has its event after it. A background refresh brings it
    forward now and then, so a scan never reads far.
    """

    cursor: str | None = None
    refreshed_at: float = float("-inf")
    refreshing: bool = False


@dataclass(frozen=True)
class ClaimCall:
    """One ``task_claim`` request: its own ``workerId``, and where a scan for its claims starts.

    When the call is cancelled before its answer arrived, the service may have committed its
    claims: they are found in the run's ``task.claimed`` events after ``after`` by this
    ``worker_id`` (unique to the call) and released by the events' ``claimId``.
    """

    worker_id: str
    run_id: str
    after: str | None


@contextlib.contextmanager
def _ending(trace: ProcessSpan, mailbox: str, outcome: str, failure: str | None = None) -> Iterator[None]:
    """Run the block in a ``settle`` span (``outcome``) under ``trace``, a ``process`` span that ends with it.

    ``failure`` (a description) marks the process span failed.
    """
    try:
        if failure is not None:
            trace.fail(failure)
        with trace.settle(mailbox, outcome=outcome):
            yield
    finally:
        trace.end()


@dataclass
class HeldDelivery:
    """A queue delivery the session holds, its visibility extended in the background until completed."""

    delivery: AsyncDelivery
    visibility_ms: int
    mailbox: str = ""
    # The message's ``process`` span (a child of its sender's), from the receive to message_complete.
    trace: ProcessSpan = field(default_factory=lambda: ProcessSpan(None))
    keeper: "asyncio.Task[None] | None" = None
    refused_code: str | None = None
    lost: bool = False

    async def keep_visible(self) -> None:
        """Extend the visibility every third of it until refused (the run stopped, or the delivery is stale)."""
        while True:
            await asyncio.sleep(max(self.visibility_ms / 3000, 0.05))
            try:
                await self.delivery.extend(self.visibility_ms)
            except ScopeInactiveError as error:
                self.refused_code = error.code
                return
            except LeaseLostError:
                self.lost = True
                return
            except RunstateError as error:  # the server is away: try again, the delivery may still hold
                logger.warning("delivery %s: extend failed (%s); retrying", self.delivery.id, error)

    async def stop(self) -> None:
        """Stop extending (idempotent)."""
        keeper, self.keeper = self.keeper, None
        if keeper is not None:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)


@dataclass
class HeldClaim:
    """A claim the session holds, renewed by its ``hold`` until the agent records its end."""

    claim: AsyncClaim
    hold: AsyncHold
    # A run refusal seen for this claim (its run was cancelled, completed or is past its deadline).
    refused_code: str | None = None

    @property
    def cancellation_requested(self) -> bool:
        """Whether the task's cancellation was requested or its run refused it."""
        stopped = self.hold.ctx.stop_reason in ("cancellation_requested", "scope_refused")
        return stopped or self.refused_code is not None or self.claim.cancellation_requested

    @property
    def lease_lost(self) -> bool:
        """Whether the renewer found the lease lost (taken over or expired)."""
        return self.hold.ctx.stop_reason == "lease_lost"


@dataclass
class Session:
    """The runstate side of one MCP session."""

    rs: AsyncRunstate
    api_key: str | None = None  # the key the session started with (HTTP: its bearer key)
    held: dict[str, HeldClaim] = field(default_factory=dict)  # by claim id
    pool_leases: dict[str, AsyncPoolLease] = field(default_factory=dict)  # by lease id
    mailbox_ttl_ms: dict[str, int] = field(default_factory=dict)  # the lease TTL of each mailbox claimed from
    deliveries: dict[str, HeldDelivery] = field(default_factory=dict)  # by delivery id
    # Resource subscriptions: a watcher of the event log per subscribed URI, and how to notify the client.
    watchers: "dict[str, asyncio.Task[None]]" = field(default_factory=dict)
    send_resource_updated: Callable[[str], Awaitable[None]] | None = None
    # The session's worker id (every claim's workerId starts with it), its claim calls so far,
    # the claim log of each run claimed from, and its background work (ended with the session).
    worker_id: str = field(default_factory=lambda: f"mcp-{secrets.token_hex(6)}")
    claim_calls: int = 0
    claim_logs: dict[str, ClaimLog] = field(default_factory=dict)
    background: "set[asyncio.Task[None]]" = field(default_factory=set)
    # What each recently answered call took, by request id: (answered at, how to hand it back).
    answered: "dict[int | str, tuple[float, Callable[[Session], Awaitable[None]]]]" = field(default_factory=dict)

    def holds_anything(self) -> bool:
        """Whether the session holds claims, pool leases or deliveries (its answers then carry ``cancellation``)."""
        return bool(self.held or self.pool_leases or self.deliveries)

    def hold_pool_lease(self, lease: AsyncPoolLease, lease_ttl_ms: int | None) -> None:
        """Renew ``lease`` in the background until pool_release or the session's end."""
        lease.start_renewing(lease_ttl_ms)
        self.pool_leases[lease.id] = lease

    async def drop_pool_lease(self, lease_id: str) -> AsyncPoolLease | None:
        """Stop renewing the pool lease (the caller releases it); return what was held."""
        lease = self.pool_leases.pop(lease_id, None)
        if lease is not None:
            await lease.stop_renewing()
        return lease

    def hold_delivery(self, delivery: AsyncDelivery, visibility_ms: int | None, *, mailbox: str, run_id: str) -> None:
        """Keep ``delivery`` invisible to others until message_complete or the session's end.

        Its ``process`` span starts here, a child of the sender's, as in ``consume_messages``.
        """
        trace = process_span(
            mailbox,
            traceparent=delivery.data.get("traceparent"),
            tracestate=delivery.data.get("tracestate"),
            run_id=run_id,
            message_id=delivery.message_id,
            attempt=delivery.attempt,
        )
        held = HeldDelivery(delivery, visibility_ms or DEFAULT_VISIBILITY_MS, mailbox, trace)
        held.keeper = asyncio.get_running_loop().create_task(held.keep_visible())
        self.deliveries[delivery.id] = held

    async def drop_delivery(self, delivery_id: str) -> HeldDelivery | None:
        """Stop extending the delivery and end its ``process`` span (the caller puts it back); return what was held."""
        held = self.deliveries.pop(delivery_id, None)
        if held is not None:
            await held.stop()
            held.trace.end()
        return held

    @contextlib.asynccontextmanager
    async def settling_delivery(self, delivery_id: str, outcome: str) -> AsyncIterator[HeldDelivery | None]:
        """Stop extending ``delivery_id``; record its end in the block (its ``settle`` span); yield what was held."""
        held = self.deliveries.pop(delivery_id, None)
        if held is None:
            yield None
            return
        await held.stop()
        with _ending(held.trace, held.mailbox, outcome):
            yield held

    async def hold(self, claim: AsyncClaim, lease_ttl_ms: int | None) -> None:
        """Start renewing ``claim`` in the background for as long as the session lives.

        Without ``lease_ttl_ms`` the claim has its mailbox's TTL, read once per session and
        mailbox (the holder would otherwise read the mailbox at every claim).
        """
        if lease_ttl_ms is None:
            mailbox = str(claim.task.get("mailbox"))
            if mailbox not in self.mailbox_ttl_ms:
                self.mailbox_ttl_ms[mailbox] = int((await self.rs.mailboxes.retrieve(mailbox))["leaseTtlMs"])
            lease_ttl_ms = self.mailbox_ttl_ms[mailbox]
        # No claim watch: every claim call has a workerId of its own (one watch each), and the
        # session renews its claims before each answer anyway (``refresh``).
        hold = AsyncHold(claim, AsyncTasks(claim._http, None), lease_ttl_ms=lease_ttl_ms, watch=False)
        await hold.start()  # the claim's ``process`` span starts (a child of its submitter's)
        self.held[claim.id] = HeldClaim(claim, hold)

    async def release_hold(self, claim_id: str) -> HeldClaim | None:
        """Stop renewing ``claim_id`` and end its ``process`` span (the caller records its end); return what was held.

        For a release, or the session's end: no ``settle`` span (``settling`` records one).
        """
        held = self.held.pop(claim_id, None)
        if held is not None:
            await held.hold.detach()
            held.hold.trace.end()
        return held

    @contextlib.asynccontextmanager
    async def settling(
        self, claim_id: str, outcome: str, *, failure: str | None = None
    ) -> AsyncIterator[HeldClaim | None]:
        """Stop renewing ``claim_id``, and record its end in the block: yield what was held (None: nothing).

        The block is the claim's ``settle`` span (``outcome``: ``complete``, ``fail``) under its
        ``process`` span, which ends with the block; ``failure`` marks the process span failed.
        """
        held = self.held.pop(claim_id, None)
        if held is None:
            yield None
            return
        await held.hold.detach()
        with _ending(held.hold.trace, str(held.claim.task.get("mailbox")), outcome, failure):
            yield held

    def claim(self, claim_id: str) -> AsyncClaim:
        """Return the held claim, or a handle on a claim this session does not hold (the service fences it)."""
        held = self.held.get(claim_id)
        if held is not None:
            return held.claim
        return AsyncClaim(self.http, {"claimId": claim_id, "attempt": 0, "task": {}})

    @property
    def http(self) -> AsyncHttp:
        """The client's HTTP plumbing, for handles on objects this session does not hold (the service fences them)."""
        return self.rs._http

    async def refresh(self, *, fresh: frozenset[str] = frozenset()) -> None:
        """Renew every held claim but ``fresh`` ones in one request, to learn of cancellations now.

        The background renewer learns of them too, but only every third of a lease: an agent's
        next answer must already say that its work was cancelled.
        """
        stale = [held for claim_id, held in self.held.items() if claim_id not in fresh]
        if not stale:
            return
        results = await self.rs.tasks.renew_many([held.claim for held in stale])
        for held, result in zip(stale, results, strict=True):
            if isinstance(result.error, ScopeInactiveError):
                held.refused_code = result.error.code

    def cancellation(self) -> list[JsonDict]:
        """Held tasks whose cancellation was requested or whose run stopped, with what to do."""
        notes: list[JsonDict] = []
        for held in self.held.values():
            if held.cancellation_requested:
                notes.append(
                    {
                        "taskId": held.claim.task_id,
                        "claimId": held.claim.id,
                        "runId": held.claim.task.get("runId"),
                        "reason": held.refused_code or "CANCELLATION_REQUESTED",
                        "instruction": STOP,
                    }
                )
        for lease in self.pool_leases.values():
            if lease.lost_reason == "scope_refused":
                notes.append(
                    {"poolLeaseId": lease.id, "runId": lease.data.get("runId"), "reason": "RUN_INACTIVE"}
                    | {"instruction": STOP_POOL}
                )
        for held_delivery in self.deliveries.values():
            if held_delivery.refused_code is not None:
                notes.append(
                    {"deliveryId": held_delivery.delivery.id, "reason": held_delivery.refused_code}
                    | {"instruction": STOP_MESSAGE}
                )
        return notes

    def in_background(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """Run ``work`` for the session, cancelled when it ends."""
        task = asyncio.get_running_loop().create_task(work, name=name)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def claim_call(self, run_id: str) -> ClaimCall:
        """Start a claim request on ``run_id``: its unique workerId and the cursor a scan for it starts from.

        Costs no request: the run's claim log is brought forward in the background (at the
        session's first claim in the run, then every ``CLAIM_LOG_REFRESH_S`` while it claims).
        """
        self.claim_calls += 1
        log = self.claim_logs.setdefault(run_id, ClaimLog())
        call = ClaimCall(f"{self.worker_id}/{self.claim_calls}"[:WORKER_ID_MAX], run_id, log.cursor)
        if not log.refreshing and monotonic() - log.refreshed_at >= CLAIM_LOG_REFRESH_S:
            log.refreshing = True
            self.in_background(self._refresh_claim_log(run_id, log), f"runstate-claim-log {run_id}")
        return call

    async def _claimed_pages(self, run_id: str, after: str | None, *, wait_ms: int = 0) -> tuple[list[JsonDict], str]:
        """Read the run's ``task.claimed`` events after ``after`` to the log's end; return them and the end."""
        found: list[JsonDict] = []
        cursor = after
        while True:
            page = await self.rs.events.list(
                after=cursor, types="task.claimed", run_id=run_id, limit=EVENT_PAGE, wait_ms=wait_ms
            )
            found += page["events"]
            cursor = str(page["nextCursor"])
            if len(page["events"]) < EVENT_PAGE:
                return found, cursor
            wait_ms = 0

    async def _refresh_claim_log(self, run_id: str, log: ClaimLog) -> None:
        try:
            _, log.cursor = await self._claimed_pages(run_id, log.cursor)
        except RunstateError as error:  # the next claim call tries again
            logger.warning("run %s: claim log not brought forward (%s)", run_id, error)
        finally:
            log.refreshed_at = monotonic()
            log.refreshing = False

    async def release_lost_claims(self, call: ClaimCall) -> list[str]:
        """Release what ``call`` claimed though its answer never arrived (the call was cancelled in flight).

        Reads the run's claim events after ``call.after`` now and releases those of the call's
        worker id; returns their claim ids. Then, in the background for ``LATE_CLAIM_GRACE_S``,
        follows the log for a claim that commits late (the service's statement was still
        running when the request was abandoned) and releases it too.
        """
        released: set[str] = set()
        cursor = call.after
        try:
            cursor = await self._release_claimed(call, cursor, released)
        except RunstateError as error:  # looked for again in the background
            logger.warning("claims of %s not looked for yet (%s)", call.worker_id, error)
        self.in_background(self._follow_late_claims(call, cursor, released), f"runstate-late-claims {call.worker_id}")
        return sorted(released)

    async def _release_claimed(
        self, call: ClaimCall, after: str | None, released: set[str], *, wait_ms: int = 0
    ) -> str | None:
        """Release the call's claims among the run's claim events after ``after``; return where they end."""
        events, cursor = await self._claimed_pages(call.run_id, after, wait_ms=wait_ms)
        for event in events:
            data = event.get("data") or {}
            claim_id = data.get("claimId")
            if data.get("workerId") != call.worker_id or not claim_id or claim_id in released:
                continue
            released.add(claim_id)
            with contextlib.suppress(RunstateError):  # taken over or ended meanwhile: nothing to hand back
                await self.claim(claim_id).release()
        return cursor

    async def _follow_late_claims(self, call: ClaimCall, after: str | None, released: set[str]) -> None:
        deadline = monotonic() + LATE_CLAIM_GRACE_S
        cursor = after
        while (left_ms := int((deadline - monotonic()) * 1000)) > 0:
            try:
                cursor = await self._release_claimed(call, cursor, released, wait_ms=left_ms)
            except RunstateError as error:  # the server is away: try again while the grace lasts
                logger.warning("late claims of %s not looked for (%s); retrying", call.worker_id, error)
                await asyncio.sleep(min(1.0, left_ms / 1000))

    def answering(self, request_id: int | str) -> None:
        """Forget an earlier call with the same id: a late cancel names the call running now."""
        self.answered.pop(request_id, None)

    def answered_call(self, request_id: int | str, undo: "Callable[[Session], Awaitable[None]]") -> None:
        """Remember how to hand back what an answered call took, for a cancel that crossed its answer."""
        now = monotonic()
        while self.answered:  # oldest first: stop at the first one still kept
            old, (at, _) = next(iter(self.answered.items()))
            if now - at < LATE_CANCEL_S and len(self.answered) < LATE_CANCEL_MAX:
                break
            del self.answered[old]
        self.answered[request_id] = (now, undo)

    async def cancelled_after_answer(self, request_id: int | str) -> bool:
        """Hand back what an answered call took, its cancel having crossed the answer; whether it was known."""
        entry = self.answered.pop(request_id, None)
        if entry is None:
            return False
        await entry[1](self)
        return True

    async def close(self) -> None:
        """Stop renewing everything (the session ended) and close the client; record nothing."""
        for task in list(self.background):
            task.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)
        for claim_id in list(self.held):
            await self.release_hold(claim_id)
        for lease_id in list(self.pool_leases):
            await self.drop_pool_lease(lease_id)
        for delivery_id in list(self.deliveries):
            await self.drop_delivery(delivery_id)
        for uri in list(self.watchers):
            await self.unwatch(uri)
        await self.rs.aclose()

    async def unwatch(self, uri: str) -> None:
        """Stop watching ``uri`` for changes (idempotent)."""
        watcher = self.watchers.pop(uri, None)
        if watcher is not None:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)


def held_view(held: HeldClaim) -> dict[str, Any]:
    """Describe one held claim for an answer."""
    return {
        "claimId": held.claim.id,
        "taskId": held.claim.task_id,
        "attempt": held.claim.attempt,
        "cancellationRequested": held.cancellation_requested,
        "leaseLost": held.lease_lost,
    }
