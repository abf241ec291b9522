"""Mailboxes and the work they hold: tasks (WORK) and messages (QUEUE)."""

from django.db import models
from django.db.models import Q
from django.utils import timezone

from coordination.domain.ids import uuid7
from coordination.domain.states import MailboxMode, MessageState, TaskState

DEFAULT_LEASE_TTL_MS = 30_000
DEFAULT_MAX_ATTEMPTS = 3


class Mailbox(models.Model):
    """A named place for work in a project, ensured idempotently."""

    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    project = models.ForeignKey("coordination.Project", on_delete=models.CASCADE, related_name="mailboxes")
    name = models.CharField(max_length=100)
    mode = models.CharField(max_length=8, choices=MailboxMode)
    lease_ttl_ms = models.PositiveIntegerField(default=DEFAULT_LEASE_TTL_MS)
    max_attempts = models.PositiveIntegerField(default=DEFAULT_MAX_ATTEMPTS)
    created_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["name"]
        verbose_name_plural = "mailboxes"
        constraints = [models.UniqueConstraint(fields=["project", "name"], name="mailbox_unique_name")]

    def __str__(self) -> str:
        return f"{self.name} ({self.mode})"


class Task(models.Model):
    """A unit of work in a WORK mailbox, done once under a lease.

    The current claim is ``(id, attempts)``: every claim operation is a guarded update on
    ``attempts`` and a held state, so a stale claim changes nothing (``LEASE_LOST``).
    """

    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    # No index of their own: task_project_state and task_run_created lead with them.
    project = models.ForeignKey("coordination.Project", on_delete=models.CASCADE, related_name="+", db_index=False)
    mailbox = models.ForeignKey(Mailbox, on_delete=models.PROTECT, related_name="tasks")
    run = models.ForeignKey("coordination.Run", on_delete=models.PROTECT, related_name="tasks", db_index=False)
    # The run's path, copied so a cascade finds a subtree's tasks with one index range scan.
    run_path = models.TextField(editable=False)
    # The earliest deadline of the run's chain (deadlines never change after creation).
    run_deadline = models.DateTimeField(null=True, blank=True, editable=False)
    key = models.CharField(max_length=200, null=True, blank=True)  # noqa: DJ001 - null: no key (unique)
    input = models.JSONField(default=dict, blank=True)
    state = models.CharField(max_length=24, choices=TaskState, default=TaskState.QUEUED)
    outcome = models.JSONField(null=True, blank=True)
    error = models.JSONField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    max_attempts = models.PositiveIntegerField(default=DEFAULT_MAX_ATTEMPTS)
    priority = models.IntegerField(default=0)
    # Set once, when the task joins a group (group services lock the group before the task).
    # Indexed by task_group_member, only where set: most tasks belong to no group.
    group = models.ForeignKey(
        "coordination.TaskGroup",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="tasks",
        db_index=False,
    )
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    available_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    worker_id = models.CharField(max_length=200, blank=True, default="")
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    # When the current lease was granted or last extended (claim or renew); with
    # lease_expires_at it gives the claim's TTL, which a claim or renew may choose.
    last_renewed_at = models.DateTimeField(null=True, blank=True)
    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    cancel_grace_until = models.DateTimeField(null=True, blank=True)
    cancel_reason = models.TextField(null=True, blank=True)  # noqa: DJ001 - null: none given
    # The finished task this one reruns (``POST /v1/tasks/{id}/rerun``); null unless a rerun.
    # Indexed by task_rerun_of, only where set: most tasks are no rerun.
    rerun_of = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="reruns", db_index=False
    )
    # The submitter's W3C trace context (``coordination.plumbing.tracing``): a claim answers it, and the
    # worker's span is its child. Empty when the submitter traced nothing.
    traceparent = models.CharField(max_length=55, blank=True, default="", db_default="")
    tracestate = models.CharField(max_length=512, blank=True, default="", db_default="")

    class Meta:
        ordering = ["created_at", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["mailbox", "run", "key"], condition=Q(key__isnull=False), name="task_unique_key"
            )
        ]
        indexes = [
            # The claim query: exactly one run's queued tasks, highest priority, then oldest.
            models.Index(
                fields=["mailbox", "run", "-priority", "created_at"],
                condition=Q(state="QUEUED"),
                name="task_claimable",
            ),
            # Lease takeover and the lease sweep.
            models.Index(
                fields=["lease_expires_at"],
                condition=Q(state__in=["RUNNING", "CANCELLATION_REQUESTED"]),
                name="task_held_lease",
            ),
            models.Index(fields=["expires_at"], condition=Q(state="QUEUED"), name="task_queued_expiry"),
            models.Index(fields=["project", "state"], name="task_project_state"),
            models.Index(fields=["run", "created_at"], name="task_run_created"),
            models.Index(fields=["group"], condition=Q(group__isnull=False), name="task_group_member"),
            models.Index(fields=["rerun_of"], condition=Q(rerun_of__isnull=False), name="task_rerun_of"),
        ]

    def __str__(self) -> str:
        return f"task {self.id} ({self.state})"


class Message(models.Model):
    """A message in a QUEUE mailbox, delivered under a visibility lease.

    The current delivery is ``(id, attempts)``, fenced like a task's claim.
    """

    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    project = models.ForeignKey("coordination.Project", on_delete=models.CASCADE, related_name="+")
    mailbox = models.ForeignKey(Mailbox, on_delete=models.PROTECT, related_name="messages")
    run = models.ForeignKey("coordination.Run", on_delete=models.PROTECT, related_name="messages")
    run_path = models.TextField(editable=False)
    key = models.CharField(max_length=200, null=True, blank=True)  # noqa: DJ001 - null: no key (unique)
    body = models.JSONField(default=dict, blank=True)
    state = models.CharField(max_length=16, choices=MessageState, default=MessageState.QUEUED)
    attempts = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    visible_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)
    dead_letter_reason = models.TextField(null=True, blank=True)  # noqa: DJ001 - null: none given
    # The sender's W3C trace context, as on ``Task``: a delivery answers it.
    traceparent = models.CharField(max_length=55, blank=True, default="", db_default="")
    tracestate = models.CharField(max_length=512, blank=True, default="", db_default="")

    class Meta:
        ordering = ["created_at", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["mailbox", "run", "key"], condition=Q(key__isnull=False), name="message_unique_key"
            )
        ]
        indexes = [
            models.Index(
                fields=["mailbox", "run", "visible_at"],
                condition=Q(state__in=["QUEUED", "IN_FLIGHT"]),
                name="message_receivable",
            ),
            models.Index(fields=["run", "created_at"], name="message_run_created"),
        ]

    def __str__(self) -> str:
        return f"message {self.id} ({self.state})"
