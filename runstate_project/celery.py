"""The Celery app, configured from Django settings under the ``CELERY_`` namespace."""

import os

from celery import Celery
from celery.signals import beat_init, worker_init

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


@worker_init.connect
def _keep_database_connections(sender=None, **kwargs) -> None:
    """Let worker threads keep their database connection between tasks.

    The API runs each request in a thread of its own, so there ``CONN_MAX_AGE`` stays 0; a
    worker's pool threads live on, and reconnecting for every sweep or wake-up would cost
    more than the work itself.
    """
    from django.conf import settings

    max_age = int(os.environ.get("RUNSTATE_WORKER_CONN_MAX_AGE", "300"))
    settings.DATABASES["default"]["CONN_MAX_AGE"] = max_age
    from django.db import connections

    connections["default"].settings_dict["CONN_MAX_AGE"] = max_age
