import asyncio
import os
import signal
import time
from pathlib import Path

from coordination.services.sweeps import tasks_settle_expired_leases
from runstate import Runstate
from tests.mcp.conftest import call, http_session, stdio_session


def mcp_server_pids() -> set[int]:
    """The ``runstate mcp`` processes this test process spawned."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if parent == os.getpid() and b"runstate.cli" in command and b"mcp" in command:
            pids.add(int(entry.name))
    return pids


def setup_work(count: int, lease_ttl_ms: int = 30_000) -> tuple[str, str]:
    """A WORK mailbox and a run with ``count`` tasks."""
    rs = Runstate()
    mailbox = f"mcp-{time.monotonic_ns()}"
    rs.mailboxes.ensure(mailbox, mode="WORK", lease_ttl_ms=lease_ttl_ms)
    run = rs.scopes.create(name="mcp")
    for index in range(count):
        run.tasks.submit(mailbox, {"n": index})
    rs.close()
    return mailbox, run.id


def test_tools_list_describes_every_tool_and_marks_the_destructive_ones(sdk):
    async def main():
        async with stdio_session(sdk.url, sdk.api_key) as session:
            return (await session.list_tools()).tools

    tools = {tool.name: tool for tool in asyncio.run(main())}
    assert {"run_create", "run_status", "run_cancel", "task_claim", "task_complete", "group_wait"} <= set(tools)
    for tool in tools.values():
        assert tool.description and len(tool.description) > 40, tool.name
        assert tool.input_schema["type"] == "object", tool.name
        assert tool.output_schema is not None, tool.name
        annotations = tool.annotations
        assert annotations is not None and annotations.read_only_hint is not None, tool.name
        assert annotations.destructive_hint == (tool.name in {"run_cancel", "run_complete"}), tool.name
    assert tools["run_status"].annotations.read_only_hint
    assert tools["task_complete"].annotations.idempotent_hint
    assert not tools["task_claim"].annotations.idempotent_hint


def test_two_sessions_never_get_the_same_task(sdk):
    mailbox, run_id = setup_work(8)

    async def agent(session, taken):
        while True:
            error, body = await call(session, "task_claim", mailbox=mailbox, runId=run_id)
            assert not error, body
            if not body["claims"]:
                return
            claim = body["claims"][0]
            taken.append(claim["task"]["id"])
            error, body = await call(session, "task_complete", claimId=claim["claimId"], outcome={"ok": True})
            assert not error and body["task"]["state"] == "SUCCEEDED", body

    async def main():
        first, second = [], []
        async with stdio_session(sdk.url, sdk.api_key) as one, stdio_session(sdk.url, sdk.api_key) as two:
            await asyncio.gather(agent(one, first), agent(two, second))
        return first, second

    first, second = asyncio.run(main())
    assert len(first) + len(second) == 8
    assert not set(first) & set(second)


def test_a_cancelled_run_reaches_the_agent_and_its_complete_records_cancelled(sdk):
    mailbox, run_id = setup_work(1)

    async def main():
        async with stdio_session(sdk.url, sdk.api_key) as session:
            error, body = await call(session, "task_claim", mailbox=mailbox, runId=run_id)
            assert not error and body["cancellation"] == [], body
            claim = body["claims"][0]
            error, body = await call(session, "run_cancel", runId=run_id, reason="enough")
            assert not error and body["run"]["storedState"] == "CANCELLED", body
            notes = body["cancellation"]
            assert [note["taskId"] for note in notes] == [claim["task"]["id"]]
            assert "task_complete" in notes[0]["instruction"]
            error, beat = await call(session, "task_heartbeat", claimId=claim["claimId"])
            assert not error and beat["cancellationRequested"], beat
            error, done = await call(session, "task_complete", claimId=claim["claimId"], outcome=None)
            assert not error and done["task"]["state"] == "CANCELLED", done
            assert "cancellation" not in done  # nothing is held any more

    asyncio.run(main())


def test_a_claim_held_three_lease_ttls_still_completes(sdk):
    mailbox, run_id = setup_work(1, lease_ttl_ms=1000)

    async def main():
        async with stdio_session(sdk.url, sdk.api_key) as session:
            error, body = await call(session, "task_claim", mailbox=mailbox, runId=run_id, leaseTtlMs=1000)
            claim = body["claims"][0]
            await asyncio.sleep(3.5)  # the agent thinks; the server renews
            # The lease sweep finds nothing to take over.
            await asyncio.to_thread(tasks_settle_expired_leases)
            error, done = await call(session, "task_complete", claimId=claim["claimId"], outcome=42)
            assert not error and done["task"]["state"] == "SUCCEEDED" and done["task"]["attempts"] == 1, done

    asyncio.run(main())


def test_a_killed_session_s_task_is_taken_over_by_another_after_its_lease(sdk):
    mailbox, run_id = setup_work(1, lease_ttl_ms=1000)

    async def main():
        before = mcp_server_pids()
        async with stdio_session(sdk.url, sdk.api_key) as first:
            (pid,) = mcp_server_pids() - before
            error, body = await call(first, "task_claim", mailbox=mailbox, runId=run_id)
            task_id = body["claims"][0]["task"]["id"]
            async with stdio_session(sdk.url, sdk.api_key) as second:
                error, body = await call(second, "task_claim", mailbox=mailbox, runId=run_id)
                assert not error and body["claims"] == [], body  # held by the first session
                os.kill(pid, signal.SIGKILL)
                await asyncio.sleep(1.5)  # past the lease, nobody renews it
                await asyncio.to_thread(tasks_settle_expired_leases)
                error, body = await call(second, "task_claim", mailbox=mailbox, runId=run_id, waitMs=5000)
                (claim,) = body["claims"]
                assert (claim["task"]["id"], claim["attempt"]) == (task_id, 2), body
                error, body = await call(second, "task_complete", claimId=claim["claimId"], outcome="taken over")
                assert not error and body["task"]["state"] == "SUCCEEDED", body

    asyncio.run(main())


def test_a_refusal_is_a_tool_result_with_the_code_and_the_next_step(sdk, mcp_http):
    async def main():
        async with http_session(mcp_http, sdk.api_key) as session:
            error, body = await call(session, "task_complete", claimId="nope", outcome=1)
            assert error and body["error"]["code"] in {"NOT_FOUND", "LEASE_LOST"}, body
            assert body["error"]["nextStep"]

    asyncio.run(main())


def test_a_key_bound_to_a_run_gets_not_found_for_another_run_over_http(sdk, make_key, mcp_http):
    rs = Runstate()
    mine, other = rs.scopes.create(name="mine"), rs.scopes.create(name="other")
    rs.close()
    bound = make_key(["coordination_read", "coordination_write"], run_id=mine.id)

    async def main():
        async with http_session(mcp_http, bound) as session:
            error, body = await call(session, "run_status", runId=mine.id)
            assert not error and body["run"]["id"] == mine.id, body
            error, body = await call(session, "run_status", runId=other.id)
            assert error and body["error"]["code"] == "NOT_FOUND", body
            error, body = await call(session, "run_cancel", runId=other.id)
            assert error and body["error"]["code"] == "NOT_FOUND", body

    asyncio.run(main())


def test_an_http_session_holds_its_claims_between_calls(sdk, mcp_http):
    mailbox, run_id = setup_work(1)

    async def main():
        async with http_session(mcp_http, sdk.api_key) as session:
            error, body = await call(session, "task_claim", mailbox=mailbox, runId=run_id)
            claim = body["claims"][0]
            error, body = await call(session, "run_status", runId=run_id)
            assert not error and body["cancellation"] == [], body  # still held by this session
            error, body = await call(session, "task_complete", claimId=claim["claimId"], outcome=1)
            assert not error and body["task"]["state"] == "SUCCEEDED" and "cancellation" not in body, body

    asyncio.run(main())


def test_an_http_session_without_a_key_is_refused_as_a_tool_result(sdk, mcp_http):
    async def main():
        async with http_session(mcp_http, "") as session:
            error, body = await call(session, "run_status", runId="x")
            assert error and body["error"]["code"] == "UNAUTHENTICATED", body

    asyncio.run(main())


def test_the_mcp_server_imports_nothing_from_django():
    import subprocess
    import sys

    from tests.mcp.conftest import ROOT

    code = (
        "import sys, runstate.mcp.server; sys.exit(any(m == 'django' or m.startswith('django.') for m in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=False).returncode == 0


def test_the_http_transport_refuses_a_foreign_host_header(mcp_http):
    """DNS-rebinding protection: a page on another origin cannot reach the local server through its own name."""
    import httpx

    headers = {"Host": "evil.example", "Accept": "application/json, text/event-stream"}
    answer = httpx.post(mcp_http, headers=headers, json={"jsonrpc": "2.0", "id": 1, "method": "ping"}, timeout=10)
    assert answer.status_code == 421
    headers = {"Origin": "http://evil.example", "Accept": "application/json, text/event-stream"}
    answer = httpx.post(mcp_http, headers=headers, json={"jsonrpc": "2.0", "id": 1, "method": "ping"}, timeout=10)
    assert answer.status_code == 403
