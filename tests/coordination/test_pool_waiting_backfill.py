"""Migration 0014 backfills ``Pool.waiting`` from the WAITING lease rows (gone waiters included)."""

import importlib
from datetime import timedelta

import pytest
from django.apps import apps
from django.utils import timezone

from coordination.models import Pool, PoolLease
from coordination.services.keys import project_ensure
from coordination.services.pools import pool_acquire, pool_put
from coordination.services.runs import run_create

pytestmark = pytest.mark.django_db

backfill = importlib.import_module("coordination.migrations.0014_pool_waiting").backfill


def test_backfill_counts_each_pools_waiting_rows():
    project = project_ensure(name="backfill")
    run = run_create(project_id=project.id)
    busy, _ = pool_put(project_id=project.id, name="busy", capacity=1)
    idle, _ = pool_put(project_id=project.id, name="idle", capacity=1)
    pool_acquire(project_id=project.id, name="busy", run_id=run.id)
    waiters = [pool_acquire(project_id=project.id, name="busy", run_id=run.id, wait_ms=10_000).lease for _ in range(3)]
    # A gone waiter is still a WAITING row until a walk times it out: it counts.
    PoolLease.objects.filter(id=waiters[0].id).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert Pool.objects.get(id=busy.id).waiting == 3
    Pool.objects.update(waiting=0)  # as the column is right after AddField

    backfill(apps, None)

    assert Pool.objects.get(id=busy.id).waiting == 3
    assert Pool.objects.get(id=idle.id).waiting == 0
