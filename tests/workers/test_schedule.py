"""The periodic sweeps are registered in code: by the migrations, and again when beat starts."""

import pytest
from django_celery_beat.models import PeriodicTask

from workers.schedule import PERIODIC_SWEEPS, ensure_periodic_sweeps

pytestmark = pytest.mark.django_db


def test_the_migrations_registered_every_sweep():
    registered = dict(PeriodicTask.objects.filter(name__startswith="runstate:").values_list("name", "task"))
    assert registered == {name: task for name, task, *_ in PERIODIC_SWEEPS}


def test_ensure_restores_lost_or_changed_rows_and_is_idempotent():
    PeriodicTask.objects.filter(name="runstate: fire due timers").delete()
    PeriodicTask.objects.filter(name="runstate: expired leases").update(enabled=False)
    assert ensure_periodic_sweeps() == 2
    assert ensure_periodic_sweeps() == 0
    leases = PeriodicTask.objects.get(name="runstate: expired leases")
    assert leases.enabled and leases.interval.every == 1
    assert PeriodicTask.objects.filter(name="runstate: fire due timers", task="runstate.sweep_timers").exists()


def test_every_scheduled_task_is_one_a_worker_knows():
    """Beat sends the sweeps by name: each is a task the modules a worker imports declare (tasks, dispatch)."""
    from runstate_project.celery import app

    app.loader.import_default_modules()  # what a worker imports at start (autodiscovery), after Django's apps
    scheduled = {task for _, task, *_ in PERIODIC_SWEEPS}
    assert {"runstate.rewake_unclaimed_work", "runstate.dispatch_upcoming_timers"} <= scheduled
    assert scheduled - set(app.tasks) == set()
