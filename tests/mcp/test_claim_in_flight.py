"""A ``task_claim`` cancelled while its request is in flight hands back what the service committed.

The MCP server talks to the API through a proxy in this process that forwards every request
and holds the answer of claim requests (``POST /v1/mailboxes/{name}/claims``) after the
service answered it: the claim is committed, its answer has not reached the server when the
client sends ``notifications/cancelled``. The server never learns the claim id from the
answer; it finds the claim by the call's own ``workerId`` in the run's ``task.claimed``
events and releases it, so the task is claimable again at once, not after its lease.
"""

import asyncio
import json
import random
import threading
import time
import uuid

import anyio
import httpx2
import uvicorn
from django.db import connection

from coordination.models import Event, Task
from runstate import Runstate
from tests.mcp.conftest import AnswerGate, call, free_port, stdio_session
from tests.waiting import WAIT_S, until, wait_until

LONG_LEASE_MS = 600_000  # ten minutes: a task seen QUEUED again was released, not taken over
CLAIMS_PATH = "/claims"


class HoldingProxy:
    """An HTTP proxy to the API that holds the answers of claim requests after the service gave them.

    ``hold_s`` None: a claim answer is held until the client goes away; a number: that long.
    ``committed`` lists the claims the service answered through the proxy.
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.hold_s: float | None = None
        self.drop = False  # break the connection in the middle of a claim's answer instead
        self.answered = threading.Event()
        self.committed: list[str] = []
        self.in_flight = 0  # claim requests sent to the service and not answered yet
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(
                self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off", interface="asgi3"
            )
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "HoldingProxy":
        self.thread.start()
        wait_until(lambda: self.server.started, what="the proxy to start", interval_s=0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        # Without force_exit uvicorn waits for every request task, and one may still await
        # an upstream long-poll that no client reads any more: the leaked thread held each
        # test for the whole join timeout. Forced, the loop's close cancels those tasks.
        self.server.should_exit = self.server.force_exit = True
        self.thread.join(timeout=WAIT_S)
        assert not self.thread.is_alive(), "the proxy did not stop"

    async def app(self, scope, receive, send) -> None:
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        query = scope["query_string"].decode()
        url = self.upstream + scope["path"] + (f"?{query}" if query else "")
        headers = [(k.decode(), v.decode()) for k, v in scope["headers"] if k not in (b"host", b"content-length")]
        claiming = scope["method"] == "POST" and scope["path"].endswith(CLAIMS_PATH) and "/mailboxes/" in scope["path"]
        self.in_flight += claiming
        try:
            async with httpx2.AsyncClient(timeout=60) as client:
                answer = await client.request(scope["method"], url, content=body, headers=headers)
        finally:
            self.in_flight -= claiming
        if claiming:
            self.committed += [claim["claimId"] for claim in answer.json().get("claims", [])]
            self.answered.set()
            if self.drop:  # the head of the answer, then the connection breaks: the client never reads it
                length = str(len(answer.content)).encode()
                await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", length)]})
                raise ConnectionAbortedError("the claim's answer is lost")
            if self.hold_s is None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                return
            await asyncio.sleep(self.hold_s)
        skip = {"content-length", "content-encoding", "transfer-encoding", "connection"}
        out = [(k.encode(), v.encode()) for k, v in answer.headers.items() if k.lower() not in skip]
        out.append((b"content-length", str(len(answer.content)).encode()))
        await send({"type": "http.response.start", "status": answer.status_code, "headers": out})
        await send({"type": "http.response.body", "body": answer.content})


def own_connection(read):
    """Run ``read`` (called in a thread of its own) and close that thread's connection: none is left open."""

    def call(*args):
        try:
            return read(*args)
        finally:
            connection.close()

    return call


@own_connection
def task_rows(run_id: str) -> dict[str, tuple[str, int]]:
    return {str(t.id): (t.state, t.attempts) for t in Task.objects.filter(run_id=run_id)}


@own_connection
def claim_events(run_id: str) -> tuple[list[dict], list[dict]]:
    """The run's ``task.claimed`` events and its release events (``task.requeued`` by a release)."""
    events = Event.objects.filter(run_id=run_id).order_by("id")
    claimed = [e.data | {"taskId": e.subject_id} for e in events if e.type == "task.claimed"]
    released = [
        e.data | {"taskId": e.subject_id}
        for e in events
        if e.type == "task.requeued" and e.data.get("cause") == "released"
    ]
    return claimed, released


async def settled(run_id: str, check) -> None:
    """Wait until ``check(rows)`` holds for the run's tasks (the server releases in the background)."""
    seen = {}

    async def holds() -> bool:
        seen["rows"] = await asyncio.to_thread(task_rows, run_id)
        return check(seen["rows"])

    await until(holds, what="the server's releases", interval_s=0.1, explain=lambda: seen["rows"])


def setup_run(tasks: int) -> tuple[str, str, list[str]]:
    with Runstate() as rs:
        mailbox = f"mcp-flight-{uuid.uuid4().hex[:8]}"
        rs.mailboxes.ensure(mailbox, mode="WORK", lease_ttl_ms=LONG_LEASE_MS)
        run = rs.scopes.create(name="in flight")
        ids = [run.tasks.submit(mailbox, {"n": n}).id for n in range(tasks)]
        return mailbox, run.id, ids


async def start_claim(session, **arguments):
    return asyncio.create_task(session.call_tool("task_claim", arguments))


async def claimable_again(agent, other, mailbox: str, run_id: str, task_id: str) -> None:
    """The cancelled call's task is claimable again at once: released, long before its ten-minute lease."""
    await settled(run_id, lambda rows: rows[task_id][0] == "QUEUED")
    error, body = await call(other, "task_claim", mailbox=mailbox, runId=run_id, waitMs=10_000)
    assert not error and [c["attempt"] for c in body["claims"]] == [2], body
    error, body = await call(agent, "run_status", runId=run_id)  # the session goes on, holding nothing
    assert not error and "cancellation" not in body, body


async def cancel(pending) -> None:
    pending.cancel()
    await asyncio.gather(pending, return_exceptions=True)


def test_a_claim_committed_but_unanswered_is_released_when_its_call_is_cancelled(sdk):
    mailbox, run_id, (task_id,) = setup_run(1)

    async def main():
        with HoldingProxy(sdk.url) as proxy:
            async with stdio_session(proxy.url, sdk.api_key) as agent, stdio_session(sdk.url, sdk.api_key) as other:
                pending = await start_claim(agent, mailbox=mailbox, runId=run_id, waitMs=0)
                assert await asyncio.to_thread(proxy.answered.wait, 30)
                assert len(proxy.committed) == 1  # the service committed the claim; its answer is held
                assert (await asyncio.to_thread(task_rows, run_id))[task_id] == ("RUNNING", 1)
                await cancel(pending)
                await claimable_again(agent, other, mailbox, run_id, task_id)
        claimed, released = await asyncio.to_thread(claim_events, run_id)
        assert [r["attempt"] for r in released] == [1]
        first = claimed[0]
        assert first["claimId"] == proxy.committed[0] and first["workerId"].startswith("mcp-")

    asyncio.run(main())


def test_a_cancelled_claim_that_committed_nothing_releases_nothing(sdk):
    """The call's workerId is its own: another worker's claims in the same run stay held."""
    mailbox, run_id, ids = setup_run(2)

    async def main():
        with HoldingProxy(sdk.url) as proxy, Runstate() as rs:
            held = await asyncio.to_thread(rs.scope(run_id).tasks.claim, mailbox, max=2, worker_id="someone-else")
            assert len(held) == 2
            async with stdio_session(proxy.url, sdk.api_key) as agent:
                pending = await start_claim(agent, mailbox=mailbox, runId=run_id, waitMs=0, max=5)
                assert await asyncio.to_thread(proxy.answered.wait, 30)
                assert proxy.committed == []
                await cancel(pending)
                # A claim committing late would be looked for meanwhile: give the server a moment to look.
                error, body = await call(agent, "run_status", runId=run_id)
                assert not error, body
                await asyncio.sleep(1.0)
            for claim in held:  # still held by their worker
                await asyncio.to_thread(claim.renew)
        rows = await asyncio.to_thread(task_rows, run_id)
        assert sorted(rows.values()) == [("RUNNING", 1), ("RUNNING", 1)]
        _, released = await asyncio.to_thread(claim_events, run_id)
        assert released == []

    asyncio.run(main())


def test_a_claim_whose_answer_is_lost_to_a_broken_connection_is_released(sdk):
    """No cancel: the connection breaks after the service committed; the call answers TRANSPORT_ERROR."""
    mailbox, run_id, (task_id,) = setup_run(1)

    async def main():
        with HoldingProxy(sdk.url) as proxy:
            proxy.drop = True
            async with stdio_session(proxy.url, sdk.api_key) as agent:
                error, body = await call(agent, "task_claim", mailbox=mailbox, runId=run_id, waitMs=0)
                assert error and body["error"]["code"] == "TRANSPORT_ERROR", body
                assert len(proxy.committed) == 1
                await settled(run_id, lambda rows: rows[task_id] == ("QUEUED", 1))
                assert "cancellation" not in body  # it holds nothing
        _, released = await asyncio.to_thread(claim_events, run_id)
        assert [r["attempt"] for r in released] == [1]

    asyncio.run(main())


def test_the_race_of_a_cancel_with_a_claim_in_flight_leaks_no_claim(sdk):
    """Rounds of a cancel sent at a random moment of a claim's flight, its answer held a random while.

    The cancel lands before the request reached the service, after it committed but before
    the answer arrived, or after the answer: in every case no claim is left held by nobody.
    """
    rounds = 16
    mailbox, run_id, ids = setup_run(3)
    rng = random.Random(28)
    unanswered = 0

    async def main():
        nonlocal unanswered
        with HoldingProxy(sdk.url) as proxy:
            async with stdio_session(proxy.url, sdk.api_key) as agent:
                for round in range(rounds):
                    before = len(proxy.committed)
                    proxy.answered.clear()
                    # Even rounds: the cancel lands while the committed answer is held; odd rounds: at
                    # a random moment of the flight, often before the request reached the service.
                    proxy.hold_s = rng.uniform(0.2, 0.5) if round % 2 == 0 else rng.uniform(0.0, 0.1)
                    pending = await start_claim(agent, mailbox=mailbox, runId=run_id, waitMs=0, max=rng.choice([1, 2]))
                    if round % 2 == 0:
                        assert await asyncio.to_thread(proxy.answered.wait, 30)
                        await asyncio.sleep(rng.uniform(0.0, 0.1))
                    else:
                        await asyncio.sleep(rng.uniform(0.0, 0.15))
                    if pending.done():  # answered before the cancel: the agent hands the claims back itself
                        for claim in json.loads(pending.result().content[0].text)["claims"]:
                            error, body = await call(agent, "task_release", claimId=claim["claimId"])
                            assert not error, body
                    else:
                        await cancel(pending)
                        unanswered += len(proxy.committed) > before
                    await settled(run_id, lambda rows: all(state == "QUEUED" for state, _ in rows.values()))
                # A claim that reached the service after its cancel commits late: its release follows
                # (while the session lives: its end leaves such a claim to its lease).
                # Settled: every claim the proxy saw committed is in the log and released, twice in a
                # row a second apart (a cancelled call's request may still be on its way to the proxy,
                # on a loaded machine for a while).
                deadline, settled_since = time.monotonic() + WAIT_S, None
                while True:
                    committed = sorted(proxy.committed)
                    claimed, released = await asyncio.to_thread(claim_events, run_id)
                    rows = await asyncio.to_thread(task_rows, run_id)
                    quiet = proxy.in_flight == 0 and all(state == "QUEUED" for state, _ in rows.values())
                    seen = sorted(c["claimId"] for c in claimed) == committed
                    if not (quiet and seen and len(released) >= len(claimed)):
                        settled_since = None
                    elif settled_since is None or settled_since[1] != committed:
                        settled_since = (time.monotonic(), committed)
                    elif time.monotonic() - settled_since[0] >= 1.0:
                        break
                    assert time.monotonic() < deadline, (committed, claimed, released, rows)
                    await asyncio.sleep(0.1)
        # Every claim the service committed was released exactly once: none held, none twice.
        assert sorted(c["claimId"] for c in claimed) == sorted(proxy.committed)
        assert sorted((r["taskId"], r["attempt"]) for r in released) == sorted(
            (c["taskId"], c["attempt"]) for c in claimed
        )

    asyncio.run(main())
    assert unanswered >= rounds // 4, f"only {unanswered} of {rounds} rounds cancelled a committed, unanswered claim"


def test_a_claim_answered_while_its_cancel_was_on_its_way_is_released(sdk):
    """The cancel crosses the answer: the server answered, the client cancelled before reading it.

    The client drops an answer that arrives after its cancel (as the protocol says it should),
    so the claim it names would be held by nobody until its lease: the server hands it back
    when the late cancel arrives.
    """
    mailbox, run_id, (task_id,) = setup_run(1)

    async def main():
        gate = AnswerGate()
        async with (
            stdio_session(sdk.url, sdk.api_key, gate=gate) as agent,
            stdio_session(sdk.url, sdk.api_key) as other,
        ):
            gate.hold_next = True
            pending = await start_claim(agent, mailbox=mailbox, runId=run_id, waitMs=0)
            with anyio.fail_after(WAIT_S):
                await gate.holding.wait()  # the server answered: the claim is committed and named
            assert (await asyncio.to_thread(task_rows, run_id))[task_id] == ("RUNNING", 1)
            assert not pending.done()
            await cancel(pending)  # the client sends notifications/cancelled for an answered call
            gate.release.set()  # the answer reaches a client that has given the call up
            assert pending.cancelled()
            await claimable_again(agent, other, mailbox, run_id, task_id)
        _, released = await asyncio.to_thread(claim_events, run_id)
        assert [r["attempt"] for r in released] == [1]

    asyncio.run(main())
