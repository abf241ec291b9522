"""``bench.cancel_push``'s Celery handler: ``@runstate_task`` holding its claim until its signal trips.

The benchmark's Celery workers import this module (``--include``). Each handler writes
``start <task>`` when it runs and ``trip <task> <time> <reason> <push|renewal>`` when its
``ctx.signal`` trips, straight to file descriptor 1 (the benchmark reads the worker's
standard output; Celery redirects ``sys.stdout`` to its logger). ``push``: the process's claim
watch stopped the claim (``Renewer._stop``); else a renewal did. With
``BENCH_PUSH_RENEWAL_ONLY=1`` the watch never starts: renewal alone, the figure beside it.
"""

from __future__ import annotations

import os
import threading
import time

from django.db import connection

from workers import runstate_task
from workers import runtime as worker_runtime
from workers.watch import ClaimWatcher

MAILBOX = "bench-push-celery"
QUEUE = "bench-push"
PROJECT = os.environ.get("BENCH_PUSH_PROJECT", "bench-cancel-push")

_pushed: set[str] = set()
_pushed_lock = threading.Lock()
_stop = worker_runtime.Renewer._stop


def _tracking_stop(self, held, event) -> None:
    with _pushed_lock:
        _pushed.add(held.ctx.claim_id)
    _stop(self, held, event)


worker_runtime.Renewer._stop = _tracking_stop  # type: ignore[method-assign]
if os.environ.get("BENCH_PUSH_RENEWAL_ONLY") == "1":
    ClaimWatcher.want = lambda self: None  # type: ignore[method-assign]
    worker_runtime.READY_TIMEOUT_S = 0.0


def _say(line: str) -> None:
    os.write(1, (line + "\n").encode())


@runstate_task(mailbox=MAILBOX, project=PROJECT, name="bench.cancel_push.hold", queue=QUEUE)
def hold(ctx, n: int):
    """Hold the claim until the signal trips (a cancel, the run's end); say when it did, and who told."""
    connection.close()  # 1,000 handlers hold no connection while they wait (the claim was theirs)
    _say(f"start {ctx.task_id}")
    ctx.signal.wait()
    tripped = time.time()
    with _pushed_lock:
        source = "push" if ctx.claim_id in _pushed else "renewal"
    reason = ctx.lost or "cancellation_requested"
    _say(f"trip {ctx.task_id} {tripped:.6f} {reason} {source}")
    return None
