"""``AsyncWorker``: the worker loop of ``AsyncRunstate`` (``run.consume`` / ``run.worker``).

Written by hand (not generated): the sync twin in ``runstate/_sync/consume.py`` runs the
same engine on a loop of its own, with every handler in a thread.
"""

import asyncio
from collections.abc import Callable
from typing import Any

from runstate._async.http import AsyncHttp
from runstate._async.work import AsyncTasks
from runstate._worker import (
    AsyncTaskContext,
    ConsumeSummary,
    Engine,
    _TaskContextBase,
    is_async_callable,
    run_in_thread,
)

# An ``async def handler(ctx)`` (cancelled when its claim is lost), or a plain function run in a thread.
AsyncHandler = Callable[[AsyncTaskContext], Any]

__all__ = ["AsyncHandler", "AsyncWorker", "ConsumeSummary"]


class AsyncWorker:
    """A worker loop on one run and mailbox: ``await worker.run()``; ``worker.stop()`` ends it."""

    def __init__(
        self,
        http: AsyncHttp,
        run_id: str,
        mailbox: str,
        handler: AsyncHandler,
        *,
        concurrency: int,
        lease_ttl_ms: int | None,
        worker_id: str | None,
        claim_wait_ms: int,
        renew_fraction: float,
        drain_timeout: float,
        handle_signals: bool,
    ) -> None:
        self.handler = handler
        self._engine = Engine(
            http,
            run_id,
            mailbox,
            tasks=AsyncTasks(http, run_id),
            make_context=AsyncTaskContext,
            start_handler=self._start,
            concurrency=concurrency,
            lease_ttl_ms=lease_ttl_ms,
            worker_id=worker_id,
            claim_wait_ms=claim_wait_ms,
            renew_fraction=renew_fraction,
            drain_timeout=drain_timeout,
            handle_signals=handle_signals,
        )

    def __repr__(self) -> str:
        return f"<{type(self).__name__} run={self._engine.run_id} mailbox={self._engine.mailbox}>"

    @property
    def summary(self) -> ConsumeSummary:
        """Return what the loop has done so far."""
        return self._engine.summary

    async def _start(self, ctx: _TaskContextBase) -> Any:
        assert isinstance(ctx, AsyncTaskContext)
        if is_async_callable(self.handler):
            return await self.handler(ctx)
        result = await run_in_thread(asyncio.get_running_loop(), self.handler, ctx)
        if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
            return await result
        return result

    async def run(self) -> ConsumeSummary:
        """Work until the run refuses work, ``stop()`` or ``SIGTERM``; return the summary."""
        return await self._engine.run()

    def stop(self) -> None:
        """Stop claiming; running handlers get ``drain_timeout`` to finish (safe from any thread)."""
        self._engine.stop()
