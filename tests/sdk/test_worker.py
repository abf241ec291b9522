"""The worker loop (``consume``) against the live service: exactly once, cancellation, takeover, stop."""

import asyncio
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from coordination.models import Task
from coordination.services.sweeps import tasks_settle_expired_leases
from runstate import AsyncRunstate, Runstate
from tests.sdk.conftest import ROOT
from tests.waiting import WAIT_S, until

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]

LEASE_TTL_MS = 1500  # renewals every 0.5 s
RENEW_INTERVAL_S = LEASE_TTL_MS / 3 / 1000
# Room for a renewal's round trip and scheduling on a busy machine, on top of the interval.
LATENCY_MARGIN_S = 0.5


def test_three_consumers_drain_300_tasks_exactly_once(sdk):
    handled: list[tuple[str, int]] = []

    async def scenario():
        async with AsyncRunstate() as rs:
            await rs.mailboxes.ensure("drain", mode="WORK")
            run = await rs.scopes.create(name="drain")
            for start in range(0, 300, 50):
                await asyncio.gather(*(run.tasks.submit("drain", {"n": n}) for n in range(start, start + 50)))

            clients = [AsyncRunstate() for _ in range(3)]
            workers = []
            for index, client in enumerate(clients):

                async def handler(ctx, index=index):
                    handled.append((ctx.task_id, index))
                    await asyncio.sleep(random.uniform(0, 0.01))
                    return {"n": ctx.input["n"], "worker": index}

                workers.append(client.scope(run.id).worker("drain", handler, concurrency=4, handle_signals=False))
            running = [asyncio.create_task(worker.run()) for worker in workers]
            await until(lambda: sum(w.summary.completed for w in workers) >= 300, waits=2, what="300 tasks")
            for worker in workers:
                worker.stop()
            summaries = await asyncio.gather(*running)
            for client in clients:
                await client.aclose()
            return run.id, summaries

    run_id, summaries = asyncio.run(scenario())

    task_ids = [task_id for task_id, _ in handled]
    assert len(task_ids) == 300
    assert len(set(task_ids)) == 300
    assert sum(s.completed for s in summaries) == 300
    assert all(s.failed == s.lost == s.released == 0 and s.stop_reason == "stopped" for s in summaries)
    assert len({index for _, index in handled}) == 3  # all three took part
    tasks = Task.objects.filter(run_id=run_id)
    assert tasks.count() == 300
    assert set(tasks.values_list("state", "attempts").distinct()) == {("SUCCEEDED", 1)}
    assert sorted(t.outcome["n"] for t in tasks) == list(range(300))


def cancel_scenario(handler_body):
    """Start one consumer whose handler runs ``handler_body(ctx, seen)``; cooperatively cancel its task."""
    seen = {}

    async def scenario():
        async with AsyncRunstate() as rs:
            await rs.mailboxes.ensure("coop", mode="WORK", lease_ttl_ms=LEASE_TTL_MS)
            run = await rs.scopes.create()
            ticket = await run.tasks.submit("coop", {"step": 1})
            started = asyncio.Event()

            async def handler(ctx):
                seen["ctx"] = ctx
                started.set()
                return await handler_body(ctx, seen)

            worker = run.worker("coop", handler, handle_signals=False)
            running = asyncio.create_task(worker.run())
            await asyncio.wait_for(started.wait(), WAIT_S)
            await asyncio.sleep(0.3)  # somewhere in the middle of a renewal interval
            await ticket.cancel(reason="enough")
            seen["cancelled_at"] = time.monotonic()  # the request is recorded: the next renewal sees it
            task = await ticket.result(timeout_ms=10_000)
            worker.stop()
            summary = await running
            return task, summary

    task, summary = asyncio.run(scenario())
    return task, summary, seen


def test_a_handler_sees_the_signal_within_one_renewal_after_a_cooperative_cancel(sdk):
    async def body(ctx, seen):
        await ctx.signal.wait()
        seen["signalled_at"] = time.monotonic()
        return {"stopped": "early"}

    task, summary, seen = cancel_scenario(body)

    latency = seen["signalled_at"] - seen["cancelled_at"]
    assert latency <= RENEW_INTERVAL_S + LATENCY_MARGIN_S, latency
    assert seen["ctx"].stop_reason == "cancellation_requested"
    assert seen["ctx"].is_cancellation_requested()
    assert task["state"] == "CANCELLED"
    assert task["cancelReason"] == "enough"
    assert task["outcome"] == {"stopped": "early"}
    assert summary.completed == 1


def test_a_handler_that_raises_after_the_cancel_request_ends_failed(sdk):
    async def body(ctx, seen):
        await ctx.signal.wait()
        raise RuntimeError("could not stop cleanly")

    task, summary, _ = cancel_scenario(body)

    assert task["state"] == "FAILED"  # a failure is never rewritten as a cancellation, nor retried
    assert task["attempts"] == 1
    assert task["error"]["type"] == "RuntimeError"
    assert task["error"]["message"] == "could not stop cleanly"
    assert summary.failed == 1


def test_a_raising_handler_is_retried_then_fails(sdk):
    attempts = []

    async def scenario():
        async with AsyncRunstate() as rs:
            await rs.mailboxes.ensure("flaky", mode="WORK", max_attempts=3)
            run = await rs.scopes.create()
            ok = await run.tasks.submit("flaky", {"fail_times": 1})
            bad = await run.tasks.submit("flaky", {"fail_times": 99})

            async def handler(ctx):
                attempts.append((ctx.task_id, ctx.attempt))
                if ctx.attempt <= ctx.input["fail_times"]:
                    raise ValueError(f"attempt {ctx.attempt}")
                return "ok"

            worker = run.worker("flaky", handler, concurrency=2, handle_signals=False)
            running = asyncio.create_task(worker.run())
            results = [await ok.result(timeout_ms=20_000), await bad.result(timeout_ms=20_000)]
            worker.stop()
            return results, await running, ok.id, bad.id

    (ok, bad), summary, ok_id, bad_id = asyncio.run(scenario())

    assert ok["state"] == "SUCCEEDED" and ok["outcome"] == "ok" and ok["attempts"] == 2
    assert bad["state"] == "FAILED" and bad["attempts"] == 3 and bad["error"]["message"] == "attempt 3"
    assert sorted(a for t, a in attempts if t == bad_id) == [1, 2, 3]
    assert summary.completed == 1 and summary.failed == 4


@pytest.mark.parametrize("concurrency", [1, 2])
def test_a_consumer_whose_run_is_cancelled_stops_and_its_handler_is_cancelled(sdk, concurrency):
    seen = {}

    async def scenario():
        async with AsyncRunstate() as rs:
            await rs.mailboxes.ensure("doomed", mode="WORK", lease_ttl_ms=LEASE_TTL_MS)
            run = await rs.scopes.create()
            ticket = await run.tasks.submit("doomed", {})
            started = asyncio.Event()

            async def handler(ctx):
                seen["ctx"] = ctx
                started.set()
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    seen["cancelled"] = True
                    raise

            consume = asyncio.create_task(run.consume("doomed", handler, concurrency=concurrency, handle_signals=False))
            await asyncio.wait_for(started.wait(), WAIT_S)
            await rs.scope(run.id).cancel(reason="stop everything")
            summary = await asyncio.wait_for(consume, timeout=10)
            return summary, await ticket.status()

    summary, task = asyncio.run(scenario())

    assert summary.stop_reason == "SCOPE_CANCELLED"
    assert seen.get("cancelled") is True
    assert seen["ctx"].signal.is_set()
    assert seen["ctx"].stop_reason == "scope_refused"
    assert summary.lost == 1 and summary.completed == 0
    assert task["state"] == "CANCELLED"


def test_a_handler_that_outlives_the_cancel_grace_loses_its_claim_and_is_cancelled(sdk):
    """After ``grace_ms`` the server records CANCELLED and the claim is LEASE_LOST: the handler is cancelled."""
    seen = {}

    async def scenario():
        async with AsyncRunstate() as rs:
            await rs.mailboxes.ensure("graceful", mode="WORK", lease_ttl_ms=LEASE_TTL_MS)
            run = await rs.scopes.create()
            ticket = await run.tasks.submit("graceful", {})
            started = asyncio.Event()

            async def handler(ctx):
                seen["ctx"] = ctx
                started.set()
                try:
                    await asyncio.sleep(3600)  # ignores ctx.signal
                except asyncio.CancelledError:
                    seen["cancelled_at"] = time.monotonic()
                    raise

            worker = run.worker("graceful", handler, handle_signals=False)
            running = asyncio.create_task(worker.run())
            await asyncio.wait_for(started.wait(), WAIT_S)
            await ticket.cancel(reason="too slow", grace_ms=200)
            cancelled_at = time.monotonic()
            await until(lambda: "cancelled_at" in seen, what="the handler to be cancelled")
            worker.stop()
            return await running, await ticket.status(), seen["cancelled_at"] - cancelled_at

    summary, task, latency = asyncio.run(scenario())

    assert seen["ctx"].signal.is_set()
    # The grace, then at most one renewal that still holds and one that is refused.
    assert latency <= 0.2 + 2 * RENEW_INTERVAL_S + LATENCY_MARGIN_S, latency
    assert summary.lost == 1 and summary.completed == 0
    # The lease sweep (run by beat every second in production) records the cancellation.
    assert task["state"] == "CANCELLATION_REQUESTED"
    tasks_settle_expired_leases()
    settled = Task.objects.get(id=task["id"])
    assert settled.state == "CANCELLED" and settled.cancel_reason == "too slow"


def consumer_process(sdk, run_id, mailbox, mode, drain_timeout=30.0):
    env = dict(os.environ, RUNSTATE_URL=sdk.url, RUNSTATE_API_KEY=sdk.api_key, RUNSTATE_SCOPE_ID=run_id)
    env["PYTHONUNBUFFERED"] = "1"
    return subprocess.Popen(
        [sys.executable, "-m", "tests.sdk.consumer_process", mailbox, mode, str(drain_timeout)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def read_line(process, timeout_s=20.0):
    """Read one stdout line of ``process`` (failing with its stderr after ``timeout_s``)."""
    result = []
    reader = threading.Thread(target=lambda: result.append(process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not result or not result[0]:
        process.kill()
        raise AssertionError(f"no output from the consumer process:\n{process.stderr.read()}")
    return result[0].strip()


def prepare(mailbox, *, lease_ttl_ms):
    with Runstate() as rs:
        rs.mailboxes.ensure(mailbox, mode="WORK", lease_ttl_ms=lease_ttl_ms)
        run = rs.scopes.create()
        ticket = run.tasks.submit(mailbox, {"job": 1})
    return run.id, ticket.id


def kill_after(process, *lines, check=None):
    """Read ``lines`` (in order) from ``process``, run ``check()``, then SIGKILL it and reap it."""
    try:
        for line in lines:
            assert read_line(process) == line
        if check is not None:
            check()
        os.kill(process.pid, signal.SIGKILL)
        process.wait(10)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_consumer_killed_mid_task_has_its_task_taken_over(sdk):
    run_id, task_id = prepare("takeover", lease_ttl_ms=1000)
    kill_after(consumer_process(sdk, run_id, "takeover", "hang"), f"claimed {task_id} 1")

    seen = {}

    async def second_consumer():
        async with AsyncRunstate() as rs:
            ticket = rs.tasks.get(task_id)

            async def handler(ctx):
                seen["attempt"] = ctx.attempt
                return {"by": "second"}

            worker = rs.scope(run_id).worker("takeover", handler, handle_signals=False)
            running = asyncio.create_task(worker.run())
            started = time.monotonic()
            task = await ticket.result(timeout_ms=20_000)
            took = time.monotonic() - started
            worker.stop()
            await running
            return task, took

    task, took = asyncio.run(second_consumer())

    assert task["state"] == "SUCCEEDED"
    assert task["outcome"] == {"by": "second"}
    assert task["attempts"] == 2 and seen["attempt"] == 2
    assert took < 20  # the 1 s lease runs out, then the next claim takes the task over


def test_sigterm_lets_the_running_handler_finish_and_records_it(sdk):
    run_id, task_id = prepare("sigterm", lease_ttl_ms=3000)
    process = consumer_process(sdk, run_id, "sigterm", "finish")
    try:
        assert read_line(process) == f"claimed {task_id} 1"
        process.send_signal(signal.SIGTERM)
        assert read_line(process) == "summary completed=1 failed=0 lost=0 released=0 stop_reason=stopped"
        assert process.wait(20) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    task = Task.objects.get(id=task_id)
    assert task.state == "SUCCEEDED"
    assert task.outcome == {"mode": "finish", "stop_reason": None}


def test_sigterm_releases_a_task_whose_handler_outlives_the_drain_timeout(sdk):
    run_id, task_id = prepare("drained", lease_ttl_ms=30_000)
    process = consumer_process(sdk, run_id, "drained", "hang", drain_timeout=0.5)
    try:
        assert read_line(process) == f"claimed {task_id} 1"
        process.send_signal(signal.SIGTERM)
        assert read_line(process) == "summary completed=0 failed=0 lost=0 released=1 stop_reason=stopped"
        assert process.wait(20) == 0  # the hanging handler thread does not keep the process alive
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    task = Task.objects.get(id=task_id)
    assert task.state == "QUEUED"  # back in the queue at once, not after the 30 s lease
    assert task.attempts == 1


def test_the_sync_worker_runs_handlers_in_threads_with_a_threading_event(sdk):
    seen = {"threads": set()}
    with Runstate() as rs:
        rs.mailboxes.ensure("threads", mode="WORK", lease_ttl_ms=LEASE_TTL_MS)
        run = rs.scopes.create()
        tickets = [run.tasks.submit("threads", {"n": n}) for n in range(8)]
        blocker = run.tasks.submit("threads", {"block": True}, priority=10)

        def handler(ctx):
            seen["threads"].add(threading.current_thread().name)
            if ctx.input.get("block"):
                seen["event"] = ctx.signal
                ctx.signal.wait(30)  # a threading.Event: blocks this thread only
                return {"cancelled_by": ctx.stop_reason}
            time.sleep(0.05)
            return ctx.input["n"] * 2

        worker = run.worker("threads", handler, concurrency=3, handle_signals=False)
        thread = threading.Thread(target=worker.run)
        thread.start()
        try:
            results = [ticket.result(timeout_ms=20_000) for ticket in tickets]
            blocker.cancel(reason="done")
            blocked = blocker.result(timeout_ms=10_000)
        finally:
            worker.stop()
            thread.join(20)
    assert not thread.is_alive()
    assert [r["outcome"] for r in results] == [n * 2 for n in range(8)]
    assert blocked["state"] == "CANCELLED" and blocked["outcome"] == {"cancelled_by": "cancellation_requested"}
    assert isinstance(seen["event"], threading.Event)
    assert all(name.startswith("runstate-handler") for name in seen["threads"])
    assert worker.summary.completed == 9 and worker.summary.stop_reason == "stopped"
