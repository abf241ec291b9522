"""The claim operations: the single statement first, the careful path when it declines.

On PostgreSQL (fast paths on) each operation runs its statement (``statements``); when that
touches no row, or on SQLite, the careful ORM path (``careful``) decides the answer.
"""

import uuid
from datetime import timedelta

from django.utils import timezone

from coordination.domain import exceptions
from coordination.domain.states import MailboxMode, TaskState
from coordination.models import Mailbox, Task
from coordination.services import dispatch, sql
from coordination.services.claims import careful
from coordination.services.claims.claim import Claim
from coordination.services.claims.statements import (
    CLAIM_BY_ID_SQL,
    CLAIM_SQL,
    COMPLETE_SQL,
    FAIL_SQL,
    RELEASE_SQL,
    RENEW_SQL,
    fast_one,
    one_params,
)
from coordination.services.mailboxes import validate_lease_ttl_ms
from coordination.services.sql import fast_paths_enabled

MAX_CLAIMS_PER_CALL = 100


def _check_claim(mailbox: Mailbox, lease_ttl_ms: int | None, max_claims: int) -> None:
    """Refuse a claim from a mailbox of messages, or with a lease or count out of range."""
    if mailbox.mode != MailboxMode.WORK:
        raise exceptions.MailboxModeConflict(f"Mailbox '{mailbox.name}' holds messages, not tasks.")
    validate_lease_ttl_ms(lease_ttl_ms)
    if not 1 <= max_claims <= MAX_CLAIMS_PER_CALL:
        raise exceptions.ValidationFailed("Invalid max.", max=f"must be between 1 and {MAX_CLAIMS_PER_CALL}")


def claim_statement(
    *,
    project_id: uuid.UUID,
    mailbox: Mailbox,
    run_id: uuid.UUID,
    worker_id: str = "",
    lease_ttl_ms: int | None = None,
    max_claims: int = 1,
) -> tuple[str, dict]:
    """Return ``task_claim``'s single statement and its parameters, after the checks it makes first.

    Whoever runs it (the service here, the API's hot path on its own connection) builds the
    claims from its rows with ``claims_from_rows``; no rows leave the answer to the careful path.
    """
    _check_claim(mailbox, lease_ttl_ms, max_claims)
    now = timezone.now()
    params = {
        "project_id": project_id,
        "mailbox_id": mailbox.id,
        "run_id": run_id,
        "now": now,
        "lease_until": now + timedelta(milliseconds=lease_ttl_ms or mailbox.lease_ttl_ms),
        "worker_id": worker_id,
        "max": max_claims,
    }
    return CLAIM_SQL, params


def claims_from_rows(rows: list[tuple], mailbox: Mailbox, lease_until) -> list[Claim]:
    """Return the claims ``claim_statement``'s rows (``sql.models_from_rows`` of ``Task``) hand out."""
    claims = []
    for (task,) in rows:
        Task.mailbox.field.set_cached_value(task, mailbox)
        claims.append(Claim(task, task.attempts, lease_until))
    return claims


def task_claim(
    *,
    project_id: uuid.UUID,
    mailbox: Mailbox,
    run_id: uuid.UUID,
    worker_id: str = "",
    lease_ttl_ms: int | None = None,
    max_claims: int = 1,
    after_statement: bool = False,
) -> list[Claim]:
    """Claim up to ``max_claims`` tasks of exactly ``run_id``, highest priority then oldest.

    Expired leases of the run are taken over first (their tasks go back to the queue, or
    fail when their attempts are spent), so crash takeover never waits for a sweep. A group
    member whose takeover would end it is left to the sweep, which locks its group first.
    On PostgreSQL one statement claims when the run is active and has no lease to take
    over; otherwise (and when it finds nothing) the careful path decides.
    ``after_statement``: the caller ran ``claim_statement`` itself and it claimed nothing (the
    API's hot path, on its own connection): only the careful path is left.
    """
    _check_claim(mailbox, lease_ttl_ms, max_claims)
    if fast_paths_enabled() and not after_statement:
        statement, params = claim_statement(
            project_id=project_id,
            mailbox=mailbox,
            run_id=run_id,
            worker_id=worker_id,
            lease_ttl_ms=lease_ttl_ms,
            max_claims=max_claims,
        )
        claims = claims_from_rows(sql.fetch_models(Task, statement, params), mailbox, params["lease_until"])
        if claims:
            return claims
    return careful.task_claim(
        project_id=project_id,
        mailbox=mailbox,
        run_id=run_id,
        worker_id=worker_id,
        lease_ttl_ms=lease_ttl_ms,
        max_claims=max_claims,
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
    return careful.task_claim_by_id(
        project_id=project_id, task_id=task_id, worker_id=worker_id, lease_ttl_ms=lease_ttl_ms, mailbox_id=mailbox_id
    )


# Each operation on one claim: its statement and parameters (after the checks it makes first),
# then the changed task or, when the statement touched no row, the careful path's answer. The
# API's hot path runs the same statements on its own connection.


def renew_statement(*, project_id: uuid.UUID, claim_id: str, lease_ttl_ms: int | None = None) -> tuple[str, dict]:
    """Return ``claim_renew``'s statement and parameters."""
    validate_lease_ttl_ms(lease_ttl_ms)
    return RENEW_SQL, one_params(project_id, claim_id, now=timezone.now(), lease_ttl_ms=lease_ttl_ms)


def complete_statement(*, project_id: uuid.UUID, claim_id: str, outcome: object) -> tuple[str, dict]:
    """Return ``claim_complete``'s statement and parameters."""
    return COMPLETE_SQL, one_params(project_id, claim_id, now=timezone.now(), outcome=sql.json_param(outcome))


def fail_statement(
    *, project_id: uuid.UUID, claim_id: str, error: object, retry: bool = False, retry_delay_ms: int = 0
) -> tuple[str, dict]:
    """Return ``claim_fail``'s statement and parameters."""
    if retry_delay_ms < 0:
        raise exceptions.ValidationFailed("Invalid retry delay.", retryDelayMs="must be >= 0")
    now = timezone.now()
    params = one_params(
        project_id,
        claim_id,
        now=now,
        error=sql.json_param(error),
        retry=retry,
        available_at=now + timedelta(milliseconds=retry_delay_ms),
    )
    return FAIL_SQL, params


def release_statement(*, project_id: uuid.UUID, claim_id: str) -> tuple[str, dict]:
    """Return ``claim_release``'s statement and parameters."""
    return RELEASE_SQL, one_params(project_id, claim_id, now=timezone.now())


def claim_renew(*, project_id: uuid.UUID, claim_id: str, lease_ttl_ms: int | None = None) -> Claim:
    """Extend the claim's lease; the answer tells whether cancellation was requested."""
    task = fast_one(*renew_statement(project_id=project_id, claim_id=claim_id, lease_ttl_ms=lease_ttl_ms))
    if task is not None:
        return Claim(task, task.attempts, task.lease_expires_at)
    return careful.claim_renew(project_id=project_id, claim_id=claim_id, lease_ttl_ms=lease_ttl_ms)


def claim_complete(*, project_id: uuid.UUID, claim_id: str, outcome: object) -> Task:
    """Record the handler's result: ``SUCCEEDED``, or ``CANCELLED`` if cancellation was requested."""
    task = fast_one(*complete_statement(project_id=project_id, claim_id=claim_id, outcome=outcome))
    if task is None:
        return careful.claim_complete(project_id=project_id, claim_id=claim_id, outcome=outcome)
    return task


def claim_fail(
    *, project_id: uuid.UUID, claim_id: str, error: object, retry: bool = False, retry_delay_ms: int = 0
) -> Task:
    """Record a failure: back to the queue while attempts remain and ``retry`` is set, else ``FAILED``.

    After a cancellation request a failure is final and never rewritten as a cancellation.
    """
    task = fast_one(
        *fail_statement(
            project_id=project_id, claim_id=claim_id, error=error, retry=retry, retry_delay_ms=retry_delay_ms
        )
    )
    if task is None:
        return careful.claim_fail(
            project_id=project_id, claim_id=claim_id, error=error, retry=retry, retry_delay_ms=retry_delay_ms
        )
    if task.state == TaskState.QUEUED:
        dispatch.work_requeued(task)
    return task


def claim_release(*, project_id: uuid.UUID, claim_id: str) -> Task:
    """Hand the task back: to the queue, or ``CANCELLED`` if cancellation was requested.

    Works on an inactive run too: after its run was cancelled the task is already
    ``CANCELLED`` and the release answers it unchanged.
    """
    task = fast_one(*release_statement(project_id=project_id, claim_id=claim_id))
    if task is None:
        return careful.claim_release(project_id=project_id, claim_id=claim_id)
    if task.state == TaskState.QUEUED:
        dispatch.work_requeued(task)
    return task
