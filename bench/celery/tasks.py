"""The Celery benchmark's two no-ops, one plain and one ``@runstate_task``; its worker imports this module.

Importing it sets Django up with the benchmark's defaults (its own database and Redis
database), so the benchmark's process and its worker agree on both.
"""

from __future__ import annotations

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "runstate_project.settings")
os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/runstate_bench_celery")
os.environ.setdefault("CELERY_BROKER_URL", "redis://127.0.0.1:6379/12")
os.environ.setdefault("DEBUG", "0")
os.environ.setdefault("SECRET_KEY", "runstate-bench-not-a-secret")
os.environ.setdefault("LOG_LEVEL", "WARNING")

import django  # noqa: E402
from django.apps import apps  # noqa: E402

if not apps.ready:
    django.setup()

import redis  # noqa: E402
from celery import shared_task  # noqa: E402

from workers import runstate_task  # noqa: E402

QUEUE = "bench-celery"
COUNTER = "bench-celery:plain-done"


@runstate_task(mailbox="bench-noop", project="bench-celery", lease_ttl=30, name="bench.celery.noop", queue=QUEUE)
def noop(ctx):
    """Do nothing: what is measured is runstate's claim, heartbeat and completion around it."""
    return None


_counter_client: redis.Redis | None = None


@shared_task(name="bench.celery.plain_noop", ignore_result=True, acks_late=True, queue=QUEUE)
def plain_noop():
    """Do nothing but count (the benchmark's only way to see that it ran)."""
    global _counter_client
    if _counter_client is None:
        _counter_client = redis.Redis.from_url(os.environ["CELERY_BROKER_URL"])
    _counter_client.incr(COUNTER)
