"""``Worker``: the worker loop of ``Runstate`` (``run.consume`` / ``run.worker``).

Written by hand (not generated). It runs the async engine on an event loop of its own in
the calling thread, with a pooled async connection set of the same configuration, and each
handler in a daemon thread whose ``ctx.signal`` is a ``threading.Event``.
"""

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from runstate._async.http import AsyncHttp
from runstate._sync.http import Http
from runstate._worker import ConsumeSummary, Engine, TaskContext, _TaskContextBase, run_in_thread

# A plain function ``handler(ctx)``, run in a thread.
Handler = Callable[[TaskContext], Any]

__all__ = ["ConsumeSummary", "Handler", "Worker"]


class Worker:
    """A worker loop on one run and mailbox: ``worker.run()`` blocks; ``worker.stop()`` (any thread) ends it."""

    def __init__(
        self,
        http: Http,
        run_id: str,
        mailbox: str,
        handler: Handler,
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
        self._config = http.config
        self._run_id = run_id
        self._mailbox = mailbox
        self._options: dict[str, Any] = {
            "concurrency": concurrency,
            "lease_ttl_ms": lease_ttl_ms,
            "worker_id": worker_id,
            "claim_wait_ms": claim_wait_ms,
            "renew_fraction": renew_fraction,
            "drain_timeout": drain_timeout,
            "handle_signals": handle_signals,
        }
        self._lock = threading.Lock()
        self._engine: Engine | None = None
        self._stop_requested = False

    def __repr__(self) -> str:
        return f"<{type(self).__name__} run={self._run_id} mailbox={self._mailbox}>"

    @property
    def summary(self) -> ConsumeSummary:
        """Return what the loop has done so far."""
        return self._engine.summary if self._engine is not None else ConsumeSummary()

    def run(self) -> ConsumeSummary:
        """Work until the run refuses work, ``stop()`` or ``SIGTERM``; return the summary.

        Runs an event loop in the calling thread, so it cannot be called from a running loop.
        """
        return asyncio.run(self._main())

    def stop(self) -> None:
        """Stop claiming; running handlers get ``drain_timeout`` to finish. Safe from any thread."""
        with self._lock:
            self._stop_requested = True
            engine = self._engine
        if engine is not None:
            engine.stop()

    async def _main(self) -> ConsumeSummary:
        http = AsyncHttp(self._config)
        loop = asyncio.get_running_loop()

        async def start(ctx: _TaskContextBase) -> Any:
            return await run_in_thread(loop, self.handler, ctx)

        engine = Engine(
            http, self._run_id, self._mailbox, make_context=TaskContext, start_handler=start, **self._options
        )
        with self._lock:
            self._engine = engine
            if self._stop_requested:
                engine.stop()
        try:
            return await engine.run()
        finally:
            await http.aclose()
