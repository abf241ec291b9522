"""Narrow forms of ``task_claim_by_id`` and ``claim_complete``: a raw psycopg cursor, only what a worker uses.

A Celery worker claims its task by id and completes it, once per task. The fast paths of
``operations`` return the whole task row through Django's cursor and build a ``Task``: a
third of the worker's CPU per task went to that (issue 27). Here the same statements, with
the same fence, lease and events (``statements``, imported and not copied), end in a
narrower ``SELECT``, and run on the connection's psycopg cursor, prepared on a connection
as its Django cursor would be (``RUNSTATE_DB_PREPARE_THRESHOLD``):

- the claim returns the task's id, run, key, input, attempt, the lease it was granted and the
  submitter's trace context;
- the completion returns the task's new state.

When a statement touches no row the service function answers instead (its careful path
decides the exact answer: ``None``, ``LEASE_LOST``, a run's refusal), so every answer is
the service's. On SQLite, or with ``RUNSTATE_FAST_PATHS`` off, only the services run.
Errors are Django's (``connection.wrap_database_errors``), so a dropped connection is
noticed as before (``close_old_connections``, ``runtime._through_outages``).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from django.db import connection
from django.utils import timezone

from coordination.services import sql
from coordination.services.claims.claim import Claim, claim_id_for, parse_claim_id
from coordination.services.claims.operations import claim_complete, task_claim_by_id
from coordination.services.claims.statements import CLAIM_BY_ID_SQL, COMPLETE_SQL
from coordination.services.mailboxes import validate_lease_ttl_ms


def _narrowed(statement: str, select: str) -> str:
    """Return the claims module's ``statement`` with its last line (``SELECT <task row> FROM done``) replaced."""
    body, tail = statement.rstrip().rsplit("\n", 1)
    if not (tail.startswith("SELECT ") and tail.endswith(" FROM done")):
        raise RuntimeError(f"the claims statement no longer ends with its task row: {tail[:80]!r}")
    return f"{body}\n{select}\n"


# The lease granted is what the statement set: its expiry less the claim's time.
CLAIM_BY_ID_NARROW_SQL = _narrowed(
    CLAIM_BY_ID_SQL,
    "SELECT id, run_id, key, input::text, attempts, "
    "round(extract(epoch FROM lease_expires_at - last_renewed_at) * 1000)::int, traceparent, tracestate, group_id "
    "FROM done",
)
COMPLETE_NARROW_SQL = _narrowed(COMPLETE_SQL, "SELECT state FROM done")


@dataclass(frozen=True)
class NarrowClaim:
    """What a worker needs of a claim: its handler context's fields and the lease granted."""

    task_id: uuid.UUID
    run_id: uuid.UUID
    key: str | None
    input: Any
    attempt: int
    lease_ttl_ms: int
    traceparent: str = ""  # the submitter's W3C context (coordination.plumbing.tracing)
    tracestate: str = ""
    group_id: uuid.UUID | None = None

    @property
    def claim_id(self) -> str:
        """Return the opaque claim id (``claim_id_for``)."""
        return claim_id_for(self.task_id, self.attempt)

    @classmethod
    def of(cls, claim: Claim) -> NarrowClaim:
        """Return the narrow view of a ``Claim``."""
        task = claim.task
        granted = claim.lease_ttl_ms or task.mailbox.lease_ttl_ms
        return cls(
            task.id,
            task.run_id,
            task.key,
            task.input,
            claim.attempt,
            granted,
            task.traceparent,
            task.tracestate,
            task.group_id,
        )


def _fetchone(statement: str, params: dict) -> tuple | None:
    """Run ``statement`` on the connection's own psycopg cursor; return its first row."""
    connection.ensure_connection()
    with connection.wrap_database_errors, connection.connection.cursor() as cursor:
        cursor.execute(statement, params)
        return cursor.fetchone()


def task_claim_by_id_narrow(
    *, project_id: uuid.UUID, task_id: uuid.UUID, worker_id: str, lease_ttl_ms: int | None, mailbox_id: uuid.UUID
) -> NarrowClaim | None:
    """Claim ``task_id`` as ``task_claim_by_id`` does; return the narrow view of the claim, or None."""
    if sql.fast_paths_enabled():
        validate_lease_ttl_ms(lease_ttl_ms)
        row = _fetchone(
            CLAIM_BY_ID_NARROW_SQL,
            {
                "project_id": project_id,
                "task_id": task_id,
                "mailbox_id": mailbox_id,
                "now": timezone.now(),
                "lease_ttl_ms": lease_ttl_ms,
                "worker_id": worker_id,
            },
        )
        if row is not None:
            id_, run_id, key, input_json, attempt, granted_ms, traceparent, tracestate, group_id = row
            return NarrowClaim(
                id_, run_id, key, json.loads(input_json), attempt, granted_ms, traceparent, tracestate, group_id
            )
    claim = task_claim_by_id(
        project_id=project_id, task_id=task_id, worker_id=worker_id, lease_ttl_ms=lease_ttl_ms, mailbox_id=mailbox_id
    )
    return NarrowClaim.of(claim) if claim is not None else None


def claim_complete_narrow(*, project_id: uuid.UUID, claim_id: str, outcome: object) -> str:
    """Complete the claim as ``claim_complete`` does; return the task's new state."""
    if sql.fast_paths_enabled():
        task_id, attempt = parse_claim_id(claim_id)
        row = _fetchone(
            COMPLETE_NARROW_SQL,
            {
                "task_id": task_id,
                "project_id": project_id,
                "attempt": attempt,
                "now": timezone.now(),
                "outcome": sql.json_param(outcome),
            },
        )
        if row is not None:
            return row[0]
    return claim_complete(project_id=project_id, claim_id=claim_id, outcome=outcome).state
