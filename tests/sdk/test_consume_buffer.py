"""The buffered ``consume`` loop against the live service: completions and renewals in batches.

Completions wait in a buffer until ``FLUSH_SIZE`` are waiting or the oldest has waited
``FLUSH_DELAY_S``; one renewer tick renews every held claim in one call. What is asserted is
what went over the wire (counted by wrapping the real transport) and what the database
holds, never how long anything took: a flush trigger is isolated by making the other one
unreachable (a size of 10,000, a delay of an hour).
"""

import asyncio
import logging
import threading
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from coordination.models import Task
from coordination.services.sweeps import tasks_settle_expired_leases
from runstate import AsyncRunstate, Runstate
from runstate._worker import watch
from tests.sdk.test_batches import CountingAsyncTransport
from tests.sdk.test_worker import consumer_process, kill_after, prepare
from tests.waiting import until, wait_until

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]

NEVER_S = 3600.0  # a flush delay no test waits out
UNREACHABLE = 10_000  # a flush size no test reaches


@pytest.fixture
def renewal_only(monkeypatch):
    """Workers without their claim watch, as against a server that has none: renewal alone tells them.

    These tests let a lease run out under a running handler and take its task over, to see what
    the worker does with a result it can no longer record; the watch would tell it first (that
    is ``tests/sdk/test_cancel_push.py``'s), and a worker given a 404 falls back to renewal.
    """
    monkeypatch.setattr(watch, "PATH", "/claims/watch-absent")


def batches(transport, path):
    """The item counts of the requests sent to ``path`` (``/claims/complete`` or ``/claims/renew``)."""
    return [n for sent, n in transport.batches if sent == path]


async def gate_scenario(mailbox, count, *, concurrency, lease_ttl_ms=None, between=None):
    """Run ``count`` tasks whose handlers all start, then all return together; return what happened.

    ``between(run_id, tickets, contexts)`` runs (in a thread) once every handler started and
    before they return. Returns the summary, the tickets and the counting transport.
    """
    transport = CountingAsyncTransport()
    async with AsyncRunstate(transport=transport) as rs:
        await rs.mailboxes.ensure(mailbox, mode="WORK", lease_ttl_ms=lease_ttl_ms)
        run = await rs.scopes.create()
        tickets = await run.tasks.submit_many(mailbox, [{"input": {"n": n}} for n in range(count)])
        contexts = {}
        go = asyncio.Event()

        async def handler(ctx):
            contexts[ctx.task_id] = ctx
            await go.wait()
            return {"n": ctx.input["n"]}

        worker = run.worker(mailbox, handler, concurrency=concurrency, handle_signals=False)
        running = asyncio.create_task(worker.run())
        await until(lambda: len(contexts) == count, what="every handler to start")
        if between is not None:
            await asyncio.to_thread(between, run.id, tickets, contexts)
        go.set()
        await until(lambda: worker.summary.completed + worker.summary.lost == count, what="every record")
        worker.stop()
        summary = await running
    return summary, tickets, transport


def test_fifty_waiting_completions_are_sent_at_once_in_one_request(sdk, monkeypatch):
    monkeypatch.setattr("runstate._worker.completer.FLUSH_DELAY_S", NEVER_S)

    summary, tickets, transport = asyncio.run(gate_scenario("size", 50, concurrency=50))

    # The hour-long delay never passed: the 50th waiting completion sent the buffer.
    assert summary.completed == 50 and summary.lost == summary.failed == 0
    assert batches(transport, "/claims/complete") == [50]
    assert not [path for path, _ in transport.batches if path.endswith("/complete") and path != "/claims/complete"]
    assert set(Task.objects.filter(id__in=[t.id for t in tickets]).values_list("state", "attempts")) == {
        ("SUCCEEDED", 1)
    }


def test_completions_below_the_size_are_sent_once_the_delay_passed(sdk, monkeypatch):
    monkeypatch.setattr("runstate._worker.completer.FLUSH_SIZE", UNREACHABLE)

    summary, tickets, transport = asyncio.run(gate_scenario("timed", 5, concurrency=5))

    # Recorded while the worker ran (``gate_scenario`` waits for it before stopping): the delay sent them.
    assert summary.completed == 5
    sent = batches(transport, "/claims/complete")
    assert sum(sent) == 5 and len(sent) < 5, sent  # buffered together, not one request each
    assert sorted(t["outcome"]["n"] for t in Task.objects.filter(id__in=[t.id for t in tickets]).values()) == [
        0,
        1,
        2,
        3,
        4,
    ]


def test_stopping_sends_the_buffered_completions_before_the_loop_returns(sdk, monkeypatch):
    monkeypatch.setattr("runstate._worker.completer.FLUSH_SIZE", UNREACHABLE)
    monkeypatch.setattr("runstate._worker.completer.FLUSH_DELAY_S", NEVER_S)

    async def scenario():
        transport = CountingAsyncTransport()
        async with AsyncRunstate(transport=transport) as rs:
            await rs.mailboxes.ensure("held-back", mode="WORK")
            run = await rs.scopes.create()
            tickets = await run.tasks.submit_many("held-back", [{"input": {"n": n}} for n in range(3)])

            async def handler(ctx):
                return {"n": ctx.input["n"]}

            worker = run.worker("held-back", handler, concurrency=3, handle_signals=False)
            running = asyncio.create_task(worker.run())
            await until(lambda: len(worker._engine._completer._pending) == 3, what="three buffered completions")
            states = {(await ticket.status())["state"] for ticket in tickets}
            worker.stop()
            summary = await asyncio.wait_for(running, 60)
        return summary, states, tickets, transport

    summary, states_while_buffered, tickets, transport = asyncio.run(scenario())

    assert states_while_buffered == {"RUNNING"}  # nothing sent yet
    assert summary.completed == 3 and summary.stop_reason == "stopped"
    assert batches(transport, "/claims/complete") == [3]
    assert set(Task.objects.filter(id__in=[t.id for t in tickets]).values_list("state", flat=True)) == {"SUCCEEDED"}


def steal(task_id):
    """Let the lease of ``task_id`` run out and claim the task again (attempt 2) with another client."""
    Task.objects.filter(id=task_id).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    tasks_settle_expired_leases()
    row = Task.objects.get(id=task_id)
    assert (row.state, row.attempts) == ("QUEUED", 1)
    with Runstate() as thief:
        (claim,) = thief.scope(str(row.run_id)).tasks.claim(row.mailbox.name, max=1)
    connection.close()  # this thread's connection: the test's flush must not wait on it
    assert claim.attempt == 2
    return claim


@pytest.mark.parametrize("flush_size", [50, 1])
def test_a_lost_claim_in_a_buffer_is_reported_like_an_unbatched_one(sdk, monkeypatch, caplog, flush_size, renewal_only):
    """Three buffered completions, one of a claim taken over meanwhile: two recorded, one lost, in one request.

    With a flush size of 1 each completion goes alone: the summary and the log are the same.
    """
    monkeypatch.setattr("runstate._worker.completer.FLUSH_SIZE", flush_size)
    stolen = {}

    def between(run_id, tickets, contexts):
        stolen["task_id"] = tickets[1].id
        stolen["claim"] = steal(tickets[1].id)

    with caplog.at_level(logging.INFO, logger="runstate.worker"):
        summary, tickets, transport = asyncio.run(gate_scenario("lossy", 3, concurrency=3, between=between))

    assert (summary.completed, summary.lost, summary.failed) == (2, 1, 0)
    sent = batches(transport, "/claims/complete")
    assert sum(sent) == 3 and (flush_size == 1 or len(sent) < 3), sent
    assert any(
        m.startswith(f"task {stolen['task_id']} attempt 1: result not recorded (LEASE_LOST) after ")
        for m in caplog.messages
    ), caplog.messages
    rows = {str(row.id): row for row in Task.objects.filter(id__in=[t.id for t in tickets])}
    thief_held = rows.pop(stolen["task_id"])
    assert (thief_held.state, thief_held.attempts, thief_held.outcome) == ("RUNNING", 2, None)
    assert {(row.state, row.attempts) for row in rows.values()} == {("SUCCEEDED", 1)}


def test_the_sync_worker_reports_a_lost_buffered_completion_like_an_unbatched_one(sdk, caplog, renewal_only):
    with Runstate() as rs:
        rs.mailboxes.ensure("lossy-sync", mode="WORK")
        run = rs.scopes.create()
        tickets = run.tasks.submit_many("lossy-sync", [{"input": {"n": n}} for n in range(3)])
        started = []
        go = threading.Event()

        def handler(ctx):
            started.append(ctx.task_id)
            go.wait(30)
            return {"n": ctx.input["n"]}

        worker = run.worker("lossy-sync", handler, concurrency=3, handle_signals=False)
        with caplog.at_level(logging.INFO, logger="runstate.worker"):
            thread = threading.Thread(target=worker.run)
            thread.start()
            try:
                wait_until(lambda: len(started) >= 3, what="three handlers to start", interval_s=0.01)
                assert len(started) == 3
                steal(tickets[0].id)
                go.set()
                wait_until(
                    lambda: worker.summary.completed + worker.summary.lost >= 3, what="every record", interval_s=0.01
                )
            finally:
                go.set()
                worker.stop()
                thread.join(30)
    assert not thread.is_alive()
    assert (worker.summary.completed, worker.summary.lost, worker.summary.failed) == (2, 1, 0)
    assert any(
        m.startswith(f"task {tickets[0].id} attempt 1: result not recorded (LEASE_LOST) after ")
        for m in caplog.messages
    ), caplog.messages


def test_one_renewer_tick_renews_every_held_claim_and_a_refusal_trips_that_task_only(sdk, renewal_only):
    """Four held claims renewed in one call per tick; one cancelled, one taken over: only those two are told."""
    seen = {}

    async def scenario():
        transport = CountingAsyncTransport()
        async with AsyncRunstate(transport=transport) as rs:
            await rs.mailboxes.ensure("renewed", mode="WORK", lease_ttl_ms=1500)  # a tick every 0.5 s
            run = await rs.scopes.create()
            tickets = await run.tasks.submit_many("renewed", [{"input": {"n": n}} for n in range(4)])
            contexts = {}
            go = asyncio.Event()

            async def handler(ctx):
                contexts[ctx.task_id] = ctx
                try:
                    await go.wait()
                except asyncio.CancelledError:
                    seen.setdefault("cancelled", []).append(ctx.task_id)
                    raise
                return {"n": ctx.input["n"], "stop_reason": ctx.stop_reason}

            worker = run.worker("renewed", handler, concurrency=4, handle_signals=False)
            running = asyncio.create_task(worker.run())
            await until(lambda: len(contexts) == 4, what="four handlers")
            await until(lambda: len(batches(transport, "/claims/renew")) >= 2, what="two renewer ticks")
            seen["before"] = batches(transport, "/claims/renew")
            cancelled, lost = tickets[0].id, tickets[1].id
            await tickets[0].cancel(reason="enough")
            seen["thief"] = await asyncio.to_thread(steal, lost)
            await until(lambda: contexts[cancelled].signal.is_set(), what="the cancel to be seen")
            await until(lambda: contexts[lost].signal.is_set(), what="the lost lease to be seen")
            seen["untouched"] = [contexts[t.id].signal.is_set() for t in tickets[2:]]
            go.set()
            await until(lambda: worker.summary.completed + worker.summary.lost == 4, what="every record")
            worker.stop()
            return await running, tickets, contexts, transport

    summary, tickets, contexts, transport = asyncio.run(scenario())

    assert seen["before"][:2] == [4, 4]  # every held claim in one request per tick
    assert not [path for path, _ in transport.batches if path.startswith("/claims/c_")]
    assert seen["untouched"] == [False, False]
    assert contexts[tickets[0].id].stop_reason == "cancellation_requested"
    assert contexts[tickets[1].id].stop_reason == "lease_lost"
    assert seen["cancelled"] == [tickets[1].id]  # the lost claim's handler only
    assert (summary.completed, summary.lost) == (3, 1)
    rows = {str(row.id): row for row in Task.objects.filter(id__in=[t.id for t in tickets])}
    assert rows[tickets[0].id].state == "CANCELLED"
    assert (rows[tickets[1].id].state, rows[tickets[1].id].attempts) == ("RUNNING", 2)
    assert {rows[t.id].state for t in tickets[2:]} == {"SUCCEEDED"}
    assert {rows[t.id].outcome["stop_reason"] for t in tickets[2:]} == {None}


def test_a_consumer_killed_with_a_completion_buffered_has_its_task_taken_over(sdk):
    """SIGKILL while a completion waits in the buffer: it was never sent, so the lease runs out and the task reruns."""
    run_id, task_id = prepare("buffered-kill", lease_ttl_ms=1000)

    def only_in_the_buffer():
        assert Task.objects.get(id=task_id).state == "RUNNING"  # the completion was not sent

    process = consumer_process(sdk, run_id, "buffered-kill", "buffer")
    kill_after(process, f"claimed {task_id} 1", f"buffered {task_id}", check=only_in_the_buffer)

    async def second_consumer():
        async with AsyncRunstate() as rs:

            async def handler(ctx):
                return {"by": "second", "attempt": ctx.attempt}

            worker = rs.scope(run_id).worker("buffered-kill", handler, handle_signals=False)
            running = asyncio.create_task(worker.run())
            task = await rs.tasks.get(task_id).result(timeout_ms=20_000)
            worker.stop()
            return task, await running

    task, summary = asyncio.run(second_consumer())

    assert (task["state"], task["attempts"], task["outcome"]) == ("SUCCEEDED", 2, {"by": "second", "attempt": 2})
    assert summary.completed == 1
