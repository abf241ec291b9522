"""Firing a burst of due timers in bulk (``timers_fire_due``): DESIGN.md "Timers" and "Events".

On PostgreSQL each test runs twice: the one-statement batch (fast paths on) and the careful
bulk path (off); SQLite always takes the careful one.
"""

from datetime import UTC, datetime, timedelta

import pytest

from coordination.models import Event, Timer
from coordination.services.runs import run_create
from coordination.services.timers import timers_fire_due

pytestmark = pytest.mark.django_db


@pytest.fixture(
    autouse=True, params=[True, pytest.param(False, marks=pytest.mark.postgres_only)], ids=["fast", "careful"]
)
def fast_paths(request, settings):
    settings.RUNSTATE_FAST_PATHS = request.param
    return request.param


def arm(project, run, fire_at_list, *, run_deadline=None):
    return Timer.objects.bulk_create(
        Timer(project_id=project.id, run=run, run_path=run.path, fire_at=at, run_deadline=run_deadline)
        for at in fire_at_list
    )


def test_a_burst_fires_each_timer_once_with_its_lateness(project):
    run = run_create(project_id=project.id)
    now = datetime.now(UTC)
    timers = arm(project, run, [now - timedelta(milliseconds=5 * i) for i in range(1, 1201)])
    later = arm(project, run, [now + timedelta(hours=1)])[0]

    # Batches of 500: three sweeps fire 1,200 timers, the fourth finds nothing.
    assert [timers_fire_due(now=now, batch_size=500) for _ in range(4)] == [500, 500, 200, 0]

    fired = {str(t.id): t for t in Timer.objects.filter(run=run, state="FIRED")}
    assert set(fired) == {str(t.id) for t in timers}
    assert Timer.objects.get(id=later.id).state == "ARMED"
    events = list(Event.objects.filter(type="timer.fired", run_id=run.id))
    assert sorted(e.subject_id for e in events) == sorted(fired)  # exactly one event per timer
    for event in events:
        timer = fired[event.subject_id]
        assert event.data["fireAt"] == timer.fire_at.isoformat()
        assert event.data["lateMs"] == (timer.fired_at - timer.fire_at) // timedelta(milliseconds=1) > 0
        assert (event.project_id, event.run_path) == (project.id, run.path)


def test_timers_due_at_or_after_the_runs_deadline_are_cancelled_in_the_same_batch(project):
    run = run_create(project_id=project.id)
    now = datetime.now(UTC)
    deadline = now - timedelta(seconds=1)
    before = arm(project, run, [deadline - timedelta(milliseconds=i + 1) for i in range(3)], run_deadline=deadline)
    crossing = arm(project, run, [deadline, deadline + timedelta(milliseconds=1)], run_deadline=deadline)

    assert timers_fire_due(now=now) == 5

    assert {t.id for t in Timer.objects.filter(run=run, state="FIRED")} == {t.id for t in before}
    cancelled = Timer.objects.filter(run=run, state="CANCELLED")
    assert {t.id for t in cancelled} == {t.id for t in crossing}
    assert all(t.fired_at is None for t in cancelled)
    cancel_events = Event.objects.filter(type="timer.cancelled", run_id=run.id)
    assert sorted(e.subject_id for e in cancel_events) == sorted(str(t.id) for t in crossing)
    assert {e.data["cause"] for e in cancel_events} == {"run_deadline"}
    assert not Event.objects.filter(type="timer.fired", subject_id__in=[str(t.id) for t in crossing]).exists()
    # Every event of the batch was written in one statement, in the same transaction.
    assert len(set(Event.objects.filter(run_id=run.id, type__startswith="timer.").values_list("txid", flat=True))) == 1


def test_fire_at_in_the_event_is_the_isoformat_with_and_without_a_fraction(project):
    run = run_create(project_id=project.id)
    whole = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=2)
    timers = arm(project, run, [whole, whole + timedelta(microseconds=7), whole + timedelta(milliseconds=250)])
    assert timers_fire_due() == 3
    data = {e.subject_id: e.data for e in Event.objects.filter(type="timer.fired", run_id=run.id)}
    assert [data[str(t.id)]["fireAt"] for t in timers] == [t.fire_at.isoformat() for t in timers]
