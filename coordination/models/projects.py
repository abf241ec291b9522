"""Projects (tenants) and their API keys."""

from django.db import models
from django.utils import timezone

from coordination.domain.ids import uuid7
from coordination.domain.states import Permission


class Project(models.Model):
    """A tenant: every object belongs to exactly one project."""

    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    name = models.SlugField(max_length=100, unique=True)
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    # Who among the staff sees the project in the admin and the dashboard, besides superusers
    # and holders of view_every_project (coordination/reads/project_scope.py).
    staff_groups = models.ManyToManyField(
        "auth.Group",
        blank=True,
        related_name="runstate_projects",
        help_text="Staff in these groups see this project in the admin and the dashboard.",
    )

    class Meta:
        ordering = ["name"]
        permissions = [("view_every_project", "Can see every project in the admin and the dashboard")]

    def __str__(self) -> str:
        return self.name


class ApiKey(models.Model):
    """A bearer credential; only the SHA-256 of the key is stored, never the key itself.

    The key reads ``rs_<prefix>_<secret>``: ``prefix`` finds the row through a unique index,
    the hash of the whole key is then compared in constant time.
    """

    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=200, blank=True, default="")
    prefix = models.CharField(max_length=16, unique=True, editable=False)
    key_hash = models.CharField(max_length=64, editable=False)
    permissions = models.JSONField(default=list)
    # A key bound to a run sees and changes only that run and the runs below it.
    run = models.ForeignKey(
        "coordination.Run",
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="bound_keys",
    )
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True, editable=False)
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"rs_{self.prefix}_… ({self.name or 'unnamed'})"

    def has_permission(self, permission: Permission | str) -> bool:
        """Tell whether the key carries ``permission``."""
        return str(permission) in self.permissions

    def is_usable(self, now=None) -> bool:
        """Tell whether the key is neither revoked nor expired."""
        now = now or timezone.now()
        if self.revoked_at is not None:
            return False
        return self.expires_at is None or self.expires_at > now
