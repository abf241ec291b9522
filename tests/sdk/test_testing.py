"""``runstate.testing``: fake contexts drive sample handlers with no server."""

import asyncio
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from runstate import CancellationRequested
from runstate.testing import AsyncFakeContext, FakeContext


def index_in_steps(ctx):
    """A sync handler that checks its signal between steps."""
    done = []
    for step in range(10):
        if ctx.is_cancellation_requested():
            return {"stopped_after": done}
        done.append(step)
    return {"done": done}


def test_a_sync_handler_runs_to_the_end_without_a_stop():
    record = FakeContext({"index": "x"}).run(index_in_steps)
    assert record.state == "SUCCEEDED"
    assert record.outcome == {"done": list(range(10))}


def test_a_cancellation_at_a_step_is_observed_there():
    ctx = FakeContext()
    ctx.request_cancellation(at_check=4)
    record = ctx.run(index_in_steps)
    assert record.state == "CANCELLED"
    assert record.outcome == {"stopped_after": [0, 1, 2]}
    assert ctx.stop_reason == "cancellation_requested" and ctx.signal.is_set()


def test_a_lost_lease_at_a_step_records_nothing():
    ctx = FakeContext()
    ctx.lose_lease(at_check=2)
    record = ctx.run(index_in_steps)
    assert record.state == "LOST"
    assert ctx.stop_reason == "lease_lost"


def test_a_delayed_cancellation_wakes_a_blocking_wait():
    def waits(ctx):
        if ctx.wait_cancelled(30):
            return "stopped"
        return "timed out"

    ctx = FakeContext()
    ctx.request_cancellation(after=0.05)
    record = ctx.run(waits)
    assert (record.state, record.outcome) == ("CANCELLED", "stopped")
    assert FakeContext().wait_cancelled(0.01) is False


def test_a_failure_is_recorded_with_the_exception():
    def boom(ctx):
        raise ValueError("bad input")

    record = FakeContext().run(boom)
    assert record.state == "FAILED"
    assert record.error["type"] == "ValueError" and record.error["message"] == "bad input"
    assert isinstance(record.exception, ValueError)


def test_the_fake_quacks_like_the_real_context():
    ctx = FakeContext({"a": 1}, task_id="t-9", attempt=2, key="k")
    assert (ctx.input, ctx.task_id, ctx.attempt, ctx.key) == ({"a": 1}, "t-9", 2, "k")
    assert isinstance(ctx.signal, threading.Event)
    ctx.complete({"v": 1})
    assert ctx.outcome == {"v": 1} and not ctx.released
    ctx.release()
    assert ctx.released
    actx = AsyncFakeContext()
    assert isinstance(actx.signal, asyncio.Event)


# The Runlane example in Python (docs/sdk.md): an httpx call aborted through cancel_on_request.


async def rebuild_index(ctx, search_api_url):
    if ctx.is_cancellation_requested():
        return None
    try:
        async with ctx.cancel_on_request(), httpx.AsyncClient(base_url=search_api_url) as http:
            response = await http.post(f"/indexes/{ctx.input['indexId']}/rebuild")
            response.raise_for_status()
    except CancellationRequested:
        return None  # durable state says cancelled: stop quietly
    return {"rebuilt": response.text}


@pytest.fixture
def slow_server():
    arrived, release = threading.Event(), threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's naming
            arrived.set()
            release.wait(30)
            try:
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"ok")
            except OSError:
                pass

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", arrived, release
    release.set()
    server.shutdown()
    server.server_close()


def test_cancel_on_request_aborts_the_http_call_of_the_sample_handler(slow_server):
    url, arrived, _ = slow_server

    async def scenario():
        ctx = AsyncFakeContext({"indexId": "products"})

        async def cancel_when_in_flight():
            await asyncio.to_thread(arrived.wait, 10)
            ctx.request_cancellation()

        canceller = asyncio.create_task(cancel_when_in_flight())
        record = await ctx.run(lambda c: rebuild_index(c, url))
        await canceller
        return ctx, record

    ctx, record = asyncio.run(scenario())
    assert arrived.is_set()
    assert record.state == "CANCELLED" and record.outcome is None
    assert ctx.stop_reason == "cancellation_requested"


def test_the_sample_handler_finishes_when_nobody_cancels(slow_server):
    url, _, release = slow_server
    release.set()
    record = asyncio.run(AsyncFakeContext({"indexId": "p"}).run(lambda c: rebuild_index(c, url)))
    assert (record.state, record.outcome) == ("SUCCEEDED", {"rebuilt": "ok"})


def test_a_delayed_lost_lease_cancels_an_async_handler_and_records_nothing():
    seen = []

    async def sleeper(ctx):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen.append(ctx.stop_reason)
            raise

    ctx = AsyncFakeContext()
    ctx.lose_lease(after=0.05)  # armed when run() starts
    record = asyncio.run(ctx.run(sleeper))
    assert record.state == "LOST"
    assert seen == ["lease_lost"]


def test_an_escaping_abort_acknowledges_and_wait_cancelled_times_out():
    async def handler(ctx):
        assert await ctx.wait_cancelled(0.01) is False
        async with ctx.cancel_on_request():
            await asyncio.sleep(30)

    async def scenario():
        ctx = AsyncFakeContext()
        ctx.request_cancellation(after=0.05)
        return await ctx.run(handler)

    record = asyncio.run(scenario())
    assert record.state == "CANCELLED"
    assert isinstance(record.exception, CancellationRequested)
    assert record.exception.reason == "cancellation_requested"


def test_cancel_on_request_leaves_a_finished_block_and_outside_cancellation_alone():
    async def scenario():
        ctx = AsyncFakeContext()
        async with ctx.cancel_on_request():
            await asyncio.sleep(0)
        ctx.request_cancellation()
        await asyncio.sleep(0.01)  # a late signal does not cancel the task after the block

        inner_ctx = AsyncFakeContext()

        async def cancelled_from_outside():
            async with inner_ctx.cancel_on_request():
                await asyncio.sleep(30)

        task = asyncio.create_task(cancelled_from_outside())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(CancellationRequested):  # already set on entry
            async with ctx.cancel_on_request():
                pass
        return "survived"

    assert asyncio.run(scenario()) == "survived"
