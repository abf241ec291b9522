"""Timers under races: concurrent sweepers split a burst and fire each timer exactly once."""

from datetime import UTC, datetime, timedelta

import pytest

from coordination.models import Event, Timer
from coordination.services.keys import project_ensure
from coordination.services.runs import run_create
from coordination.services.timers import timer_fire, timers_fire_due
from tests.concurrency.util import run_in_threads
from workers.tasks import fire_as_due

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]


def test_four_sweepers_and_eta_wake_ups_over_5000_due_timers_fire_each_once():
    project = project_ensure(name="timers")
    run = run_create(project_id=project.id)
    deadline = datetime.now(UTC) - timedelta(milliseconds=500)
    timers = Timer.objects.bulk_create(
        Timer(
            project_id=project.id,
            run=run,
            run_path=run.path,
            # Every tenth timer is due at its run's deadline: cancelled, never fired.
            fire_at=deadline if i % 10 == 0 else deadline - timedelta(seconds=1),
            run_deadline=deadline,
        )
        for i in range(5000)
    )

    def sweep():
        total = 0
        while done := timers_fire_due(batch_size=300):
            total += done
        return total

    def wake_ups():
        # ETA messages arriving mid-burst fire single timers through the other path.
        for timer in timers[::25]:
            timer_fire(timer_id=timer.id)
        return 0

    counts = run_in_threads([sweep, sweep, sweep, sweep, wake_ups])
    assert sum(counts) <= 5000
    assert Timer.objects.filter(run=run, state="ARMED").count() == 0
    assert Timer.objects.filter(run=run, state="FIRED").count() == 4500
    assert Timer.objects.filter(run=run, state="CANCELLED").count() == 500
    fired = Event.objects.filter(type="timer.fired", run_id=run.id)
    assert fired.count() == fired.values("subject_id").distinct().count() == 4500
    cancelled = Event.objects.filter(type="timer.cancelled", run_id=run.id)
    assert cancelled.count() == cancelled.values("subject_id").distinct().count() == 500


def test_four_wake_ups_staying_through_a_spread_burst_and_a_sweeper_fire_each_timer_once():
    """Workers firing a burst as it comes due (``fire_as_due``), side by side with a sweep."""
    project = project_ensure(name="timers-spread")
    run = run_create(project_id=project.id)
    start = datetime.now(UTC) + timedelta(milliseconds=200)
    timers = Timer.objects.bulk_create(
        Timer(project_id=project.id, run=run, run_path=run.path, fire_at=start + timedelta(microseconds=150 * i))
        for i in range(3000)  # 3,000 timers due over 450 ms
    )
    until = timers[-1].fire_at

    def stay():
        return fire_as_due(until=until)

    def sweep():
        total = 0
        while datetime.now(UTC) <= until + timedelta(milliseconds=100):
            total += timers_fire_due(batch_size=200)
        return total

    counts = run_in_threads([stay, stay, stay, stay, sweep])
    assert sum(counts) == 3000
    rows = list(Timer.objects.filter(run=run).values_list("state", "fire_at", "fired_at"))
    assert {state for state, _, _ in rows} == {"FIRED"}
    assert all(fired_at >= fire_at for _, fire_at, fired_at in rows), "a timer fired before it was due"
    fired = Event.objects.filter(type="timer.fired", run_id=run.id)
    assert fired.count() == fired.values("subject_id").distinct().count() == 3000
