"""Barriers under races: released exactly once per epoch."""

import pytest

from coordination.models import Barrier, BarrierArrival, Event
from coordination.services.barriers import barrier_arrive, barrier_create, barrier_next_epoch
from coordination.services.keys import project_ensure
from coordination.services.runs import run_create
from tests.concurrency.util import rounds, run_in_threads

pytestmark = pytest.mark.django_db(transaction=True)


def test_32_threads_32_keys_target_32_released_once_per_epoch_every_round():
    """50 epochs on PostgreSQL, 10 on SQLite (``rounds``)."""
    project = project_ensure(name="barriers")
    run = run_create(project_id=project.id)
    barrier = barrier_create(project_id=project.id, run_id=run.id, target=32)
    for epoch in range(1, rounds(postgresql=50, sqlite=10) + 1):

        def arrive(key):
            # Every thread arrives twice with its key: the second is an idempotent repeat.
            first = barrier_arrive(project_id=project.id, barrier_id=barrier.id, key=key)
            again = barrier_arrive(project_id=project.id, barrier_id=barrier.id, key=key)
            return first.epoch, again.epoch

        results = run_in_threads([lambda k=f"shard-{i}": arrive(k) for i in range(32)])
        assert {epochs for epochs in results} == {(epoch, epoch)}
        current = Barrier.objects.get(id=barrier.id)
        assert (current.epoch, current.arrivals, current.state) == (epoch, 32, "RELEASED")
        assert BarrierArrival.objects.filter(barrier=barrier, epoch=epoch).count() == 32
        released = Event.objects.filter(type="barrier.released", subject_id=str(barrier.id), data__epoch=epoch)
        assert released.count() == 1
        assert Event.objects.filter(type="barrier.arrived", subject_id=str(barrier.id), data__epoch=epoch).count() == 32
        barrier_next_epoch(project_id=project.id, barrier_id=barrier.id)
