"""Sweeps over tasks: expired leases, past ``expiresAt``, lost Celery wake-ups.

One small batch per transaction, skipping rows another sweeper holds; group members one
at a time, each locking its group first.
"""

import uuid
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from coordination.domain.states import TaskState
from coordination.models import Task
from coordination.services import dispatch, task_transitions
from coordination.services.claims.leases import EXPIRY_DUE, lease_expired
from coordination.services.events import event_for, events_record_many
from coordination.services.retry import retrying
from coordination.services.tasks import after_change, lock_task, record


def tasks_settle_expired_leases(*, now: datetime | None = None, batch_size: int = 500) -> int:
    """Settle held tasks whose lease expired or whose cancel grace passed; return how many.

    Plain tasks go in one batch transaction; group members one at a time, each locking its
    group first.
    """
    now = now or timezone.now()
    settled = _settle_plain_batch(now, batch_size)
    member_ids = list(
        Task.objects.filter(EXPIRY_DUE.q(now), group__isnull=False).values_list("id", flat=True)[:batch_size]
    )
    for task_id in member_ids:
        settled += _settle_member(task_id, now)
    return settled


@transaction.atomic
def _settle_plain_batch(now: datetime, batch_size: int) -> int:
    tasks = list(
        Task.objects.filter(EXPIRY_DUE.q(now), group__isnull=True)
        .order_by("id")
        .select_for_update(skip_locked=True)[:batch_size]
    )
    events_record_many([event for task in tasks for event in lease_expired(task, now)])
    return len(tasks)


@retrying
@transaction.atomic
def _settle_member(task_id: uuid.UUID, now: datetime) -> int:
    task, locked_group = lock_task(None, task_id)
    if not EXPIRY_DUE(task, now):
        return 0  # another sweeper or the worker got there first
    events_record_many(lease_expired(task, now))
    after_change(task, locked_group, now)
    return 1


@transaction.atomic
def tasks_rewake_unclaimed(
    *, mailbox_ids: list[uuid.UUID], unclaimed_for: timedelta, now: datetime | None = None, batch_size: int = 500
) -> int:
    """Wake workers again for queued tasks of ``mailbox_ids`` left unclaimed that long; return how many.

    Their Celery message may be lost (the broker was down at submit, or a killed worker held
    it unacknowledged). ``available_at`` moves to now, so a task is announced again at most
    once per ``unclaimed_for``; a duplicate message is harmless (the claim decides).
    """
    now = now or timezone.now()
    tasks = list(
        Task.objects.filter(mailbox_id__in=mailbox_ids, state=TaskState.QUEUED, available_at__lte=now - unclaimed_for)
        .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now))
        .order_by("available_at")
        .select_for_update(skip_locked=True)[:batch_size]
    )
    if tasks:
        Task.objects.filter(id__in=[t.id for t in tasks]).update(available_at=now)
    for task in tasks:
        task.available_at = now
        dispatch.work_requeued(task)
    return len(tasks)


def tasks_expire_queued(*, now: datetime | None = None, batch_size: int = 500) -> int:
    """Expire queued tasks past their ``expiresAt``; return how many."""
    now = now or timezone.now()
    expired = _expire_plain_batch(now, batch_size)
    member_ids = list(
        Task.objects.filter(state=TaskState.QUEUED, expires_at__lte=now, group__isnull=False).values_list(
            "id", flat=True
        )[:batch_size]
    )
    for task_id in member_ids:
        expired += _expire_member(task_id, now)
    return expired


@transaction.atomic
def _expire_plain_batch(now: datetime, batch_size: int) -> int:
    due = list(
        Task.objects.filter(state=TaskState.QUEUED, expires_at__lte=now, group__isnull=True)
        .order_by("id")
        .select_for_update(skip_locked=True)[:batch_size]
    )
    if due:
        task_transitions.expire_many([t.id for t in due], now=now)
    events_record_many([event_for(task, "task.expired", cause="expires_at") for task in due])
    return len(due)


@retrying
@transaction.atomic
def _expire_member(task_id: uuid.UUID, now: datetime) -> int:
    task, locked_group = lock_task(None, task_id)
    if task.state != TaskState.QUEUED or task.expires_at is None or task.expires_at > now:
        return 0
    task_transitions.expire(task, now=now)
    record(task, "task.expired", cause="expires_at")
    after_change(task, locked_group, now)
    return 1
