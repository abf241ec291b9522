"""Pools: how many units of a scarce thing (GPUs, browser sessions) are held at once."""

from django.db import models
from django.db.models import Q
from django.utils import timezone

from coordination.domain.ids import uuid7
from coordination.domain.states import PoolLeaseState


class Pool(models.Model):
    """A named concurrency limit of a project; ``in_use`` is kept exact under the row's lock."""

    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    project = models.ForeignKey("coordination.Project", on_delete=models.CASCADE, related_name="+")
    name = models.CharField(max_length=200)
    capacity = models.PositiveIntegerField()
    # Units of HELD leases; changed only under this row's lock, in the transaction (or the one
    # statement, on the fast paths) that grants, releases or expires them.
    in_use = models.PositiveIntegerField(default=0)
    # Requests ever queued or granted: the arrival number of the next one (strict FIFO).
    arrivals = models.PositiveBigIntegerField(default=0)
    # WAITING lease rows, gone waiters (past their expiry, not yet timed out) included: kept
    # exact under this row's lock by every path that queues, grants or ends a waiter. The fast
    # paths grant and release only when it is 0 (no queue to respect or to grant).
    waiting = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]
        constraints = [models.UniqueConstraint(fields=["project", "name"], name="pool_name_per_project")]

    def __str__(self) -> str:
        return f"pool {self.name} ({self.in_use}/{self.capacity})"


class PoolLease(models.Model):
    """One request for units of a pool: a waiter row while queued, then the lease once granted."""

    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    project = models.ForeignKey("coordination.Project", on_delete=models.CASCADE, related_name="+")
    pool = models.ForeignKey(Pool, on_delete=models.CASCADE, related_name="leases")
    run = models.ForeignKey("coordination.Run", on_delete=models.PROTECT, related_name="pool_leases")
    run_path = models.TextField(editable=False)
    units = models.PositiveIntegerField()
    lease_ttl_ms = models.PositiveIntegerField()
    key = models.CharField(max_length=200, blank=True, default="")
    state = models.CharField(max_length=16, choices=PoolLeaseState, default=PoolLeaseState.WAITING)
    # Its place in the pool's queue, taken under the pool's lock: the grant order.
    arrival = models.PositiveBigIntegerField()
    # HELD: when the lease runs out. WAITING: when its caller has surely gone (waitMs + slack).
    expires_at = models.DateTimeField()
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    granted_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["arrival"]
        indexes = [
            models.Index(fields=["pool", "arrival"], condition=Q(state="WAITING"), name="poollease_waiting"),
            models.Index(fields=["expires_at"], condition=Q(state__in=["WAITING", "HELD"]), name="poollease_open_due"),
            models.Index(fields=["run", "created_at"], name="poollease_run_created"),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["pool", "key"],
                condition=Q(state__in=["WAITING", "HELD"]) & ~Q(key=""),
                name="poollease_open_key_once",
            )
        ]

    def __str__(self) -> str:
        return f"{self.units} of pool {self.pool_id} ({self.state})"
