"""Admissions: room for at most ``maxActive`` child runs of a run at once, first come first served."""

from django.db import models
from django.db.models import Q
from django.utils import timezone

from coordination.domain.ids import uuid7
from coordination.domain.states import AdmissionState


class AdmissionConfig(models.Model):
    """The admission limit of one parent run and its counters, changed only under this row's lock.

    Created by ``PUT /runs/{id}/admission``, or unconfigured (``max_active`` null: every
    admission is admitted at once) by the first admission request, so the counters are right
    whenever a limit is set later.
    """

    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    project = models.ForeignKey("coordination.Project", on_delete=models.CASCADE, related_name="+")
    run = models.OneToOneField("coordination.Run", on_delete=models.PROTECT, related_name="admission_config")
    run_path = models.TextField(editable=False)
    max_active = models.PositiveIntegerField(null=True, blank=True)  # null: not configured, no limit
    admitted = models.PositiveIntegerField(default=0)  # admitted children still active
    waiting = models.PositiveIntegerField(default=0)
    # The next waiter's place in line: strict FIFO by ticket, handed out under the row lock.
    next_ticket = models.BigIntegerField(default=1, editable=False)
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["created_at", "id"]

    def __str__(self) -> str:
        limit = "unlimited" if self.max_active is None else self.max_active
        return f"admission of run {self.run_id} ({self.admitted}/{limit} admitted, {self.waiting} waiting)"


class Admission(models.Model):
    """One request for a child run: waits in line, then is admitted with its run (or leaves)."""

    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    project = models.ForeignKey("coordination.Project", on_delete=models.CASCADE, related_name="+")
    config = models.ForeignKey(AdmissionConfig, on_delete=models.CASCADE, related_name="admissions")
    parent = models.ForeignKey("coordination.Run", on_delete=models.PROTECT, related_name="+")
    parent_path = models.TextField(editable=False)
    ticket = models.BigIntegerField(editable=False)
    key = models.CharField(max_length=200, null=True, blank=True)  # noqa: DJ001 - null: no key
    name = models.CharField(max_length=200, blank=True, default="")
    deadline = models.DateTimeField(null=True, blank=True)  # the child run's, once created
    state = models.CharField(max_length=16, choices=AdmissionState, default=AdmissionState.WAITING)
    run = models.OneToOneField(
        "coordination.Run", null=True, blank=True, on_delete=models.PROTECT, related_name="admission"
    )
    run_path = models.TextField(blank=True, default="", editable=False)  # the child's, once admitted
    # Admitted and its child not yet ended: counted in ``AdmissionConfig.admitted``.
    holds_slot = models.BooleanField(default=False)
    end_code = models.CharField(max_length=32, null=True, blank=True)  # noqa: DJ001 - the code a CANCELLED one answers
    end_run_id = models.UUIDField(null=True, blank=True)  # the run that caused ``end_code``
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    admitted_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)  # withdrawn or cancelled
    released_at = models.DateTimeField(null=True, blank=True)  # its child ended, freeing the slot

    class Meta:
        ordering = ["created_at", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["parent", "key"], condition=Q(key__isnull=False), name="admission_key_once"
            ),
        ]
        indexes = [
            models.Index(fields=["config", "ticket"], condition=Q(state="WAITING"), name="admission_waiting_line"),
            models.Index(fields=["config", "created_at"], name="admission_config_created"),
        ]

    def __str__(self) -> str:
        return f"admission {self.id} ({self.state})"
