"""One MCP session's runstate state: its client, the claims it holds, the runs it touched.

A session is one MCP connection (stdio: the process; HTTP: one ``Mcp-Session-Id``). Its claims
are renewed in the background by the SDK's hold machinery (``claim.hold()``) until the agent
completes, fails or releases them, or the session ends: then renewal stops, and the service
takes the work over after its lease as after any crashed worker.
"""

import logging
from dataclasses import dataclass, field
from typing import Any

from runstate._async.client import AsyncRunstate
from runstate._async.hold import AsyncHold
from runstate._async.work import AsyncClaim
from runstate._config import JsonDict
from runstate._errors import ScopeInactiveError

logger = logging.getLogger("runstate.mcp")

STOP = "Stop working on it and call task_complete for it (the task is recorded CANCELLED), or task_release."


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
    lease_ttl_ms: dict[str, int] = field(default_factory=dict)  # by claim id: the TTL claimed with

    async def hold(self, claim: AsyncClaim, lease_ttl_ms: int | None) -> None:
        """Start renewing ``claim`` in the background for as long as the session lives."""
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
        return AsyncClaim(self.rs._http, {"claimId": claim_id, "attempt": 0, "task": {}})

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
        return notes

    async def close(self) -> None:
        """Stop renewing everything (the session ended) and close the client; record nothing."""
        for claim_id in list(self.held):
            await self.release_hold(claim_id)
        await self.rs.aclose()


def held_view(held: HeldClaim) -> dict[str, Any]:
    """Describe one held claim for an answer."""
    return {
        "claimId": held.claim.id,
        "taskId": held.claim.task_id,
        "attempt": held.claim.attempt,
        "cancellationRequested": held.cancellation_requested,
        "leaseLost": held.lease_lost,
    }
