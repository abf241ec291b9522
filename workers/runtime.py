"""The worker side of ``@runstate_task``: claim by id, heartbeat, run the handler, record.

Kept apart from the services (as procrastinate keeps ``worker.py`` apart from ``manager.py``):
every state change here is one service call, and the database decides. One delivery of a
Celery message runs ``execute``:

1. claim the task by id under a lease (``task_claim_by_id_narrow``, the narrow form of
   ``task_claim_by_id``): a duplicate delivery, a task someone else holds or a finished task answers None and the
   message is simply acked; an inactive run refuses with its code;
2. run the handler with a ``TaskContext`` while the process's renewer (one thread for every
   claim the process holds, one batched statement per tick) renews the lease every third of
   its TTL; the process's claim watch (``workers.watch``, one thread) carries a cancellation
   request (or a lost claim) back as ``ctx.signal`` as soon as it commits, the renewal later
   if the watch is down; an async handler's asyncio task is cancelled on the signal;
3. record the outcome with the claim: a return completes it (``CANCELLED`` when cancellation
   was requested), an exception fails it (back to the queue with a delay while attempts
   remain, which sends a new message after commit), a lost claim or a refused run records
   nothing more.

After a cancellation request the renewer stops renewing that claim on its own: a handler that ignores
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
import time
import traceback
import uuid
from collections import OrderedDict
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.db import DatabaseError, InterfaceError, OperationalError, connection

from coordination.domain import exceptions
from coordination.domain.states import TaskState
from coordination.models import Event
from coordination.services.claims import (
    MAX_BATCH,
    Claim,
    NarrowClaim,
    claim_complete_narrow,
    claim_fail,
    claim_release,
    claims_renew_many,
    task_claim_by_id_narrow,
)
from runstate._tracing import ProcessSpan, in_span, leave, process_span
from runstate_project.postgresql.base import read_only_server
from workers.registry import BoundTask
from workers.watch import READY_TIMEOUT_S, ClaimWatcher

logger = logging.getLogger(__name__)

TRACEBACK_LINES = 30
EXPLICIT_HEARTBEAT_TIMEOUT_S = 30.0
# Events the claim watch read for claims not registered yet, kept for them (the oldest dropped past this).
EARLY_EVENTS_MAX = 10_000
# The pauses between tries while the database cannot be reached (``_through_outages``).
RECONNECT_PAUSE_S = 0.25
RECONNECT_PAUSE_MAX_S = 2.0


class TaskCancelled(Exception):  # noqa: N818 - reads as what happened, like asyncio.CancelledError
    """Raised by ``ctx.check()`` once cancellation was requested or the claim was lost."""


class TaskContext:
    """What a handler knows about its task and claim, and how it hears about cancellation.

    ``signal`` (a ``threading.Event``) is set when cancellation is requested (the task's or
    its run's) or when the claim is lost; pass it to I/O that can be interrupted, check it
    between steps, or call ``check()`` to raise ``TaskCancelled``.
    """

    def __init__(self, claim: NarrowClaim | Claim, *, mailbox: str) -> None:
        if isinstance(claim, Claim):
            claim = NarrowClaim.of(claim)
        self.input: Any = claim.input
        self.task_id: uuid.UUID = claim.task_id
        self.run_id: uuid.UUID = claim.run_id
        self.key: str | None = claim.key
        self.mailbox = mailbox
        self.attempt: int = claim.attempt
        self.claim_id: str = claim.claim_id
        self.signal = threading.Event()
        # None while the claim holds; else "LEASE_LOST" or the run's refusal code.
        self.lost: str | None = None
        self._cancellation_requested = False
        self._callbacks: list = []
        self._lock = threading.Lock()
        self._held: Held | None = None

    def __repr__(self) -> str:
        return f"<TaskContext task={self.task_id} attempt={self.attempt}>"

    def is_cancellation_requested(self) -> bool:
        """Whether the task or its run was asked to stop (as the claim watch or the last renewal said)."""
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
        if self._held is None:
            return not self.lease_lost
        return renewer().renew_now(self._held)

    # Called by the renewer and claim watch threads ---------------------------------------

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
        """Call ``callback`` (from the renewer or watch thread) when the signal is set; now if it already is."""
        with self._lock:
            if not self.signal.is_set():
                self._callbacks.append(callback)
                return
        callback()

    def _clear_callbacks(self) -> None:
        with self._lock:
            self._callbacks.clear()


class Held:
    """One claim the process holds, as the renewer sees it."""

    __slots__ = ("ctx", "done", "due", "explicit", "interval_s", "project_id", "renew_ttl_ms")

    def __init__(self, ctx: TaskContext, *, project_id: uuid.UUID, lease_ttl_ms: int, renew_ttl_ms: int | None):
        self.ctx = ctx
        self.project_id = project_id
        self.renew_ttl_ms = renew_ttl_ms
        self.interval_s = lease_ttl_ms / 3000
        self.due = time.monotonic() + self.interval_s
        self.explicit = False
        # Set while no renewal of this claim is in flight.
        self.done = threading.Event()
        self.done.set()


class Renewer:
    """One thread per worker process renewing every claim the process holds, and its claim watch.

    Each claim is renewed every third of its lease TTL; whatever is due at a tick (or
    within half its own interval) is renewed together, in one ``claims_renew_many``
    statement per project. The per-item answers come back to each task's context: a
    cancellation request sets ``ctx.signal``; a lost claim (lease taken over, task gone, run
    inactive) sets it and stops renewing that claim only. After a cancellation request a
    claim is renewed only explicitly (``ctx.heartbeat()``). The thread starts on the first
    claim in a process (a forked pool child starts its own); its database connection is
    closed after an error (the next tick reconnects) and while it holds no claim.

    The claim watch (``workers.watch``) tells it at once what a renewal would say later: a
    delivery calls ``expect`` before it claims (the watch then reads that project's events of
    that worker, and is started first), and the watch hands the events it reads to ``pushed``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, Held] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        # When the thread wakes on its own next (monotonic); a claim due later needs no wake-up.
        self._sleeping_until = 0.0
        # With nothing to renew, it still wakes this often (the shortest renewal interval seen),
        # so a claim taken meanwhile, due an interval later, needs no wake-up either.
        self._idle_nap_s = 1.0
        # What the claim watch reads: every project a delivery expected to claim in, and the
        # prefixes of their worker ids (``worker_prefix``: one per process, in practice).
        self._watched: tuple[frozenset[uuid.UUID], frozenset[str]] = (frozenset(), frozenset())
        # Events the watch read for a claim not registered yet (claimed, ``hold`` not called yet), by claim id.
        self._early: OrderedDict[str, Event] = OrderedDict()
        self.watcher = ClaimWatcher(self)

    def __len__(self) -> int:
        return len(self._held)

    def expect(self, project_id: uuid.UUID, worker_id: str) -> None:
        """Have the claim watch follow ``worker_id``'s claims in the project before that worker claims.

        The first time in a process, wait for the watch to start reading (at most
        ``READY_TIMEOUT_S``): a claim taken before would hear of an earlier cancel only when the
        watch starts (``watching``).
        """
        prefix = worker_prefix(worker_id)
        projects, prefixes = self._watched
        if project_id not in projects or prefix not in prefixes:
            with self._lock:
                projects, prefixes = self._watched
                self._watched = (projects | {project_id}, prefixes | {prefix})
        self.watcher.want()
        if not self.watcher.ready.is_set():
            self.watcher.ready.wait(READY_TIMEOUT_S)

    def hold(self, ctx: TaskContext, *, project_id: uuid.UUID, lease_ttl_ms: int, renew_ttl_ms: int | None) -> Held:
        """Renew ``ctx``'s claim from now on, until ``let_go``; apply what the watch read of it already."""
        held = Held(ctx, project_id=project_id, lease_ttl_ms=lease_ttl_ms, renew_ttl_ms=renew_ttl_ms)
        with self._lock:
            self._held[ctx.claim_id] = held
            early = self._early.pop(ctx.claim_id, None)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="runstate-renewer", daemon=True)
                self._thread.start()
            self._idle_nap_s = min(self._idle_nap_s, held.interval_s)
            wake = held.due < self._sleeping_until
        if wake:
            self._wake.set()
        if early is not None:
            if early.type != "task.cancellation_requested":
                self.let_go(held)
            self._stop(held, early)
        return held

    # The claim watch's side (``workers.watch.Holder``), called from its thread ------------------

    def watched(self) -> tuple[frozenset[uuid.UUID], frozenset[str]]:
        """Return the projects and the worker ids' prefixes the watch follows."""
        return self._watched

    def holding(self) -> bool:
        """Tell whether a claim is held."""
        return bool(self._held)

    def watching(self) -> None:
        """Renew every claim held now at once: it may have been stopped before the watch started reading."""
        with self._lock:
            for held in self._held.values():
                held.explicit = True
        self._wake.set()

    def pushed(self, events: list[Event]) -> None:
        """Stop the claims the events name, as their renewal would; keep those of claims not registered yet.

        The claims are looked up first, under one hold of the lock, and their signals then
        tripped in one go: a run cancel trips hundreds, and each handler woken takes the GIL
        from this thread (so a burst interleaved with them takes hundreds of milliseconds).
        """
        stopping: list[tuple[Held, Event]] = []
        with self._lock:
            for event in events:
                claim_id = event.data.get("claimId")
                held = self._held.get(claim_id)
                if held is None:
                    self._early[claim_id] = event
                    continue
                if event.type != "task.cancellation_requested":
                    del self._held[claim_id]
                stopping.append((held, event))
            while len(self._early) > EARLY_EVENTS_MAX:
                self._early.popitem(last=False)
        for held, event in stopping:
            self._stop(held, event)

    def _stop(self, held: Held, event: Event) -> None:
        """Apply one event that stops ``held``: a cancel request trips its signal, anything else ends the claim.

        As renewal says it (``_renew_chunk``): the run's refusal when its subtree ended, else
        the lease is lost (the task was cancelled, its group decided, its lease ran out). The
        caller no longer renews an ended claim.
        """
        if event.type == "task.cancellation_requested":
            if not held.ctx.is_cancellation_requested():
                held.ctx._request_cancellation()
            return
        code = exceptions.SUBTREE_END_CODES.get(event.data.get("cause"))
        held.ctx._lose(code or exceptions.LeaseLost.code, cancelled=code is not None)

    def let_go(self, held: Held) -> None:
        """Stop renewing ``held``; a renewal of it in flight finishes first."""
        with self._lock:
            if self._held.get(held.ctx.claim_id) is held:
                del self._held[held.ctx.claim_id]
        held.done.wait()

    def renew_now(self, held: Held) -> bool:
        """Renew ``held`` at the next tick, at once, and wait for it; return whether the claim still holds."""
        with self._lock:
            if self._held.get(held.ctx.claim_id) is not held:
                return not held.ctx.lease_lost
            held.explicit = True
            held.done.clear()
        self._wake.set()
        held.done.wait(EXPLICIT_HEARTBEAT_TIMEOUT_S)
        return not held.ctx.lease_lost

    def _loop(self) -> None:
        while True:
            with self._lock:
                now = time.monotonic()
                renewing = [held for held in self._held.values() if not held.ctx.is_cancellation_requested()]
                # Once one claim is due, every claim due within half its interval joins the batch.
                if any(held.due <= now for held in renewing):
                    batch = [held for held in renewing if held.explicit or held.due - held.interval_s / 2 <= now]
                else:
                    batch = []
                batch += [held for held in self._held.values() if held.explicit and held not in batch]
                for held in batch:
                    held.done.clear()
                    held.explicit = False
                waiting = [held.due for held in renewing]
                self._sleeping_until = 0.0 if batch else min(waiting, default=now + self._idle_nap_s)
            if batch:
                self._renew(batch)
                continue
            if not waiting:
                # Nothing to renew: hold no connection meanwhile.
                connection.close()
            self._wake.wait(max(0.0, self._sleeping_until - time.monotonic()))
            self._wake.clear()

    def _renew(self, batch: list[Held]) -> None:
        by_project: dict[uuid.UUID, list[Held]] = {}
        for held in batch:
            by_project.setdefault(held.project_id, []).append(held)
        try:
            for project_id, items in by_project.items():
                for start in range(0, len(items), MAX_BATCH):
                    self._renew_chunk(project_id, items[start : start + MAX_BATCH])
        except Exception:  # noqa: BLE001 - a database hiccup: the next tick tries again, the lease outlives two misses
            logger.warning("renewing %d claims failed; retrying", len(batch), exc_info=True)
            connection.close()
            failed_at = time.monotonic()
            for held in batch:
                held.due = failed_at + held.interval_s
        finally:
            for held in batch:
                held.done.set()

    def _renew_chunk(self, project_id: uuid.UUID, items: list[Held]) -> None:
        started = time.monotonic()
        answers = claims_renew_many(
            project_id=project_id, items=[(held.ctx.claim_id, held.renew_ttl_ms) for held in items]
        )
        for held, answer in zip(items, answers, strict=True):
            if isinstance(answer, Claim):
                held.due = started + held.interval_s
                if answer.task.state == TaskState.CANCELLATION_REQUESTED and not held.ctx.is_cancellation_requested():
                    held.ctx._request_cancellation()
                continue
            with self._lock:
                if self._held.get(held.ctx.claim_id) is held:
                    del self._held[held.ctx.claim_id]
            if isinstance(answer, exceptions.LeaseLost | exceptions.NotFound):
                held.ctx._lose(answer.code, cancelled=False)
            else:
                # The run went inactive (cancelled, completed, past its deadline): a cancellation.
                held.ctx._lose(answer.code, cancelled=True)


_renewer: Renewer | None = None
_renewer_pid: int | None = None
_renewer_lock = threading.Lock()


def renewer() -> Renewer:
    """Return this process's renewer (a forked child gets a fresh one: threads do not cross a fork)."""
    global _renewer, _renewer_pid
    pid = os.getpid()
    if _renewer is None or _renewer_pid != pid:
        with _renewer_lock:
            if _renewer is None or _renewer_pid != pid:
                _renewer, _renewer_pid = Renewer(), pid
    return _renewer


def _worker_id(request) -> str:
    hostname = getattr(request, "hostname", None) or socket.gethostname()
    return f"{hostname}/{os.getpid()}/{threading.current_thread().name}"[:200]


def worker_prefix(worker_id: str) -> str:
    """Return the part of a worker id (``_worker_id``: host, process, thread) that names its process.

    The claim watch reads the events of every worker id starting so: one filter for all the
    threads of a process, not one per thread.
    """
    process, slash, _ = worker_id.rpartition("/")
    return process + slash if process else worker_id


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


def _run_handler(bound: BoundTask, ctx: TaskContext) -> Any:
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


def _soft_time_limit_error(bound: BoundTask, request) -> dict[str, Any]:
    # Celery's request carries (hard, soft) when the limits were given per message.
    limits = getattr(request, "timelimit", None) or (None, None)
    seconds = limits[1] or getattr(bound.celery_task, "soft_time_limit", None)
    return {
        "code": "soft_time_limit_exceeded",
        "type": "SoftTimeLimitExceeded",
        "message": f"The handler ran past its Celery soft time limit ({seconds} s) and was interrupted.",
    }


def execute(bound: BoundTask, task_id: str, request=None) -> str:
    """Handle one delivery of ``task_id``; return what happened (for logs): a task state or why nothing was done.

    The worker keeps its database connection from task to task (``runstate_project.celery``);
    a claim or record that meets a connection the server dropped (a PostgreSQL restart, a
    failover) is tried again on a new one, until the database answers (``_through_outages``).
    """
    project_id, mailbox_id = _through_outages(bound.ids)
    worker_id = _worker_id(request)
    renewer().expect(project_id, worker_id)  # the claim watch follows this worker's claims from now on
    try:
        claim = _through_outages(
            lambda: task_claim_by_id_narrow(
                project_id=project_id,
                task_id=uuid.UUID(str(task_id)),
                worker_id=worker_id,
                lease_ttl_ms=bound.lease_ttl_ms,
                mailbox_id=mailbox_id,
            )
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
    # The handler runs in a ``process`` span, a child of the submitter's (the context the claim carries).
    trace = process_span(
        bound.mailbox_name,
        traceparent=claim.traceparent,
        tracestate=claim.tracestate,
        run_id=str(claim.run_id),
        task_id=str(claim.task_id),
        attempt=claim.attempt,
        group_id=str(claim.group_id) if claim.group_id else None,
    )
    token = in_span(trace.context)
    try:
        return _work(bound, ctx, claim, project_id, request, trace)
    finally:
        leave(token)
        trace.end()


def _work(
    bound: BoundTask, ctx: TaskContext, claim: NarrowClaim, project_id: uuid.UUID, request, trace: ProcessSpan
) -> str:
    lease_ttl_ms = bound.lease_ttl_ms or claim.lease_ttl_ms
    heartbeat = renewer()
    ctx._held = heartbeat.hold(ctx, project_id=project_id, lease_ttl_ms=lease_ttl_ms, renew_ttl_ms=bound.lease_ttl_ms)
    outcome: Any = None
    error: dict[str, Any] | None = None
    try:
        outcome = _run_handler(bound, ctx)
    except (TaskCancelled, asyncio.CancelledError) as stopped:
        if not ctx.signal.is_set():
            error = _handler_error(stopped)
    except SoftTimeLimitExceeded as limit:
        trace.fail(limit)
        error = _soft_time_limit_error(bound, request)
    except Exception as failure:  # noqa: BLE001 - the handler's failure is recorded, not raised
        trace.fail(failure)
        error = _handler_error(failure)
    except BaseException:
        # The worker is going away (shutdown, interrupt): hand the task back for another worker.
        heartbeat.let_go(ctx._held)
        _release(project_id, ctx)
        raise
    finally:
        heartbeat.let_go(ctx._held)
    with trace.settle(bound.mailbox_name, outcome="complete" if error is None else "fail"):
        return _through_outages(lambda: _record(bound, ctx, project_id, outcome, error))


def database_wait_s() -> float:
    """Return how long one delivery waits for an unreachable database before it gives its claim or record up."""
    configured = getattr(settings, "RUNSTATE_WORKER_DB_WAIT_S", None)
    return float(configured if configured is not None else os.environ.get("RUNSTATE_WORKER_DB_WAIT_S", "60"))


def _through_outages(call):
    """Return ``call()``; while the database cannot be reached, reconnect and call again until it answers.

    A connection the server dropped (a restart, a crash of the primary) fails the first
    statement sent on it: it is replaced and the call tried again at once. While no server
    accepts a connection (PostgreSQL down, or no primary: libpq's
    ``target_session_attrs=read-write`` turns a standby not yet promoted away), the call is
    tried again after a pause growing to ``RECONNECT_PAUSE_MAX_S``, for up to
    ``RUNSTATE_WORKER_DB_WAIT_S`` seconds (default 60); then the error propagates, the message
    is acknowledged, and the sweeps send the work again (a lease that ran out, a claimable task
    left unclaimed). The delivery holds its message meanwhile (late acknowledgement), so a
    worker without a database takes no further message rather than failing each one at once.

    Every call here is fenced, so a try after one that did commit changes nothing (a claim
    then finds the task held, a completion finds it finished). Outside a transaction only,
    and only when the connection itself is gone or the server takes no writes (a pooler sent
    to a standby before its promotion: ``read_only_server``): other errors propagate at once.
    """
    deadline = None
    pause = 0.0
    while True:
        try:
            return call()
        except DatabaseError as error:
            if connection.in_atomic_block:
                raise
            if not read_only_server(error) and (
                not isinstance(error, OperationalError | InterfaceError)
                or (connection.connection is not None and connection.is_usable())
            ):
                raise
            now = time.monotonic()
            if deadline is None:
                deadline = now + database_wait_s()
                logger.warning("the database is unreachable (%s); trying again for up to %.0f s", error, deadline - now)
            if now + pause > deadline:
                raise
            connection.close()
            time.sleep(pause)
            pause = min(max(pause * 2, RECONNECT_PAUSE_S), RECONNECT_PAUSE_MAX_S)


def _record(bound: BoundTask, ctx: TaskContext, project_id: uuid.UUID, outcome: Any, error: dict | None) -> str:
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
            return claim_complete_narrow(project_id=project_id, claim_id=ctx.claim_id, outcome=outcome)
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
    log = logger.info if task.state == TaskState.QUEUED else logger.warning
    log("%s: task %s attempt %s failed, now %s: %s", bound.name, ctx.task_id, ctx.attempt, task.state, error["message"])
    return task.state


def _release(project_id: uuid.UUID, ctx: TaskContext) -> None:
    if ctx.lost is not None:
        return
    try:
        claim_release(project_id=project_id, claim_id=ctx.claim_id)
    except Exception:  # noqa: BLE001 - best effort on the way out; the lease sweep is the safety net
        logger.warning("could not release %s; its lease will expire", ctx.claim_id, exc_info=True)


def _wake_later_if_early(bound: BoundTask, task_id: str) -> None:
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
