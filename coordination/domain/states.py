"""State enums of every aggregate, with their terminal sets.

One service module writes each status field (house rule): ``Run.stored_state`` is written
only by ``coordination.services.runs``, ``Task.state`` only by
``coordination.services.task_transitions``
(``tests/coordination/services/test_status_writers.py``). SQL renders these names with
``coordination.services.sql.literal`` and ``in_list``, never by hand.
"""

from django.db import models


class RunState(models.TextChoices):
    """A run's own stored state; final once it leaves ``ACTIVE``."""

    ACTIVE = "ACTIVE"  # accepts new work (unless an ancestor is inactive or a deadline passed)
    CANCELLED = "CANCELLED"  # stopped by cancel(); its subtree refuses new work
    COMPLETED = "COMPLETED"  # closed by complete(); its subtree refuses new work


class Effective(models.TextChoices):
    """Whether a run accepts new work, computed from the run and its ancestors at read time."""

    ACTIVE = "ACTIVE"
    INACTIVE = "INACTIVE"


class InactiveReason(models.TextChoices):
    """Why a run is effectively inactive."""

    CANCELLED = "CANCELLED"
    COMPLETED = "COMPLETED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"


class Permission(models.TextChoices):
    """What an API key may do."""

    RESOURCE_CONFIG = "resource_config"  # ensure mailboxes, create barriers
    COORDINATION_WRITE = "coordination_write"  # every other change
    COORDINATION_READ = "coordination_read"  # reads and waits


class MailboxMode(models.TextChoices):
    """What a mailbox holds."""

    WORK = "WORK"  # tasks, each done once under a lease
    QUEUE = "QUEUE"  # messages, delivered under a visibility lease


class TaskState(models.TextChoices):
    """A task's lifecycle; written only by ``coordination.services.task_transitions``."""

    QUEUED = "QUEUED"  # claimable once ``available_at`` has passed
    RUNNING = "RUNNING"  # claimed; the claim holds a lease until ``lease_expires_at``
    CANCELLATION_REQUESTED = "CANCELLATION_REQUESTED"  # running, and asked to stop
    SUCCEEDED = "SUCCEEDED"  # completed by its claim
    FAILED = "FAILED"  # failed with no retry left (or after a cancellation request)
    CANCELLED = "CANCELLED"  # cancelled before finishing (run cancel, task cancel, group)
    EXPIRED = "EXPIRED"  # still queued at ``expires_at``, or its run's deadline passed


TASK_TERMINAL = frozenset({TaskState.SUCCEEDED, TaskState.FAILED, TaskState.CANCELLED, TaskState.EXPIRED})
TASK_HELD = frozenset({TaskState.RUNNING, TaskState.CANCELLATION_REQUESTED})
TASK_UNFINISHED = frozenset({TaskState.QUEUED}) | TASK_HELD


class MessageState(models.TextChoices):
    """A queue message's lifecycle; written only by ``coordination.services.messages``."""

    QUEUED = "QUEUED"  # receivable once ``visible_at`` has passed
    IN_FLIGHT = "IN_FLIGHT"  # received; invisible until ``visible_at``, then delivered again
    COMPLETED = "COMPLETED"  # acknowledged
    DEAD_LETTERED = "DEAD_LETTERED"  # rejected; kept for reading
    CANCELLED = "CANCELLED"  # its run was cancelled or completed before it was handled


MESSAGE_TERMINAL = frozenset({MessageState.COMPLETED, MessageState.DEAD_LETTERED, MessageState.CANCELLED})


class GroupState(models.TextChoices):
    """A task group's lifecycle; written only by ``coordination.services.groups``."""

    OPEN = "OPEN"  # accepts new members
    SEALED = "SEALED"  # closed to new members, not yet decided
    FINALIZED = "FINALIZED"  # decided once; its gate run is cancelled


class GroupCondition(models.TextChoices):
    """When a group succeeds."""

    FIRST_ACCEPTED = "FIRST_ACCEPTED"
    N_ACCEPTED = "N_ACCEPTED"
    ALL_TERMINAL = "ALL_TERMINAL"


class GroupOutcome(models.TextChoices):
    """A finalized group's outcome."""

    SUCCESS = "SUCCESS"
    FAILURE = "FAILURE"


class Verdict(models.TextChoices):
    """A reviewer's judgement of a member."""

    ACCEPTED = "ACCEPTED"
    REJECTED = "REJECTED"


class BarrierState(models.TextChoices):
    """A barrier's state within its current epoch; written only by ``coordination.services.barriers``."""

    WAITING = "WAITING"  # fewer than ``target`` distinct keys have arrived
    RELEASED = "RELEASED"  # ``target`` keys arrived; ``nextEpoch`` re-arms it
    CANCELLED = "CANCELLED"  # its run was cancelled, completed or passed its deadline while waiting


class TimerState(models.TextChoices):
    """A durable timer's lifecycle; written only by ``coordination.services.timers``."""

    ARMED = "ARMED"  # waiting for ``fire_at``
    FIRED = "FIRED"  # fired on the server, whether or not anyone waits
    ACKNOWLEDGED = "ACKNOWLEDGED"  # a waiter saw it fire
    CANCELLED = "CANCELLED"  # disarmed before firing (directly or with its run)


class AdmissionState(models.TextChoices):
    """An admission's lifecycle; written only by ``coordination.services.admissions``."""

    WAITING = "WAITING"  # queued, strictly first come first served, for room under the parent run
    ADMITTED = "ADMITTED"  # its child run was created (final: the child's own end frees the slot)
    WITHDRAWN = "WITHDRAWN"  # left the queue on the caller's request
    CANCELLED = "CANCELLED"  # answered with a refusal code (the parent went inactive, or its run could not be made)


class PoolLeaseState(models.TextChoices):
    """A pool request's lifecycle; written only by ``coordination.services.pools``."""

    WAITING = "WAITING"  # queued behind earlier requests or for units to free up
    HELD = "HELD"  # granted: its units count in use until released or expired
    RELEASED = "RELEASED"  # handed back (or left the queue through release)
    EXPIRED = "EXPIRED"  # its lease ran out before a renewal
    TIMED_OUT = "TIMED_OUT"  # left the queue ungranted: waitMs passed or its caller went away
    CANCELLED = "CANCELLED"  # its run went inactive while it waited


POOL_LEASE_OPEN = (PoolLeaseState.WAITING, PoolLeaseState.HELD)


class ReservationState(models.TextChoices):
    """A budget reservation's state; written only by ``coordination.services.budgets``."""

    RESERVED = "RESERVED"  # its amount is held on every budget of its name on the run's chain
    COMMITTED = "COMMITTED"  # what was spent is recorded, the rest handed back
    RELEASED = "RELEASED"  # handed back whole
    EXPIRED = "EXPIRED"  # unsettled after its ttl: the sweep handed it back whole
