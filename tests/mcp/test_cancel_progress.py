"""MCP's own cancellation (``notifications/cancelled``) and progress notifications on waits."""

import asyncio
import time

from runstate import Runstate
from tests.mcp.conftest import call, stdio_session


async def cancel_in_flight(session, tool, **arguments):
    """Start a tool call, let it reach its wait, then abandon it (the client sends notifications/cancelled)."""
    pending = asyncio.create_task(session.call_tool(tool, arguments))
    await asyncio.sleep(0.5)
    assert not pending.done()
    pending.cancel()
    await asyncio.gather(pending, return_exceptions=True)


def test_a_cancelled_task_claim_leaves_the_task_claimable(sdk):
    rs = Runstate()
    mailbox = f"mcp-cancel-{time.monotonic_ns()}"
    rs.mailboxes.ensure(mailbox, mode="WORK")
    run = rs.scopes.create(name="cancel")

    async def main():
        async with stdio_session(sdk.url, sdk.api_key) as first, stdio_session(sdk.url, sdk.api_key) as second:
            await cancel_in_flight(first, "task_claim", mailbox=mailbox, runId=run.id, waitMs=20_000)
            error, body = await call(first, "run_status", runId=run.id)  # the session goes on
            assert not error and "cancellation" not in body, body  # and holds nothing
            await asyncio.to_thread(run.tasks.submit, mailbox, {"n": 1})
            error, body = await call(second, "task_claim", mailbox=mailbox, runId=run.id, waitMs=10_000)
            assert not error and [claim["attempt"] for claim in body["claims"]] == [1], body

    asyncio.run(main())
    rs.close()


def test_a_cancelled_group_wait_ends_and_the_session_goes_on(sdk):
    rs = Runstate()
    mailbox = f"mcp-wait-{time.monotonic_ns()}"
    rs.mailboxes.ensure(mailbox, mode="WORK")
    group = rs.groups.create(mailbox=mailbox, condition="FIRST_ACCEPTED")
    rs.close()

    async def main():
        async with stdio_session(sdk.url, sdk.api_key) as session:
            await cancel_in_flight(session, "group_wait", groupId=group.id, timeoutMs=20_000)
            error, body = await call(session, "group_close", groupId=group.id)
            assert not error, body

    asyncio.run(main())


def test_a_long_wait_reports_progress_to_a_client_that_asked(sdk):
    rs = Runstate()
    mailbox = f"mcp-progress-{time.monotonic_ns()}"
    rs.mailboxes.ensure(mailbox, mode="WORK")
    group = rs.groups.create(mailbox=mailbox, condition="FIRST_ACCEPTED")
    rs.close()
    seen = []

    async def progress(done, total, message):
        seen.append((done, total, message))

    async def main():
        async with stdio_session(sdk.url, sdk.api_key) as session:
            return await session.call_tool(
                "group_wait", {"groupId": group.id, "timeoutMs": 2500}, progress_callback=progress
            )

    result = asyncio.run(main())
    assert result.is_error and result.structured_content["error"]["code"] == "TIMEOUT"
    assert seen and all(total == 2500 for _, total, _ in seen)
