"""The message loop (``consume_messages``) against the live service: answers, extends, loss, stop."""

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from django.db import connection

import runstate
from coordination.models import Event, Message
from coordination.services.messages import delivery_retry
from runstate import AsyncRunstate, Reject, Runstate
from tests.sdk.conftest import ROOT
from tests.waiting import WAIT_S, until, wait_until

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]

VISIBILITY_MS = 600  # extends every 0.2 s


async def queue_with(rs, mailbox, bodies):
    await rs.mailboxes.ensure(mailbox, mode="QUEUE")
    run = await rs.scopes.create()
    sent = [await run.messages.send(mailbox, body) for body in bodies]
    return run, sent


def test_reject_is_exported_and_carries_its_reason():
    assert runstate.Reject is Reject
    assert Reject("bad input").reason == "bad input"
    assert Reject().reason is None
    assert "Reject" in runstate.__all__ and "MessageSummary" in runstate.__all__


def test_handlers_returning_complete_every_message_once(sdk):
    seen = []

    async def scenario():
        async with AsyncRunstate() as rs:
            run, sent = await queue_with(rs, "done", [{"n": n} for n in range(10)])

            async def handler(ctx):
                seen.append((ctx.message_id, ctx.delivery_id, ctx.attempt, ctx.body["n"]))
                await asyncio.sleep(0.01)
                return "ok"

            worker = run.message_worker("done", handler, concurrency=3, handle_signals=False)
            running = asyncio.create_task(worker.run())
            await until(lambda: worker.summary.completed >= 10, what="10 completions")
            worker.stop()
            return sent, await running

    sent, summary = asyncio.run(scenario())

    assert sorted(n for *_, n in seen) == list(range(10))
    assert {message_id for message_id, *_ in seen} == {m["id"] for m in sent}
    assert all(attempt == 1 and delivery_id.startswith("d_") for _, delivery_id, attempt, _ in seen)
    assert (summary.completed, summary.retried, summary.rejected, summary.lost) == (10, 0, 0, 0)
    assert summary.stop_reason == "stopped"
    rows = Message.objects.filter(id__in=[m["id"] for m in sent])
    assert set(rows.values_list("state", flat=True)) == {"COMPLETED"}
    assert set(rows.values_list("attempts", flat=True)) == {1}


def test_an_exception_retries_after_the_delay_and_the_message_comes_back_as_attempt_2(sdk):
    attempts = []

    async def scenario():
        async with AsyncRunstate() as rs:
            run, (message,) = await queue_with(rs, "flaky", [{"job": 1}])

            async def handler(ctx):
                attempts.append(ctx.attempt)
                if ctx.attempt == 1:
                    raise RuntimeError("first try fails")
                return "ok"

            worker = run.message_worker("flaky", handler, retry_delay_ms=300, handle_signals=False)
            running = asyncio.create_task(worker.run())
            await until(lambda: worker.summary.completed >= 1, what="the second attempt")
            worker.stop()
            return message, await running

    message, summary = asyncio.run(scenario())

    assert attempts == [1, 2]
    assert (summary.retried, summary.completed) == (1, 1)
    row = Message.objects.get(id=message["id"])
    assert (row.state, row.attempts) == ("COMPLETED", 2)
    retried = Event.objects.get(type="message.retried", subject_id=message["id"])
    assert retried.data["delayMs"] == 300


def test_reject_dead_letters_the_message_with_its_reason(sdk):
    async def scenario():
        async with AsyncRunstate() as rs:
            run, (message,) = await queue_with(rs, "poison", [{"job": "bad"}])

            def handler(ctx):  # a plain function, run in a thread
                raise Reject(f"cannot parse {ctx.body['job']}")

            worker = run.message_worker("poison", handler, handle_signals=False)
            running = asyncio.create_task(worker.run())
            await until(lambda: worker.summary.rejected >= 1, what="the reject")
            worker.stop()
            return message, await running

    message, summary = asyncio.run(scenario())

    assert (summary.rejected, summary.retried, summary.completed) == (1, 0, 0)
    row = Message.objects.get(id=message["id"])
    assert (row.state, row.dead_letter_reason, row.attempts) == ("DEAD_LETTERED", "cannot parse bad", 1)


def test_background_extends_keep_a_slow_handlers_message_from_redelivery(sdk):
    """The handler takes five visibilities; its message is never handed out again."""
    calls = []

    async def scenario():
        async with AsyncRunstate() as rs:
            run, (message,) = await queue_with(rs, "slow", [{"job": 1}])

            async def handler(ctx):
                calls.append(ctx.attempt)
                await asyncio.sleep(VISIBILITY_MS * 5 / 1000)
                return "ok"

            # concurrency 2: a free slot keeps receiving, so a redelivery would reach this worker.
            worker = run.message_worker(
                "slow", handler, concurrency=2, visibility_ms=VISIBILITY_MS, receive_wait_ms=200, handle_signals=False
            )
            running = asyncio.create_task(worker.run())
            await until(lambda: worker.summary.completed >= 1, what="the slow handler")
            worker.stop()
            return message, await running

    message, summary = asyncio.run(scenario())

    assert calls == [1]
    assert (summary.completed, summary.lost) == (1, 0)
    row = Message.objects.get(id=message["id"])
    assert (row.state, row.attempts) == ("COMPLETED", 1)
    assert Event.objects.filter(type="message.received", subject_id=message["id"]).count() == 1


def retry_elsewhere(project_id, delivery_id):
    """Retry the delivery as another party would, on a connection of this thread (closed after)."""
    try:
        delivery_retry(project_id=project_id, delivery_id=delivery_id, delay_ms=60_000)
    finally:
        connection.close()


def test_a_delivery_answered_elsewhere_is_lost_at_the_next_extend(sdk):
    """Another party retries the delivery (delay 60 s): the next extend is LEASE_LOST, the handler cancelled."""
    seen = {}

    async def scenario():
        async with AsyncRunstate() as rs:
            run, (message,) = await queue_with(rs, "taken", [{"job": 1}])
            started = asyncio.Event()

            async def handler(ctx):
                seen["ctx"] = ctx
                started.set()
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    seen["cancelled"] = True
                    raise

            worker = run.message_worker("taken", handler, visibility_ms=VISIBILITY_MS, handle_signals=False)
            running = asyncio.create_task(worker.run())
            await asyncio.wait_for(started.wait(), 20)
            await asyncio.to_thread(retry_elsewhere, sdk.project_id, seen["ctx"].delivery_id)
            await until(lambda: worker.summary.lost >= 1, what="the lost delivery")
            worker.stop()
            return message, await running

    message, summary = asyncio.run(scenario())

    ctx = seen["ctx"]
    assert (summary.lost, summary.completed, summary.retried) == (1, 0, 0)
    assert ctx.lost and ctx.stop_reason == "lease_lost" and seen.get("cancelled") is True
    row = Message.objects.get(id=message["id"])
    assert (row.state, row.attempts) == ("QUEUED", 1)  # the other party's retry stands; nothing more was sent


@pytest.mark.parametrize("client", ["async", "sync"])
def test_cancelling_the_run_mid_handler_loses_the_delivery_and_stops_the_loop(sdk, client):
    seen = {}
    started = threading.Event()

    async def async_handler(ctx):
        seen["ctx"] = ctx
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            seen["cancelled"] = True
            raise

    def sync_handler(ctx):
        seen["ctx"] = ctx
        started.set()
        seen["signalled"] = ctx.signal.wait(30)
        return "too late"

    with Runstate() as rs:
        rs.mailboxes.ensure("doomed", mode="QUEUE")
        run = rs.scopes.create()
        message = run.messages.send("doomed", {"job": 1})

    def cancel_once_started():
        assert started.wait(WAIT_S)
        with Runstate() as rs:
            rs.scope(run.id).cancel(reason="stop everything")

    canceller = threading.Thread(target=cancel_once_started, daemon=True)
    canceller.start()
    if client == "async":

        async def consume():
            async with AsyncRunstate() as rs:
                return await rs.scope(run.id).consume_messages(
                    "doomed", async_handler, visibility_ms=VISIBILITY_MS, handle_signals=False
                )

        summary = asyncio.run(consume())
    else:
        with Runstate() as rs:
            summary = rs.scope(run.id).consume_messages(
                "doomed", sync_handler, visibility_ms=VISIBILITY_MS, handle_signals=False
            )
    canceller.join(WAIT_S)

    ctx = seen["ctx"]
    assert summary.stop_reason == "SCOPE_CANCELLED"
    assert (summary.lost, summary.completed, summary.retried) == (1, 0, 0)
    assert ctx.signal.is_set() and ctx.lost and ctx.is_lost()
    assert ctx.stop_reason == "scope_refused"
    if client == "async":
        assert seen.get("cancelled") is True
    else:
        assert seen.get("signalled") is True
    # Nothing more was sent for it, and it was never delivered again.
    row = Message.objects.get(id=message["id"])
    assert (row.state, row.attempts) == ("IN_FLIGHT", 1)
    types = list(Event.objects.filter(subject_id=message["id"]).order_by("id").values_list("type", flat=True))
    assert types == ["message.sent", "message.received"]


def test_the_sync_client_runs_handlers_in_threads(sdk):
    threads = set()
    with Runstate() as rs:
        rs.mailboxes.ensure("threads", mode="QUEUE")
        run = rs.scopes.create()
        sent = [run.messages.send("threads", {"n": n}) for n in range(6)]

        def handler(ctx):
            threads.add(threading.current_thread().name)
            assert isinstance(ctx.signal, threading.Event)
            if len(threads) < 2:
                time.sleep(0.05)  # let a second handler start beside this one
            return ctx.body["n"]

        worker = run.message_worker("threads", handler, concurrency=3, receive_wait_ms=200, handle_signals=False)

        def stop_after_six():
            try:
                wait_until(lambda: worker.summary.completed >= 6, what="six completions", interval_s=0.01)
            finally:
                worker.stop()

        stopper = threading.Thread(target=stop_after_six, daemon=True)
        stopper.start()
        summary = worker.run()
        stopper.join(WAIT_S)

    assert summary.completed == 6 and summary.stop_reason == "stopped"
    assert threads == {"runstate-handler"}
    assert set(Message.objects.filter(id__in=[m["id"] for m in sent]).values_list("state", flat=True)) == {"COMPLETED"}


# SIGTERM, in a process of its own ------------------------------------------------------------


def consumer_process(sdk, run_id, mailbox, mode, drain_timeout=30.0):
    env = dict(os.environ, RUNSTATE_URL=sdk.url, RUNSTATE_API_KEY=sdk.api_key, RUNSTATE_SCOPE_ID=run_id)
    env["PYTHONUNBUFFERED"] = "1"
    return subprocess.Popen(
        [sys.executable, "-m", "tests.sdk.message_consumer_process", mailbox, mode, str(drain_timeout)],
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
        rs.mailboxes.ensure(mailbox, mode="QUEUE", lease_ttl_ms=lease_ttl_ms)
        run = rs.scopes.create()
        message = run.messages.send(mailbox, {"job": 1})
    return run.id, message["id"]


def test_sigterm_lets_the_running_handler_finish_and_completes_its_message(sdk):
    run_id, message_id = prepare("msg-sigterm", lease_ttl_ms=3000)
    process = consumer_process(sdk, run_id, "msg-sigterm", "finish")
    try:
        assert read_line(process) == f"received {message_id} 1"
        process.send_signal(signal.SIGTERM)
        summary = read_line(process)
        assert summary == "summary completed=1 retried=0 rejected=0 lost=0 released=0 stop_reason=stopped"
        assert process.wait(20) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert Message.objects.get(id=message_id).state == "COMPLETED"


def test_sigterm_puts_back_a_message_whose_handler_outlives_the_drain_timeout(sdk):
    run_id, message_id = prepare("msg-drained", lease_ttl_ms=30_000)
    process = consumer_process(sdk, run_id, "msg-drained", "hang", drain_timeout=0.5)
    try:
        assert read_line(process) == f"received {message_id} 1"
        process.send_signal(signal.SIGTERM)
        summary = read_line(process)
        assert summary == "summary completed=0 retried=0 rejected=0 lost=0 released=1 stop_reason=stopped"
        assert process.wait(20) == 0  # the hanging handler thread does not keep the process alive
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    row = Message.objects.get(id=message_id)
    assert (row.state, row.attempts) == ("QUEUED", 1)  # back in the queue at once, not after 30 s
