"""Beat outlives a database that fails under it (``workers.beat.DatabaseScheduler``).

The scheduler runs here in the test's process, on the test database and the test broker,
sending to a queue of the test's own. The fault is the server's: just before a chosen
statement, another session ends the scheduler's with ``pg_terminate_backend``, so the
statement fails as it does when the server restarts or fails over under it.
"""

import contextlib
import time
import uuid

import psycopg
import pytest
from celery import Celery
from django.db import OperationalError, connection
from django_celery_beat import schedulers
from django_celery_beat.models import PeriodicTasks

from tests.waiting import WAIT_S
from tests.workers import live
from workers import beat
from workers.schedule import ensure_periodic_sweeps

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]

EVERY_SECOND = {"runstate.sweep_timers", "runstate.sweep_leases", "runstate.sweep_deadlines"}
# The statement with which django-celery-beat reads the whole schedule (all_as_schedule).
READS_THE_SCHEDULE = 'FROM "django_celery_beat_periodictask"'


class ServerEndsTheSession:
    """An execute wrapper: while armed, the server ends this session just before each statement ``matches`` picks."""

    def __init__(self, matches=lambda sql: True, *, times: int | None = None) -> None:
        self.matches = matches
        self.armed = False
        self.ended = 0
        self.times = times  # end the session this many times at most (None: while armed)

    def __call__(self, execute, sql, params, many, context):
        if self.armed and self.matches(sql) and (self.times is None or self.ended < self.times):
            pid = context["connection"].connection.info.backend_pid
            with psycopg.connect(live.test_database_url(), autocommit=True) as other:
                assert other.execute("SELECT pg_terminate_backend(%s, 10000)", [pid]).fetchone() == (True,)
            self.ended += 1
        return execute(sql, params, many, context)


@pytest.fixture
def scheduler_of():
    """Build schedulers (``scheduler_of(cls, app)``); each writes its schedule and forgets its exit hook afterwards."""
    made = []

    def build(cls, app):
        made.append(cls(app=app))
        return made[-1]

    yield build
    for scheduler in made:
        # django-celery-beat registers the schedule's last write for the process's exit, when
        # the test database is gone: write it now, once, as beat does when it stops.
        scheduler._finalize()


@pytest.fixture
def beat_app():
    """A Celery app on the test broker whose messages go to a queue of this test only; yields (app, queue)."""
    name = f"test-beat-{uuid.uuid4().hex[:12]}"
    app = Celery("test-beat", broker=live.TEST_BROKER_URL, set_as_current=False)
    app.conf.update(
        timezone="UTC",
        result_expires=None,  # no celery.backend_cleanup entry written into the schedule
        task_default_queue=name,
        task_default_exchange=name,
        task_default_routing_key=name,
    )
    ensure_periodic_sweeps()  # as beat does when it starts (a transactional test found the tables emptied)
    with app.connection_for_read() as broker:
        queue = broker.SimpleQueue(name)
        try:
            yield app, queue
        finally:
            queue.queue.delete()
            queue.close()


def sent(queue) -> set[str]:
    """Take every message off ``queue``; return the names of the tasks they carry."""
    names = set()
    while True:
        try:
            message = queue.get_nowait()
        except queue.Empty:
            return names
        names.add(message.headers["task"])
        message.ack()


def tick_until_every_second_sweep_is_sent(scheduler, queue) -> set[str]:
    names: set[str] = set()
    deadline = time.monotonic() + WAIT_S
    while not EVERY_SECOND <= names:
        assert time.monotonic() < deadline, f"beat sent only {names}"
        delay = scheduler.tick()
        names |= sent(queue)
        time.sleep(max(0.0, min(delay, 0.1)))  # as beat does, never longer than a tenth
    return names


def an_operator_changed_the_schedule() -> None:
    """What saving a periodic task in the admin does: the next tick reads the whole schedule again."""
    PeriodicTasks.update_changed()


@contextlib.contextmanager
def the_server_ends_the_session_as_beat_reads_a_changed_schedule(scheduler, queue):
    """Once ``scheduler`` sends, an operator changes the schedule and the fault is armed on its read; yields it."""
    tick_until_every_second_sweep_is_sent(scheduler, queue)
    fault = ServerEndsTheSession(lambda sql: READS_THE_SCHEDULE in sql)
    with connection.execute_wrapper(fault):
        an_operator_changed_the_schedule()
        fault.armed = True
        yield fault


def test_a_database_error_as_beat_reads_a_changed_schedule_is_retried_and_the_sweeps_go_on(beat_app, scheduler_of):
    app, queue = beat_app
    scheduler = scheduler_of(beat.DatabaseScheduler, app)
    with the_server_ends_the_session_as_beat_reads_a_changed_schedule(scheduler, queue) as fault:
        assert scheduler.tick() == beat.RETRY_AFTER_S
        fault.armed = False
        assert fault.ended == 1
        sent(queue)
        assert tick_until_every_second_sweep_is_sent(scheduler, queue) >= EVERY_SECOND


def test_django_celery_beats_own_scheduler_dies_there(beat_app, scheduler_of):
    """Why workers.beat exists: upstream, that error leaves ``tick`` and ends beat. When this fails,
    django-celery-beat guards the read itself and ``workers.beat`` can go."""
    app, queue = beat_app
    scheduler = scheduler_of(schedulers.DatabaseScheduler, app)
    with the_server_ends_the_session_as_beat_reads_a_changed_schedule(scheduler, queue) as fault:
        with pytest.raises(OperationalError):
            scheduler.tick()
    assert fault.ended == 1


def test_beat_ticks_through_an_outage_and_sends_the_sweeps_once_the_database_is_back(beat_app, scheduler_of):
    """Every statement fails for a while (a server gone), a schedule change and beat's own writes included."""
    app, queue = beat_app
    scheduler = scheduler_of(beat.DatabaseScheduler, app)
    tick_until_every_second_sweep_is_sent(scheduler, queue)
    fault = ServerEndsTheSession()
    with connection.execute_wrapper(fault):
        an_operator_changed_the_schedule()
        fault.armed = True
        outage_ends = time.monotonic() + 2.5
        while time.monotonic() < outage_ends:
            delay = scheduler.tick()
            time.sleep(max(0.0, min(delay, 0.1)))  # as beat does, never longer than a tenth
        fault.armed = False
        assert fault.ended >= 2, fault.ended  # the schedule's read at least, and what came after it
        sent(queue)
        assert tick_until_every_second_sweep_is_sent(scheduler, queue) >= EVERY_SECOND


def test_a_database_error_as_beat_starts_is_retried_and_the_sweeps_go_on(beat_app, scheduler_of):
    """Beat reads its whole schedule as it starts (the scheduler's construction): the server
    ends the session there twice, and beat reads it again until it answers, then sends."""
    app, queue = beat_app
    fault = ServerEndsTheSession(times=2)
    with connection.execute_wrapper(fault):
        fault.armed = True
        scheduler = scheduler_of(beat.DatabaseScheduler, app)
        assert fault.ended == 2
        fault.armed = False
        assert tick_until_every_second_sweep_is_sent(scheduler, queue) >= EVERY_SECOND


def test_django_celery_beats_own_scheduler_dies_as_it_starts(beat_app, scheduler_of):
    """Upstream, the same error leaves the scheduler's construction, and beat exits (status 1)."""
    app, _ = beat_app
    fault = ServerEndsTheSession(times=1)
    with connection.execute_wrapper(fault):
        fault.armed = True
        with pytest.raises(OperationalError):
            scheduler_of(schedulers.DatabaseScheduler, app)
    assert fault.ended == 1
    connection.close()  # the session the server ended: the test's teardown opens a new one
