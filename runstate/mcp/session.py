"""One MCP session's runstate state: its client, the claims it holds, the runs it touched.

A session is one MCP connection (stdio: the process; HTTP: one ``Mcp-Session-Id``). Its claims
are renewed in the background by the SDK's hold machinery (``claim.hold()``) until the agent
completes, fails or releases them, or the session ends: then renewal stops, and the service
takes the work over after its lease as after any crashed worker.
"""

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from runstate._async.client import AsyncRunstate
from runstate._async.hold import AsyncHold
from runstate._async.http import AsyncHttp
from runstate._async.pools import AsyncPoolLease
from runstate._async.work import AsyncClaim, AsyncDelivery
from runstate._config import JsonDict
from runstate._errors import LeaseLostError, RunstateError, ScopeInactiveError

logger = logging.getLogger("runstate.mcp")

STOP = "Stop working on it and call task_complete for it (the task is recorded CANCELLED), or task_release."
STOP_POOL = "Stop using these units and call pool_release."
STOP_MESSAGE = "Stop handling this message: its run stopped, so message_complete is refused; drop it."
DEFAULT_VISIBILITY_MS = 30_000


@dataclass
class HeldDelivery:
    """A queue delivery the session holds, its visibility extended in the background until completed."""

    delivery: AsyncDelivery
    visibility_ms: int
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

    def hold_delivery(self, delivery: AsyncDelivery, visibility_ms: int | None) -> None:
        """Keep ``delivery`` invisible to others until message_complete or the session's end."""
        held = HeldDelivery(delivery, visibility_ms or DEFAULT_VISIBILITY_MS)
        held.keeper = asyncio.get_running_loop().create_task(held.keep_visible())
        self.deliveries[delivery.id] = held

    async def drop_delivery(self, delivery_id: str) -> HeldDelivery | None:
        """Stop extending the delivery (the caller completes it); return what was held."""
        held = self.deliveries.pop(delivery_id, None)
        if held is not None:
            await held.stop()
        return held

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
        hold = claim.hold(lease_ttl_ms=lease_ttl_ms)
        await hold.__aenter__()
        self.held[claim.id] = HeldClaim(claim, hold)

    async def release_hold(self, claim_id: str) -> HeldClaim | None:
        """Stop renewing ``claim_id`` (the caller records its end); return what was held."""
        held = self.held.pop(claim_id, None)
        if held is not None:
            await held.hold.detach()
        return held

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

    async def close(self) -> None:
        """Stop renewing everything (the session ended) and close the client; record nothing."""
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
