"""The end of a run's subtree: what a cancel or complete does below the run, in one place.

``run_cancel`` and ``run_complete`` call ``subtree_end`` inside their own transaction after
locking the run ``FOR UPDATE``. Each feature adds its step to ``CASCADE_STEPS`` in the house
lock order (groups before tasks before barriers and timers), so the whole effect stays one
transaction as features arrive.
"""

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from coordination.models import Run
from coordination.states import RunState


@dataclass(frozen=True)
class SubtreeEnd:
    """A run whose subtree stops accepting work, and why."""

    run: Run
    state: RunState  # CANCELLED or COMPLETED
    reason: str | None
    now: datetime

    @property
    def path_prefix(self) -> str:
        """Return the path prefix shared by the run and every run below it."""
        return self.run.path


CascadeStep = Callable[[SubtreeEnd], None]

# Filled in house lock order; every step runs inside the cancel's transaction.
CASCADE_STEPS: list[CascadeStep] = []


def subtree_end(end: SubtreeEnd) -> None:
    """Apply every registered step to the subtree of ``end.run``."""
    for step in CASCADE_STEPS:
        step(end)
