"""The Celery app, configured from Django settings under the ``CELERY_`` namespace."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "runstate_project.settings")

app = Celery("runstate_project")
app.config_from_object("django.conf:settings", namespace="CELERY")
# Every Celery task lives in the ``workers`` app (house rule: no coordination/tasks.py).
app.autodiscover_tasks(["workers"])
