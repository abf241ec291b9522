"""Barriers (wait for everyone) and durable timers (wake me later)."""

from django.db import models
from django.db.models import Q
from django.utils import timezone

from coordination.domain.ids import uuid7
from coordination.domain.states import BarrierState, TimerState


class Barrier(models.Model):
    """Releases once ``target`` distinct keys arrived in the current epoch."""

    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    project = models.ForeignKey("coordination.Project", on_delete=models.CASCADE, related_name="+")
    run = models.ForeignKey("coordination.Run", on_delete=models.PROTECT, related_name="barriers")
    run_path = models.TextField(editable=False)
    name = models.CharField(max_length=200, blank=True, default="")
    target = models.PositiveIntegerField()
    epoch = models.PositiveIntegerField(default=1)
    arrivals = models.PositiveIntegerField(default=0)
    state = models.CharField(max_length=16, choices=BarrierState, default=BarrierState.WAITING)
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    released_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["created_at", "id"]
        indexes = [models.Index(fields=["run", "created_at"], name="barrier_run_created")]

    def __str__(self) -> str:
        return f"{self.name or 'barrier'} {self.id} (epoch {self.epoch}, {self.state})"


class BarrierArrival(models.Model):
    """One key's arrival in one epoch; the unique constraint makes arrivals idempotent."""

    id = models.BigAutoField(primary_key=True)
    barrier = models.ForeignKey(Barrier, on_delete=models.CASCADE, related_name="arrival_rows")
    epoch = models.PositiveIntegerField()
    key = models.CharField(max_length=200)
    arrived_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["id"]
        constraints = [models.UniqueConstraint(fields=["barrier", "epoch", "key"], name="barrier_arrival_once")]

    def __str__(self) -> str:
        return f"{self.key} at epoch {self.epoch}"


class Timer(models.Model):
    """A durable wake-up that fires on the server at ``fire_at``."""

    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    project = models.ForeignKey("coordination.Project", on_delete=models.CASCADE, related_name="+")
    run = models.ForeignKey("coordination.Run", on_delete=models.PROTECT, related_name="timers")
    run_path = models.TextField(editable=False)
    # The earliest deadline of the run's chain: a timer due after it never fires.
    run_deadline = models.DateTimeField(null=True, blank=True, editable=False)
    state = models.CharField(max_length=16, choices=TimerState, default=TimerState.ARMED)
    fire_at = models.DateTimeField()
    fired_at = models.DateTimeField(null=True, blank=True)
    acknowledged_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["fire_at", "id"]
        indexes = [
            models.Index(fields=["fire_at"], condition=Q(state="ARMED"), name="timer_armed_due"),
            models.Index(fields=["run", "created_at"], name="timer_run_created"),
        ]

    def __str__(self) -> str:
        return f"timer {self.id} ({self.state} at {self.fire_at:%Y-%m-%d %H:%M:%S})"
