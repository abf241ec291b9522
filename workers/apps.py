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
        """Register Celery as the services' waker; import the decorated task modules; cache mailboxes in workers.

        The services send wake-ups through ``coordination.services.dispatch`` alone, which
        knows this app only by the registration made here (the domain imports no worker
        module). The task modules are imported so API processes know which mailboxes are
        bound to Celery.
        """
        from celery.signals import worker_init

        from coordination.services import dispatch
        from workers import dispatch as celery_dispatch
        from workers.decorators import cache_mailboxes_in_this_worker

        dispatch.waker_register(celery_dispatch)
        # A Celery worker (Django is set up before its worker_init): submits in its processes
        # read their mailbox through the process cache (workers.decorators).
        worker_init.connect(cache_mailboxes_in_this_worker, weak=False, dispatch_uid="runstate-cache-mailboxes")
        for module in task_modules():
            importlib.import_module(module)
