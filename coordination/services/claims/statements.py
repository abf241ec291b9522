"""The single statements of the PostgreSQL fast paths, one per claim transition.

Each is kept as a named constant (the plan-shape tests intercept them by name) and renders
its fence from ``leases`` and its state changes from ``task_transitions``: no rule is
restated here.
"""

import uuid

from coordination.domain.states import TASK_HELD, TaskState
from coordination.models import Task
from coordination.services import sql, task_transitions
from coordination.services.claims.claim import CLAIMED_EVENT_DATA_SQL, parse_claim_id
from coordination.services.claims.leases import CLAIM_HOLDS, CLAIMABLE, RUN_DEADLINE_AHEAD, TAKEOVER_DUE
from coordination.services.events import event_insert_sql
from coordination.services.locking import CHAIN_ACTIVE_SQL, CHAIN_KEY_SHARE_CTE, chain_key_share_cte
from coordination.services.sql import fast_paths_enabled, in_list, literal

_QUEUED, _CANCELLED = literal(TaskState.QUEUED), literal(TaskState.CANCELLED)

# The single statements of the PostgreSQL fast paths --------------------------------------
#
# Each transition is one guarded statement: the claim's fence in the WHERE, the event
# inserted by the same statement (a data-modifying CTE), the task's row returned. A statement
# that touches no row changes nothing, and the careful path (``careful``) then decides the exact
# answer (LEASE_LOST, SCOPE_CANCELLED, ...). Group members, whose group must be locked
# before the task (house order), never match: they always take the careful path.

_TASK = sql.columns(Task, "done")

# The claim (task id, attempt) still holds the task (``leases.CLAIM_HOLDS``, which the careful
# path tests on the row it locked), and the run deadline stands for the chain.
_FENCE = f"""
    t.id = %(task_id)s AND t.project_id = %(project_id)s AND t.group_id IS NULL
    AND {CLAIM_HOLDS.sql(attempt="%(attempt)s")}
    AND {RUN_DEADLINE_AHEAD.sql()}
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
            WHERE x.mailbox_id = %(mailbox_id)s AND x.run_id = %(run_id)s AND {TAKEOVER_DUE.sql("x")}
        ) AS open
    FROM chain
), picked AS (
    SELECT q.id FROM coordination_task q
    WHERE q.mailbox_id = %(mailbox_id)s AND q.run_id = %(run_id)s AND {CLAIMABLE.sql("q")}
      AND (SELECT open FROM gate)
    ORDER BY q.priority DESC, q.created_at
    LIMIT %(max)s
    FOR UPDATE SKIP LOCKED
), done AS (
    UPDATE coordination_task t
    SET {task_transitions.CLAIM_SET_SQL}, lease_expires_at = %(lease_until)s
    FROM picked WHERE t.id = picked.id
    RETURNING t.*
), events AS (
    {event_insert_sql("done", type_sql="'task.claimed'", data_sql=CLAIMED_EVENT_DATA_SQL)}
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
    SET {task_transitions.CLAIM_SET_SQL},
        lease_expires_at = %(now)s + coalesce(%(lease_ttl_ms)s, m.lease_ttl_ms) * interval '1 millisecond'
    FROM target, coordination_mailbox m
    WHERE t.ctid = target.ctid AND t.id = target.id AND m.id = target.mailbox_id
      AND target.project_id = %(project_id)s  -- a task's project and mailbox never change
      AND (%(mailbox_id)s::uuid IS NULL OR target.mailbox_id = %(mailbox_id)s::uuid)
      AND {CLAIMABLE.sql()}
      AND (SELECT open FROM gate)
    RETURNING t.*
), events AS (
    {event_insert_sql("done", type_sql="'task.claimed'", data_sql=CLAIMED_EVENT_DATA_SQL)}
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
_COMPLETE_EVENTS = event_insert_sql(
    "done",
    type_sql=f"CASE WHEN state = {_CANCELLED} THEN 'task.cancelled' ELSE 'task.succeeded' END",
    data_sql=f"CASE WHEN state = {_CANCELLED} "
    "THEN jsonb_build_object('reason', cancel_reason, 'cause', 'handler_returned') "
    "ELSE jsonb_build_object('attempt', attempts) END",
)

COMPLETE_SQL = f"""
WITH done AS (
    UPDATE coordination_task t
    SET {task_transitions.COMPLETE_SET_SQL}, outcome = %(outcome)s
    WHERE {_FENCE}
    RETURNING t.*
), events AS ({_COMPLETE_EVENTS})
SELECT {_TASK} FROM done
"""

# Back to the queue while ``retry`` is set, the task is RUNNING and attempts remain; else FAILED
# (``task_transitions.requeue_allowed``).
FAIL_SQL = f"""
WITH done AS (
    UPDATE coordination_task t
    SET {task_transitions.FAIL_SET_SQL}
    WHERE {_FENCE}
    RETURNING t.*
), events AS (
    {
    event_insert_sql(
        "done",
        type_sql=f"CASE WHEN state = {_QUEUED} THEN 'task.requeued' ELSE 'task.failed' END",
        data_sql=f"CASE WHEN state = {_QUEUED} "
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
    SET {task_transitions.RELEASE_SET_SQL}
    WHERE t.id = %(task_id)s AND t.project_id = %(project_id)s AND t.attempts = %(attempt)s
      AND t.state IN {in_list(TASK_HELD)} AND t.group_id IS NULL
    RETURNING t.*
), events AS (
    {
    event_insert_sql(
        "done",
        type_sql=f"CASE WHEN state = {_CANCELLED} THEN 'task.cancelled' ELSE 'task.requeued' END",
        data_sql=f"CASE WHEN state = {_CANCELLED} "
        "THEN jsonb_build_object('reason', cancel_reason, 'cause', 'released') "
        "ELSE jsonb_build_object('cause', 'released', 'attempt', attempts) END",
    )
}
)
SELECT {_TASK} FROM done
"""


# Batches: many claims in one statement, each item fenced on its own ------------------------

# The batch form of ``_FENCE``: each item carries its own attempt. Rows are locked in id
# order (the ``locked`` CTE sorts below its row locks), so two batches never deadlock.
_BATCH_ITEMS = f"""
items AS (
    SELECT * FROM unnest(%(task_ids)s::uuid[], %(attempts)s::int[], %(values)s::text[]) AS i(task_id, attempt, value)
), locked AS (
    SELECT t.id FROM coordination_task t JOIN items i ON i.task_id = t.id
    WHERE t.id = ANY (%(task_ids)s::uuid[])  -- found by primary key, whatever else the project holds
      AND t.project_id = %(project_id)s AND t.group_id IS NULL
      AND {CLAIM_HOLDS.sql(attempt="i.attempt")}
      AND {RUN_DEADLINE_AHEAD.sql()}
    ORDER BY t.id
    FOR UPDATE OF t
)"""

COMPLETE_MANY_SQL = f"""
WITH {_BATCH_ITEMS}, done AS (
    UPDATE coordination_task t
    SET {task_transitions.COMPLETE_SET_SQL}, outcome = i.value::jsonb
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


def one_params(project_id: uuid.UUID, claim_id: str, **params) -> dict:
    """Return the parameters of a fenced single statement on one claim; a malformed claim id is ``NOT_FOUND``."""
    task_id, attempt = parse_claim_id(claim_id)
    return {"task_id": task_id, "project_id": project_id, "attempt": attempt, **params}


def fast_one(statement: str, params: dict) -> Task | None:
    """Run a fenced single statement on one claim; return the changed task, or None (careful path)."""
    if not fast_paths_enabled():
        return None
    rows = sql.fetch_models(Task, statement, params)
    return rows[0][0] if rows else None
