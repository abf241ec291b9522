"""The Celery app, configured from Django settings under the ``CELERY_`` namespace."""

import os

from celery import Celery
from celery.signals import beat_init

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "runstate_project.settings")

app = Celery("runstate_project")
app.config_from_object("django.conf:settings", namespace="CELERY")
# Every Celery task lives in the ``workers`` app (house rule: no coordination/tasks.py).
app.autodiscover_tasks(["workers"])


@beat_init.connect
def _ensure_periodic_sweeps(sender=None, **kwargs) -> None:
    """Register the sweeps each time beat starts (the migrations did it once already)."""
    import django
    from django.apps import apps

    if not apps.ready:
        django.setup()
    from workers.schedule import ensure_periodic_sweeps

    ensure_periodic_sweeps()
