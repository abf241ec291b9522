"""The condition table of DESIGN.md "Task groups", as pure functions.

No database here: ``decide`` takes the group's counters and says whether it is decided.
The counters (``GroupCounts``) are what ``recount`` gives over ALL the group's members,
late verdicts included; ``TaskGroup`` keeps them on its row (docs/internals.md, "Group
counters"), and ``member_counts`` is one member's share of them.
"""

from collections.abc import Iterable
from dataclasses import dataclass

from coordination.domain.states import TASK_TERMINAL, GroupCondition, GroupOutcome, TaskState, Verdict


@dataclass(frozen=True)
class MemberFacts:
    """What the rules need to know of one member."""

    task_state: str
    verdict: str | None


@dataclass(frozen=True)
class GroupCounts:
    """A group's counters: members, verdicts, and members still acceptable and finished."""

    members: int = 0
    accepted: int = 0
    rejected: int = 0
    acceptable: int = 0
    finished: int = 0

    def __add__(self, other: "GroupCounts") -> "GroupCounts":
        return GroupCounts(*(a + b for a, b in zip(self.astuple(), other.astuple(), strict=True)))

    def __sub__(self, other: "GroupCounts") -> "GroupCounts":
        return GroupCounts(*(a - b for a, b in zip(self.astuple(), other.astuple(), strict=True)))

    def astuple(self) -> tuple[int, int, int, int, int]:
        return (self.members, self.accepted, self.rejected, self.acceptable, self.finished)


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


def member_counts(member: MemberFacts) -> GroupCounts:
    """Return one member's share of its group's counters."""
    return GroupCounts(
        members=1,
        accepted=int(member.verdict == Verdict.ACCEPTED),
        rejected=int(member.verdict == Verdict.REJECTED),
        acceptable=int(still_acceptable(member)),
        finished=int(finished(member)),
    )


def recount(members: Iterable[MemberFacts]) -> GroupCounts:
    """Return the counters of a group with these members (what the stored counters must equal)."""
    total = GroupCounts()
    for member in members:
        total += member_counts(member)
    return total


def decide(
    *,
    condition: str,
    threshold: int | None,
    closed: bool,
    counts: GroupCounts,
    deadline_passed: bool,
) -> tuple[GroupOutcome, str] | None:
    """Return ``(outcome, reason)`` when the group is decided, else None.

    A success that holds wins over a deadline that passed in the same evaluation: the
    deciding verdict was recorded before anyone looked at the clock.
    """
    accepted = counts.accepted
    if condition == GroupCondition.FIRST_ACCEPTED:
        if accepted >= 1:
            return GroupOutcome.SUCCESS, "first_accepted"
    elif condition == GroupCondition.N_ACCEPTED:
        assert threshold is not None
        if accepted >= threshold:
            return GroupOutcome.SUCCESS, "threshold_reached"
        if closed and accepted + counts.acceptable < threshold:
            return GroupOutcome.FAILURE, "threshold_unreachable"
    elif condition == GroupCondition.ALL_TERMINAL:
        if closed and counts.finished == counts.members:
            if accepted >= 1 and counts.rejected == 0:
                return GroupOutcome.SUCCESS, "all_terminal"
            return GroupOutcome.FAILURE, "all_terminal"
    if deadline_passed:
        return GroupOutcome.FAILURE, "deadline"
    return None
