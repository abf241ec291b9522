"""Cancellations that do not end: tasks left ``CANCELLATION_REQUESTED`` for longer than their lease TTL.

A running task asked to stop ends on its own once its worker hears of the request (at its
next renewal, well within one lease TTL) and its handler returns, or once its lease runs out
and the lease sweep records ``CANCELLED``. So a request older than the claim's lease TTL
means one of three things (Runlane's diagnosis, docs/operations.md "Stuck cancellations"):

- **maintenance**: the lease (or the cancel's grace) has run out and the sweep has not
  recorded ``CANCELLED``: celery beat or the worker running the sweeps is down or behind;
- **signal use**: the worker renewed after the request, so it was told, and keeps renewing:
  its handler ignores ``ctx.signal`` / ``is_cancellation_requested()``;
- **lease refresh**: the worker has not renewed since the request although its lease still
  holds (a renewal that chose a longer TTL than the one before): look at its renew loop.

The claim's TTL is ``lease_expires_at - last_renewed_at`` (a claim or renew may choose its
own); a lease granted before ``last_renewed_at`` existed falls back to its mailbox's TTL.
Read by the metrics (``runstate_cancellation_*``) and the dashboard's panel.
"""

import uuid
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta

from coordination.domain.states import TaskState
from coordination.models import Task
from coordination.reads.project_scope import ProjectScope, of_projects

MAINTENANCE = "maintenance"
SIGNAL_USE = "signal use"
LEASE_REFRESH = "lease refresh"


@dataclass(frozen=True)
class StuckCancellation:
    """A task whose cancel request is older than its claim's lease TTL, and the likely cause."""

    task: Task
    lease_ttl: timedelta
    cause: str


def _lease_ttl(expires_at: datetime | None, renewed_at: datetime | None, mailbox_ttl_ms: int) -> timedelta:
    if expires_at is not None and renewed_at is not None:
        return expires_at - renewed_at
    return timedelta(milliseconds=mailbox_ttl_ms)


def claim_lease_ttl(task: Task) -> timedelta:
    """Return the TTL of the task's current lease: as granted by its last claim or renewal."""
    return _lease_ttl(task.lease_expires_at, task.last_renewed_at, task.mailbox.lease_ttl_ms)


def likely_cause(task: Task, now: datetime) -> str:
    """Return which of the three causes a stuck cancellation points to."""
    lease_out = task.lease_expires_at is None or task.lease_expires_at <= now
    grace_out = task.cancel_grace_until is not None and task.cancel_grace_until <= now
    if lease_out or grace_out:
        return MAINTENANCE
    if task.last_renewed_at is not None and task.last_renewed_at > task.cancel_requested_at:
        return SIGNAL_USE
    return LEASE_REFRESH


def _requested(projects: ProjectScope):
    rows = Task.objects.filter(state=TaskState.CANCELLATION_REQUESTED, cancel_requested_at__isnull=False)
    return of_projects(rows, projects)


def is_stuck(task: Task, now: datetime) -> bool:
    """Return whether the task's cancel request is older than its claim's lease TTL."""
    return task.cancel_requested_at + claim_lease_ttl(task) <= now


def stuck_cancellations(now: datetime, projects: ProjectScope = None, limit: int = 50) -> list[StuckCancellation]:
    """Return the stuck cancellations, the oldest request first (at most ``limit``).

    Only tasks asked to stop and still held are read: there are at most as many as leases.
    """
    found = []
    rows = _requested(projects).select_related("mailbox", "project").order_by("cancel_requested_at", "id")
    for task in rows.iterator(chunk_size=500):
        if is_stuck(task, now):
            found.append(StuckCancellation(task, claim_lease_ttl(task), likely_cause(task, now)))
            if len(found) >= limit:
                break
    return found


@dataclass
class MailboxCancellations:
    """Per mailbox: the oldest cancel request still waiting, and how many are stuck."""

    oldest_requested_at: datetime | None = None
    stuck: int = 0


def cancellations_by_mailbox(
    now: datetime, project_id: uuid.UUID | None = None
) -> dict[uuid.UUID, MailboxCancellations]:
    """Return, per mailbox with a task asked to stop, its oldest request and its stuck count (of one project or all)."""
    found: dict[uuid.UUID, MailboxCancellations] = defaultdict(MailboxCancellations)
    fields = ("mailbox_id", "cancel_requested_at", "lease_expires_at", "last_renewed_at", "mailbox__lease_ttl_ms")
    for mailbox_id, requested_at, expires_at, renewed_at, mailbox_ttl_ms in _requested(project_id).values_list(*fields):
        entry = found[mailbox_id]
        if entry.oldest_requested_at is None or requested_at < entry.oldest_requested_at:
            entry.oldest_requested_at = requested_at
        if requested_at + _lease_ttl(expires_at, renewed_at, mailbox_ttl_ms) <= now:
            entry.stuck += 1
    return found
