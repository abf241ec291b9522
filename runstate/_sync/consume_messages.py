"""``MessageWorker``: the message loop of ``Runstate`` (``run.consume_messages``).

Written by hand (not generated): a ``BlockingLoop`` (``runstate/_blocking.py``) around the
async engine, each handler in a daemon thread whose ``ctx.signal`` is a ``threading.Event``.
"""

from collections.abc import Callable
from typing import Any

from runstate._async.http import AsyncHttp
from runstate._blocking import BlockingLoop, StartHandler
from runstate._message_worker import MessageContext, MessageEngine, MessageSummary
from runstate._sync.http import Http

# A plain function ``handler(ctx)``, run in a thread.
MessageHandler = Callable[[MessageContext], Any]

__all__ = ["MessageHandler", "MessageSummary", "MessageWorker"]


class MessageWorker(BlockingLoop[MessageSummary]):
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
        super().__init__(http, run_id, mailbox, handler)
        self._options: dict[str, Any] = {
            "concurrency": concurrency,
            "visibility_ms": visibility_ms,
            "retry_delay_ms": retry_delay_ms,
            "receive_wait_ms": receive_wait_ms,
            "extend_fraction": extend_fraction,
            "drain_timeout": drain_timeout,
            "handle_signals": handle_signals,
        }

    def _new_summary(self) -> MessageSummary:
        return MessageSummary()

    def _make_engine(self, http: AsyncHttp, start: StartHandler) -> MessageEngine:
        return MessageEngine(
            http, self._run_id, self._mailbox, make_context=MessageContext, start_handler=start, **self._options
        )
