"""Runs: nodes of a tree that scope all work and stop it when cancelled or completed."""

import uuid

from django.db import models
from django.utils import timezone

from coordination.domain.ids import path_ids, uuid7
from coordination.domain.states import RunState

MAX_DEPTH = 64


class Run(models.Model):
    """A run (scope).

    The tree is stored as a materialized path: ``path`` lists the ids of every ancestor and
    of the run itself, root first, each followed by ``/``. The ancestors of a run are read
    off its own row (no query per level) and its subtree is one prefix query
    (``path LIKE '<path>%'``), served on PostgreSQL by a ``text_pattern_ops`` index. Paths
    never change: runs are never moved.
    """

    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    project = models.ForeignKey("coordination.Project", on_delete=models.PROTECT, related_name="runs")
    parent = models.ForeignKey("self", null=True, blank=True, on_delete=models.PROTECT, related_name="children")
    path = models.TextField(editable=False)
    depth = models.PositiveSmallIntegerField(default=0, editable=False)
    name = models.CharField(max_length=200, blank=True, default="")
    stored_state = models.CharField(max_length=16, choices=RunState, default=RunState.ACTIVE)
    deadline = models.DateTimeField(null=True, blank=True)
    child_limit = models.PositiveIntegerField(default=1000)
    # Maintained under the parent's row lock by run_create, so childLimit holds under races.
    child_count = models.PositiveIntegerField(default=0, editable=False)
    cancel_reason = models.TextField(null=True, blank=True)  # noqa: DJ001 - null means "no reason given"
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    ended_at = models.DateTimeField(null=True, blank=True)
    # When the deadline sweep ended the subtree's work (the run's storedState stays ACTIVE).
    deadline_swept_at = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        ordering = ["created_at", "id"]
        indexes = [
            models.Index(fields=["project", "created_at", "id"], name="run_project_created"),
            models.Index(fields=["parent", "created_at", "id"], name="run_parent_created"),
            models.Index(
                fields=["deadline"],
                condition=models.Q(deadline__isnull=False, deadline_swept_at__isnull=True),
                name="run_deadline_unswept",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name or 'run'} {self.id}"

    @staticmethod
    def path_for(run_id: uuid.UUID, parent_path: str = "") -> str:
        """Return the materialized path of a run with ``run_id`` under ``parent_path``."""
        return f"{parent_path}{run_id}/"

    @property
    def chain_ids(self) -> list[uuid.UUID]:
        """Return the ids of the root, every ancestor and the run itself, root first."""
        return path_ids(self.path)

    @property
    def ancestor_ids(self) -> list[uuid.UUID]:
        """Return the ids of the run's ancestors, root first."""
        return self.chain_ids[:-1]
