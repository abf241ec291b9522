"""``BlockingLoop``: how the sync client runs a worker loop (``Worker``, ``MessageWorker``).

``run()`` runs the async engine on an event loop of its own in the calling thread, with an
async connection set of the same configuration, and each handler in a daemon thread whose
``ctx.signal`` is a ``threading.Event``; ``stop()`` works from any thread, before or during
``run()``.
"""

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from runstate._async.http import AsyncHttp
from runstate._sync.http import Http
from runstate._worker import run_in_thread


class _Engine[SummaryT](Protocol):
    summary: SummaryT

    async def run(self) -> SummaryT: ...

    def stop(self) -> None: ...


# What an engine is given to start a handler: ``start(ctx)`` runs it in a thread.
StartHandler = Callable[[Any], Awaitable[Any]]


class BlockingLoop[SummaryT]:
    """A worker loop driven from plain code: ``run()`` blocks; ``stop()`` (any thread) ends it.

    A subclass says which engine to build (``_make_engine``) and what an empty summary is.
    """

    def __init__(self, http: Http, run_id: str, mailbox: str, handler: Callable[[Any], Any]) -> None:
        self.handler = handler
        self._config = http.config
        self._run_id = run_id
        self._mailbox = mailbox
        self._lock = threading.Lock()
        self._engine: _Engine[SummaryT] | None = None
        self._stop_requested = False

    def __repr__(self) -> str:
        return f"<{type(self).__name__} run={self._run_id} mailbox={self._mailbox}>"

    def _new_summary(self) -> SummaryT:
        raise NotImplementedError

    def _make_engine(self, http: AsyncHttp, start: StartHandler) -> _Engine[SummaryT]:
        raise NotImplementedError

    @property
    def summary(self) -> SummaryT:
        """Return what the loop has done so far."""
        return self._engine.summary if self._engine is not None else self._new_summary()

    def run(self) -> SummaryT:
        """Work until the run refuses work, ``stop()`` or ``SIGTERM``; return the summary.

        Runs an event loop in the calling thread, so it cannot be called from a running loop.
        """
        return asyncio.run(self._main())

    def stop(self) -> None:
        """Stop fetching work; running handlers get ``drain_timeout`` to finish. Safe from any thread."""
        with self._lock:
            self._stop_requested = True
            engine = self._engine
        if engine is not None:
            engine.stop()

    async def _main(self) -> SummaryT:
        http = AsyncHttp(self._config)
        loop = asyncio.get_running_loop()

        async def start(ctx: Any) -> Any:
            return await run_in_thread(loop, self.handler, ctx)

        engine = self._make_engine(http, start)
        with self._lock:
            self._engine = engine
            if self._stop_requested:
                engine.stop()
        try:
            return await engine.run()
        finally:
            await http.aclose()
