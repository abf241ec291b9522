"""The condition table of DESIGN.md "Task groups", as one pure function.

No database here: ``decide`` takes what the group knows and says whether it is decided.
"""

from collections.abc import Iterable
from dataclasses import dataclass

from coordination.states import TASK_TERMINAL, GroupCondition, GroupOutcome, TaskState, Verdict


@dataclass(frozen=True)
class MemberFacts:
    """What the rules need to know of one member."""

    task_state: str
    verdict: str | None


def still_acceptable(member: MemberFacts) -> bool:
    """Tell whether the member could still be accepted: unfinished, or succeeded and unjudged."""
    if member.task_state not in TASK_TERMINAL:
        return True
    return member.task_state == TaskState.SUCCEEDED and member.verdict is None


def finished(member: MemberFacts) -> bool:
    """Tell whether the member is done for ALL_TERMINAL: terminal, and judged if it succeeded."""
    if member.task_state not in TASK_TERMINAL:
        return False
    return member.task_state != TaskState.SUCCEEDED or member.verdict is not None


def decide(
    *,
    condition: str,
    threshold: int | None,
    closed: bool,
    members: Iterable[MemberFacts],
    deadline_passed: bool,
) -> tuple[GroupOutcome, str] | None:
    """Return ``(outcome, reason)`` when the group is decided, else None.

    A success that holds wins over a deadline that passed in the same evaluation: the
    deciding verdict was recorded before anyone looked at the clock.
    """
    members = list(members)
    accepted = sum(1 for m in members if m.verdict == Verdict.ACCEPTED)
    if condition == GroupCondition.FIRST_ACCEPTED:
        if accepted >= 1:
            return GroupOutcome.SUCCESS, "first_accepted"
    elif condition == GroupCondition.N_ACCEPTED:
        assert threshold is not None
        if accepted >= threshold:
            return GroupOutcome.SUCCESS, "threshold_reached"
        if closed and accepted + sum(1 for m in members if still_acceptable(m)) < threshold:
            return GroupOutcome.FAILURE, "threshold_unreachable"
    elif condition == GroupCondition.ALL_TERMINAL:
        if closed and all(finished(m) for m in members):
            rejected = sum(1 for m in members if m.verdict == Verdict.REJECTED)
            if accepted >= 1 and rejected == 0:
                return GroupOutcome.SUCCESS, "all_terminal"
            return GroupOutcome.FAILURE, "all_terminal"
    if deadline_passed:
        return GroupOutcome.FAILURE, "deadline"
    return None
