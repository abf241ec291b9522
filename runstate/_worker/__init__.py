"""The worker engine behind ``consume`` and ``claim.hold()``, one concern per module.

- ``contexts``: what a handler gets (``TaskContext``, ``AsyncTaskContext``, the hold contexts,
  and the base the message contexts share) and ``cancel_on_request``'s abort
  (``CancellationRequested``);
- ``threads``: a plain-function handler run in a daemon thread;
- ``completer``: the completion buffer, sent in batches by one flusher task;
- ``signals``: ``SIGTERM`` stops every worker loop on an event loop;
- ``engine``: the loop itself (``Engine``): claim, renew, run, record, stop;
- ``watch``: the claim watch (``ClaimWatch``: one per worker loop) and the one a client's holds
  share (``SharedWatch``);
- ``holder``: one claim held by hand with the engine's renewer and record methods (``Holder``);
- ``protocols``: what the engine asks of a claim and of the tasks namespace (``Claim``,
  ``Tasks``), which ``runstate._async.work`` implements from above.

The message loop (``runstate/_message_worker.py``) uses the contexts' base, the thread runner
and the signal handling from here; both loops build on ``runstate/_loop.py``. Modules outside
this package import from ``runstate._worker``, which re-exports what they use.
"""

from runstate._worker.contexts import (
    AsyncHoldContext,
    AsyncTaskContext,
    CancellationRequested,
    HoldContext,
    TaskContext,
    _HandlerContext,
    _TaskContextBase,
)
from runstate._worker.engine import ConsumeSummary, Engine, describe_error
from runstate._worker.holder import Holder
from runstate._worker.protocols import Claim, Tasks
from runstate._worker.signals import _sigterm_stops
from runstate._worker.threads import is_async_callable, run_in_thread

__all__ = [
    "AsyncHoldContext",
    "AsyncTaskContext",
    "CancellationRequested",
    "Claim",
    "ConsumeSummary",
    "Engine",
    "HoldContext",
    "Holder",
    "TaskContext",
    "Tasks",
    "_HandlerContext",
    "_TaskContextBase",
    "_sigterm_stops",
    "describe_error",
    "is_async_callable",
    "run_in_thread",
]
