"""A Celery worker process's claim watch: what stops a claim reaches its handler as it commits.

Real threads run ``workers.runtime.execute`` as a threads-pool worker would, with a lease of
ten minutes: the renewer would say nothing for 200 s, so a handler that hears of its cancel
heard it from the process's claim watch (``workers.watch``). The interleavings the watch must
survive are forced: an event read before its claim is registered, claims taken before the
watch starts, the LISTEN connection killed while a cancel commits.
"""

import threading
import uuid

import pytest
from django.db import connection

from coordination.domain.states import TaskState
from coordination.models import Event, Task
from coordination.services.claims import task_claim_by_id_narrow
from coordination.services.runs import run_cancel, run_create
from coordination.services.tasks import task_cancel
from tests.waiting import wait_until
from tests.workers.holding import hold_until_released, running_handlers
from workers import runstate_task
from workers.runtime import TaskContext, renewer

pytestmark = pytest.mark.django_db(transaction=True)

PROJECT = "claim-watch-unit"
LEASE_TTL_S = 600  # renewed every 200 s: only the watch can tell a handler within a test
WORKER = "watch-test/worker"

contexts: dict = {}
release = threading.Event()


@runstate_task(mailbox="claim-watch-holds", project=PROJECT, lease_ttl=LEASE_TTL_S, queue="tests-claim-watch")
def hold(ctx, i: int):
    """Hold the claim until the test releases it or the signal says stop."""
    hold_until_released(ctx, contexts, release)
    return {"i": i}


@pytest.fixture
def handlers():
    """Start one handler thread per task (``start(tasks)``); release and join them at the end."""
    with running_handlers(hold, contexts, release) as start:
        yield start


def read_past(watcher, event: Event) -> bool:
    return watcher.cursor is not None and watcher.cursor >= (event.txid, event.id)


def test_a_task_cancel_and_a_run_cancel_reach_running_handlers_without_a_renewal(handlers, is_postgres):
    count = 12 if is_postgres else 4
    run = run_create(project_id=hold.project_id)
    tasks = [hold.submit(run.id, {"i": i}) for i in range(count)]
    running = handlers(tasks)
    assert renewer().watcher.ready.is_set()

    target = tasks[0]
    task_cancel(project_id=hold.project_id, task_id=target.id, reason="not needed")
    wait_until(lambda: contexts[target.id].signal.is_set(), what="the cancel request to reach its handler")
    assert contexts[target.id].is_cancellation_requested() and not contexts[target.id].lease_lost
    assert not any(ctx.signal.is_set() for task_id, ctx in contexts.items() if task_id != target.id)
    # The handler returns on the signal: its completion records CANCELLED.
    wait_until(lambda: Task.objects.get(id=target.id).state == TaskState.CANCELLED, what="the handler's record")

    run_cancel(project_id=hold.project_id, run_id=run.id, reason="the swarm is done")
    others = [contexts[task.id] for task in tasks[1:]]
    wait_until(lambda: all(ctx.signal.is_set() for ctx in others), what="the run cancel to reach every handler")
    assert {ctx.lost for ctx in others} == {"SCOPE_CANCELLED"}
    assert all(ctx.is_cancellation_requested() for ctx in others)

    running["runner"].join(120)
    results = dict(zip([t.id for t in tasks], running["results"], strict=True))
    assert results.pop(target.id) == TaskState.CANCELLED  # returned after the request: recorded CANCELLED
    assert set(results.values()) == {"SCOPE_CANCELLED"}  # their claims ended with the run: nothing recorded
    assert set(Task.objects.filter(run=run).values_list("state", flat=True)) == {TaskState.CANCELLED}


def claimed_by(worker_id: str):
    """Submit a task of ``hold`` and claim it as ``worker_id``, as ``execute`` would; return the task and the claim."""
    project_id, mailbox_id = hold.ids()
    task = hold.submit(run_create(project_id=project_id).id, {"i": 0})
    claim = task_claim_by_id_narrow(
        project_id=project_id,
        task_id=task.id,
        worker_id=worker_id,
        lease_ttl_ms=LEASE_TTL_S * 1000,
        mailbox_id=mailbox_id,
    )
    assert claim is not None
    return task, claim


def test_an_event_read_before_its_claim_is_registered_is_applied_when_it_is():
    """``execute`` claims, then registers the claim: a cancel read by the watch in between is kept for it."""
    hold.forget_ids()
    project_id = hold.project_id
    process = renewer()
    process.expect(project_id, WORKER)
    task, claim = claimed_by(WORKER)
    task_cancel(project_id=project_id, task_id=task.id, reason="before the handler ran")
    requested = Event.objects.get(subject_id=task.id, type="task.cancellation_requested")
    assert requested.data["heldBy"] == WORKER
    wait_until(lambda: read_past(process.watcher, requested), what="the watch to read the cancel")

    ctx = TaskContext(claim, mailbox=hold.mailbox_name)
    held = process.hold(ctx, project_id=project_id, lease_ttl_ms=LEASE_TTL_S * 1000, renew_ttl_ms=None)
    try:
        assert ctx.signal.is_set() and ctx.is_cancellation_requested() and not ctx.lease_lost
    finally:
        process.let_go(held)


def test_claims_held_before_the_watch_starts_are_renewed_once_when_it_does():
    """A claim registered before the watch reads (its delivery did not wait) hears an earlier cancel at its start."""
    hold.forget_ids()
    project_id = hold.project_id
    fresh = renewer()
    fresh.watcher.stop()  # as in a process whose watch has not started yet
    task, claim = claimed_by(WORKER)
    ctx = TaskContext(claim, mailbox=hold.mailbox_name)
    held = fresh.hold(ctx, project_id=project_id, lease_ttl_ms=LEASE_TTL_S * 1000, renew_ttl_ms=None)
    try:
        task_cancel(project_id=project_id, task_id=task.id, reason="before the watch started")
        assert not ctx.signal.is_set()  # nothing renews it for 200 s, and no watch reads yet
        fresh.expect(project_id, f"{WORKER}/another")  # a later delivery starts the watch
        assert fresh.watcher.ready.is_set()
        wait_until(lambda: ctx.signal.is_set(), what="the renewal the watch's start asks for")
        assert ctx.is_cancellation_requested()
    finally:
        fresh.let_go(held)


@pytest.mark.postgres_only
def test_a_cancel_committed_while_the_listen_connection_is_down_still_arrives(handlers):
    run = run_create(project_id=hold.project_id)
    tasks = [hold.submit(run.id, {"i": i}) for i in range(3)]
    running = handlers(tasks)
    watcher = renewer().watcher
    with connection.cursor() as cursor:
        # The watch's LISTEN connection, and nothing else: terminate it, then cancel at once.
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE query = 'LISTEN runstate' AND pid <> pg_backend_pid()"
            " AND datname = current_database() AND backend_type = 'client backend'"
        )
        listeners = [row[0] for row in cursor.fetchall()]
        assert listeners, "the claim watch listens"
        for pid in listeners:
            cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
    reads = watcher.reads
    task_cancel(project_id=hold.project_id, task_id=tasks[1].id, reason="while the watch reconnects")
    wait_until(lambda: contexts[tasks[1].id].signal.is_set(), what="the cancel, read after the reconnection")
    assert watcher.reads > reads
    assert not contexts[tasks[0].id].signal.is_set() and not contexts[tasks[2].id].signal.is_set()
    release.set()
    running["runner"].join(120)
    assert dict(zip([t.id for t in tasks], running["results"], strict=True))[tasks[1].id] == TaskState.CANCELLED


def test_the_watch_reads_only_the_events_of_this_process_workers(handlers):
    """Another worker's cancelled claim in the same project reaches no handler here and is not kept."""
    run = run_create(project_id=hold.project_id)
    mine = hold.submit(run.id, {"i": 0})
    running = handlers([mine])
    project_id = hold.project_id
    theirs, _ = claimed_by(f"elsewhere/{uuid.uuid4()}")
    task_cancel(project_id=project_id, task_id=theirs.id, reason="theirs")
    requested = Event.objects.get(subject_id=theirs.id, type="task.cancellation_requested")
    process = renewer()
    wait_until(lambda: read_past(process.watcher, requested), what="the watch to read past the other's cancel")
    # The watch hands an event over before its cursor passes it: this one was never read.
    assert requested.data["claimId"] not in process._early
    assert not contexts[mine.id].signal.is_set()
    release.set()
    running["runner"].join(120)
