"""``async with claim.hold() as ctx``: work on a claim by hand, renewed in the background.

Written by hand (not generated): the sync twin in ``runstate/_sync/hold.py`` runs the same
holder on an event loop in a thread of its own. Both use the consume engine's renewer and
record methods (``runstate._worker.Holder``), so a held claim ends as ``consume`` would end
it for one task.
"""

from typing import Protocol

from runstate._async.http import AsyncHttp
from runstate._tracing import ProcessSpan, in_span, leave
from runstate._worker import AsyncHoldContext, Claim, Holder, Tasks

__all__ = ["AsyncHold", "AsyncHoldContext"]


class HeldClaim(Claim, Protocol):
    """The claim a hold renews (``AsyncClaim``, whose ``hold()`` makes one): the engine's ``Claim`` and its client."""

    _http: AsyncHttp


class AsyncHold:
    """The async context manager ``claim.hold()`` returns.

    On entry the lease starts being renewed every ``renew_fraction`` of its TTL (``lease_ttl_ms``,
    else the mailbox's: pass the TTL you claimed with), and the claim joins its client's claim
    watch (``watch``; one ``GET /v1/claims/watch`` per client and worker id, whatever the number
    of holds), which tells the hold at once what stops it. ``ctx.signal`` is set when cancellation
    is requested, the lease is lost or the run is refused; the block is not cancelled by that
    (wrap its I/O in ``async with ctx.cancel_on_request():`` to abort it). On exit:

    - the block ended normally: the task is completed with ``ctx.complete(value)``'s value, or
      ``None`` (``CANCELLED`` rather than ``SUCCEEDED`` if cancellation was requested);
    - ``ctx.release()`` was called: the task goes back to the queue (if cancellation was
      requested it is completed instead, which acknowledges the request);
    - the block raised: the failure is recorded as ``consume`` records one (retried while
      attempts remain) and the exception propagates; ``CancellationRequested`` escaping the
      block acknowledges the request (the task ends ``CANCELLED``) and propagates too;
    - the block was cancelled from outside: the task is released and ``CancelledError`` propagates;
    - the service refused the record (lease lost, run inactive): the refusal
      (``LeaseLostError``, ``ScopeCancelledError``...) is raised from the ``async with``.
    """

    def __init__(
        self,
        claim: HeldClaim,
        tasks: Tasks,
        *,
        lease_ttl_ms: int | None = None,
        renew_fraction: float = 1 / 3,
        watch: bool = True,
    ) -> None:
        self.claim = claim
        self.ctx = AsyncHoldContext(claim)
        self._holder = Holder(
            claim._http, claim, self.ctx, tasks, lease_ttl_ms=lease_ttl_ms, renew_fraction=renew_fraction, watch=watch
        )
        self._token = None  # the process span made current for the block

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.claim.id}>"

    @property
    def trace(self) -> ProcessSpan:
        """The claim's ``process`` span (a child of the submitter's), started on entry or ``start``."""
        return self._holder.held.trace

    async def start(self) -> AsyncHoldContext:
        """Start renewing without entering a block, for holders that outlive one (with ``detach``).

        The claim's ``process`` span starts, but is not made current: the caller runs in no
        block of it.
        """
        await self._holder.enter()
        return self.ctx

    async def detach(self) -> None:
        """Stop renewing without recording anything: the caller records the claim's end itself.

        For holders that outlive one ``async with`` block (the MCP server holds a session's claims
        between tool calls and records ``task_complete`` / ``task_fail`` / ``task_release`` as asked).
        The ``process`` span (``trace``) is left to the caller, who settles (``trace.settle``)
        and ends it.
        """
        await self._holder.stop()

    async def __aenter__(self) -> AsyncHoldContext:
        await self._holder.enter()
        self._token = in_span(self._holder.held.trace.context)
        return self.ctx

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        leave(self._token)
        refusal = await self._holder.exit(exc)
        if exc is None and refusal is not None:
            raise refusal
