"""Which projects a staff user may see in the admin and the dashboard, and reads kept to them.

Superusers, and staff holding ``coordination.view_every_project``, see every project. Other
staff see the projects whose ``staff_groups`` hold one of their groups, and no other: the
dashboard, its panels and stream, and the admin's lists and pages of project-owned rows.
"""

import uuid
from collections.abc import Collection

from django.db.models import QuerySet

from coordination.models import Project

# The projects a read covers: None for every project, one project's id, or several ids.
ProjectScope = uuid.UUID | Collection[uuid.UUID] | None

VIEW_EVERY_PROJECT = "coordination.view_every_project"


def of_projects(queryset: QuerySet, projects: ProjectScope, field: str = "project_id") -> QuerySet:
    """Return ``queryset`` kept to ``projects`` (through ``field``)."""
    if projects is None:
        return queryset
    if isinstance(projects, uuid.UUID):
        return queryset.filter(**{field: projects})
    return queryset.filter(**{f"{field}__in": list(projects)})


def sees_every_project(user) -> bool:
    """Return whether ``user`` may see every project (a superuser, or the permission's holder)."""
    return bool(user.is_active and user.is_staff and (user.is_superuser or user.has_perm(VIEW_EVERY_PROJECT)))


def visible_projects(user) -> QuerySet[Project]:
    """Return the projects ``user`` may see in the admin and the dashboard."""
    if sees_every_project(user):
        return Project.objects.all()
    if not (user.is_active and user.is_staff):
        return Project.objects.none()
    through = Project.staff_groups.through.objects.filter(group__user=user)
    return Project.objects.filter(id__in=through.values("project_id"))


def project_scope(user) -> list[uuid.UUID] | None:
    """Return the ids of the projects ``user`` may see, or None when they see every project."""
    if sees_every_project(user):
        return None
    return list(visible_projects(user).values_list("id", flat=True))
