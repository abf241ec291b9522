"""Claims: hand queued tasks out under a lease, and the operations fenced by the claim.

A claim is ``(task id, attempt)``. Every operation on it is fenced: a stale worker (its
lease taken over, its task cancelled) changes nothing and hears ``LEASE_LOST`` or the
run's own refusal code.
"""

import json
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import F, Q
from django.db.models.functions import Coalesce
from django.utils import timezone

from coordination import exceptions
from coordination.exceptions import CoordinationError
from coordination.ids import fence_id, parse_fence_id
from coordination.models import Event, Mailbox, Task
from coordination.services import dispatch, sql
from coordination.services.events import event_for, event_insert_sql, events_record_many
from coordination.services.groups import LockedGroup
from coordination.services.locking import (
    CHAIN_ACTIVE_SQL,
    CHAIN_KEY_SHARE_CTE,
    chain_key_share_cte,
    run_chain_lock_active,
)
from coordination.services.mailboxes import validate_lease_ttl_ms
from coordination.services.retry import retrying
from coordination.services.sql import fast_paths_enabled
from coordination.services.tasks import after_change, lock_task, record, run_refusal
from coordination.states import TASK_HELD, TASK_TERMINAL, MailboxMode, TaskState

MAX_CLAIMS_PER_CALL = 100


@dataclass(frozen=True)
class Claim:
    """A task handed to a worker under a lease: ``claim_id`` fences every later operation."""

    task: Task
    attempt: int
    lease_expires_at: datetime
    # The lease granted, when the claimer knows it without another query (claims by id).
    lease_ttl_ms: int | None = None

    @property
    def claim_id(self) -> str:
        """Return the opaque claim id."""
        return claim_id_for(self.task.id, self.attempt)


def claim_id_for(task_id: uuid.UUID, attempt: int) -> str:
    """Return the claim id of ``attempt`` on ``task_id``."""
    return fence_id("c", task_id, attempt)


def parse_claim_id(claim_id: str) -> tuple[uuid.UUID, int]:
    """Split a claim id into task id and attempt; a malformed one is ``NOT_FOUND``."""
    try:
        return parse_fence_id("c", claim_id)
    except ValueError:
        raise exceptions.NotFound("Claim not found.", claimId=str(claim_id)) from None


# The single statements of the PostgreSQL fast paths --------------------------------------
#
# Each transition is one guarded statement: the claim's fence in the WHERE, the event
# inserted by the same statement (a data-modifying CTE), the task's row returned. A statement
# that touches no row changes nothing, and the careful path below then decides the exact
# answer (LEASE_LOST, SCOPE_CANCELLED, ...). Group members, whose group must be locked
# before the task (house order), never match: they always take the careful path.

_TASK = sql.columns(Task, "done")
_HELD = "('RUNNING', 'CANCELLATION_REQUESTED')"

# The claim (task id, attempt) still holds the task: the careful path's ``_locked_claim``
# test, in SQL. A held task's run can only be inactive through a deadline (a cancel or
# complete ends held tasks in its own transaction), so the run deadline stands for the chain.
_FENCE = f"""
    t.id = %(task_id)s AND t.project_id = %(project_id)s AND t.attempts = %(attempt)s
    AND t.state IN {_HELD} AND t.group_id IS NULL
    AND t.lease_expires_at > %(now)s
    AND (t.cancel_grace_until IS NULL OR t.cancel_grace_until > %(now)s)
    AND (t.run_deadline IS NULL OR t.run_deadline > %(now)s)
"""

# Claim. The run chain is locked FOR KEY SHARE first, root first, behind its fair-gate locks
# (its ids come from the run's path, in this statement), so a cancel of any run in the chain
# waits for us or makes us find an inactive chain; then queued tasks are picked FOR UPDATE
# SKIP LOCKED and updated. The pick runs only when the whole chain is active and the run has
# no expired lease to take over (the careful path does takeovers); the planner evaluates
# that gate as a one-time filter before the scan, so the chain is locked before any task:
#
#   Update on coordination_task t
#     CTE chain -> LockRows -> Sort (r.depth)
#                  -> Result  One-Time Filter: (advisory locks of chain_ids)
#                       -> Index Scan on coordination_run r
#     -> Nested Loop
#          -> Subquery Scan on picked -> Limit -> LockRows
#               -> Result  One-Time Filter: $gate
#                    -> Index Scan using task_claimable on coordination_task
#          -> Index Scan using coordination_task_pkey on coordination_task t
CLAIM_SQL = f"""
WITH {CHAIN_KEY_SHARE_CTE}, gate AS (
    SELECT {CHAIN_ACTIVE_SQL}
        AND NOT EXISTS (
            SELECT 1 FROM coordination_task x
            WHERE x.state = 'RUNNING' AND x.lease_expires_at <= %(now)s
              AND x.mailbox_id = %(mailbox_id)s AND x.run_id = %(run_id)s
              AND x.cancel_grace_until IS NULL AND (x.group_id IS NULL OR x.attempts < x.max_attempts)
        ) AS open
    FROM chain
), picked AS (
    SELECT q.id FROM coordination_task q
    WHERE q.mailbox_id = %(mailbox_id)s AND q.run_id = %(run_id)s AND q.state = 'QUEUED'
      AND q.available_at <= %(now)s AND (q.expires_at IS NULL OR q.expires_at > %(now)s)
      AND (SELECT open FROM gate)
    ORDER BY q.priority DESC, q.created_at
    LIMIT %(max)s
    FOR UPDATE SKIP LOCKED
), done AS (
    UPDATE coordination_task t
    SET state = 'RUNNING', attempts = t.attempts + 1, lease_expires_at = %(lease_until)s, last_renewed_at = %(now)s,
        worker_id = %(worker_id)s, started_at = coalesce(t.started_at, %(now)s)
    FROM picked WHERE t.id = picked.id
    RETURNING t.*
), events AS (
    {
    event_insert_sql(
        "done", type_sql="'task.claimed'", data_sql="jsonb_build_object('attempt', attempts, 'workerId', worker_id)"
    )
}
)
SELECT {_TASK} FROM done ORDER BY done.priority DESC, done.created_at
"""

# Claim one task by id (a Celery worker woken for it). The task's run chain is locked FOR KEY
# SHARE root first, its ids read from the task's run's path in this statement, and the task
# is updated only when the whole chain is active (a one-time filter evaluated before the
# task's row is locked, as in CLAIM_SQL). Only a QUEUED task that is available and not past
# its expiry matches: a duplicate delivery, a task held by another worker (whose lease may
# have expired: the careful path takes it over), a finished one or an inactive run touch no
# row and the careful path answers. A concurrent claimer of the same row makes this UPDATE
# wait and re-check the row, which is then RUNNING: no match.
CLAIM_BY_ID_SQL = f"""
WITH target AS MATERIALIZED (
    -- Found by primary key alone, then updated by its row address (a TID scan): the planner
    -- never scans a project's queued tasks for it. A row changed meanwhile is re-checked
    -- in its newest version by the UPDATE's own conditions (state, times).
    SELECT ctid, id, run_id, project_id, mailbox_id FROM coordination_task WHERE id = %(task_id)s
), {
    chain_key_share_cte(
        "SELECT path FROM coordination_run WHERE id = (SELECT run_id FROM target) AND project_id = %(project_id)s"
    )
}, gate AS (
    SELECT {CHAIN_ACTIVE_SQL} AS open FROM chain
), done AS (
    UPDATE coordination_task t
    SET state = 'RUNNING', attempts = t.attempts + 1,
        lease_expires_at = %(now)s + coalesce(%(lease_ttl_ms)s, m.lease_ttl_ms) * interval '1 millisecond',
        last_renewed_at = %(now)s, worker_id = %(worker_id)s, started_at = coalesce(t.started_at, %(now)s)
    FROM target, coordination_mailbox m
    WHERE t.ctid = target.ctid AND t.id = target.id AND m.id = target.mailbox_id
      AND target.project_id = %(project_id)s  -- a task's project and mailbox never change
      AND (%(mailbox_id)s::uuid IS NULL OR target.mailbox_id = %(mailbox_id)s::uuid)
      AND t.state = 'QUEUED' AND t.available_at <= %(now)s AND (t.expires_at IS NULL OR t.expires_at > %(now)s)
      AND (SELECT open FROM gate)
    RETURNING t.*
), events AS (
    {
    event_insert_sql(
        "done", type_sql="'task.claimed'", data_sql="jsonb_build_object('attempt', attempts, 'workerId', worker_id)"
    )
}
)
SELECT {_TASK} FROM done
"""

RENEW_SQL = f"""
WITH done AS (
    UPDATE coordination_task t
    SET lease_expires_at = %(now)s + coalesce(%(lease_ttl_ms)s, m.lease_ttl_ms) * interval '1 millisecond',
        last_renewed_at = %(now)s
    FROM coordination_mailbox m
    WHERE m.id = t.mailbox_id AND {_FENCE}
    RETURNING t.*
)
SELECT {_TASK} FROM done
"""

# What a complete sets, and the event it writes, for one claim or a batch.
_COMPLETE_SET = """
    state = CASE WHEN t.state = 'CANCELLATION_REQUESTED' THEN 'CANCELLED' ELSE 'SUCCEEDED' END,
    finished_at = %(now)s, lease_expires_at = NULL"""
_COMPLETE_EVENTS = event_insert_sql(
    "done",
    type_sql="CASE WHEN state = 'CANCELLED' THEN 'task.cancelled' ELSE 'task.succeeded' END",
    data_sql="CASE WHEN state = 'CANCELLED' "
    "THEN jsonb_build_object('reason', cancel_reason, 'cause', 'handler_returned') "
    "ELSE jsonb_build_object('attempt', attempts) END",
)

COMPLETE_SQL = f"""
WITH done AS (
    UPDATE coordination_task t
    SET {_COMPLETE_SET}, outcome = %(outcome)s
    WHERE {_FENCE}
    RETURNING t.*
), events AS ({_COMPLETE_EVENTS})
SELECT {_TASK} FROM done
"""

# Back to the queue while ``retry`` is set, the task is RUNNING and attempts remain; else FAILED.
_REQUEUE = "(%(retry)s AND t.state = 'RUNNING' AND t.attempts < t.max_attempts)"
FAIL_SQL = f"""
WITH done AS (
    UPDATE coordination_task t
    SET state = CASE WHEN {_REQUEUE} THEN 'QUEUED' ELSE 'FAILED' END,
        available_at = CASE WHEN {_REQUEUE} THEN %(available_at)s ELSE t.available_at END,
        finished_at = CASE WHEN {_REQUEUE} THEN t.finished_at ELSE %(now)s END,
        error = %(error)s, lease_expires_at = NULL, worker_id = ''
    WHERE {_FENCE}
    RETURNING t.*
), events AS (
    {
    event_insert_sql(
        "done",
        type_sql="CASE WHEN state = 'QUEUED' THEN 'task.requeued' ELSE 'task.failed' END",
        data_sql="CASE WHEN state = 'QUEUED' "
        "THEN jsonb_build_object('cause', 'retry', 'attempt', attempts, 'error', error) "
        "ELSE jsonb_build_object('error', error, 'attempt', attempts) END",
    )
}
)
SELECT {_TASK} FROM done
"""

# Release needs only the attempt and a held state (it works after a lease ran out, and on an
# inactive run); everything else, a finished task included, is the careful path's answer.
RELEASE_SQL = f"""
WITH done AS (
    UPDATE coordination_task t
    SET state = CASE WHEN t.state = 'CANCELLATION_REQUESTED' THEN 'CANCELLED' ELSE 'QUEUED' END,
        finished_at = CASE WHEN t.state = 'CANCELLATION_REQUESTED' THEN %(now)s ELSE t.finished_at END,
        available_at = CASE WHEN t.state = 'CANCELLATION_REQUESTED' THEN t.available_at ELSE %(now)s END,
        lease_expires_at = NULL, worker_id = ''
    WHERE t.id = %(task_id)s AND t.project_id = %(project_id)s AND t.attempts = %(attempt)s
      AND t.state IN {_HELD} AND t.group_id IS NULL
    RETURNING t.*
), events AS (
    {
    event_insert_sql(
        "done",
        type_sql="CASE WHEN state = 'CANCELLED' THEN 'task.cancelled' ELSE 'task.requeued' END",
        data_sql="CASE WHEN state = 'CANCELLED' "
        "THEN jsonb_build_object('reason', cancel_reason, 'cause', 'released') "
        "ELSE jsonb_build_object('cause', 'released', 'attempt', attempts) END",
    )
}
)
SELECT {_TASK} FROM done
"""


def _fast_one(statement: str, project_id: uuid.UUID, claim_id: str, **params) -> Task | None:
    """Run a fenced single statement on one claim; return the changed task, or None (careful path)."""
    if not fast_paths_enabled():
        return None
    task_id, attempt = parse_claim_id(claim_id)
    rows = sql.fetch_models(
        Task, statement, {"task_id": task_id, "project_id": project_id, "attempt": attempt, **params}
    )
    return rows[0][0] if rows else None


# Claim -----------------------------------------------------------------------------------


def task_claim(
    *,
    project_id: uuid.UUID,
    mailbox: Mailbox,
    run_id: uuid.UUID,
    worker_id: str = "",
    lease_ttl_ms: int | None = None,
    max_claims: int = 1,
) -> list[Claim]:
    """Claim up to ``max_claims`` tasks of exactly ``run_id``, highest priority then oldest.

    Expired leases of the run are taken over first (their tasks go back to the queue, or
    fail when their attempts are spent), so crash takeover never waits for a sweep. A group
    member whose takeover would end it is left to the sweep, which locks its group first.
    On PostgreSQL one statement claims when the run is active and has no lease to take
    over; otherwise (and when it finds nothing) the careful path decides.
    """
    if mailbox.mode != MailboxMode.WORK:
        raise exceptions.MailboxModeConflict(f"Mailbox '{mailbox.name}' holds messages, not tasks.")
    validate_lease_ttl_ms(lease_ttl_ms)
    if not 1 <= max_claims <= MAX_CLAIMS_PER_CALL:
        raise exceptions.ValidationFailed("Invalid max.", max=f"must be between 1 and {MAX_CLAIMS_PER_CALL}")
    if fast_paths_enabled():
        now = timezone.now()
        lease_until = now + timedelta(milliseconds=lease_ttl_ms or mailbox.lease_ttl_ms)
        rows = sql.fetch_models(
            Task,
            CLAIM_SQL,
            {
                "project_id": project_id,
                "mailbox_id": mailbox.id,
                "run_id": run_id,
                "now": now,
                "lease_until": lease_until,
                "worker_id": worker_id,
                "max": max_claims,
            },
        )
        if rows:
            claims = []
            for (task,) in rows:
                Task.mailbox.field.set_cached_value(task, mailbox)
                claims.append(Claim(task, task.attempts, lease_until))
            return claims
    return _task_claim_careful(
        project_id=project_id,
        mailbox=mailbox,
        run_id=run_id,
        worker_id=worker_id,
        lease_ttl_ms=lease_ttl_ms,
        max_claims=max_claims,
    )


@transaction.atomic
def _task_claim_careful(
    *,
    project_id: uuid.UUID,
    mailbox: Mailbox,
    run_id: uuid.UUID,
    worker_id: str,
    lease_ttl_ms: int | None,
    max_claims: int,
) -> list[Claim]:
    # Claiming is new work: hold the chain so a cancel waits for us or refuses us.
    run_chain_lock_active(run_id, project_id=project_id)
    now = timezone.now()
    in_run = Task.objects.filter(mailbox=mailbox, run_id=run_id)
    # SKIP LOCKED: a row another claimer holds is theirs; we never wait for it.
    expired = list(
        in_run.filter(state=TaskState.RUNNING, lease_expires_at__lte=now)
        .filter(Q(group__isnull=True) | Q(attempts__lt=F("max_attempts")))
        .filter(Q(cancel_grace_until__isnull=True))
        .order_by("lease_expires_at")
        .select_for_update(skip_locked=True)[:max_claims]
    )
    events = [event for task in expired for event in lease_expired(task, now)]
    candidates = list(
        in_run.filter(state=TaskState.QUEUED, available_at__lte=now)
        .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now))
        .order_by("-priority", "created_at")
        .select_for_update(skip_locked=True)[:max_claims]
    )
    lease_until = now + timedelta(milliseconds=lease_ttl_ms or mailbox.lease_ttl_ms)
    if candidates:
        Task.objects.filter(id__in=[t.id for t in candidates]).update(
            state=TaskState.RUNNING,
            attempts=F("attempts") + 1,
            lease_expires_at=lease_until,
            last_renewed_at=now,
            worker_id=worker_id,
            started_at=Coalesce(F("started_at"), now),
        )
    claims = []
    for task in candidates:
        task.state = TaskState.RUNNING
        task.attempts += 1
        task.lease_expires_at = lease_until
        task.last_renewed_at = now
        task.worker_id = worker_id
        task.started_at = task.started_at or now
        claims.append(Claim(task, task.attempts, lease_until))
        events.append(event_for(task, "task.claimed", attempt=task.attempts, workerId=worker_id))
    events_record_many(events)
    return claims


def _let_go(task: Task, now: datetime, *, cause: str) -> Event | None:
    """Free a locked held task's lease; record ``CANCELLED`` (and return its event) if cancellation was requested."""
    task.lease_expires_at = None
    task.worker_id = ""
    if task.state != TaskState.CANCELLATION_REQUESTED:
        return None
    task.state = TaskState.CANCELLED
    task.finished_at = now
    task.save(update_fields=["state", "finished_at", "lease_expires_at", "worker_id"])
    return event_for(task, "task.cancelled", reason=task.cancel_reason, cause=cause)


def lease_expired(task: Task, now: datetime) -> list[Event]:
    """Settle a locked held task whose lease ran out (or whose cancel grace passed)."""
    cancelled = _let_go(task, now, cause="cancellation_finalized")
    if cancelled is not None:
        return [cancelled]
    if task.attempts < task.max_attempts:
        task.state = TaskState.QUEUED
        task.available_at = now
        task.save(update_fields=["state", "available_at", "lease_expires_at", "worker_id"])
        # A crashed Celery worker's message is gone: send the task out again.
        dispatch.work_requeued(task)
        return [event_for(task, "task.requeued", cause="lease_expired", attempt=task.attempts)]
    task.state = TaskState.FAILED
    task.error = {"code": "lease_expired", "message": "The lease expired with no attempts left."}
    task.finished_at = now
    task.save(update_fields=["state", "error", "finished_at", "lease_expires_at", "worker_id"])
    return [event_for(task, "task.failed", error=task.error)]


def takeover_due(task: Task, now: datetime) -> bool:
    """Whether a claimer may take over ``task``'s expired lease itself (the same rule as ``task_claim``)."""
    return (
        task.state == TaskState.RUNNING
        and task.lease_expires_at is not None
        and task.lease_expires_at <= now
        and task.cancel_grace_until is None
        and (task.group_id is None or task.attempts < task.max_attempts)
    )


def task_claim_by_id(
    *,
    project_id: uuid.UUID,
    task_id: uuid.UUID,
    worker_id: str = "",
    lease_ttl_ms: int | None = None,
    mailbox_id: uuid.UUID | None = None,
) -> Claim | None:
    """Claim one specific task under a lease; return None when it is not claimable now.

    A Celery worker woken for this task calls it, and the claim decides: a duplicate
    message, a task another worker holds, a finished one, one not yet available (retry
    delay) or past its ``expiresAt`` answers None. An expired lease is taken over first, as
    ``task_claim`` does. An inactive run refuses with its own code. ``mailbox_id`` given,
    a task of another mailbox is ``NOT_FOUND``. On PostgreSQL one statement claims a
    queued, available task of an active run (``CLAIM_BY_ID_SQL``); every other case is the
    careful path's.
    """
    validate_lease_ttl_ms(lease_ttl_ms)
    if fast_paths_enabled():
        now = timezone.now()
        rows = sql.fetch_models(
            Task,
            CLAIM_BY_ID_SQL,
            {
                "project_id": project_id,
                "task_id": task_id,
                "mailbox_id": mailbox_id,
                "now": now,
                "lease_ttl_ms": lease_ttl_ms,
                "worker_id": worker_id,
            },
        )
        if rows:
            task = rows[0][0]
            granted_ms = round((task.lease_expires_at - now) / timedelta(milliseconds=1))
            return Claim(task, task.attempts, task.lease_expires_at, granted_ms)
    return _task_claim_by_id_careful(
        project_id=project_id, task_id=task_id, worker_id=worker_id, lease_ttl_ms=lease_ttl_ms, mailbox_id=mailbox_id
    )


@transaction.atomic
def _task_claim_by_id_careful(
    *,
    project_id: uuid.UUID,
    task_id: uuid.UUID,
    worker_id: str,
    lease_ttl_ms: int | None,
    mailbox_id: uuid.UUID | None,
) -> Claim | None:
    rows = Task.objects.filter(id=task_id, project_id=project_id)
    if mailbox_id is not None:
        rows = rows.filter(mailbox_id=mailbox_id)
    run_id = rows.values_list("run_id", flat=True).first()
    if run_id is None:
        raise exceptions.NotFound("Task not found.", taskId=str(task_id))
    # Claiming is new work: hold the chain so a cancel waits for us or refuses us.
    run_chain_lock_active(run_id, project_id=project_id)
    # Wait for the row rather than skip it: a duplicate delivery then sees the first claim.
    task = Task.objects.select_for_update(of=("self",)).select_related("mailbox").get(id=task_id)
    now = timezone.now()
    events = lease_expired(task, now) if takeover_due(task, now) else []
    claimable = (
        task.state == TaskState.QUEUED
        and task.available_at <= now
        and (task.expires_at is None or task.expires_at > now)
    )
    claim = None
    if claimable:
        task.state = TaskState.RUNNING
        task.attempts += 1
        task.lease_expires_at = now + timedelta(milliseconds=lease_ttl_ms or task.mailbox.lease_ttl_ms)
        task.last_renewed_at = now
        task.worker_id = worker_id
        task.started_at = task.started_at or now
        task.save(update_fields=["state", "attempts", "lease_expires_at", "last_renewed_at", "worker_id", "started_at"])
        events.append(event_for(task, "task.claimed", attempt=task.attempts, workerId=worker_id))
        claim = Claim(task, task.attempts, task.lease_expires_at, lease_ttl_ms or task.mailbox.lease_ttl_ms)
    events_record_many(events)
    return claim


# Batches: many claims in one statement, each item fenced on its own ------------------------

MAX_BATCH = 1000

# The batch form of ``_FENCE``: each item carries its own attempt. Rows are locked in id
# order (the ``locked`` CTE sorts below its row locks), so two batches never deadlock.
_BATCH_ITEMS = """
items AS (
    SELECT * FROM unnest(%(task_ids)s::uuid[], %(attempts)s::int[], %(values)s::text[]) AS i(task_id, attempt, value)
), locked AS (
    SELECT t.id FROM coordination_task t JOIN items i ON i.task_id = t.id
    WHERE t.id = ANY (%(task_ids)s::uuid[])  -- found by primary key, whatever else the project holds
      AND t.project_id = %(project_id)s AND t.attempts = i.attempt
      AND t.state IN ('RUNNING', 'CANCELLATION_REQUESTED') AND t.group_id IS NULL
      AND t.lease_expires_at > %(now)s
      AND (t.cancel_grace_until IS NULL OR t.cancel_grace_until > %(now)s)
      AND (t.run_deadline IS NULL OR t.run_deadline > %(now)s)
    ORDER BY t.id
    FOR UPDATE OF t
)"""

COMPLETE_MANY_SQL = f"""
WITH {_BATCH_ITEMS}, done AS (
    UPDATE coordination_task t
    SET {_COMPLETE_SET}, outcome = i.value::jsonb
    FROM items i
    WHERE t.id = i.task_id AND t.attempts = i.attempt AND t.id IN (SELECT id FROM locked)
    RETURNING t.*
), events AS ({_COMPLETE_EVENTS})
SELECT {_TASK} FROM done
"""

RENEW_MANY_SQL = f"""
WITH {_BATCH_ITEMS}, done AS (
    UPDATE coordination_task t
    SET lease_expires_at = %(now)s + coalesce(i.value::int, m.lease_ttl_ms) * interval '1 millisecond',
        last_renewed_at = %(now)s
    FROM items i, coordination_mailbox m
    WHERE t.id = i.task_id AND t.attempts = i.attempt AND m.id = t.mailbox_id AND t.id IN (SELECT id FROM locked)
    RETURNING t.*
)
SELECT {_TASK} FROM done
"""


def claims_complete_many(*, project_id: uuid.UUID, items: list[tuple[str, object]]) -> list[Task | CoordinationError]:
    """Complete many claims; answer per item, in order: the task, or the error that item alone met.

    Items still held are completed by one statement (rows locked in id order); every other
    item takes the careful path in its own transaction, so a stale claim is ``LEASE_LOST``
    in its own item while the others succeed.
    """
    return _per_item(
        COMPLETE_MANY_SQL,
        project_id,
        [(claim_id, json.dumps(outcome) if outcome is not None else None) for claim_id, outcome in items],
        careful=lambda claim_id, index: _claim_complete_careful(
            project_id=project_id, claim_id=claim_id, outcome=items[index][1]
        ),
    )


def claims_renew_many(*, project_id: uuid.UUID, items: list[tuple[str, int | None]]) -> list[Claim | CoordinationError]:
    """Renew many claims (``(claim_id, lease_ttl_ms or None)``); answer per item, as ``claims_complete_many``."""
    for index, (_, lease_ttl_ms) in enumerate(items):
        try:
            validate_lease_ttl_ms(lease_ttl_ms)
        except exceptions.ValidationFailed as error:
            raise exceptions.ValidationFailed(f"Item {index}: {error.message}", index=index, **error.details) from None
    answers = _per_item(
        RENEW_MANY_SQL,
        project_id,
        [(claim_id, str(ttl) if ttl is not None else None) for claim_id, ttl in items],
        careful=lambda claim_id, index: _claim_renew_careful(
            project_id=project_id, claim_id=claim_id, lease_ttl_ms=items[index][1]
        ),
    )
    return [answer if isinstance(answer, Claim | CoordinationError) else _claim_of(answer) for answer in answers]


def _claim_of(task: Task) -> Claim:
    return Claim(task, task.attempts, task.lease_expires_at)


def _per_item(statement: str, project_id: uuid.UUID, items: list[tuple[str, str | None]], *, careful) -> list:
    if not 1 <= len(items) <= MAX_BATCH:
        raise exceptions.ValidationFailed("Invalid batch.", items=f"must hold between 1 and {MAX_BATCH} claims")
    if len({claim_id for claim_id, _ in items}) != len(items):
        raise exceptions.ValidationFailed("Invalid batch.", items="a claim may appear once per batch")
    answers: list = [None] * len(items)
    parsed = {}
    for index, (claim_id, _) in enumerate(items):
        try:
            parsed[index] = parse_claim_id(claim_id)
        except exceptions.NotFound as error:
            answers[index] = error
    if fast_paths_enabled() and parsed:
        rows = sql.fetch_models(
            Task,
            statement,
            {
                "project_id": project_id,
                "now": timezone.now(),
                "task_ids": [parsed[index][0] for index in parsed],
                "attempts": [parsed[index][1] for index in parsed],
                "values": [items[index][1] for index in parsed],
            },
        )
        done = {(task.id, task.attempts): task for (task,) in rows}
        for index, fence in parsed.items():
            answers[index] = done.get(fence)
    for index in parsed:
        if answers[index] is None:
            try:
                answers[index] = careful(items[index][0], index)
            except CoordinationError as error:
                answers[index] = error
    return answers


# Operations on a claim -------------------------------------------------------------------


def _locked_claim(project_id: uuid.UUID, claim_id: str, *, now: datetime) -> tuple[Task, LockedGroup | None]:
    """Lock the claim's task (group first) and return it if the claim still holds it; else raise.

    A claim is lost when another attempt took the task over, the task left its held
    states, the lease expired, or a cooperative cancel's grace elapsed. When the run is
    inactive, its refusal code wins over ``LEASE_LOST`` (DESIGN.md "Precise points").
    """
    task_id, attempt = parse_claim_id(claim_id)
    try:
        # The row lock serializes us with claimers, sweeps, cascades and group decisions.
        task, locked_group = lock_task(project_id, task_id)
    except exceptions.NotFound:
        raise exceptions.NotFound("Claim not found.", claimId=str(claim_id)) from None
    held = (
        task.attempts == attempt
        and task.state in TASK_HELD
        and task.lease_expires_at is not None
        and task.lease_expires_at > now
        and (task.cancel_grace_until is None or task.cancel_grace_until > now)
    )
    # A cancel or complete of the run ends its held tasks in the same transaction, so a
    # held task's run can only be inactive through a deadline: skip the chain read then.
    if held and (task.run_deadline is None or task.run_deadline > now):
        return task, locked_group
    refusal = run_refusal(task, now)
    if refusal is not None:
        raise refusal
    if not held:
        raise exceptions.LeaseLost(claimId=str(claim_id), taskId=str(task.id), state=task.state)
    return task, locked_group


def claim_renew(*, project_id: uuid.UUID, claim_id: str, lease_ttl_ms: int | None = None) -> Claim:
    """Extend the claim's lease; the answer tells whether cancellation was requested."""
    validate_lease_ttl_ms(lease_ttl_ms)
    task = _fast_one(RENEW_SQL, project_id, claim_id, now=timezone.now(), lease_ttl_ms=lease_ttl_ms)
    if task is not None:
        return Claim(task, task.attempts, task.lease_expires_at)
    return _claim_renew_careful(project_id=project_id, claim_id=claim_id, lease_ttl_ms=lease_ttl_ms)


@retrying
@transaction.atomic
def _claim_renew_careful(*, project_id: uuid.UUID, claim_id: str, lease_ttl_ms: int | None) -> Claim:
    now = timezone.now()
    task, _ = _locked_claim(project_id, claim_id, now=now)
    task.lease_expires_at = now + timedelta(milliseconds=lease_ttl_ms or task.mailbox.lease_ttl_ms)
    task.last_renewed_at = now
    task.save(update_fields=["lease_expires_at", "last_renewed_at"])
    return Claim(task, task.attempts, task.lease_expires_at)


def claim_complete(*, project_id: uuid.UUID, claim_id: str, outcome: object) -> Task:
    """Record the handler's result: ``SUCCEEDED``, or ``CANCELLED`` if cancellation was requested."""
    task = _fast_one(COMPLETE_SQL, project_id, claim_id, now=timezone.now(), outcome=sql.json_param(outcome))
    if task is None:
        return _claim_complete_careful(project_id=project_id, claim_id=claim_id, outcome=outcome)
    return task


@retrying
@transaction.atomic
def _claim_complete_careful(*, project_id: uuid.UUID, claim_id: str, outcome: object) -> Task:
    now = timezone.now()
    task, locked_group = _locked_claim(project_id, claim_id, now=now)
    task.outcome = outcome
    task.finished_at = now
    task.lease_expires_at = None
    if task.state == TaskState.CANCELLATION_REQUESTED:
        task.state = TaskState.CANCELLED
        event = event_for(task, "task.cancelled", reason=task.cancel_reason, cause="handler_returned")
    else:
        task.state = TaskState.SUCCEEDED
        event = event_for(task, "task.succeeded", attempt=task.attempts)
    task.save(update_fields=["state", "outcome", "finished_at", "lease_expires_at"])
    events_record_many([event])
    after_change(task, locked_group, now)
    return task


def claim_fail(
    *, project_id: uuid.UUID, claim_id: str, error: object, retry: bool = False, retry_delay_ms: int = 0
) -> Task:
    """Record a failure: back to the queue while attempts remain and ``retry`` is set, else ``FAILED``.

    After a cancellation request a failure is final and never rewritten as a cancellation.
    """
    if retry_delay_ms < 0:
        raise exceptions.ValidationFailed("Invalid retry delay.", retryDelayMs="must be >= 0")
    now = timezone.now()
    task = _fast_one(
        FAIL_SQL,
        project_id,
        claim_id,
        now=now,
        error=sql.json_param(error),
        retry=retry,
        available_at=now + timedelta(milliseconds=retry_delay_ms),
    )
    if task is None:
        return _claim_fail_careful(
            project_id=project_id, claim_id=claim_id, error=error, retry=retry, retry_delay_ms=retry_delay_ms
        )
    if task.state == TaskState.QUEUED:
        dispatch.work_requeued(task)
    return task


@retrying
@transaction.atomic
def _claim_fail_careful(
    *, project_id: uuid.UUID, claim_id: str, error: object, retry: bool, retry_delay_ms: int
) -> Task:
    now = timezone.now()
    task, locked_group = _locked_claim(project_id, claim_id, now=now)
    task.error = error
    task.lease_expires_at = None
    task.worker_id = ""
    if retry and task.state == TaskState.RUNNING and task.attempts < task.max_attempts:
        task.state = TaskState.QUEUED
        task.available_at = now + timedelta(milliseconds=retry_delay_ms)
        task.save(update_fields=["state", "error", "available_at", "lease_expires_at", "worker_id"])
        record(task, "task.requeued", cause="retry", attempt=task.attempts, error=error)
        dispatch.work_requeued(task)
        return task
    task.state = TaskState.FAILED
    task.finished_at = now
    task.save(update_fields=["state", "error", "finished_at", "lease_expires_at", "worker_id"])
    record(task, "task.failed", error=error, attempt=task.attempts)
    after_change(task, locked_group, now)
    return task


def claim_release(*, project_id: uuid.UUID, claim_id: str) -> Task:
    """Hand the task back: to the queue, or ``CANCELLED`` if cancellation was requested.

    Works on an inactive run too: after its run was cancelled the task is already
    ``CANCELLED`` and the release answers it unchanged.
    """
    task = _fast_one(RELEASE_SQL, project_id, claim_id, now=timezone.now())
    if task is None:
        return _claim_release_careful(project_id=project_id, claim_id=claim_id)
    if task.state == TaskState.QUEUED:
        dispatch.work_requeued(task)
    return task


@retrying
@transaction.atomic
def _claim_release_careful(*, project_id: uuid.UUID, claim_id: str) -> Task:
    task_id, attempt = parse_claim_id(claim_id)
    try:
        task, locked_group = lock_task(project_id, task_id)
    except exceptions.NotFound:
        raise exceptions.NotFound("Claim not found.", claimId=str(claim_id)) from None
    if task.attempts != attempt or task.state == TaskState.QUEUED:
        raise exceptions.LeaseLost(claimId=str(claim_id), taskId=str(task.id), state=task.state)
    if task.state in TASK_TERMINAL:
        return task
    now = timezone.now()
    cancelled = _let_go(task, now, cause="released")
    if cancelled is not None:
        events_record_many([cancelled])
    else:
        task.state = TaskState.QUEUED
        task.available_at = now
        task.save(update_fields=["state", "available_at", "lease_expires_at", "worker_id"])
        record(task, "task.requeued", cause="released", attempt=task.attempts)
        dispatch.work_requeued(task)
    after_change(task, locked_group, now)
    return task
