"""The worker side of ``@runstate_task``: claim by id, heartbeat, run the handler, record.

Kept apart from the services (as procrastinate keeps ``worker.py`` apart from ``manager.py``):
every state change here is one service call, and the database decides. One delivery of a
Celery message runs ``execute``:

1. claim the task by id under a lease (``task_claim_by_id``): a duplicate delivery, a task
   someone else holds or a finished task answers None and the message is simply acked; an
   inactive run refuses with its code;
2. run the handler with a ``TaskContext`` while a heartbeat thread renews the lease every
   third of its TTL and carries a cancellation request (or a lost claim) back as
   ``ctx.signal``; an async handler's asyncio task is cancelled on the signal;
3. record the outcome with the claim: a return completes it (``CANCELLED`` when cancellation
   was requested), an exception fails it (back to the queue with a delay while attempts
   remain, which sends a new message after commit), a lost claim or a refused run records
   nothing more.

After a cancellation request the heartbeat stops renewing on its own: a handler that ignores
the signal keeps its claim until the lease (or the cancel's grace) runs out, and the lease
sweep then records ``CANCELLED``. ``ctx.heartbeat()`` still renews explicitly, for cleanup
that needs longer. Celery's ``revoke`` plays no part.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import threading
import traceback
import uuid
from typing import TYPE_CHECKING, Any

from celery.exceptions import SoftTimeLimitExceeded
from django.db import connection

from coordination import exceptions
from coordination.services.claims import Claim, claim_complete, claim_fail, claim_release, claim_renew, task_claim_by_id
from coordination.states import TaskState

if TYPE_CHECKING:
    from workers.decorators import RunstateTask

logger = logging.getLogger(__name__)

TRACEBACK_LINES = 30
EXPLICIT_HEARTBEAT_TIMEOUT_S = 30.0


class TaskCancelled(Exception):  # noqa: N818 - reads as what happened, like asyncio.CancelledError
    """Raised by ``ctx.check()`` once cancellation was requested or the claim was lost."""


class TaskContext:
    """What a handler knows about its task and claim, and how it hears about cancellation.

    ``signal`` (a ``threading.Event``) is set when cancellation is requested (the task's or
    its run's) or when the claim is lost; pass it to I/O that can be interrupted, check it
    between steps, or call ``check()`` to raise ``TaskCancelled``.
    """

    def __init__(self, claim: Claim, *, mailbox: str) -> None:
        task = claim.task
        self.input: Any = task.input
        self.task_id: uuid.UUID = task.id
        self.run_id: uuid.UUID = task.run_id
        self.key: str | None = task.key
        self.mailbox = mailbox
        self.attempt: int = claim.attempt
        self.claim_id: str = claim.claim_id
        self.signal = threading.Event()
        # None while the claim holds; else "LEASE_LOST" or the run's refusal code.
        self.lost: str | None = None
        self._cancellation_requested = False
        self._callbacks: list = []
        self._lock = threading.Lock()
        self._heartbeat: Heartbeat | None = None

    def __repr__(self) -> str:
        return f"<TaskContext task={self.task_id} attempt={self.attempt}>"

    def is_cancellation_requested(self) -> bool:
        """Whether the task or its run was asked to stop (as of the last heartbeat)."""
        return self._cancellation_requested

    @property
    def lease_lost(self) -> bool:
        """Whether the claim is gone: nothing the handler does will be recorded."""
        return self.lost is not None

    def check(self) -> None:
        """Raise ``TaskCancelled`` if the handler should stop (cancellation requested or claim lost)."""
        if self.signal.is_set():
            reason = self.lost or "cancellation requested"
            raise TaskCancelled(f"task {self.task_id}: {reason}")

    def heartbeat(self) -> bool:
        """Renew the lease now (also after a cancellation request); return whether the claim still holds."""
        if self._heartbeat is None:
            return not self.lease_lost
        return self._heartbeat.renew_now()

    # Called by the heartbeat thread ----------------------------------------------------------

    def _request_cancellation(self) -> None:
        self._cancellation_requested = True
        self._fire()

    def _lose(self, code: str, *, cancelled: bool) -> None:
        self.lost = code
        if cancelled:
            self._cancellation_requested = True
        self._fire()

    def _fire(self) -> None:
        with self._lock:
            if self.signal.is_set():
                return
            self.signal.set()
            callbacks = list(self._callbacks)
        for callback in callbacks:
            try:
                callback()
            except Exception:  # noqa: BLE001 - a closed event loop must not kill the heartbeat
                logger.debug("signal callback failed", exc_info=True)

    def _on_signal(self, callback) -> None:
        """Call ``callback`` (from the heartbeat thread) when the signal is set; now if it already is."""
        with self._lock:
            if not self.signal.is_set():
                self._callbacks.append(callback)
                return
        callback()

    def _clear_callbacks(self) -> None:
        with self._lock:
            self._callbacks.clear()


class Heartbeat:
    """A thread renewing one claim's lease every third of its TTL.

    It opens its own database connection only when it first renews, so a handler shorter
    than a third of the lease costs no connection, and closes it when it stops.
    """

    def __init__(self, ctx: TaskContext, *, project_id: uuid.UUID, lease_ttl_ms: int, renew_ttl_ms: int | None):
        self.ctx = ctx
        self.project_id = project_id
        self.renew_ttl_ms = renew_ttl_ms
        self.interval_s = lease_ttl_ms / 3000
        self.held = True
        self._wake = threading.Event()
        self._stopping = False
        self._explicit = False
        self._explicit_done = threading.Event()
        self._explicit_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=f"runstate-heartbeat-{ctx.task_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop renewing and wait for the thread (a renewal in progress finishes first)."""
        self._stopping = True
        self._wake.set()
        self._thread.join()

    def renew_now(self) -> bool:
        """Ask the thread to renew at once and wait for it; return whether the claim still holds."""
        with self._explicit_lock:
            if not self.held or self._stopping:
                return self.held
            self._explicit_done.clear()
            self._explicit = True
            self._wake.set()
            self._explicit_done.wait(EXPLICIT_HEARTBEAT_TIMEOUT_S)
        return self.held

    def _loop(self) -> None:
        try:
            while self.held:
                self._wake.wait(self.interval_s)
                self._wake.clear()
                if self._stopping:
                    break
                explicit, self._explicit = self._explicit, False
                # After a cancellation request only an explicit heartbeat extends the lease.
                if explicit or not self.ctx.is_cancellation_requested():
                    self._renew()
                if explicit:
                    self._explicit_done.set()
        finally:
            self._explicit_done.set()
            connection.close()

    def _renew(self) -> None:
        try:
            claim = claim_renew(project_id=self.project_id, claim_id=self.ctx.claim_id, lease_ttl_ms=self.renew_ttl_ms)
        except exceptions.LeaseLost:
            self.held = False
            self.ctx._lose(exceptions.LeaseLost.code, cancelled=False)
        except exceptions.NotFound:
            self.held = False
            self.ctx._lose(exceptions.NotFound.code, cancelled=False)
        except exceptions.CoordinationError as refusal:
            # The run went inactive (cancelled, completed, past its deadline): a cancellation.
            self.held = False
            self.ctx._lose(refusal.code, cancelled=True)
        except Exception:  # noqa: BLE001 - a database hiccup: the next beat tries again, the lease outlives two misses
            logger.warning("heartbeat of %s failed; retrying", self.ctx.claim_id, exc_info=True)
            connection.close()
        else:
            if claim.task.state == TaskState.CANCELLATION_REQUESTED and not self.ctx.is_cancellation_requested():
                self.ctx._request_cancellation()


def _worker_id(request) -> str:
    hostname = getattr(request, "hostname", None) or socket.gethostname()
    return f"{hostname}/{os.getpid()}/{threading.current_thread().name}"[:200]


async def _run_async(fn, ctx: TaskContext, kwargs: dict[str, Any]):
    loop = asyncio.get_running_loop()
    handler = asyncio.ensure_future(fn(ctx, **kwargs))

    def cancel() -> None:
        loop.call_soon_threadsafe(handler.cancel)

    ctx._on_signal(cancel)
    try:
        return await handler
    finally:
        ctx._clear_callbacks()


def _run_handler(bound: RunstateTask, ctx: TaskContext) -> Any:
    kwargs = bound.kwargs_for(ctx.input)
    if bound.is_async:
        return asyncio.run(_run_async(bound.fn, ctx, kwargs))
    return bound.fn(ctx, **kwargs)


def _handler_error(error: BaseException) -> dict[str, Any]:
    lines = traceback.format_exception(error)
    return {
        "code": "handler_error",
        "type": type(error).__name__,
        "message": str(error),
        "traceback": "".join(lines[-TRACEBACK_LINES:]),
    }


def _soft_time_limit_error(bound: RunstateTask, request) -> dict[str, Any]:
    # Celery's request carries (hard, soft) when the limits were given per message.
    limits = getattr(request, "timelimit", None) or (None, None)
    seconds = limits[1] or getattr(bound.celery_task, "soft_time_limit", None)
    return {
        "code": "soft_time_limit_exceeded",
        "type": "SoftTimeLimitExceeded",
        "message": f"The handler ran past its Celery soft time limit ({seconds} s) and was interrupted.",
    }


def execute(bound: RunstateTask, task_id: str, request=None) -> str:
    """Handle one delivery of ``task_id``; return what happened (for logs): a task state or why nothing was done.

    Celery's Django fixup closes stale database connections around every task.
    """
    project_id, mailbox_id = bound.ids()
    try:
        claim = task_claim_by_id(
            project_id=project_id,
            task_id=uuid.UUID(str(task_id)),
            worker_id=_worker_id(request),
            lease_ttl_ms=bound.lease_ttl_ms,
            mailbox_id=mailbox_id,
        )
    except exceptions.NotFound:
        logger.warning("%s: task %s not found in project %s", bound.name, task_id, bound.project_name)
        return "not_found"
    except exceptions.CoordinationError as refusal:
        logger.info("%s: task %s not claimed: %s", bound.name, task_id, refusal.code)
        return refusal.code
    if claim is None:
        _wake_later_if_early(bound, task_id)
        return "not_claimable"

    ctx = TaskContext(claim, mailbox=bound.mailbox_name)
    lease_ttl_ms = bound.lease_ttl_ms or claim.task.mailbox.lease_ttl_ms
    heartbeat = Heartbeat(ctx, project_id=project_id, lease_ttl_ms=lease_ttl_ms, renew_ttl_ms=bound.lease_ttl_ms)
    ctx._heartbeat = heartbeat
    heartbeat.start()
    outcome: Any = None
    error: dict[str, Any] | None = None
    try:
        outcome = _run_handler(bound, ctx)
    except (TaskCancelled, asyncio.CancelledError) as stopped:
        if not ctx.signal.is_set():
            error = _handler_error(stopped)
    except SoftTimeLimitExceeded:
        error = _soft_time_limit_error(bound, request)
    except Exception as failure:  # noqa: BLE001 - the handler's failure is recorded, not raised
        error = _handler_error(failure)
    except BaseException:
        # The worker is going away (shutdown, interrupt): hand the task back for another worker.
        heartbeat.stop()
        _release(project_id, ctx)
        raise
    finally:
        heartbeat.stop()
    return _record(bound, ctx, project_id, outcome, error)


def _record(bound: RunstateTask, ctx: TaskContext, project_id: uuid.UUID, outcome: Any, error: dict | None) -> str:
    if ctx.lost is not None:
        logger.info(
            "%s: task %s attempt %s stopped, nothing recorded: %s", bound.name, ctx.task_id, ctx.attempt, ctx.lost
        )
        return ctx.lost
    retry = True
    if error is None:
        try:
            json.dumps(outcome)
        except (TypeError, ValueError) as unserializable:
            error = {"code": "outcome_not_json", "type": type(unserializable).__name__, "message": str(unserializable)}
            retry = False
    try:
        if error is None:
            task = claim_complete(project_id=project_id, claim_id=ctx.claim_id, outcome=outcome)
        else:
            task = claim_fail(
                project_id=project_id,
                claim_id=ctx.claim_id,
                error=error,
                retry=retry,
                retry_delay_ms=bound.retry_delay_ms(ctx.attempt),
            )
    except (exceptions.LeaseLost, exceptions.NotFound) as lost:
        logger.info("%s: task %s attempt %s not recorded: %s", bound.name, ctx.task_id, ctx.attempt, lost.code)
        return lost.code
    except exceptions.CoordinationError as refusal:
        logger.info("%s: task %s attempt %s not recorded: %s", bound.name, ctx.task_id, ctx.attempt, refusal.code)
        return refusal.code
    if error is not None:
        log = logger.info if task.state == TaskState.QUEUED else logger.warning
        log(
            "%s: task %s attempt %s failed, now %s: %s",
            bound.name,
            ctx.task_id,
            ctx.attempt,
            task.state,
            error["message"],
        )
    return task.state


def _release(project_id: uuid.UUID, ctx: TaskContext) -> None:
    if ctx.lost is not None:
        return
    try:
        claim_release(project_id=project_id, claim_id=ctx.claim_id)
    except Exception:  # noqa: BLE001 - best effort on the way out; the lease sweep is the safety net
        logger.warning("could not release %s; its lease will expire", ctx.claim_id, exc_info=True)


def _wake_later_if_early(bound: RunstateTask, task_id: str) -> None:
    """Send the message again for ``available_at`` when it came early (a retry delay, clock skew)."""
    from django.utils import timezone

    from coordination.models import Task
    from workers.dispatch import send_work

    available_at = (
        Task.objects.filter(id=task_id, state=TaskState.QUEUED, available_at__gt=timezone.now())
        .values_list("available_at", flat=True)
        .first()
    )
    if available_at is not None:
        send_work(bound, task_id, available_at)
