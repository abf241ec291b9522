"""The services reach Celery only through the waker the workers app registers at start-up.

``coordination`` imports no worker module (import-linter's ``domain-without-workers``
contract): ``services.dispatch`` holds a registration that ``WorkersConfig.ready`` fills with
``workers.dispatch``. Without one, nothing is sent, as when the broker is unreachable.
"""

import uuid
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest

import workers.dispatch
from coordination.services import dispatch

pytestmark = pytest.mark.django_db


class Recorder:
    """A waker that records what it is asked to send."""

    def __init__(self):
        self.calls = []

    def accept_submitted(self, task, mailbox):
        self.calls.append(("accept", task.id))
        return lambda **kwargs: self.calls.append(("wake", task.id))

    def send_work_batch(self, wakes):
        self.calls.append(("batch", len(wakes)))

    def dispatch_requeued_on_commit(self, task):
        self.calls.append(("requeued", task.id))

    def dispatch_timer(self, timer_id, fire_at):
        self.calls.append(("timer", timer_id))

    def dispatch_run_deadline(self, run_id, deadline):
        self.calls.append(("deadline", run_id))


@pytest.fixture
def waker(monkeypatch):
    """Register a recorder in place of Celery for one test."""
    recorder = Recorder()
    monkeypatch.setattr(dispatch, "_waker", None)
    dispatch.waker_register(recorder)
    return recorder


def test_the_workers_app_registers_celery_as_the_waker_at_start_up():
    assert dispatch.waker() is workers.dispatch


def test_every_wake_up_goes_through_the_registered_waker_after_commit(waker, django_capture_on_commit_callbacks):
    task, timer_id, run_id, when = SimpleNamespace(id=uuid.uuid4()), uuid.uuid4(), uuid.uuid4(), datetime.now(UTC)
    with django_capture_on_commit_callbacks(execute=True):
        dispatch.work_submitted(task, mailbox=None)
        dispatch.timer_due(timer_id, when)
        dispatch.run_deadline_due(run_id, when)
        assert waker.calls == [("accept", task.id)], "nothing is sent before commit"
    assert waker.calls == [("accept", task.id), ("wake", task.id), ("timer", timer_id), ("deadline", run_id)]
    dispatch.work_requeued(task)
    dispatch._send_wakes([lambda: None, lambda: None])
    assert waker.calls[-2:] == [("requeued", task.id), ("batch", 2)]


def test_without_a_waker_nothing_is_sent_and_nothing_fails(monkeypatch, django_capture_on_commit_callbacks):
    monkeypatch.setattr(dispatch, "_waker", None)
    task = SimpleNamespace(id=uuid.uuid4(), input={"anything": True})
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        assert dispatch.work_accept(task, mailbox=None) is None
        dispatch.work_submitted(task, mailbox=None)
        dispatch.work_requeued(task)
        dispatch.timer_due(uuid.uuid4(), datetime.now(UTC))
        dispatch.run_deadline_due(uuid.uuid4(), datetime.now(UTC))
        dispatch._send_wakes([lambda: None, lambda: None])
    assert callbacks == []
