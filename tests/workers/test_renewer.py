"""One renewer per worker process: every claim the process holds, renewed together.

Real threads run ``workers.runtime.execute`` as a threads-pool worker would, each for its
own task and with its own database connection, while the test changes the database under
them: the process's renewer keeps every lease alive with batched statements, a claim lost
among them stops only its own handler, a cancel request reaches only its own ``ctx``.
"""

import threading
import time

import pytest
from django.utils import timezone

from coordination.domain.states import TaskState
from coordination.models import Task
from coordination.services.runs import run_create
from coordination.services.tasks import task_cancel
from tests.waiting import wait_until
from tests.workers.holding import hold_until_released, running_handlers
from workers import runstate_task
from workers.runtime import renewer

pytestmark = pytest.mark.django_db(transaction=True)

PROJECT = "renewer-unit"
LEASE_TTL_S = 1.5  # renewed every 0.5 s

contexts: dict = {}
release = threading.Event()


@runstate_task(mailbox="renewer-holds", project=PROJECT, lease_ttl=LEASE_TTL_S, queue="tests-renewer")
def hold(ctx, i: int):
    """Hold the claim until the test releases it or the signal says stop."""
    hold_until_released(ctx, contexts, release)
    return {"i": i}


@pytest.fixture
def handlers():
    """Start one handler thread per task (``start(tasks)``); release and join them at the end."""
    with running_handlers(hold, contexts, release) as start:
        yield start


def leases(tasks) -> dict:
    return dict(Task.objects.filter(id__in=[t.id for t in tasks]).values_list("id", "lease_expires_at"))


def test_the_shared_renewer_keeps_50_claims_alive_and_a_lost_claim_stops_only_its_task(handlers, is_postgres):
    count = 50 if is_postgres else 10  # SQLite writes one at a time: fewer, same rule
    run = run_create(project_id=hold.project_id)
    tasks = [hold.submit(run.id, {"i": i}) for i in range(count)]
    running = handlers(tasks)
    first = leases(tasks)
    assert all(lease is not None for lease in first.values())

    # One thread renews them all: no thread per task.
    names = [thread.name for thread in threading.enumerate()]
    assert names.count("runstate-renewer") == 1, names
    assert not [name for name in names if name.startswith("runstate-heartbeat")]
    assert len(renewer()) == count

    # Past two full leases, every claim still holds, renewed more than once.
    time.sleep(2 * LEASE_TTL_S)
    now = timezone.now()
    later = leases(tasks)
    assert all(later[task_id] > first[task_id] and later[task_id] > now for task_id in first)
    assert not any(ctx.signal.is_set() for ctx in contexts.values())

    # Another attempt takes one task over (as after a lease expiry): its claim is lost.
    lost = tasks[7]
    Task.objects.filter(id=lost.id).update(attempts=2, lease_expires_at=timezone.now() + timezone.timedelta(seconds=60))
    wait_until(
        lambda: contexts[lost.id].signal.is_set(),
        what="the lost claim to be noticed",
        interval_s=0.02,
        limit_s=3 * LEASE_TTL_S,
    )
    assert contexts[lost.id].lost == "LEASE_LOST"
    assert not contexts[lost.id].is_cancellation_requested()
    time.sleep(LEASE_TTL_S)  # another round of renewals for the others
    others = [ctx for task_id, ctx in contexts.items() if task_id != lost.id]
    assert not any(ctx.signal.is_set() or ctx.lease_lost for ctx in others)

    release.set()
    running["runner"].join(120)
    results = dict(zip([t.id for t in tasks], running["results"], strict=True))
    assert results.pop(lost.id) == "LEASE_LOST"
    assert set(results.values()) == {TaskState.SUCCEEDED}
    rows = Task.objects.filter(run=run)
    assert rows.filter(state=TaskState.SUCCEEDED).count() == count - 1
    # The lost claim recorded nothing: the task is as the takeover left it.
    assert rows.get(id=lost.id).state == TaskState.RUNNING and rows.get(id=lost.id).attempts == 2
    assert len(renewer()) == 0


def test_a_cancel_request_reaches_the_right_ctx_only(handlers, is_postgres):
    count = 20 if is_postgres else 6
    run = run_create(project_id=hold.project_id)
    tasks = [hold.submit(run.id, {"i": i}) for i in range(count)]
    running = handlers(tasks)
    target = tasks[3]
    requested = time.monotonic()
    task_cancel(project_id=hold.project_id, task_id=target.id, reason="not needed")
    wait_until(
        lambda: contexts[target.id].signal.is_set(),
        what="the cancel request to reach its ctx",
        interval_s=0.02,
        limit_s=3 * LEASE_TTL_S - (time.monotonic() - requested),
    )
    assert contexts[target.id].is_cancellation_requested() and not contexts[target.id].lease_lost
    time.sleep(LEASE_TTL_S)  # the others keep renewing and hear nothing
    assert not any(ctx.signal.is_set() for task_id, ctx in contexts.items() if task_id != target.id)

    release.set()
    running["runner"].join(120)
    states = dict(Task.objects.filter(run=run).values_list("id", "state"))
    # The handler returned after the request: the completion records CANCELLED.
    assert states.pop(target.id) == TaskState.CANCELLED
    assert set(states.values()) == {TaskState.SUCCEEDED}


def test_an_explicit_heartbeat_renews_at_once(handlers):
    run = run_create(project_id=hold.project_id)
    task = hold.submit(run.id, {"i": 0})
    handlers([task])
    before = Task.objects.get(id=task.id).lease_expires_at
    time.sleep(0.05)
    assert contexts[task.id].heartbeat() is True
    assert Task.objects.get(id=task.id).lease_expires_at > before
