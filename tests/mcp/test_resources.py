"""Resources, their subscriptions and the swarm_worker prompt."""

import asyncio
import json

import mcp_types as types
import pytest

from runstate import Runstate
from tests.mcp.conftest import stdio_session


# Clients of the protocol versions agents speak today (up to 2025-11-25) subscribe this way.
@pytest.mark.filterwarnings("ignore:resources/(un)?subscribe is removed")
def test_a_subscribed_run_notifies_its_cancellation(sdk):
    rs = Runstate()
    run = rs.scopes.create(name="watched")
    other = rs.scopes.create(name="not watched")
    uri = f"runstate://runs/{run.id}"
    updates: list[str] = []
    updated = asyncio.Event()

    async def on_message(message):
        if isinstance(message, types.ResourceUpdatedNotification):
            updates.append(str(message.params.uri))
            updated.set()

    async def main():
        async with stdio_session(sdk.url, sdk.api_key, message_handler=on_message) as session:
            result = await session.read_resource(uri)
            assert json.loads(result.contents[0].text)["storedState"] == "ACTIVE"
            await session.subscribe_resource(uri)
            await asyncio.to_thread(other.cancel)  # another run changes: no update
            await asyncio.to_thread(run.cancel, "watched it")
            await asyncio.wait_for(updated.wait(), timeout=20)
            result = await session.read_resource(uri)
            assert json.loads(result.contents[0].text)["storedState"] == "CANCELLED"
            await session.unsubscribe_resource(uri)

    asyncio.run(main())
    rs.close()
    assert updates == [uri]


def test_resources_of_another_project_or_unknown_are_errors_and_the_prompt_tells_the_loop(sdk):
    async def main():
        async with stdio_session(sdk.url, sdk.api_key) as session:
            templates = (await session.list_resource_templates()).resource_templates
            assert {t.uri_template for t in templates} == {
                "runstate://runs/{run_id}",
                "runstate://tasks/{task_id}",
                "runstate://groups/{group_id}",
            }
            try:
                await session.read_resource("runstate://runs/nope")
            except Exception as error:  # noqa: BLE001 - a resource read refusal is a protocol error by design
                assert "NOT_FOUND" in str(error)
            else:
                raise AssertionError("an unknown run was read")
            prompt = await session.get_prompt("swarm_worker", {"mailbox": "reviews", "runId": "r1"})
            text = prompt.messages[0].content.text
            assert "task_claim" in text and "reviews" in text and "r1" in text and "cancellation" in text

    asyncio.run(main())
