"""``AsyncMessageWorker``: the message loop of ``AsyncRunstate`` (``run.consume_messages``).

Written by hand (not generated): the sync twin in ``runstate/_sync/consume_messages.py`` runs
the same engine on a loop of its own, with every handler in a thread.
"""

import asyncio
from collections.abc import Callable
from typing import Any

from runstate._async.http import AsyncHttp
from runstate._message_worker import AsyncMessageContext, MessageEngine, MessageSummary, _MessageContextBase
from runstate._worker import is_async_callable, run_in_thread

# An ``async def handler(ctx)`` (cancelled when its delivery is lost), or a plain function run in a thread.
AsyncMessageHandler = Callable[[AsyncMessageContext], Any]

__all__ = ["AsyncMessageHandler", "AsyncMessageWorker", "MessageSummary"]


class AsyncMessageWorker:
    """A message loop on one run and QUEUE mailbox: ``await worker.run()``; ``worker.stop()`` ends it."""

    def __init__(
        self,
        http: AsyncHttp,
        run_id: str,
        mailbox: str,
        handler: AsyncMessageHandler,
        *,
        concurrency: int,
        visibility_ms: int | None,
        retry_delay_ms: int,
        receive_wait_ms: int,
        extend_fraction: float,
        drain_timeout: float,
        handle_signals: bool,
    ) -> None:
        self.handler = handler
        self._engine = MessageEngine(
            http,
            run_id,
            mailbox,
            make_context=AsyncMessageContext,
            start_handler=self._start,
            concurrency=concurrency,
            visibility_ms=visibility_ms,
            retry_delay_ms=retry_delay_ms,
            receive_wait_ms=receive_wait_ms,
            extend_fraction=extend_fraction,
            drain_timeout=drain_timeout,
            handle_signals=handle_signals,
        )

    def __repr__(self) -> str:
        return f"<{type(self).__name__} run={self._engine.run_id} mailbox={self._engine.mailbox}>"

    @property
    def summary(self) -> MessageSummary:
        """Return what the loop has done so far."""
        return self._engine.summary

    async def _start(self, ctx: _MessageContextBase) -> Any:
        if is_async_callable(self.handler):
            return await self.handler(ctx)  # type: ignore[arg-type]
        result = await run_in_thread(asyncio.get_running_loop(), self.handler, ctx)
        if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
            return await result
        return result

    async def run(self) -> MessageSummary:
        """Work until the run refuses work, ``stop()`` or ``SIGTERM``; return the summary."""
        return await self._engine.run()

    def stop(self) -> None:
        """Stop receiving; running handlers get ``drain_timeout`` to finish (safe from any thread)."""
        self._engine.stop()
