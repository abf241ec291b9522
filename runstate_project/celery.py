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
    """Give each worker thread or process one persistent database connection.

    The connection pool exists for the API, where every request runs in a thread of its
    own; a worker's pool threads (or forked processes) live on, so a persistent connection
    each is simpler and cheaper, and a pool must not cross a fork anyway.
    """
    from django.conf import settings
    from django.db import connections

    max_age = int(os.environ.get("RUNSTATE_WORKER_CONN_MAX_AGE", "300"))
    for settings_dict in (settings.DATABASES["default"], connections["default"].settings_dict):
        settings_dict.get("OPTIONS", {}).pop("pool", None)
        settings_dict["CONN_MAX_AGE"] = max_age
