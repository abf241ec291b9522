"""The worker engine behind ``consume`` and ``claim.hold()``, one concern per module.

- ``contexts``: what a handler gets (``TaskContext``, ``AsyncTaskContext``, the hold contexts)
  and ``cancel_on_request``'s abort (``CancellationRequested``);
- ``threads``: a plain-function handler run in a daemon thread;
- ``completer``: the completion buffer, sent in batches by one flusher task;
- ``signals``: ``SIGTERM`` stops every worker loop on an event loop;
- ``engine``: the loop itself (``Engine``): claim, renew, run, record, stop;
- ``holder``: one claim held by hand with the engine's renewer and record methods (``Holder``).

The message loop (``runstate/_message_worker.py``) uses the thread runner and the signal
handling from here; both loops build on ``runstate/_loop.py``.
"""

from runstate._worker.contexts import (
    AsyncHoldContext,
    AsyncTaskContext,
    CancellationRequested,
    HoldContext,
    TaskContext,
    _Signal,
    _TaskContextBase,
)
from runstate._worker.engine import MIN_RENEW_INTERVAL_S, ConsumeSummary, Engine, describe_error
from runstate._worker.holder import Holder
from runstate._worker.signals import _sigterm_stops
from runstate._worker.threads import is_async_callable, run_in_thread

__all__ = [
    "MIN_RENEW_INTERVAL_S",
    "AsyncHoldContext",
    "AsyncTaskContext",
    "CancellationRequested",
    "ConsumeSummary",
    "Engine",
    "HoldContext",
    "Holder",
    "TaskContext",
    "_Signal",
    "_TaskContextBase",
    "_sigterm_stops",
    "describe_error",
    "is_async_callable",
    "run_in_thread",
]
