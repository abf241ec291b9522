"""``MessageWorker``: the message loop of ``Runstate`` (``run.consume_messages``).

Written by hand (not generated). It runs the async engine on an event loop of its own in
the calling thread, with an async connection set of the same configuration, and each
handler in a daemon thread whose ``ctx.signal`` is a ``threading.Event``.
"""

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from runstate._async.http import AsyncHttp
from runstate._message_worker import MessageContext, MessageEngine, MessageSummary, _MessageContextBase
from runstate._sync.http import Http
from runstate._worker import run_in_thread

# A plain function ``handler(ctx)``, run in a thread.
MessageHandler = Callable[[MessageContext], Any]

__all__ = ["MessageHandler", "MessageSummary", "MessageWorker"]


class MessageWorker:
    """A message loop on one run and QUEUE mailbox: ``worker.run()`` blocks; ``worker.stop()`` (any thread) ends it."""

    def __init__(
        self,
        http: Http,
        run_id: str,
        mailbox: str,
        handler: MessageHandler,
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
        self._config = http.config
        self._run_id = run_id
        self._mailbox = mailbox
        self._options: dict[str, Any] = {
            "concurrency": concurrency,
            "visibility_ms": visibility_ms,
            "retry_delay_ms": retry_delay_ms,
            "receive_wait_ms": receive_wait_ms,
            "extend_fraction": extend_fraction,
            "drain_timeout": drain_timeout,
            "handle_signals": handle_signals,
        }
        self._lock = threading.Lock()
        self._engine: MessageEngine | None = None
        self._stop_requested = False

    def __repr__(self) -> str:
        return f"<{type(self).__name__} run={self._run_id} mailbox={self._mailbox}>"

    @property
    def summary(self) -> MessageSummary:
        """Return what the loop has done so far."""
        return self._engine.summary if self._engine is not None else MessageSummary()

    def run(self) -> MessageSummary:
        """Work until the run refuses work, ``stop()`` or ``SIGTERM``; return the summary.

        Runs an event loop in the calling thread, so it cannot be called from a running loop.
        """
        return asyncio.run(self._main())

    def stop(self) -> None:
        """Stop receiving; running handlers get ``drain_timeout`` to finish. Safe from any thread."""
        with self._lock:
            self._stop_requested = True
            engine = self._engine
        if engine is not None:
            engine.stop()

    async def _main(self) -> MessageSummary:
        http = AsyncHttp(self._config)
        loop = asyncio.get_running_loop()

        async def start(ctx: _MessageContextBase) -> Any:
            return await run_in_thread(loop, self.handler, ctx)

        engine = MessageEngine(
            http,
            self._run_id,
            self._mailbox,
            make_context=MessageContext,
            start_handler=start,
            **self._options,
        )
        with self._lock:
            self._engine = engine
            if self._stop_requested:
                engine.stop()
        try:
            return await engine.run()
        finally:
            await http.aclose()
