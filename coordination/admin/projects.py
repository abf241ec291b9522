"""Projects: created through ``project_ensure``, never renamed or deleted here."""

from django.contrib import admin

from coordination.models import Project
from coordination.services.keys import project_ensure

from .base import ServiceBackedAdmin


@admin.register(Project)
class ProjectAdmin(ServiceBackedAdmin):
    list_display = ("name", "created_at")
    search_fields = ("name",)
    fields = ("name", "id", "created_at")
    readonly_fields = ("id", "created_at")

    def get_fields(self, request, obj=None):  # noqa: D102
        return ("name",) if obj is None else self.fields

    def has_change_permission(self, request, obj=None):  # noqa: D102
        # The name is how `create_api_key --project NAME` finds a project: renaming one here
        # would make the next call create a second project.
        return False

    def has_delete_permission(self, request, obj=None):  # noqa: D102
        # Deleting a project would delete its keys and events outside any service.
        return False

    def create_through_service(self, request, form):  # noqa: D102
        return project_ensure(name=form.cleaned_data["name"])
