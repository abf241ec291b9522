"""The append-only event log."""

from django.db import models
from django.db.models import Q
from django.utils import timezone


class Event(models.Model):
    """One state change, written in the same transaction as the change.

    ``txid`` is the writing transaction's id on PostgreSQL (``pg_current_xact_id()``). Readers
    order by ``(txid, id)`` and only return events of transactions older than every
    transaction still running in this database (``selectors.EVENT_HORIZON_SQL``): a
    transaction that commits late can then never slip an event in behind a reader's cursor.
    On SQLite writers are serialized, so ``txid`` is 0 and id order is commit order.
    """

    id = models.BigAutoField(primary_key=True)
    txid = models.BigIntegerField(editable=False)
    # No index of its own: event_project_cursor leads with it.
    project = models.ForeignKey("coordination.Project", on_delete=models.CASCADE, related_name="+", db_index=False)
    type = models.CharField(max_length=64)
    run_id = models.UUIDField(null=True, blank=True)
    # The run's materialized path, so ``?runId=`` matches the run and every run below it.
    run_path = models.TextField(blank=True, default="")
    subject_id = models.CharField(max_length=64, blank=True, default="")
    data = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["txid", "id"]
        indexes = [
            models.Index(fields=["project", "txid", "id"], name="event_project_cursor"),
            # The few events that stop a claim its worker did not end itself (``heldBy``, see
            # ``services/task_transitions.held_event_data``): the claim watches' feed reads them
            # alone, however many other events a drain writes.
            models.Index(fields=["project", "txid", "id"], name="event_held_by", condition=Q(data__has_key="heldBy")),
        ]

    def __str__(self) -> str:
        return f"{self.type} {self.subject_id}"
