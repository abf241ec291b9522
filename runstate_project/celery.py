"""The Celery app, configured from Django settings under the ``CELERY_`` namespace."""

import os
import sys

from celery import Celery
from celery.signals import beat_init, worker_init

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "runstate_project.settings")

app = Celery("runstate_project")
app.config_from_object("django.conf:settings", namespace="CELERY")
# Every Celery task lives in the ``workers`` app (house rule: no coordination/tasks.py).
app.autodiscover_tasks(["workers"])


@worker_init.connect
@beat_init.connect
def _refuse_unsafe_database_routes(sender=None, **kwargs) -> None:
    """Stop a worker or beat whose database settings would break behind its pooler (coordination/plumbing/checks.py).

    Celery logs and swallows a signal handler's exceptions; ``SystemExit`` it lets through.
    """
    import django
    from django.apps import apps
    from django.core.exceptions import ImproperlyConfigured

    if not apps.ready:
        django.setup()
    from coordination.plumbing.checks import refuse_unsafe_database_routes

    try:
        refuse_unsafe_database_routes()
    except ImproperlyConfigured as refused:
        sys.stderr.write(f"{refused}\n")
        raise SystemExit(1) from refused


@worker_init.connect
def _trace_worker(sender=None, **kwargs) -> None:
    """Set tracing up in a worker (off unless the ``OTEL_*`` variables configure it).

    Forked pool processes keep the provider: its batch processor restarts its thread in a child.
    """
    from runstate_project.tracing import setup_tracing

    setup_tracing("celery-worker")


@beat_init.connect
def _trace_beat(sender=None, **kwargs) -> None:
    """Set tracing up in beat (off unless the ``OTEL_*`` variables configure it)."""
    from runstate_project.tracing import setup_tracing

    setup_tracing("beat")


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
    """Give each worker thread or process one persistent database connection, checked only after an error.

    The connection pool exists for the API, where every request runs in a thread of its
    own; a worker's pool threads (or forked processes) live on, so a persistent connection
    each is simpler and cheaper, and a pool must not cross a fork anyway.

    Celery's Django fixup closes every connection before and after each task (Celery 5.7
    ignores ``CONN_MAX_AGE`` there), which costs a new connection per task. Around a task
    the worker does what Django does around a request instead (``close_old_connections``):
    a connection is closed when it is older than ``RUNSTATE_WORKER_CONN_MAX_AGE`` seconds,
    or when a database error happened on it and it no longer answers (so a worker recovers
    from a PostgreSQL restart). No health check runs otherwise (``CONN_HEALTH_CHECKS``
    off): a query per task for nothing.
    """
    from django.conf import settings
    from django.db import close_old_connections, connections

    max_age = int(os.environ.get("RUNSTATE_WORKER_CONN_MAX_AGE", "300"))
    for settings_dict in (settings.DATABASES["default"], connections["default"].settings_dict):
        settings_dict.get("OPTIONS", {}).pop("pool", None)
        settings_dict["CONN_MAX_AGE"] = max_age
        settings_dict["CONN_HEALTH_CHECKS"] = False
    for fixup in getattr(app, "_fixups", None) or ():
        worker_fixup = getattr(fixup, "worker_fixup", None)
        if worker_fixup is not None and hasattr(worker_fixup, "close_database"):
            # The fixup's task_prerun/postrun handlers call this attribute.
            worker_fixup.close_database = lambda **kwargs: close_old_connections()


@worker_init.connect
def _survive_broker_loss_with_unacked_messages(sender=None, **kwargs) -> None:
    """Keep the worker alive when the Redis broker goes away while it holds unacknowledged messages.

    After a broker connection loss, Celery 5.7 collects the connection, which detaches the
    transport from it, and then closes it. Whatever still touches the old channel (the close
    putting the messages in flight back on the queue, a task finishing and acking its
    message) makes kombu's Redis transport build a client for a broker it no longer knows,
    and it raises ``AttributeError`` instead of a connection error. The worker takes that for
    an unrecoverable error and stops for good, rather than reconnecting once Redis is back.
    Raise the connection error kombu raises when the broker refuses, which those callers
    handle: the messages stay in Redis's unacked set until the visibility timeout, and the
    re-wake sweep sends any runstate work still unclaimed meanwhile. Upstream reports of the
    same symptom (a worker that never recovers from a Redis connection reset): celery/celery
    #10205, #8030. Drop this patch once the pinned kombu raises a connection error there.
    """
    from kombu.transport import redis as kombu_redis

    connparams = kombu_redis.Channel._connparams
    if getattr(connparams, "refuses_when_detached", False):
        return

    def connparams_if_attached(self, asynchronous=False):
        if getattr(self.connection, "client", None) is None:
            raise kombu_redis.get_redis_ConnectionError()("the broker connection is closed")
        return connparams(self, asynchronous=asynchronous)

    connparams_if_attached.refuses_when_detached = True
    kombu_redis.Channel._connparams = connparams_if_attached
