"""Row locks on the run chain, in the one house order (root first), behind a fair gate.

Django's ORM can say ``FOR UPDATE`` and ``FOR NO KEY UPDATE`` but not ``FOR KEY SHARE``,
the weakest lock that still conflicts with a cancel's ``FOR UPDATE``; this module adds it
by appending the clause to the ORM's own SQL (so ids keep the backend's representation).

The fair gate. PostgreSQL does not queue row locks fairly: a ``FOR KEY SHARE`` (or
``FOR NO KEY UPDATE``) locker joins the compatible lockers already on a row even while a
``FOR UPDATE`` waits there, so a steady stream of creators of work (claims, submits, quota
takes, reservations) can hold a cancel off for as long as it lasts: seven back-to-back
reservers kept one waiting over 30 s. Advisory locks live in the heavyweight lock manager,
whose queue is fair: a shared request that arrives behind a waiting exclusive one waits its
turn. So every lock on a run row is preceded by the run's advisory lock in the same
transaction, root first like the rows: shared before ``FOR KEY SHARE`` and
``FOR NO KEY UPDATE``, exclusive before ``FOR UPDATE``. A cancel then waits only for the
creators already in; those arriving after it wait for it, and find the run inactive. The
advisory locks add no exclusion the row locks do not already make (shared conflicts only
with exclusive, taken only where the row's ``FOR UPDATE`` follows), so they change who goes
first, never what may run together.
"""

import enum
import uuid
from collections.abc import Sequence
from datetime import datetime

from django.db import connection
from django.db.models import BooleanField
from django.db.models.expressions import RawSQL
from django.utils import timezone

from coordination.domain import exceptions
from coordination.domain.ids import path_ids
from coordination.domain.states import RunState
from coordination.models import Run
from coordination.services.sql import literal


class LockMode(enum.Enum):
    """Row lock strengths used on runs, weakest first."""

    KEY_SHARE = "FOR KEY SHARE"  # creating work under the run
    NO_KEY_UPDATE = "FOR NO KEY UPDATE"  # changing the run's counters (child_count)
    UPDATE = "FOR UPDATE"  # cancelling or completing the run


# A run id's advisory lock key: the first 64 bits of the UUID, in PostgreSQL's bigint key space.
RUN_LOCK_KEY_SQL = "('x' || translate(left(({id})::text, 18), '-', ''))::bit(64)::bigint"


def fair_gate_sql(ids_sql: str, *, exclusive: bool = False) -> str:
    """Return a boolean expression that takes the advisory locks of the runs ``ids_sql`` (a uuid[], root first).

    Always true; shared locks unless ``exclusive``. See the module docstring.
    """
    function = "pg_advisory_xact_lock" if exclusive else "pg_advisory_xact_lock_shared"
    key = RUN_LOCK_KEY_SQL.format(id="u.id")
    return (
        f"(SELECT count({function}(k)) FROM (SELECT {key} AS k "
        f"FROM unnest({ids_sql}) WITH ORDINALITY AS u(id, n) ORDER BY u.n) AS gate_keys) >= 0"
    )


def chain_key_share_cte(path_sql: str) -> str:
    """Return the CTEs ``chain_ids`` and ``chain`` that lock the chain of the run at path ``path_sql`` FOR KEY SHARE.

    ``path_sql`` is a scalar subquery giving the run's path (NULL for an unknown run: the
    chain is then empty). The fair gate's shared advisory locks come first: the condition
    on them does not depend on the scanned row, so the planner evaluates it as a one-time
    filter before the scan, and so before any row lock. ORDER BY runs below the row locks,
    so rows are locked root first.
    """
    return f"""
chain_ids AS MATERIALIZED (
    SELECT string_to_array(rtrim(({path_sql}), '/'), '/')::uuid[] AS ids
), chain AS (
    SELECT r.stored_state, r.deadline, r.path
    FROM coordination_run r
    WHERE r.id = ANY ((SELECT ids FROM chain_ids)::uuid[])
      AND (SELECT {fair_gate_sql("chain_ids.ids")} FROM chain_ids)
    ORDER BY r.depth
    FOR KEY SHARE OF r
)"""


# The same lock inside one SQL statement, for the single-statement fast paths: CTEs named
# ``chain_ids`` and ``chain``, ``chain`` locking the chain of ``%(run_id)s`` (in
# ``%(project_id)s``) FOR KEY SHARE behind the fair gate, root first; and the condition, over
# ``chain``, that every run of it accepts new work at ``%(now)s`` (an unknown run gives an
# empty chain, so it fails too). ``chain_refusal`` says why, on the careful path.
CHAIN_KEY_SHARE_CTE = chain_key_share_cte(
    "SELECT path FROM coordination_run WHERE id = %(run_id)s AND project_id = %(project_id)s"
)
CHAIN_ACTIVE_SQL = (
    f"count(*) > 0 AND bool_and(stored_state = {literal(RunState.ACTIVE)} AND (deadline IS NULL OR deadline > %(now)s))"
)


def _lock_runs(ids: Sequence[uuid.UUID], mode: LockMode) -> list[Run]:
    """Lock the runs with ``ids`` in ``mode``, root first, and return them root first."""
    if not ids:
        return []
    queryset = Run.objects.filter(id__in=list(ids)).order_by("depth")
    if connection.vendor != "postgresql":
        # SQLite: the transaction already holds the write lock (BEGIN IMMEDIATE).
        return list(queryset)
    # The fair gate (module docstring), in the same statement: a condition on no column of
    # the row, so a one-time filter evaluated before the scan and its row locks. ids come
    # root first.
    gate = fair_gate_sql("%s::uuid[]", exclusive=mode is LockMode.UPDATE)
    queryset = queryset.filter(RawSQL(gate, [list(ids)], output_field=BooleanField()))
    sql, params = queryset.query.sql_with_params()
    # ORDER BY depth runs below the row-locking step, so rows are locked root first.
    return list(Run.objects.raw(f"{sql} {mode.value}", params))


def run_ancestors_lock(path: str) -> list[Run]:
    """Lock the ancestors of the run at ``path`` ``FOR KEY SHARE``, root first; return them root first.

    The first step of ``run_chain_lock`` for a caller that read the path itself and locks
    the run in a statement of its own.
    """
    return _lock_runs([uuid.UUID(part) for part in path.split("/") if part][:-1], LockMode.KEY_SHARE)


def run_path_lock(path: str, *, update: uuid.UUID | None = None) -> list[Run]:
    """Lock the chain of the run at ``path`` root first, ``FOR KEY SHARE``; ``update``, if one of them, ``FOR UPDATE``.

    For a caller that locks a second chain besides a group's gate chain (``group_join``):
    the gate, if it is in this chain, is locked here in the mode ``group_lock`` takes it in,
    so that the transaction never upgrades a share lock on it (two upgraders deadlock).
    Return the chain, root first.
    """
    ids = path_ids(path)
    if update not in ids:
        return _lock_runs(ids, LockMode.KEY_SHARE)
    at = ids.index(update)
    above = _lock_runs(ids[:at], LockMode.KEY_SHARE)
    return above + _lock_runs([update], LockMode.UPDATE) + _lock_runs(ids[at + 1 :], LockMode.KEY_SHARE)


def run_chain_lock(run_id: uuid.UUID, *, project_id, target_mode: LockMode = LockMode.KEY_SHARE) -> list[Run]:
    """Lock the chain of ``run_id`` root first and return it root first.

    Ancestors get ``FOR KEY SHARE``; the run itself gets ``target_mode``. Raise
    ``NotFound`` when the run does not exist in ``project_id``.
    """
    if not connection.in_atomic_block:
        raise RuntimeError("run_chain_lock must be called inside transaction.atomic()")
    path = Run.objects.filter(id=run_id, project_id=project_id).values_list("path", flat=True).first()
    if path is None:
        raise exceptions.NotFound("Run not found.", runId=str(run_id))
    chain_ids = path_ids(path)
    if target_mode is LockMode.KEY_SHARE:
        return _lock_runs(chain_ids, LockMode.KEY_SHARE)
    ancestors = _lock_runs(chain_ids[:-1], LockMode.KEY_SHARE)
    return ancestors + _lock_runs(chain_ids[-1:], target_mode)


def chain_refusal(chain: Sequence[Run], now: datetime | None = None) -> exceptions.Conflict | None:
    """Return the error a run with this chain (root first) answers to new work, or None.

    The root-most inactive run names the cause; a stored state outranks a deadline on the
    same run.
    """
    now = now or timezone.now()
    for run in chain:
        if run.stored_state == RunState.CANCELLED:
            return exceptions.ScopeCancelled(runId=str(run.id))
        if run.stored_state == RunState.COMPLETED:
            return exceptions.ScopeCompleted(runId=str(run.id))
        if run.deadline is not None and run.deadline <= now:
            return exceptions.DeadlineExceeded(runId=str(run.id))
    return None


def run_chain_lock_active(run_id: uuid.UUID, *, project_id, target_mode: LockMode = LockMode.KEY_SHARE) -> list[Run]:
    """Lock the chain of ``run_id`` (see ``run_chain_lock``) and refuse if it is inactive.

    Every service that creates new work under a run calls this first: once it returns, a
    concurrent cancel of any run in the chain waits for this transaction to commit, and its
    cascade then sees what this transaction created.
    """
    chain = run_chain_lock(run_id, project_id=project_id, target_mode=target_mode)
    refusal = chain_refusal(chain)
    if refusal is not None:
        raise refusal
    return chain
