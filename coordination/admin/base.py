"""What the coordination admins share: links, and rows created and changed the house way."""

import uuid

from django.conf import settings
from django.contrib import admin
from django.contrib.admin.utils import quote
from django.db.models import Model
from django.urls import reverse
from django.utils.html import format_html

from coordination.models import Project
from coordination.reads.project_scope import of_projects, project_scope, visible_projects


def change_url(obj: Model) -> str:
    """Return the admin change page of ``obj``."""
    opts = obj._meta
    return reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[quote(obj.pk)])


def changelist_url(model: type[Model]) -> str:
    """Return the admin changelist of ``model``."""
    opts = model._meta
    return reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist")


def change_link(obj: Model, label: object = None) -> str:
    """Return an HTML link to the change page of ``obj``."""
    return format_html('<a href="{}">{}</a>', change_url(obj), obj if label is None else label)


def trace_link(trace_id: str) -> str:
    """Return ``trace_id`` as a link to ``RUNSTATE_TRACE_URL`` (its ``{trace_id}`` filled in), or as text.

    Only an http(s) URL becomes a link; no trace id shows a dash.
    """
    if not trace_id:
        return "—"
    template = settings.RUNSTATE_TRACE_URL
    if "{trace_id}" not in template or not template.startswith(("https://", "http://")):
        return trace_id
    url = template.replace("{trace_id}", trace_id)
    return format_html('<a href="{}" target="_blank" rel="noopener noreferrer">{}</a>', url, trace_id)


class VisibleRelatedFilter(admin.RelatedFieldListFilter):
    """A filter on a project, or on a project's row, offering only those the user may see."""

    def limit_choices(self, field, request) -> dict:
        """Return the filter that keeps the choices to the user's projects (none: every project)."""
        ids = project_scope(request.user)
        if ids is None:
            return {}
        return {"id__in": ids} if field.related_model is Project else {"project_id__in": ids}

    def field_choices(self, field, request, model_admin):  # noqa: D102
        ordering = self.field_admin_ordering(field, request, model_admin)
        limit = self.limit_choices(field, request)
        return field.get_choices(include_blank=False, ordering=ordering, limit_choices_to=limit or None)


class ProjectScopedAdmin(admin.ModelAdmin):
    """Show a staff user only the rows of the projects they may see (``coordination.reads.project_scope``).

    The lists, the change pages (a row of another project is answered as one that does not
    exist), the actions (they act on the listed rows), the project filter and the project
    choices of add forms.
    """

    # The field that names the row's project (the project's own id on the project admin).
    project_field = "project_id"

    def get_queryset(self, request):  # noqa: D102
        return of_projects(super().get_queryset(request), project_scope(request.user), self.project_field)

    def get_list_filter(self, request):  # noqa: D102
        # A filter on a project or a project's row (a mailbox, a pool) lists its choices:
        # only the user's projects' ones.
        return tuple(
            (name, VisibleRelatedFilter) if self._filters_on_project_owned(name) else name
            for name in super().get_list_filter(request)
        )

    def _filters_on_project_owned(self, name: object) -> bool:
        if not isinstance(name, str) or "__" in name:
            return False
        field = next((f for f in self.model._meta.get_fields() if f.name == name), None)
        related = getattr(field, "related_model", None) if field is not None and field.many_to_one else None
        return related is not None and (
            related is Project or any(f.name == "project" for f in related._meta.get_fields())
        )

    def formfield_for_foreignkey(self, db_field, request, **kwargs):  # noqa: D102
        if db_field.name == "project":
            kwargs["queryset"] = visible_projects(request.user)
        return super().formfield_for_foreignkey(db_field, request, **kwargs)


class ServiceBackedAdmin(admin.ModelAdmin):
    """Create rows through a service and change only plain labels, never state.

    On add, ``create_through_service`` makes the row (the admin still logs it and redirects as
    usual). On change, only the fields in ``editable_on_change`` are written, with
    ``update_fields``: the admin's copy of the row was read before the form was posted, and a
    full ``save()`` would write back state that a service changed in the meantime.
    """

    editable_on_change: tuple[str, ...] = ()

    def create_through_service(self, request, form) -> Model:
        """Create the row from a valid add form through its service, and return it."""
        raise NotImplementedError

    def save_form(self, request, form, change):  # noqa: D102
        if change:
            return super().save_form(request, form, change)
        return self.create_through_service(request, form)

    def save_model(self, request, obj, form, change):  # noqa: D102
        if not change:
            return  # the service saved it in save_form
        fields = [name for name in self.editable_on_change if name in form.changed_data]
        if fields:
            obj.save(update_fields=fields)

    def save_related(self, request, form, formsets, change):  # noqa: D102
        if change:
            super().save_related(request, form, formsets, change)


def parse_uuid(text: str) -> uuid.UUID | None:
    """Return ``text`` as a UUID, or None when it is not one."""
    try:
        return uuid.UUID(text.strip())
    except ValueError:
        return None


def count_of(number: int, noun: str) -> str:
    """Return ``number`` with ``noun``, plural unless it is one ("1 run", "2 runs")."""
    return f"{number} {noun}{'' if number == 1 else 's'}"
