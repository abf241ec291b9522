"""App configuration for the Celery integration."""

import importlib
import os

from django.apps import AppConfig
from django.conf import settings


def task_modules() -> list[str]:
    """Return the modules declaring ``@runstate_task`` functions that every process imports at start."""
    configured = getattr(settings, "RUNSTATE_TASK_MODULES", None)
    if configured is None:
        configured = os.environ.get("RUNSTATE_TASK_MODULES", "").split(",")
    return [name.strip() for name in configured if name.strip()]


class WorkersConfig(AppConfig):
    """Register the workers app."""

    name = "workers"
    verbose_name = "Workers"

    def ready(self) -> None:
        """Import the decorated task modules, so API processes know which mailboxes are bound to Celery."""
        for module in task_modules():
            importlib.import_module(module)
