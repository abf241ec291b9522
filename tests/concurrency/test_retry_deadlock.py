"""A service PostgreSQL aborts to break a deadlock runs again (``retry.retrying``), when it is the outermost.

A real deadlock: the service locks run A then run B, the test's other transaction locks B then
A. The service's backend checks for deadlocks after 50 ms, the other's after 30 s, so the
service is the one PostgreSQL aborts.
"""

import threading

import pytest
from django.db import OperationalError, connection, transaction

from coordination.models import Run
from coordination.services.keys import project_ensure
from coordination.services.retry import deadlocked, retrying
from coordination.services.runs import run_create
from tests.concurrency.util import run_closing
from tests.waiting import WAIT_S

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres_only]


def _lock(run_id) -> None:
    Run.objects.select_for_update().get(id=run_id)


def _deadlock_timeout(value: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT set_config('deadlock_timeout', %s, true)", [value])


class Deadlocker:
    """Two transactions locking two runs in opposite orders, the service's once (its first attempt)."""

    def __init__(self):
        project = project_ensure(name="deadlocks")
        self.a, self.b = (run_create(project_id=project.id).id for _ in range(2))
        self.attempts = 0
        self.service_holds_a, self.other_holds_b = threading.Event(), threading.Event()

    @retrying
    @transaction.atomic
    def service(self) -> int:
        self.attempts += 1
        _deadlock_timeout("50ms")
        _lock(self.a)
        if self.attempts == 1:
            self.service_holds_a.set()
            assert self.other_holds_b.wait(WAIT_S)
        _lock(self.b)
        return self.attempts

    def other(self) -> None:
        with transaction.atomic():
            _deadlock_timeout("30s")
            _lock(self.b)
            self.other_holds_b.set()
            assert self.service_holds_a.wait(WAIT_S)
            _lock(self.a)  # the cycle: the service, waiting for B, is aborted and lets go of A

    def race(self, service) -> tuple[dict, list]:
        results, errors = {}, []
        threads = [
            threading.Thread(target=run_closing(lambda: results.update(service=service()), errors)),
            threading.Thread(target=run_closing(self.other, errors)),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT_S)
        assert not any(thread.is_alive() for thread in threads), "a side did not finish in time"
        return results, errors


def test_the_service_chosen_to_break_a_deadlock_runs_again_and_succeeds():
    deadlocker = Deadlocker()
    results, errors = deadlocker.race(deadlocker.service)
    assert errors == []
    assert results == {"service": 2}, "the first attempt was aborted, the second committed"


def test_inside_a_callers_transaction_the_deadlock_is_left_to_the_caller():
    """The abort spoils the caller's transaction too: only the outermost retrying service may run it again."""
    deadlocker = Deadlocker()

    def inside_a_transaction():
        with transaction.atomic():
            return deadlocker.service()

    results, errors = deadlocker.race(inside_a_transaction)
    assert results == {}
    [error] = errors
    assert isinstance(error, OperationalError) and deadlocked(error)
    assert deadlocker.attempts == 1
