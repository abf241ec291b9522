"""What the task loop (``consume``) and the message loop (``consume_messages``) share.

Both read the mailbox's lease TTL when none is given, fetch work in batches sized to their
free slots (claims or deliveries), long-poll for it, back off on transport errors, stop when
the run refuses work or on ``stop()``, hand back what arrives after a stop, and give running
handlers ``drain_timeout`` before cancelling them. ``FetchLoop`` is that skeleton; each
engine says how to fetch, start, lose and hand back one item, and owns everything about
running it.
"""

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from runstate._async.http import AsyncHttp
from runstate._config import segment
from runstate._errors import (
    RateLimitedError,
    ScopeInactiveError,
    ServerError,
    ServiceUnavailableError,
    TransportError,
)

logger = logging.getLogger("runstate.worker")

# Failures a worker rides out (with backoff) rather than stopping for.
TRANSIENT = (TransportError, ServiceUnavailableError, RateLimitedError, ServerError)
# How long to pause after a transient fetch failure: doubles per failure up to the cap.
CLAIM_BACKOFF_S = 0.5
CLAIM_BACKOFF_MAX_S = 15.0
# With a short (or no) long-poll, pause this long after an empty answer instead of spinning.
IDLE_PAUSE_S = 0.5
# A renewal (or an extend) must leave room to reach the server before the lease runs out.
MIN_RENEW_INTERVAL_S = 0.05


class _Summary(Protocol):
    stop_reason: str


class Held[ContextT]:
    """An item being worked on (a claim or a delivery): its handler's context, the handler, and its end.

    Each engine adds what it tracks of its own items (the claim or delivery, its lease).
    """

    def __init__(self, ctx: ContextT) -> None:
        self.ctx = ctx
        self.lost = False  # the item is gone: nothing may be recorded, the handler is cancelled
        self.abandoned = False  # the worker is stopping: the handler is cancelled, the item handed back
        self.handler: asyncio.Future[Any] | None = None
        self.supervisor: asyncio.Task[None] | None = None  # awaits the handler and records its end

    def running(self) -> bool:
        """Return whether the handler is still running (it takes a slot of ``concurrency``)."""
        return self.handler is not None and not self.handler.done()


class FetchLoop[SummaryT: _Summary]:
    """The fetch-and-dispatch skeleton of a worker loop, and its stop control.

    A subclass sets ``summary`` (with a ``stop_reason``) and ``_held`` (items by id, each a
    ``Held`` whose context has ``_trip``), and implements ``_start(item)`` and ``_lose(held, reason)``.
    """

    summary: SummaryT
    _held: dict[str, Any]

    def __init__(
        self,
        http: AsyncHttp,
        run_id: str,
        mailbox: str,
        *,
        concurrency: int,
        drain_timeout: float,
        handle_signals: bool,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        self._http = http
        self.run_id = run_id
        self.mailbox = mailbox
        self.concurrency = concurrency
        self.drain_timeout = drain_timeout  # how long running handlers get to finish once stopping
        self.handle_signals = handle_signals  # whether SIGTERM stops this loop (see runstate/_worker/signals.py)
        self._stop_requested = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._changed: asyncio.Event | None = None

    def stop(self) -> None:
        """Stop fetching; running handlers get ``drain_timeout`` to finish. Safe from any thread."""
        self._stop_requested = True
        loop, event = self._loop, self._stop_event
        if loop is None or event is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            event.set()
        else:
            loop.call_soon_threadsafe(event.set)

    def _begin(self) -> asyncio.AbstractEventLoop:
        """Bind the loop's events to the running event loop and return it (a ``stop()`` before ``run()`` counts)."""
        self._loop = loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        self._changed = asyncio.Event()
        if self._stop_requested:
            self._stop_event.set()
        return loop

    async def _lease_ttl_ms(self, given: int | None) -> int:
        """Return ``given``, or the mailbox's lease TTL (one request) when none was given."""
        if given is not None:
            return given
        mailbox = await self._http.request("GET", f"/mailboxes/{segment(self.mailbox)}", idempotent=True)
        return int(mailbox["leaseTtlMs"])

    def _start(self, item: Any) -> None:
        raise NotImplementedError

    def _lose(self, held: Any, reason: str) -> None:
        raise NotImplementedError

    async def _fetch_loop(
        self,
        fetch: Callable[[int], Awaitable[Sequence[Any]]],
        hand_back: Callable[[Any], Awaitable[None]],
        *,
        max_per_call: int,
        wait_ms: int,
        verb: str,
    ) -> None:
        """Fetch up to the free slots (``fetch(n)``) and start each item, until stopped or refused.

        An item that arrives after a stop is handed back at once; a run refusing work loses
        every held item (its signal is set) and ends the loop with the refusal's code.
        """
        assert self._stop_event is not None and self._changed is not None
        failures = 0
        while not self._stop_event.is_set():
            self._changed.clear()
            # A slot frees when its handler returns: the next fetch need not wait for the record.
            free = self.concurrency - sum(1 for held in self._held.values() if held.running())
            if free <= 0:
                await self._first_of(self._changed.wait())
                continue
            call = asyncio.ensure_future(fetch(min(free, max_per_call)))
            try:
                await self._first_of(call)
            finally:
                if not call.done():
                    # Stopping mid-wait. The server may still hand out an item the answer to
                    # this abandoned request carried: its lease or visibility runs out and it
                    # is handed out again.
                    call.cancel()
            if not call.done() or call.cancelled():
                return
            error = call.exception()
            if error is None:
                failures = 0
                items = call.result()
                if self._stop_event.is_set():
                    await asyncio.gather(*(hand_back(item) for item in items))
                    return
                for item in items:
                    self._start(item)
                if not items and wait_ms < IDLE_PAUSE_S * 1000:
                    await self._first_of(asyncio.sleep(IDLE_PAUSE_S))
            elif isinstance(error, ScopeInactiveError):
                logger.info("run %s refuses work (%s): stopping", self.run_id, error.code)
                self.summary.stop_reason = error.code
                for held in list(self._held.values()):
                    self._lose(held, "scope_refused")
                return
            elif isinstance(error, TRANSIENT):
                failures += 1
                pause = min(CLAIM_BACKOFF_MAX_S, CLAIM_BACKOFF_S * 2 ** (failures - 1))
                logger.warning("%s on %s failed (%s); retrying in %.1f s", verb, self.mailbox, error, pause)
                await self._first_of(asyncio.sleep(pause))
            else:
                raise error
        self.summary.stop_reason = self.summary.stop_reason or "stopped"

    async def _first_of(self, awaitable: Awaitable[Any]) -> None:
        """Wait for ``awaitable`` or a stop request, whichever comes first."""
        assert self._stop_event is not None
        inner = asyncio.ensure_future(awaitable)
        stop = asyncio.ensure_future(self._stop_event.wait())
        try:
            await asyncio.wait({inner, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not inner.done() and not isinstance(awaitable, asyncio.Future):
                inner.cancel()
        if self._stop_event.is_set():
            self.summary.stop_reason = self.summary.stop_reason or "stopped"

    async def _shutdown(self, *, drain_timeout: float) -> None:
        """Let running handlers finish for ``drain_timeout`` s, then cancel them.

        A cancelled handler's item is marked ``abandoned`` and its context tripped with
        ``"stopping"``; its supervisor hands the item back. Returns once every supervisor ended.
        """
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

    def _slot_freed(self, _: object) -> None:
        if self._changed is not None:
            self._changed.set()
