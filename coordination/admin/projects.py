"""Projects: created through ``project_ensure``, never renamed or deleted here.

A project's change page edits only its ``staff_groups``: the staff who see it in the admin
and the dashboard besides superusers (``coordination.reads.project_scope``).
"""

from django.contrib import admin

from coordination.models import Project
from coordination.services.keys import project_ensure

from .base import ProjectScopedAdmin, ServiceBackedAdmin


@admin.register(Project)
class ProjectAdmin(ProjectScopedAdmin, ServiceBackedAdmin):
    list_display = ("name", "created_at")
    search_fields = ("name",)
    fields = ("name", "id", "created_at", "staff_groups")
    filter_horizontal = ("staff_groups",)
    project_field = "id"

    def get_fields(self, request, obj=None):  # noqa: D102
        return ("name",) if obj is None else self.fields

    def get_readonly_fields(self, request, obj=None):  # noqa: D102
        # The name is how `create_api_key --project NAME` finds a project: renaming one here
        # would make the next call create a second project.
        return () if obj is None else ("name", "id", "created_at")

    def has_delete_permission(self, request, obj=None):  # noqa: D102
        # Deleting a project would delete its keys and events outside any service.
        return False

    def create_through_service(self, request, form):  # noqa: D102
        return project_ensure(name=form.cleaned_data["name"])
