"""API keys: created through ``api_key_create`` (plaintext shown once), revoked, never deleted.

The plaintext of a new key is rendered into the add view's own response, a page sent with
``Cache-Control: no-store``. It never goes through ``messages``: their cookie is signed, not
encrypted, so anyone who sees the cookie (a proxy's log, a shared browser) would read the key.
"""

from django import forms
from django.contrib import admin, messages
from django.template.response import TemplateResponse
from django.utils import timezone
from django.utils.cache import add_never_cache_headers

from coordination.domain.states import Permission
from coordination.models import ApiKey
from coordination.services.keys import api_key_create, api_key_revoke

from .base import ProjectScopedAdmin, ServiceBackedAdmin, count_of


class ApiKeyCreateForm(forms.ModelForm):
    """The add form: what ``api_key_create`` needs, checked before it is called."""

    permissions = forms.MultipleChoiceField(
        choices=[(permission.value, permission.value) for permission in Permission],
        widget=forms.CheckboxSelectMultiple,
        help_text="resource_config: ensure mailboxes, create barriers; coordination_write: every other "
        "change; coordination_read: reads and waits.",
    )

    class Meta:
        model = ApiKey
        fields = ("project", "name", "permissions", "run", "expires_at")
        help_texts = {
            "run": "Optional: bind the key to this run; it then sees and changes only the run and the runs below it.",
            "expires_at": "Optional: the key stops working at this time.",
        }

    def clean_expires_at(self):  # noqa: D102
        expires_at = self.cleaned_data.get("expires_at")
        if expires_at is not None and expires_at <= timezone.now():
            raise forms.ValidationError("Choose a time in the future.")
        return expires_at

    def clean(self):  # noqa: D102
        cleaned_data = super().clean()
        project, run = cleaned_data.get("project"), cleaned_data.get("run")
        if project is not None and run is not None and run.project_id != project.id:
            self.add_error("run", "This run belongs to another project.")
        return cleaned_data


@admin.register(ApiKey)
class ApiKeyAdmin(ProjectScopedAdmin, ServiceBackedAdmin):
    list_display = (
        "name",
        "project",
        "prefix",
        "permission_list",
        "run",
        "created_at",
        "expires_at",
        "revoked_at",
        "last_used_at",
    )
    list_filter = ("project",)
    list_select_related = ("project", "run")
    search_fields = ("name", "=prefix")
    raw_id_fields = ("run",)
    actions = ("revoke_selected",)
    editable_on_change = ("name",)
    add_fields = ("project", "name", "permissions", "run", "expires_at")
    # key_hash is never shown: it is not secret, but nobody needs it.
    change_fields = (
        "name",
        "project",
        "prefix",
        "permission_list",
        "run",
        "status",
        "created_at",
        "expires_at",
        "revoked_at",
        "last_used_at",
    )

    def get_fields(self, request, obj=None):  # noqa: D102
        return self.add_fields if obj is None else self.change_fields

    def get_readonly_fields(self, request, obj=None):  # noqa: D102
        if obj is None:
            return ()
        return tuple(name for name in self.change_fields if name not in self.editable_on_change)

    def get_form(self, request, obj=None, change=False, **kwargs):  # noqa: D102
        if obj is None:
            kwargs["form"] = ApiKeyCreateForm
        return super().get_form(request, obj, change=change, **kwargs)

    def has_delete_permission(self, request, obj=None):  # noqa: D102
        return False  # revoke instead: the row stays as the record of who had access

    def create_through_service(self, request, form):  # noqa: D102
        data = form.cleaned_data
        issued = api_key_create(
            project_id=data["project"].id,
            permissions=data["permissions"],
            name=data["name"],
            run_id=data["run"].id if data["run"] else None,
            expires_at=data["expires_at"],
        )
        # The only time the plaintext exists outside the caller's hands: only its hash is stored.
        # It rides on this request alone, to the page response_add renders.
        request.runstate_new_key = issued.plaintext
        return issued.api_key

    def response_add(self, request, obj, post_url_continue=None):
        """Show the new key once, on a page of its own, instead of redirecting with a message."""
        context = {
            **self.admin_site.each_context(request),
            "title": "New API key",
            "opts": self.opts,
            "api_key": obj,
            "plaintext": request.runstate_new_key,
        }
        response = TemplateResponse(request, "admin/runstate/api_key_created.html", context)
        add_never_cache_headers(response)
        return response

    @admin.display(description="permissions")
    def permission_list(self, api_key: ApiKey) -> str:
        return ", ".join(api_key.permissions)

    @admin.display(description="status")
    def status(self, api_key: ApiKey) -> str:
        if api_key.revoked_at is not None:
            return "revoked"
        return "usable" if api_key.is_usable() else "expired"

    @admin.action(description="Revoke selected keys", permissions=["change"])
    def revoke_selected(self, request, queryset):
        revoked = already = 0
        for api_key in queryset.select_related(None).only("id", "revoked_at"):
            if api_key.revoked_at is not None:
                already += 1
                continue
            api_key_revoke(api_key_id=api_key.id)
            revoked += 1
        note = f" ({count_of(already, 'key')} already revoked)" if already else ""
        self.message_user(request, f"Revoked {count_of(revoked, 'key')}{note}.", messages.SUCCESS)
