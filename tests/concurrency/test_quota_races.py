"""Quotas under races: concurrent takes never grant more than the bucket holds plus its refill."""

import time

import pytest

from coordination.models import Quota
from coordination.services.keys import project_ensure
from coordination.services.quotas import quota_put, quota_take
from coordination.services.runs import run_cancel, run_create
from tests.concurrency.util import race_a_cancel, run_in_threads

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres_only]


@pytest.fixture(params=[True, False], ids=["fast", "careful"])
def fast_paths(request, settings):
    settings.RUNSTATE_FAST_PATHS = request.param
    return request.param


def test_16_threads_never_take_more_than_limit_plus_refill_10_rounds(fast_paths):
    project = project_ensure(name="quotas")
    run = run_create(project_id=project.id)
    limit, period_ms = 40, 500  # 80 tokens a second
    for round_ in range(10):
        name = f"api-{round_}"
        quota_put(project_id=project.id, name=name, limit=limit, period_ms=period_ms)

        def taker(name=name):
            granted = 0
            for _ in range(15):
                granted += quota_take(project_id=project.id, run_id=run.id, name=name, amount=1).granted
            return granted

        started = time.monotonic()
        granted = sum(run_in_threads([taker] * 16))
        elapsed_s = time.monotonic() - started
        # The bucket held at most `limit` when the first take started and refilled at most
        # elapsed × rate until the last one ended.
        assert granted <= limit + elapsed_s * limit * 1000 / period_ms
        assert granted >= limit  # the full bucket was there to take
        quota = Quota.objects.get(project=project, name=name)
        assert 0 <= quota.level_micro <= limit * 1_000_000


def test_takes_racing_a_cancel_grant_nothing_once_the_cancel_committed_20_rounds(fast_paths):
    project = project_ensure(name="quotas")
    quota_put(project_id=project.id, name="api", limit=1_000_000, period_ms=1000)
    for _ in range(20):
        run = run_create(project_id=project.id)
        child = run_create(project_id=project.id, parent_id=run.id)
        race_a_cancel(
            lambda run=run: run_cancel(project_id=project.id, run_id=run.id),
            lambda child=child: quota_take(project_id=project.id, run_id=child.id, name="api"),
        )
