"""State enums of every aggregate, with their terminal sets.

One service function writes each status field (house rule): ``Run.stored_state`` is written
only by ``coordination.services.runs``.
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
