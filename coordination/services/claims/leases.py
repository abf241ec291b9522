"""The claim and lease rules, each defined once, in Python, SQL and ORM filters.

When a task may be claimed, when a claim still holds its task, when a lease may be taken
over, when it is due for the sweep, and what its expiry does.

A rule (``services/rules.py``) is a list of clauses, each written side by side as the Python
test on a ``Task``, the SQL condition on the task row and, where a query needs it, the ORM
filter. The single
statements render their ``WHERE`` from ``Rule.sql``, the careful path calls the rule on the
row it locked, the careful claim and the sweeps filter with ``Rule.q``.
``tests/coordination/services/test_lease_rules.py`` checks on PostgreSQL that the three forms
agree on a table of cases.
"""

from datetime import datetime

from django.db.models import F, Q

from coordination.domain.states import TASK_HELD, TaskState
from coordination.models import Event, Task
from coordination.services import dispatch, task_transitions
from coordination.services.events import event_for
from coordination.services.rules import Clause, Rule
from coordination.services.sql import in_list, literal


def _lease_ahead(task: Task, now: datetime) -> bool:
    return task.lease_expires_at is not None and task.lease_expires_at > now


# The fence: the claim ``(task id, attempt)`` still holds the task. The run's own refusal (an
# inactive chain) is checked apart: a held task's run can only be inactive through a
# deadline, since a cancel or complete ends held tasks in its own transaction.
CLAIM_HOLDS = Rule(
    Clause("{t}.attempts = {attempt}", lambda task, now, attempt: task.attempts == attempt),
    Clause(f"{{t}}.state IN {in_list(TASK_HELD)}", lambda task, now, **_: task.state in TASK_HELD),
    Clause("{t}.lease_expires_at > %(now)s", lambda task, now, **_: _lease_ahead(task, now)),
    Clause(
        "{t}.cancel_grace_until IS NULL OR {t}.cancel_grace_until > %(now)s",
        lambda task, now, **_: task.cancel_grace_until is None or task.cancel_grace_until > now,
    ),
)

# The run deadline, which stands for the chain on a held task (see ``CLAIM_HOLDS``).
RUN_DEADLINE_AHEAD = Rule(
    Clause(
        "{t}.run_deadline IS NULL OR {t}.run_deadline > %(now)s",
        lambda task, now, **_: task.run_deadline is None or task.run_deadline > now,
    ),
)

# Claimable: a queued task whose retry delay is over and whose ``expiresAt`` has not passed.
CLAIMABLE = Rule(
    Clause(
        f"{{t}}.state = {literal(TaskState.QUEUED)}",
        lambda task, now: task.state == TaskState.QUEUED,
        lambda now: Q(state=TaskState.QUEUED),
    ),
    Clause(
        "{t}.available_at <= %(now)s",
        lambda task, now: task.available_at <= now,
        lambda now: Q(available_at__lte=now),
    ),
    Clause(
        "{t}.expires_at IS NULL OR {t}.expires_at > %(now)s",
        lambda task, now: task.expires_at is None or task.expires_at > now,
        lambda now: Q(expires_at__isnull=True) | Q(expires_at__gt=now),
    ),
)

# Takeover: a claimer may settle an expired lease itself (crash takeover never waits for a
# sweep), unless a cooperative cancel's grace decides it, or it would end a group member,
# whose group must be locked first (the sweep's job).
TAKEOVER_DUE = Rule(
    Clause(
        f"{{t}}.state = {literal(TaskState.RUNNING)}",
        lambda task, now: task.state == TaskState.RUNNING,
        lambda now: Q(state=TaskState.RUNNING),
    ),
    Clause(
        "{t}.lease_expires_at <= %(now)s",
        lambda task, now: task.lease_expires_at is not None and task.lease_expires_at <= now,
        lambda now: Q(lease_expires_at__lte=now),
    ),
    Clause(
        "{t}.cancel_grace_until IS NULL",
        lambda task, now: task.cancel_grace_until is None,
        lambda now: Q(cancel_grace_until__isnull=True),
    ),
    Clause(
        "{t}.group_id IS NULL OR {t}.attempts < {t}.max_attempts",
        lambda task, now: task.group_id is None or task.attempts < task.max_attempts,
        lambda now: Q(group__isnull=True) | Q(attempts__lt=F("max_attempts")),
    ),
)

# Expiry: a held task whose lease ran out, or whose cooperative cancel's grace passed, is due
# for the lease sweep.
EXPIRY_DUE = Rule(
    Clause(
        f"{{t}}.state IN {in_list(TASK_HELD)}",
        lambda task, now: task.state in TASK_HELD,
        lambda now: Q(state__in=TASK_HELD),
    ),
    Clause(
        "{t}.lease_expires_at <= %(now)s OR {t}.cancel_grace_until <= %(now)s",
        lambda task, now: (
            (task.lease_expires_at is not None and task.lease_expires_at <= now)
            or (task.cancel_grace_until is not None and task.cancel_grace_until <= now)
        ),
        lambda now: Q(lease_expires_at__lte=now) | Q(cancel_grace_until__lte=now),
    ),
)


def claim_holds(task: Task, attempt: int, now: datetime) -> bool:
    """Tell whether the claim ``(task, attempt)`` still holds ``task`` (locked) at ``now``."""
    return CLAIM_HOLDS(task, now, attempt=attempt)


def takeover_due(task: Task, now: datetime) -> bool:
    """Whether a claimer may take over ``task``'s expired lease itself (the same rule as ``task_claim``)."""
    return TAKEOVER_DUE(task, now)


def lease_expired(task: Task, now: datetime) -> list[Event]:
    """Settle a locked held task whose lease ran out (or whose cancel grace passed); return its events.

    After a cancellation request it is ``CANCELLED``; else it goes back to the queue while
    attempts remain, and fails with ``lease_expired`` when none do.
    """
    held = task_transitions.held_event_data(task)  # the worker that may still be running it is told
    if task.state == TaskState.CANCELLATION_REQUESTED:
        task_transitions.release(task, now=now)
        return [event_for(task, "task.cancelled", reason=task.cancel_reason, cause="cancellation_finalized", **held)]
    if task.attempts < task.max_attempts:
        task_transitions.release(task, now=now)
        # A crashed Celery worker's message is gone: send the task out again.
        dispatch.work_requeued(task)
        return [event_for(task, "task.requeued", cause="lease_expired", attempt=task.attempts, **held)]
    task_transitions.fail(task, now=now, error=dict(task_transitions.LEASE_EXPIRED_ERROR))
    return [event_for(task, "task.failed", error=task.error, **held)]
