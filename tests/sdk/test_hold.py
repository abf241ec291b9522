"""``claim.hold()`` (async and sync) against the live service, in parity with ``consume`` for one task;
``ctx.cancel_on_request()`` aborting an httpx call to a slow server."""

import asyncio
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from coordination.models import Task
from coordination.services.sweeps import tasks_settle_expired_leases
from runstate import AsyncRunstate, CancellationRequested, LeaseLostError, Runstate
from tests.waiting import WAIT_S, until, wait_until

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]

LEASE_TTL_MS = 1000  # renewals every ~0.33 s


async def claim_one(rs, mailbox, *, max_attempts=3, lease_ttl_ms=LEASE_TTL_MS):
    await rs.mailboxes.ensure(mailbox, mode="WORK", lease_ttl_ms=lease_ttl_ms, max_attempts=max_attempts)
    run = await rs.scopes.create()
    ticket = await run.tasks.submit(mailbox, {"n": 1})
    (claim,) = await run.tasks.claim(mailbox)
    return run, ticket, claim


def test_async_hold_renews_past_the_lease_and_completes_with_the_value_given(sdk):
    async def scenario():
        async with AsyncRunstate() as rs:
            run, ticket, claim = await claim_one(rs, "hold-renew")
            async with claim.hold() as ctx:
                assert ctx.task_id == ticket.id and ctx.input == {"n": 1}
                await asyncio.sleep(LEASE_TTL_MS / 1000 * 2.5)  # outlives the lease: renewals keep it
                # The lease sweep finds nothing to take over, and nobody else can claim the task.
                await asyncio.to_thread(tasks_settle_expired_leases)
                assert await run.tasks.claim("hold-renew") == []
                assert not ctx.signal.is_set()
                ctx.complete({"done": True})
            return await ticket.status()

    task = asyncio.run(scenario())
    assert task["state"] == "SUCCEEDED" and task["outcome"] == {"done": True} and task["attempts"] == 1


def test_sync_hold_renews_past_the_lease_and_completes_with_none_by_default(sdk):
    with Runstate() as rs:
        rs.mailboxes.ensure("hold-renew-sync", mode="WORK", lease_ttl_ms=LEASE_TTL_MS)
        run = rs.scopes.create()
        ticket = run.tasks.submit("hold-renew-sync", {"n": 1})
        (claim,) = run.tasks.claim("hold-renew-sync")
        with claim.hold() as ctx:
            assert not ctx.wait_cancelled(LEASE_TTL_MS / 1000 * 2.5)  # blocks; the lease outlives it
            tasks_settle_expired_leases()
            assert run.tasks.claim("hold-renew-sync") == []
        task = ticket.status()
    assert task["state"] == "SUCCEEDED" and task["outcome"] is None and task["attempts"] == 1


@pytest.mark.parametrize("client", ["async", "sync"])
def test_a_cancel_request_sets_the_signal_and_a_normal_end_acknowledges_it(sdk, client):
    if client == "async":

        async def scenario():
            async with AsyncRunstate() as rs:
                _, ticket, claim = await claim_one(rs, "hold-cancel")
                async with claim.hold() as ctx:
                    await ticket.cancel(reason="enough")
                    assert await ctx.wait_cancelled(10)
                    reason = ctx.stop_reason
                    ctx.complete({"stopped": "early"})
                return reason, await ticket.status()

        reason, task = asyncio.run(scenario())
    else:
        with Runstate() as rs:
            rs.mailboxes.ensure("hold-cancel-sync", mode="WORK", lease_ttl_ms=LEASE_TTL_MS)
            run = rs.scopes.create()
            ticket = run.tasks.submit("hold-cancel-sync", {"n": 1})
            (claim,) = run.tasks.claim("hold-cancel-sync")
            with claim.hold() as ctx:
                ticket.cancel(reason="enough")
                assert ctx.wait_cancelled(10)
                assert ctx.is_cancellation_requested()
                reason = ctx.stop_reason
                ctx.release()  # with cancellation requested, a release acknowledges it instead
            task = ticket.status()
    assert reason == "cancellation_requested"
    assert task["state"] == "CANCELLED" and task["cancelReason"] == "enough"


@pytest.mark.parametrize("client", ["async", "sync"])
def test_a_lost_lease_sets_the_signal_and_the_refused_complete_is_raised(sdk, client):
    """After a cancel's ``grace_ms`` the claim is LEASE_LOST: the block was told, its record is refused.

    The cancel request reaches the block first (the claim watch pushes it at once); the block
    then outlives the grace, the lease sweep ends the task, and the value it gives is refused.
    """

    def lease_taken_back(task_id) -> bool:
        tasks_settle_expired_leases()
        return Task.objects.get(id=task_id).state == "CANCELLED"

    if client == "async":

        async def scenario():
            async with AsyncRunstate() as rs:
                _, ticket, claim = await claim_one(rs, "hold-lost")
                with pytest.raises(LeaseLostError):
                    async with claim.hold() as ctx:
                        await ticket.cancel(reason="too slow", grace_ms=100)
                        assert await ctx.wait_cancelled(WAIT_S)
                        await until(lambda: asyncio.to_thread(lease_taken_back, ticket.id), what="the lease lost")
                        ctx.complete({"late": True})
                return ctx

        ctx = asyncio.run(scenario())
        task_id = ctx.task_id
    else:
        with Runstate() as rs:
            rs.mailboxes.ensure("hold-lost-sync", mode="WORK", lease_ttl_ms=LEASE_TTL_MS)
            run = rs.scopes.create()
            ticket = run.tasks.submit("hold-lost-sync", {"n": 1})
            (claim,) = run.tasks.claim("hold-lost-sync")
            with pytest.raises(LeaseLostError):
                with claim.hold() as ctx:
                    ticket.cancel(reason="too slow", grace_ms=100)
                    assert ctx.wait_cancelled(WAIT_S)
                    wait_until(lambda: lease_taken_back(ticket.id), what="the lease lost")
                    ctx.complete({"late": True})
            task_id = ticket.id
    assert ctx.signal.is_set()
    task = Task.objects.get(id=task_id)
    assert task.state == "CANCELLED" and task.outcome is None  # the late value was not recorded


@pytest.mark.parametrize("client", ["async", "sync"])
def test_an_exception_fails_the_task_and_is_re_raised(sdk, client):
    if client == "async":

        async def scenario():
            async with AsyncRunstate() as rs:
                _, ticket, claim = await claim_one(rs, "hold-raise", max_attempts=1)
                with pytest.raises(ValueError, match="bad input"):
                    async with claim.hold():
                        raise ValueError("bad input")
                return await ticket.status()

        task = asyncio.run(scenario())
    else:
        with Runstate() as rs:
            rs.mailboxes.ensure("hold-raise-sync", mode="WORK", lease_ttl_ms=LEASE_TTL_MS, max_attempts=2)
            run = rs.scopes.create()
            ticket = run.tasks.submit("hold-raise-sync", {"n": 1})
            (claim,) = run.tasks.claim("hold-raise-sync")
            with pytest.raises(ValueError, match="bad input"), claim.hold():
                raise ValueError("bad input")
            task = ticket.status()
            assert task["state"] == "QUEUED"  # retried while attempts remain, as consume does
            (claim,) = run.tasks.claim("hold-raise-sync")
            with pytest.raises(ValueError, match="bad input"), claim.hold():
                raise ValueError("bad input")
            task = ticket.status()
    assert task["state"] == "FAILED"
    assert task["error"]["type"] == "ValueError" and task["error"]["message"] == "bad input"


def test_release_hands_the_task_back(sdk):
    async def scenario():
        async with AsyncRunstate() as rs:
            _, ticket, claim = await claim_one(rs, "hold-release")
            async with claim.hold() as ctx:
                ctx.release()
            return await ticket.status()

    task = asyncio.run(scenario())
    assert task["state"] == "QUEUED" and task["attempts"] == 1


# Parity: the same scenarios through consume() and through hold() end the task the same way.

SCENARIOS = ["return", "raise", "cancel_then_return", "cancel_then_raise"]


async def body(ctx, scenario, ticket):
    if scenario.startswith("cancel"):
        await ticket.cancel(reason="parity")
        assert await ctx.wait_cancelled(10)
    if scenario.endswith("raise"):
        raise RuntimeError("boom")
    return {"scenario": scenario}


def fingerprint(task):
    error = task["error"]
    return task["state"], task["outcome"], error and error["type"], task["attempts"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_hold_ends_a_task_as_consume_does(sdk, scenario):
    async def through_consume():
        async with AsyncRunstate() as rs:
            await rs.mailboxes.ensure("parity-consume", mode="WORK", lease_ttl_ms=LEASE_TTL_MS, max_attempts=1)
            run = await rs.scopes.create()
            ticket = await run.tasks.submit("parity-consume", {})
            worker = run.worker("parity-consume", lambda ctx: body(ctx, scenario, ticket), handle_signals=False)
            running = asyncio.create_task(worker.run())
            task = await ticket.result(timeout_ms=20_000)
            worker.stop()
            await running
            return task

    async def through_hold():
        async with AsyncRunstate() as rs:
            _, ticket, claim = await claim_one(rs, "parity-hold", max_attempts=1)
            try:
                async with claim.hold() as ctx:
                    ctx.complete(await body(ctx, scenario, ticket))
            except RuntimeError:
                assert scenario.endswith("raise")
            return await ticket.status()

    consumed = asyncio.run(through_consume())
    held = asyncio.run(through_hold())
    assert fingerprint(held) == fingerprint(consumed)
    expected = {
        "return": "SUCCEEDED",
        "raise": "FAILED",
        "cancel_then_return": "CANCELLED",
        "cancel_then_raise": "FAILED",  # a failure is never rewritten as a cancellation
    }[scenario]
    assert held["state"] == expected


# cancel_on_request: the Runlane example, in Python with httpx.


class SlowServer:
    """A local HTTP server whose answers wait until released (or 60 s)."""

    def __init__(self):
        self.arrived = threading.Event()
        self.release = threading.Event()
        self.answered = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's naming
                outer.arrived.set()
                outer.release.wait(60)
                try:
                    self.send_response(200)
                    self.end_headers()
                    self.wfile.write(b"rebuilt")
                    outer.answered.append(self.path)
                except OSError:  # the client went away
                    pass

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


async def rebuild_index(ctx, search_api_url):
    """The Runlane guide's handler, translated: abort the HTTP call when cancellation is requested."""
    if ctx.is_cancellation_requested():
        return None
    try:
        async with ctx.cancel_on_request(), httpx.AsyncClient(base_url=search_api_url) as http:
            response = await http.post(f"/indexes/{ctx.input['indexId']}/rebuild")
            response.raise_for_status()
    except CancellationRequested as aborted:
        return {"aborted": aborted.reason}  # the handler chooses what it records
    return {"rebuilt": response.text}


@pytest.mark.parametrize("via", ["consume", "hold"])
def test_cancel_on_request_aborts_an_httpx_call_to_a_slow_server(sdk, via):
    async def scenario(server):
        async with AsyncRunstate() as rs, AsyncRunstate() as operator:
            await rs.mailboxes.ensure("search", mode="WORK", lease_ttl_ms=LEASE_TTL_MS)
            run = await rs.scopes.create()
            ticket = await run.tasks.submit("search", {"indexId": "products"})

            async def cancel_once_the_call_is_in_flight():
                await asyncio.to_thread(server.arrived.wait, 20)
                await operator.tasks.get(ticket.id).cancel(reason="customer_deleted_project")

            canceller = asyncio.create_task(cancel_once_the_call_is_in_flight())
            if via == "consume":
                worker = run.worker("search", lambda ctx: rebuild_index(ctx, server.url), handle_signals=False)
                running = asyncio.create_task(worker.run())
                task = await ticket.result(timeout_ms=20_000)
                worker.stop()
                await running
            else:
                (claim,) = await run.tasks.claim("search")
                async with claim.hold() as ctx:
                    ctx.complete(await rebuild_index(ctx, server.url))
                task = await ticket.status()
            await canceller
            return task

    with SlowServer() as server:
        task = asyncio.run(scenario(server))
        assert server.arrived.is_set()
        assert server.answered == []  # the call was aborted while the server still held it
    assert task["state"] == "CANCELLED"
    assert task["cancelReason"] == "customer_deleted_project"
    assert task["outcome"] == {"aborted": "cancellation_requested"}


def test_an_abort_that_escapes_the_handler_acknowledges_the_cancellation(sdk):
    started = []

    async def handler(ctx):
        started.append(ctx.task_id)
        async with ctx.cancel_on_request():
            await asyncio.sleep(3600)

    async def scenario():
        async with AsyncRunstate() as rs:
            await rs.mailboxes.ensure("escape", mode="WORK", lease_ttl_ms=LEASE_TTL_MS)
            run = await rs.scopes.create()
            ticket = await run.tasks.submit("escape", {})
            worker = run.worker("escape", handler, handle_signals=False)
            running = asyncio.create_task(worker.run())
            await until(lambda: started, what="the handler to start", interval_s=0.02)  # so the cancel is cooperative
            await ticket.cancel(reason="stop")
            task = await ticket.result(timeout_ms=20_000)
            worker.stop()
            return task, await running

    task, summary = asyncio.run(scenario())
    assert started and task["state"] == "CANCELLED" and task["outcome"] is None
    assert summary.completed == 1 and summary.failed == 0


def test_a_hold_cancelled_from_outside_releases_the_task(sdk):
    async def scenario():
        async with AsyncRunstate() as rs:
            _, ticket, claim = await claim_one(rs, "hold-outside")
            inside = asyncio.Event()

            async def holder():
                async with claim.hold():
                    inside.set()
                    await asyncio.sleep(3600)

            task = asyncio.create_task(holder())
            await inside.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return await ticket.status()

    task = asyncio.run(scenario())
    assert task["state"] == "QUEUED" and task["attempts"] == 1


async def cancel_later(client, task_id, delay_s):
    await asyncio.sleep(delay_s)
    await client.tasks.get(task_id).cancel(reason="race")


def test_a_cancel_racing_the_end_of_a_hold_never_breaks_the_record(sdk):
    """Rounds of a cancel request sent at a random moment around the block's end (renewing every 100 ms).

    Whatever the order, the ``async with`` never raises, and the task ends CANCELLED when the
    request was recorded before the completion, SUCCEEDED otherwise; a signal the block saw
    always means CANCELLED.
    """
    rounds = 20

    async def scenario():
        results = []
        async with AsyncRunstate() as rs, AsyncRunstate() as operator:
            await rs.mailboxes.ensure("hold-race", mode="WORK", lease_ttl_ms=LEASE_TTL_MS)
            run = await rs.scopes.create()
            for n in range(rounds):
                ticket = await run.tasks.submit("hold-race", {"n": n})
                (claim,) = await run.tasks.claim("hold-race")
                cancel = asyncio.create_task(cancel_later(operator, ticket.id, random.uniform(0, 0.4)))
                # Renewals every 100 ms, with 900 ms of slack: a busy machine does not lose the lease.
                async with claim.hold(renew_fraction=0.1) as ctx:
                    await asyncio.sleep(random.uniform(0, 0.4))
                    ctx.complete({"n": n})
                saw_signal = ctx.signal.is_set()
                await cancel
                results.append((saw_signal, await ticket.status()))
        return results

    results = asyncio.run(scenario())
    assert len(results) == 20
    for saw_signal, task in results:
        assert task["state"] in ("SUCCEEDED", "CANCELLED")
        assert task["outcome"] == {"n": task["input"]["n"]}
        if saw_signal:
            assert task["state"] == "CANCELLED"


def test_a_consumer_whose_run_is_cancelled_inside_cancel_on_request_records_nothing(sdk):
    """The engine cancels a handler whose run is refused; cancel_on_request leaves that a CancelledError."""
    seen = []
    started = []

    async def handler(ctx):
        started.append(ctx.task_id)
        try:
            async with ctx.cancel_on_request():
                await asyncio.sleep(3600)
        except BaseException as exc:
            seen.append((type(exc), ctx.stop_reason))
            raise

    async def scenario():
        async with AsyncRunstate() as rs:
            await rs.mailboxes.ensure("abort-refused", mode="WORK", lease_ttl_ms=LEASE_TTL_MS)
            run = await rs.scopes.create()
            await run.tasks.submit("abort-refused", {})
            worker = run.worker("abort-refused", handler, handle_signals=False)
            running = asyncio.create_task(worker.run())
            await until(lambda: started, what="the handler to start", interval_s=0.02)
            await run.cancel(reason="stop all")
            return await asyncio.wait_for(running, 30)

    summary = asyncio.run(scenario())
    assert seen == [(asyncio.CancelledError, "scope_refused")]
    assert (summary.completed, summary.failed, summary.lost) == (0, 0, 1)
    assert summary.stop_reason == "SCOPE_CANCELLED"
