"""The end of a run's subtree: what a cancel or complete does below the run, in one place.

``run_cancel`` and ``run_complete`` call ``subtree_end`` inside their own transaction after
locking the run ``FOR UPDATE``. Each feature adds its step to ``cascade_steps`` in the house
lock order (groups before tasks before barriers and timers), so the whole effect stays one
transaction as features arrive.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from coordination.models import Run
from coordination.states import RunState


@dataclass(frozen=True)
class SubtreeEnd:
    """A run whose subtree stops accepting work, and why."""

    run: Run
    state: RunState | None  # CANCELLED or COMPLETED; None when the run's deadline passed
    reason: str | None
    now: datetime
    # Scratch space for steps that work in two halves around another step (groups).
    memo: dict = field(default_factory=dict)

    @property
    def cause(self) -> str:
        """Return why the subtree ends, as recorded in its events."""
        if self.state is None:
            return "run_deadline"
        return "run_cancelled" if self.state == RunState.CANCELLED else "run_completed"

    @property
    def by_deadline(self) -> bool:
        """Tell whether the subtree ends because a deadline passed (unfinished tasks then expire)."""
        return self.state is None

    @property
    def path_prefix(self) -> str:
        """Return the path prefix shared by the run and every run below it."""
        return self.run.path


CascadeStep = Callable[[SubtreeEnd], None]


def cascade_steps() -> tuple[CascadeStep, ...]:
    """Return the steps in house lock order (groups, then tasks, then barriers and timers).

    Each step lives with its aggregate; importing here, not at module level, keeps the
    aggregates free to import this module.
    """
    from coordination.services.barriers import barriers_cancel_subtree
    from coordination.services.groups import groups_end_subtree, groups_reevaluate_after_subtree_end
    from coordination.services.messages import messages_cancel_subtree
    from coordination.services.tasks import tasks_cancel_subtree
    from coordination.services.timers import timers_cancel_subtree

    return (
        groups_end_subtree,  # finalize groups gated in the subtree; lock groups of members in it
        tasks_cancel_subtree,
        groups_reevaluate_after_subtree_end,  # members elsewhere' groups may now be decided
        messages_cancel_subtree,
        barriers_cancel_subtree,
        timers_cancel_subtree,
    )


def subtree_end(end: SubtreeEnd) -> None:
    """Apply every step to the subtree of ``end.run``, inside the caller's transaction."""
    for step in cascade_steps():
        step(end)
