"""A cancel reaches running handlers through the claim watch, not at the next renewal (issue 38).

Every worker here takes a ten-minute lease: renewal would come after 200 s, past any wait of
these tests (``WAIT_S``), so a handler that sees its cancel was told by the watch. The watch
is cut between the worker and the API (a proxy, ``tests/proxy.py``) and the API process is
restarted while cancels are issued: each handler still sees its own. On PostgreSQL the watch
is woken by the LISTEN hub, on the embedded default (SQLite) by polling the event log.
Claims held by hand (``claim.hold()``) share one watch per client and are told the same way.
"""

import asyncio
import contextlib
import threading

import pytest

from coordination.models import Task
from coordination.services.runs import run_cancel
from coordination.services.tasks import task_cancel
from runstate import AsyncRunstate, Runstate, ScopeCancelledError
from runstate._sync.hold import _Background
from runstate._worker.watch import _shared
from tests.operator.live import uvicorn_server
from tests.proxy import proxy_to
from tests.waiting import WAIT_S, until

pytestmark = pytest.mark.django_db(transaction=True)

# Renewal every 200 s: far past WAIT_S.
LONG_LEASE_MS = 600_000


class Handlers:
    """Async handlers that wait for their signal and return why they stopped."""

    def __init__(self) -> None:
        self.started: dict[str, asyncio.Event] = {}
        self.stopped: dict[str, str | None] = {}

    async def handler(self, ctx):
        self.started.setdefault(ctx.task_id, asyncio.Event()).set()
        try:
            await ctx.signal.wait()
        finally:  # also when the loop cancels it (its claim is gone): the first reason given
            self.stopped[ctx.task_id] = ctx.stop_reason
        return {"stopped": ctx.stop_reason}

    async def running(self, count: int) -> None:
        await until(lambda: len(self.started) >= count, waits=1, what=f"{count} handlers running")


async def start(rs, mailbox: str, count: int, handlers: Handlers):
    await rs.mailboxes.ensure(mailbox, mode="WORK", lease_ttl_ms=LONG_LEASE_MS)
    run = await rs.scopes.create()
    tickets = [await run.tasks.submit(mailbox, {"n": n}) for n in range(count)]
    worker = run.worker(mailbox, handlers.handler, concurrency=count, handle_signals=False)
    running = asyncio.create_task(worker.run())
    await handlers.running(count)
    return run, tickets, worker, running


def test_a_task_cancel_reaches_a_running_async_handler_at_once(sdk):
    handlers = Handlers()

    async def scenario():
        async with AsyncRunstate() as rs:
            _, (ticket, other), worker, running = await start(rs, "push", 2, handlers)
            await ticket.cancel(reason="enough")
            task = await ticket.result(timeout_ms=int(WAIT_S * 1000))
            still_running = other.id not in handlers.stopped
            await other.cancel(reason="done")  # ends the other handler too: no drain timeout at the stop
            await other.result(timeout_ms=int(WAIT_S * 1000))
            worker.stop()
            await running
            return task, still_running, ticket.id, other.id

    task, still_running, task_id, other_id = asyncio.run(scenario())
    assert task["state"] == "CANCELLED" and task["outcome"] == {"stopped": "cancellation_requested"}
    assert handlers.stopped[task_id] == "cancellation_requested"
    assert still_running  # the other claim of the same worker was not touched
    assert handlers.stopped[other_id] == "cancellation_requested"


def test_a_cancel_pushed_before_the_claim_call_answers_reaches_the_handler_when_it_starts(sdk):
    """The watch's frame and the claim's answer travel on two connections: the frame may come first.

    Forced: the claim call's answer is held back until the cancel of the task it claimed was
    committed and its frame received by the watch; the engine keeps the frame for the claim.
    """
    handlers = Handlers()

    async def scenario():
        async with AsyncRunstate() as rs:
            await rs.mailboxes.ensure("early", mode="WORK", lease_ttl_ms=LONG_LEASE_MS)
            run = await rs.scopes.create()
            ticket = await run.tasks.submit("early", {"n": 0})
            worker = run.worker("early", handlers.handler, concurrency=1, handle_signals=False)
            engine = worker._engine
            claim = engine._tasks.claim

            async def claim_then_cancel(*args, **kwargs):
                claims = await claim(*args, **kwargs)
                for held in claims:
                    await asyncio.to_thread(task_cancel, project_id=sdk.project_id, task_id=held.task_id)
                    await until(lambda held=held: held.id in engine._early, what="the watch's frame of the cancel")
                return claims

            engine._tasks.claim = claim_then_cancel
            running = asyncio.create_task(worker.run())
            task = await ticket.result(timeout_ms=int(WAIT_S * 1000))
            worker.stop()
            await running
            return task, ticket.id

    task, task_id = asyncio.run(scenario())
    assert task["state"] == "CANCELLED" and task["outcome"] == {"stopped": "cancellation_requested"}
    assert handlers.stopped[task_id] == "cancellation_requested"


def test_a_run_cancel_reaches_every_busy_slot_of_a_sync_worker(sdk):
    stopped: dict[str, str | None] = {}
    started = threading.Semaphore(0)

    def handler(ctx):
        started.release()
        ctx.signal.wait(WAIT_S)  # a threading.Event: this handler's thread only
        stopped[ctx.task_id] = ctx.stop_reason

    with Runstate() as rs:
        rs.mailboxes.ensure("busy", mode="WORK", lease_ttl_ms=LONG_LEASE_MS)
        run = rs.scopes.create()
        for n in range(3):
            run.tasks.submit("busy", {"n": n})
        worker = run.worker("busy", handler, concurrency=3, handle_signals=False)
        thread = threading.Thread(target=worker.run)
        thread.start()
        try:
            for _ in range(3):
                assert started.acquire(timeout=WAIT_S)
            run.cancel(reason="enough")
            thread.join(WAIT_S)
        finally:
            worker.stop()
            thread.join(WAIT_S)
    assert not thread.is_alive()
    assert list(stopped.values()) == ["scope_refused"] * 3
    assert worker.summary.stop_reason == "SCOPE_CANCELLED"


def test_a_cancel_issued_while_the_watch_is_cut_reaches_its_handler_when_it_reconnects(sdk, sdk_server, monkeypatch):
    handlers = Handlers()
    with proxy_to(port_of(sdk_server.url)) as proxy:
        monkeypatch.setenv("RUNSTATE_URL", proxy.url)

        async def scenario():
            async with AsyncRunstate() as rs:
                run, tickets, worker, running = await start(rs, "cut", 3, handlers)
                proxy.cut()  # the watch, the claim long-poll: every connection of the worker
                for ticket in tickets[:2]:
                    await asyncio.to_thread(task_cancel, project_id=sdk.project_id, task_id=ticket.id)
                proxy.restore()
                await until(lambda: len(handlers.stopped) >= 2, waits=1, what="the two missed cancels")
                await asyncio.to_thread(task_cancel, project_id=sdk.project_id, task_id=tickets[2].id)
                await until(lambda: len(handlers.stopped) >= 3, waits=1, what="the cancel after reconnecting")
                worker.stop()
                await running
                return [ticket.id for ticket in tickets]

        task_ids = asyncio.run(scenario())
    assert handlers.stopped == dict.fromkeys(task_ids, "cancellation_requested")
    assert set(Task.objects.filter(id__in=task_ids).values_list("state", flat=True)) == {"CANCELLED"}


def test_cancels_issued_while_the_api_restarts_reach_their_handlers(sdk, monkeypatch, tmp_path):
    handlers = Handlers()
    with contextlib.ExitStack() as servers:
        first_context = uvicorn_server(tmp_path / "first")
        first = servers.enter_context(first_context)
        with proxy_to(port_of(first.url)) as proxy:
            monkeypatch.setenv("RUNSTATE_URL", proxy.url)

            async def scenario():
                async with AsyncRunstate() as rs:
                    run, tickets, worker, running = await start(rs, "restart", 3, handlers)
                    # The API process goes away; while it is down, a task cancel and a run cancel.
                    await asyncio.to_thread(first_context.__exit__, None, None, None)
                    await asyncio.to_thread(task_cancel, project_id=sdk.project_id, task_id=tickets[0].id)
                    await asyncio.to_thread(run_cancel, project_id=sdk.project_id, run_id=run.id)
                    second = await asyncio.to_thread(servers.enter_context, uvicorn_server(tmp_path / "second"))
                    proxy.retarget(port_of(second.url))
                    await until(lambda: len(handlers.stopped) >= 3, waits=1, what="every cancel after the restart")
                    worker.stop()
                    await running
                    return [ticket.id for ticket in tickets]

            task_ids = asyncio.run(scenario())
    assert handlers.stopped[task_ids[0]] == "cancellation_requested"
    assert [handlers.stopped[task_id] for task_id in task_ids[1:]] == ["scope_refused"] * 2


# Claims held by hand ---------------------------------------------------------------------


async def claim_by_hand(rs, mailbox: str, count: int):
    await rs.mailboxes.ensure(mailbox, mode="WORK", lease_ttl_ms=LONG_LEASE_MS)
    run = await rs.scopes.create()
    tickets = [await run.tasks.submit(mailbox, {"n": n}) for n in range(count)]
    claims = await run.tasks.claim(mailbox, max=count)
    return run, tickets, sorted(claims, key=lambda claim: [t.id for t in tickets].index(claim.task_id))


def test_async_holds_share_one_watch_that_tells_each_its_own_cancel(sdk):
    async def scenario():
        async with AsyncRunstate() as rs:
            run, tickets, claims = await claim_by_hand(rs, "hold-push", 3)
            holds = [claim.hold(lease_ttl_ms=LONG_LEASE_MS) for claim in claims]
            ctxs = [await hold.__aenter__() for hold in holds]
            watches = dict(_shared[rs._http])
            await tickets[0].cancel(reason="enough")
            await until(lambda: ctxs[0].signal.is_set(), what="the first hold told of its cancel")
            others_untouched = not ctxs[1].signal.is_set() and not ctxs[2].signal.is_set()
            await holds[0].__aexit__(None, None, None)  # a normal end acknowledges the cancel
            await run.cancel(reason="all of it")
            await until(lambda: ctxs[1].signal.is_set() and ctxs[2].signal.is_set(), what="the run's end")
            refusals = []
            for hold in holds[1:]:
                with pytest.raises(ScopeCancelledError) as refused:
                    await hold.__aexit__(None, None, None)
                refusals.append(refused.value.code)
            first = await tickets[0].status()
            return watches, others_untouched, [ctx.stop_reason for ctx in ctxs], refusals, first, rs._http.worker_id

    watches, others_untouched, reasons, refusals, first, worker_id = asyncio.run(scenario())
    assert list(watches) == [worker_id]  # one watch for the three holds: claims carry the client's workerId
    assert watches[worker_id].watch.connections == 1
    assert others_untouched
    assert reasons == ["cancellation_requested", "scope_refused", "scope_refused"]
    assert refusals == ["SCOPE_CANCELLED"] * 2
    assert first["state"] == "CANCELLED"


def test_a_cancel_committed_before_the_hold_starts_is_told_when_it_starts(sdk):
    """The watch opens after the claim: one renewal as the hold starts covers the window between."""

    async def scenario():
        async with AsyncRunstate() as rs:
            _, (ticket,), (claim,) = await claim_by_hand(rs, "hold-late", 1)
            await ticket.cancel(reason="before the hold")
            async with claim.hold(lease_ttl_ms=LONG_LEASE_MS) as ctx:
                told = ctx.is_cancellation_requested()  # no wait: told as the hold started
            return told, await ticket.status()

    told, task = asyncio.run(scenario())
    assert told
    assert task["state"] == "CANCELLED"


def test_a_closed_client_ends_the_watch_its_holds_shared(sdk):
    async def scenario():
        rs = AsyncRunstate()
        _, _, (claim,) = await claim_by_hand(rs, "hold-close", 1)
        async with claim.hold(lease_ttl_ms=LONG_LEASE_MS):
            pass
        shared = _shared[rs._http][rs._http.worker_id]
        lingering = not shared._task.done()  # kept for the client's next hold
        await rs.aclose()
        await asyncio.wait({shared._task}, timeout=WAIT_S)
        return lingering, shared._task

    lingering, task = asyncio.run(scenario())
    assert lingering
    assert task.done() and not task.cancelled() and task.exception() is None  # ended by itself, quietly


def test_a_sync_hold_is_told_of_its_cancel_by_the_watch_and_the_next_hold_reuses_it(sdk):
    with Runstate() as rs:
        rs.mailboxes.ensure("hold-push-sync", mode="WORK", lease_ttl_ms=LONG_LEASE_MS)
        run = rs.scopes.create()
        tickets = [run.tasks.submit("hold-push-sync", {"n": n}) for n in range(2)]
        told = []
        for ticket in tickets:
            (claim,) = run.tasks.claim("hold-push-sync")
            assert claim.task_id == ticket.id
            with claim.hold(lease_ttl_ms=LONG_LEASE_MS) as ctx:
                canceller = threading.Timer(0, ticket.cancel)
                canceller.start()
                told.append(ctx.wait_cancelled(WAIT_S))  # renewal would tell after 200 s
                canceller.join(WAIT_S)
            background = _Background._of[rs._http]
            watch = _shared[background.http][claim.task["workerId"]]
            told.append((id(background), id(watch), watch.watch.connections))
        states = [ticket.status()["state"] for ticket in tickets]
    assert told[0] is True and told[2] is True
    assert told[1] == told[3]  # the second hold ran on the same background and watch
    assert told[1][2] == 1  # one connection in all
    assert states == ["CANCELLED", "CANCELLED"]


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])
