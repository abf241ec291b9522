"""A group's stored counters beside a recount of its members, for the group tests.

The recount is written from DESIGN.md "Task groups" (``coordination.domain.group_rules`` deliberately
not used): accepted and rejected verdicts (late ones included), members still acceptable
(unfinished, or SUCCEEDED and unjudged) and finished (terminal, and judged if SUCCEEDED).
"""

from coordination.models import GroupMember, TaskGroup

TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED", "EXPIRED"}
COUNTERS = ("member_count", "accepted_count", "rejected_count", "acceptable_count", "finished_count")


def stored_counts(group_id) -> dict[str, int]:
    """Return the counters on the group's row."""
    return dict(zip(COUNTERS, TaskGroup.objects.filter(id=group_id).values_list(*COUNTERS).get(), strict=True))


def recounted(members) -> dict[str, int]:
    """Return the counters of a group whose members are these ``(task state, verdict)`` pairs."""
    members = list(members)
    return {
        "member_count": len(members),
        "accepted_count": sum(verdict == "ACCEPTED" for _, verdict in members),
        "rejected_count": sum(verdict == "REJECTED" for _, verdict in members),
        "acceptable_count": sum(
            state not in TERMINAL or (state == "SUCCEEDED" and verdict is None) for state, verdict in members
        ),
        "finished_count": sum(
            state in TERMINAL and (state != "SUCCEEDED" or verdict is not None) for state, verdict in members
        ),
    }


def recount(group_id) -> dict[str, int]:
    """Return the counters recounted from the group's member rows and their tasks."""
    return recounted(GroupMember.objects.filter(group_id=group_id).values_list("task__state", "verdict"))


def assert_counts_match(group_id) -> None:
    """Assert that the group's stored counters equal a recount of its members."""
    assert stored_counts(group_id) == recount(group_id)
