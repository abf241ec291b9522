"""django-celery-beat's periodic tasks, with their actions guarded by the change permission.

The package's own admin declares no permission on its four actions (enable, disable, toggle,
run now), so a staff user who may only view periodic tasks could run or switch them. This
admin is the package's, registered again with each action asking for ``change``.
"""

from django.contrib import admin
from django_celery_beat.admin import PeriodicTaskAdmin  # importing it registers it: unregister below
from django_celery_beat.models import PeriodicTask


def _needs_change(name: str):
    """Return the package's action ``name``, declared to need the change permission."""
    inherited = getattr(PeriodicTaskAdmin, name)

    def action(modeladmin, request, queryset):
        return inherited(modeladmin, request, queryset)

    action.__name__ = name
    return admin.action(description=inherited.short_description, permissions=["change"])(action)


admin.site.unregister(PeriodicTask)


@admin.register(PeriodicTask)
class GuardedPeriodicTaskAdmin(PeriodicTaskAdmin):
    """The package's periodic task admin; every action needs the change permission."""

    enable_tasks = _needs_change("enable_tasks")
    disable_tasks = _needs_change("disable_tasks")
    toggle_tasks = _needs_change("toggle_tasks")
    run_tasks = _needs_change("run_tasks")
