"""Timer wake-ups coalesced per bucket of due time (``workers.dispatch.dispatch_timer``)."""

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from coordination.models import Event, Timer
from coordination.services.runs import run_create
from coordination.services.timers import timer_cancel
from workers import dispatch, tasks
from workers.tasks import fire_timer


@pytest.fixture
def sent(monkeypatch):
    """Record the wake-ups instead of sending them; start with no bucket remembered."""
    messages = []
    monkeypatch.setattr(dispatch, "_timer_wakes_sent", {})
    monkeypatch.setattr(fire_timer, "apply_async", lambda args, eta, expires: messages.append((args[0], eta, args[1])))
    return messages


def bucket_start(offset_s: float) -> datetime:
    return datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=offset_s)


def test_a_lone_timer_is_woken_at_its_own_time(sent):
    fire_at = bucket_start(5) + timedelta(milliseconds=42)
    dispatch.dispatch_timer(uuid.uuid4(), fire_at)
    assert [eta for _, eta, _ in sent] == [fire_at]


def test_a_burst_in_one_bucket_sends_two_wake_ups_the_last_at_the_buckets_end(sent):
    start = bucket_start(5)
    burst = [start + timedelta(milliseconds=90 - i) for i in range(80)]  # 80 timers, all in [start, start + 100 ms)
    for fire_at in burst:
        dispatch.dispatch_timer(uuid.uuid4(), fire_at)
    assert [eta for _, eta, _ in sent] == [burst[0], start + timedelta(milliseconds=100)]
    # The bucket-end wake-up comes no earlier than any timer of the bucket, so it drains them all.
    assert max(burst) <= sent[-1][1]
    # Both stay until the bucket's end: the first fires the later timers as they come due.
    assert [until for _, _, until in sent] == [(start + timedelta(milliseconds=100)).isoformat()] * 2


def test_each_bucket_of_a_spread_burst_gets_its_wake_ups(sent):
    start = bucket_start(5)
    for i in range(1000):  # 1,000 timers over one second: ten buckets
        dispatch.dispatch_timer(uuid.uuid4(), start + timedelta(microseconds=i * 1000))
    assert len(sent) == 20
    for bucket in range(10):
        end = start + timedelta(milliseconds=100 * (bucket + 1))
        assert end in [eta for _, eta, _ in sent]


def test_a_wake_up_that_could_not_be_sent_is_sent_by_the_next_timer(sent, monkeypatch):
    start = bucket_start(5)
    failing = [True]

    def apply_async(args, eta, expires):
        if failing[0]:
            failing[0] = False
            raise ConnectionError("broker down")
        sent.append((args[0], eta, args[1]))

    monkeypatch.setattr(fire_timer, "apply_async", apply_async)
    dispatch.dispatch_timer(uuid.uuid4(), start + timedelta(milliseconds=10))
    dispatch.dispatch_timer(uuid.uuid4(), start + timedelta(milliseconds=20))
    dispatch.dispatch_timer(uuid.uuid4(), start + timedelta(milliseconds=30))
    assert [eta for _, eta, _ in sent] == [start + timedelta(milliseconds=20), start + timedelta(milliseconds=100)]


def test_timers_beyond_the_eta_horizon_send_nothing_and_reserve_nothing(sent, settings):
    far = datetime.now(UTC) + timedelta(seconds=settings.RUNSTATE_ETA_HORIZON_S + 60)
    dispatch.dispatch_timer(uuid.uuid4(), far)
    assert sent == [] and sum(dispatch._timer_wakes_sent.values()) == 0


@pytest.mark.django_db
def test_a_wake_up_whose_own_timer_was_cancelled_still_fires_the_others_due(project, monkeypatch):
    """A coalesced wake-up stands for its whole bucket, whatever became of its own timer."""
    # The task closes stale connections first; inside the test's transaction that is ours.
    monkeypatch.setattr(tasks, "close_old_connections", lambda: None)
    run = run_create(project_id=project.id)
    due = datetime.now(UTC) - timedelta(milliseconds=50)
    own, *others = Timer.objects.bulk_create(
        Timer(project_id=project.id, run=run, run_path=run.path, fire_at=due) for _ in range(3)
    )
    timer_cancel(project_id=project.id, timer_id=own.id)
    fire_timer(str(own.id))
    assert sorted(Timer.objects.filter(run=run).values_list("state", flat=True)) == ["CANCELLED", "FIRED", "FIRED"]
    assert Event.objects.filter(type="timer.fired", subject_id__in=[str(t.id) for t in others]).count() == 2


@pytest.mark.django_db
def test_a_wake_up_stays_until_its_buckets_end_and_fires_each_later_timer_when_due_never_before(project, monkeypatch):
    monkeypatch.setattr(tasks, "close_old_connections", lambda: None)
    run = run_create(project_id=project.id)
    now = datetime.now(UTC)
    first, *later = Timer.objects.bulk_create(
        Timer(project_id=project.id, run=run, run_path=run.path, fire_at=now + timedelta(milliseconds=ms))
        for ms in (0, 40, 80, 60_000)
    )
    beyond = later.pop()  # due long after the bucket's end: left to its own wake-up
    fire_timer(str(first.id), (now + timedelta(milliseconds=100)).isoformat())
    timers = {t.id: t for t in Timer.objects.filter(run=run)}
    for timer in (first, *later):
        assert timers[timer.id].state == "FIRED"
        assert timers[timer.id].fired_at >= timer.fire_at
    assert timers[beyond.id].state == "ARMED"
