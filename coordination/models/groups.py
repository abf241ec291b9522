"""Task groups: a set of tasks decided exactly once, and their members' verdicts."""

from django.db import models
from django.utils import timezone

from coordination.domain.ids import uuid7
from coordination.domain.states import GroupCondition, GroupOutcome, GroupState, Verdict

MAX_MEMBERS = 100


class TaskGroup(models.Model):
    """A group owns its gate run (``scope``): its members are tasks delivered on the gate.

    Finalizing records the outcome and cancels the gate in the same transaction, so from
    that commit on no worker can claim the group's remaining work.
    """

    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    project = models.ForeignKey("coordination.Project", on_delete=models.CASCADE, related_name="+")
    mailbox = models.ForeignKey("coordination.Mailbox", on_delete=models.PROTECT, related_name="groups")
    scope = models.OneToOneField("coordination.Run", on_delete=models.PROTECT, related_name="gated_group")
    parent_scope = models.ForeignKey(
        "coordination.Run", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    name = models.CharField(max_length=200, blank=True, default="")
    condition = models.CharField(max_length=16, choices=GroupCondition)
    threshold = models.PositiveSmallIntegerField(null=True, blank=True)
    expected_members = models.PositiveSmallIntegerField(null=True, blank=True)
    deadline = models.DateTimeField(null=True, blank=True)
    state = models.CharField(max_length=16, choices=GroupState, default=GroupState.OPEN)
    outcome = models.CharField(max_length=16, choices=GroupOutcome, null=True, blank=True)  # noqa: DJ001
    outcome_reason = models.CharField(max_length=32, null=True, blank=True)  # noqa: DJ001
    # Maintained under the group's row lock, so GROUP_FULL and expectedMembers hold under races.
    member_count = models.PositiveSmallIntegerField(default=0, editable=False)
    # The condition table's counters over ALL members, late verdicts included
    # (``group_rules.recount``), kept under the group's row lock: verdicts and member inserts
    # write them in their own statements; a member task's state change, wherever it happens,
    # through the ``coordination_task_group_counts`` trigger (docs/internals.md, "Group counters").
    accepted_count = models.PositiveSmallIntegerField(default=0, editable=False)
    rejected_count = models.PositiveSmallIntegerField(default=0, editable=False)
    acceptable_count = models.PositiveSmallIntegerField(default=0, editable=False)
    finished_count = models.PositiveSmallIntegerField(default=0, editable=False)
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    closed_at = models.DateTimeField(null=True, blank=True)
    finalized_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["created_at", "id"]
        indexes = [
            models.Index(fields=["project", "created_at", "id"], name="group_project_created"),
            models.Index(fields=["deadline"], condition=~models.Q(state="FINALIZED"), name="group_undecided_deadline"),
        ]

    def __str__(self) -> str:
        return f"{self.name or 'group'} {self.id} ({self.state})"


class GroupMember(models.Model):
    """A task's membership of a group, with the verdict it received."""

    id = models.BigAutoField(primary_key=True)
    group = models.ForeignKey(TaskGroup, on_delete=models.CASCADE, related_name="members")
    task = models.OneToOneField("coordination.Task", on_delete=models.CASCADE, related_name="membership")
    verdict = models.CharField(max_length=16, choices=Verdict, null=True, blank=True)  # noqa: DJ001
    # A verdict recorded after the group finalized: kept, never changes the outcome.
    late = models.BooleanField(default=False)
    verdict_at = models.DateTimeField(null=True, blank=True)
    joined_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return f"member {self.task_id} of {self.group_id}"
