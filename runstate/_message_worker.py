"""The message loop behind ``consume_messages``: receive, extend in the background, answer, stop.

The queue twin of the task engine in ``runstate/_worker/engine.py``, built from the pieces
of ``runstate/_worker/`` (handler threads, ``SIGTERM``) and ``runstate/_loop.py`` (fetching,
transient-failure backoff): it runs on an asyncio loop, an async handler runs as a task on
that loop (cancelled when its delivery is lost), a plain function runs in a daemon thread
(told through ``ctx.signal``; its result is dropped once the delivery is lost).

A handler's return acknowledges the message (``complete``), an exception puts it back after
``retry_delay_ms`` (``retry``), and ``Reject`` dead-letters it (``reject``). While a handler
runs, its delivery is extended every ``extend_fraction`` of the visibility, so a slow handler
keeps its message. When an extend or the answer is refused with the run's code (the run was
cancelled, completed or passed its deadline) or ``LEASE_LOST``, the delivery is lost: its
context is tripped, nothing more is sent for it, and the summary counts it.
"""

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from time import monotonic
from typing import Any

from runstate._async.http import AsyncHttp
from runstate._async.work import AsyncDelivery, AsyncMessages
from runstate._config import JsonDict
from runstate._errors import LeaseLostError, NotFoundError, RunstateError, ScopeInactiveError, TransportError
from runstate._loop import MIN_RENEW_INTERVAL_S, TRANSIENT, FetchLoop, Held
from runstate._tracing import ProcessSpan, in_span, leave, process_span
from runstate._worker import _HandlerContext, _sigterm_stops

logger = logging.getLogger("runstate.worker")

# The server's cap on ``max`` of one receive call.
MAX_DELIVERIES_PER_CALL = 100


class Reject(Exception):  # noqa: N818 - named for what the handler does, as Celery's ``Reject``
    """Raise from a message handler to dead-letter its message with ``reason`` (no retry)."""

    def __init__(self, reason: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason


class _MessageContextBase(_HandlerContext):
    """What a message handler gets: the delivered message, and whether it should stop.

    ``stop_reason`` is ``"lease_lost"``, ``"scope_refused"`` or ``"stopping"``.
    """

    def __init__(self, delivery: AsyncDelivery) -> None:
        super().__init__()
        self.delivery_id: str = delivery.id
        self.message_id: str = delivery.message_id
        self.body: Any = delivery.body
        self.attempt: int = delivery.attempt
        # True once the delivery is lost (run refused, lease lost): nothing is sent for it any more.
        self.lost = False

    def __repr__(self) -> str:
        return f"<{type(self).__name__} message={self.message_id} attempt={self.attempt}>"

    def is_lost(self) -> bool:
        """Return whether the delivery is lost: the handler's result will not be recorded."""
        return self.lost

    def _trip(self, reason: str, *, lost: bool = False) -> None:
        self.lost = self.lost or lost
        super()._trip(reason)


class AsyncMessageContext(_MessageContextBase):
    """The context of an ``AsyncRunstate`` message handler; ``signal`` is an ``asyncio.Event``."""

    signal: asyncio.Event

    def __init__(self, delivery: AsyncDelivery) -> None:
        super().__init__(delivery)
        self.signal = asyncio.Event()


class MessageContext(_MessageContextBase):
    """The context of a ``Runstate`` message handler (run in a thread); ``signal`` is a ``threading.Event``."""

    signal: threading.Event

    def __init__(self, delivery: AsyncDelivery) -> None:
        super().__init__(delivery)
        self.signal = threading.Event()


@dataclass
class MessageSummary:
    """What a message loop did before it returned.

    ``completed``: messages acknowledged; ``retried``: put back after a handler's exception;
    ``rejected``: dead-lettered on ``Reject``; ``lost``: deliveries lost (run refused, lease
    lost, or the answer refused); ``released``: put back at once on stop. ``stop_reason`` is
    ``"stopped"`` (``stop()``/``SIGTERM``) or the run's refusal code (``SCOPE_CANCELLED``,
    ``SCOPE_COMPLETED``, ``DEADLINE_EXCEEDED``).
    """

    completed: int = 0
    retried: int = 0
    rejected: int = 0
    lost: int = 0
    released: int = 0
    stop_reason: str = ""


class _Held(Held[_MessageContextBase]):
    """A delivery being worked on."""

    def __init__(self, delivery: AsyncDelivery, ctx: _MessageContextBase) -> None:
        super().__init__(ctx)
        self.delivery = delivery
        self.visible_until = monotonic()  # when the visibility runs out at the latest, by this process's clock
        self.trace = ProcessSpan(None)  # the handler's ``process`` span (a child of the sender's)


class MessageEngine(FetchLoop[MessageSummary]):
    """One message loop on one run and QUEUE mailbox."""

    def __init__(
        self,
        http: AsyncHttp,
        run_id: str,
        mailbox: str,
        *,
        make_context: Callable[[AsyncDelivery], _MessageContextBase],
        start_handler: Callable[[_MessageContextBase], Awaitable[Any]],
        concurrency: int,
        visibility_ms: int | None,
        retry_delay_ms: int,
        receive_wait_ms: int,
        extend_fraction: float,
        drain_timeout: float,
        handle_signals: bool,
    ) -> None:
        super().__init__(
            http, run_id, mailbox, concurrency=concurrency, drain_timeout=drain_timeout, handle_signals=handle_signals
        )
        if not 0 < extend_fraction < 1:
            raise ValueError("extend_fraction must be between 0 and 1")
        self._messages = AsyncMessages(http, run_id)
        self._make_context = make_context
        self._start_handler = start_handler
        self.visibility_ms = visibility_ms
        self.retry_delay_ms = retry_delay_ms
        self.receive_wait_ms = max(0, min(receive_wait_ms, 30_000))
        self.extend_fraction = extend_fraction
        self.summary = MessageSummary()
        self._held: dict[str, _Held] = {}
        self._visibility_ms = 30_000

    async def run(self) -> MessageSummary:
        """Work until the run refuses work or ``stop()``; return the summary."""
        loop = self._begin()
        self._visibility_ms = await self._lease_ttl_ms(self.visibility_ms)
        with _sigterm_stops(self, loop):
            try:
                await self._receive_loop()
            except BaseException:
                await self._shutdown(drain_timeout=0)
                raise
            await self._shutdown(drain_timeout=self.drain_timeout)
        return self.summary

    # Receiving --------------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        def receive(free: int) -> Awaitable[list[AsyncDelivery]]:
            return self._messages.receive(
                self.mailbox, max=free, visibility_ms=self._visibility_ms, wait_ms=self.receive_wait_ms
            )

        await self._fetch_loop(
            receive, self._hand_back, max_per_call=MAX_DELIVERIES_PER_CALL, wait_ms=self.receive_wait_ms, verb="receive"
        )

    # Running one message ----------------------------------------------------------------

    def _start(self, delivery: AsyncDelivery) -> None:
        held = _Held(delivery, self._make_context(delivery))
        held.visible_until = monotonic() + self._visibility_ms / 1000
        held.trace = process_span(
            self.mailbox,
            traceparent=delivery.data.get("traceparent"),
            tracestate=delivery.data.get("tracestate"),
            run_id=self.run_id,
            message_id=delivery.message_id,
            attempt=delivery.attempt,
        )
        token = in_span(held.trace.context)  # the handler and its supervisor run in the span
        try:
            held.handler = asyncio.ensure_future(self._start_handler(held.ctx))
            held.handler.add_done_callback(self._slot_freed)
            self._held[delivery.id] = held
            held.supervisor = asyncio.create_task(self._supervise(held), name=f"runstate-message-{delivery.message_id}")
        finally:
            leave(token)

    def _lose(self, held: _Held, reason: str) -> None:
        """Mark the delivery lost: trip the context and cancel the handler (its result can no longer count)."""
        held.lost = True
        held.ctx._trip(reason, lost=True)
        if held.handler is not None and not held.handler.done():
            logger.info("message %s: delivery lost (%s); cancelling its handler", held.delivery.message_id, reason)
            held.handler.cancel()

    async def _keep_visible(self, held: _Held) -> None:
        """Extend the delivery every ``extend_fraction`` of the visibility while its handler runs.

        An extend that fails in transit is tried again at the next tick until the visibility
        would have run out; a refusal (the run's code, ``LEASE_LOST``) loses the delivery.
        """
        interval = max(MIN_RENEW_INTERVAL_S, self._visibility_ms / 1000 * self.extend_fraction)
        while held.running() and not held.lost:
            await asyncio.sleep(interval)
            sent = monotonic()
            try:
                await held.delivery.extend(self._visibility_ms)
            except ScopeInactiveError:
                self._lose(held, "scope_refused")
                return
            except Exception as exc:  # noqa: BLE001 - a transport failure is retried, anything else loses
                error = exc if isinstance(exc, RunstateError) else TransportError(f"extend failed: {exc!r}")
                if isinstance(error, TRANSIENT):
                    logger.warning("extend of message %s failed (%s)", held.delivery.message_id, error)
                    if monotonic() >= held.visible_until:
                        self._lose(held, "lease_lost")
                        return
                    continue
                self._lose(held, "lease_lost")
                return
            held.visible_until = sent + self._visibility_ms / 1000

    async def _supervise(self, held: _Held) -> None:
        assert held.handler is not None
        keeper = asyncio.create_task(self._keep_visible(held), name=f"runstate-extend-{held.delivery.message_id}")
        try:
            try:
                await held.handler
            except asyncio.CancelledError:
                await self._stop_keeping(keeper)
                if held.lost:
                    self.summary.lost += 1
                elif held.abandoned:
                    await self._hand_back(held.delivery)
                else:  # the handler cancelled itself: a failure like any other
                    await self._answer(held, held.delivery.retry(self.retry_delay_ms), "retried")
                return
            except Reject as reject:
                held.trace.fail(reject)
                await self._stop_keeping(keeper)
                await self._answer(held, held.delivery.reject(reject.reason), "rejected")
                return
            except Exception as exc:  # noqa: BLE001 - the handler's failure puts the message back
                held.trace.fail(exc)
                await self._stop_keeping(keeper)
                logger.warning("message %s attempt %d failed: %r", held.delivery.message_id, held.ctx.attempt, exc)
                await self._answer(held, held.delivery.retry(self.retry_delay_ms), "retried")
                return
            await self._stop_keeping(keeper)
            await self._answer(held, held.delivery.complete(), "completed")
        finally:
            await self._stop_keeping(keeper)
            held.trace.end()
            self._held.pop(held.delivery.id, None)
            if self._changed is not None:
                self._changed.set()

    async def _stop_keeping(self, keeper: "asyncio.Task[None]") -> None:
        keeper.cancel()
        await asyncio.gather(keeper, return_exceptions=True)

    async def _answer(self, held: _Held, call: Awaitable[JsonDict], counter: str) -> None:
        """Send the handler's answer unless the delivery is lost; count what became of it."""
        if held.lost:  # lost while the handler finished: nothing more is sent for it
            if asyncio.iscoroutine(call):
                call.close()
            self.summary.lost += 1
            return
        try:
            with held.trace.settle(self.mailbox, outcome=counter):
                await call
        except (LeaseLostError, ScopeInactiveError, NotFoundError) as exc:
            logger.info("message %s: answer refused (%s)", held.delivery.message_id, exc.code)
            held.ctx._trip("scope_refused" if isinstance(exc, ScopeInactiveError) else "lease_lost", lost=True)
            self.summary.lost += 1
            return
        except RunstateError as exc:
            logger.error("message %s: answer not recorded: %s", held.delivery.message_id, exc)
            held.ctx._trip("lease_lost", lost=True)
            self.summary.lost += 1
            return
        setattr(self.summary, counter, getattr(self.summary, counter) + 1)

    async def _hand_back(self, delivery: AsyncDelivery) -> None:
        try:
            await delivery.retry(0)
        except RunstateError as exc:
            logger.info("message %s: hand-back refused (%s)", delivery.message_id, exc)
            return
        self.summary.released += 1
