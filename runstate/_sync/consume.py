"""``Worker``: the worker loop of ``Runstate`` (``run.consume`` / ``run.worker``).

Written by hand (not generated): a ``BlockingLoop`` (``runstate/_blocking.py``) around the
async engine, each handler in a daemon thread whose ``ctx.signal`` is a ``threading.Event``.
"""

from collections.abc import Callable
from typing import Any

from runstate._async.http import AsyncHttp
from runstate._async.work import AsyncTasks
from runstate._blocking import BlockingLoop, StartHandler
from runstate._sync.http import Http
from runstate._worker import ConsumeSummary, Engine, TaskContext

# A plain function ``handler(ctx)``, run in a thread.
Handler = Callable[[TaskContext], Any]

__all__ = ["ConsumeSummary", "Handler", "Worker"]


class Worker(BlockingLoop[ConsumeSummary]):
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
        super().__init__(http, run_id, mailbox, handler)
        self._options: dict[str, Any] = {
            "concurrency": concurrency,
            "lease_ttl_ms": lease_ttl_ms,
            "worker_id": worker_id,
            "claim_wait_ms": claim_wait_ms,
            "renew_fraction": renew_fraction,
            "drain_timeout": drain_timeout,
            "handle_signals": handle_signals,
        }

    def _new_summary(self) -> ConsumeSummary:
        return ConsumeSummary()

    def _make_engine(self, http: AsyncHttp, start: StartHandler) -> Engine:
        return Engine(
            http,
            self._run_id,
            self._mailbox,
            tasks=AsyncTasks(http, self._run_id),
            make_context=TaskContext,
            start_handler=start,
            **self._options,
        )
