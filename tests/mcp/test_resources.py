"""Resources, their subscriptions and the swarm_worker prompt."""

import asyncio
import json

import mcp_types as types
import pytest
from mcp.client.subscriptions import listen
from mcp.shared.subscriptions import ResourceUpdated

from runstate import Runstate
from tests.mcp.conftest import http_session, stdio_session


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


# Clients of protocol 2026-07-28 listen instead: a subscriptions/listen stream names the URIs.
def test_a_listen_stream_gets_its_run_s_updates_and_no_other_session_does(sdk, make_key, mcp_http):
    rs = Runstate()
    run = rs.scopes.create(name="listened")
    elsewhere = rs.scopes.create(name="elsewhere")
    uri = f"runstate://runs/{run.id}"
    # A key bound to another run cannot read this one: its stream is not fed, on the same server.
    outsider = make_key(["coordination_read"], run_id=elsewhere.id)

    async def main():
        async with (
            http_session(mcp_http, sdk.api_key, modern=True) as session,
            http_session(mcp_http, outsider, modern=True) as other,
            listen(session, resource_subscriptions=[uri]) as stream,
            listen(other, resource_subscriptions=[uri]) as other_stream,
        ):
            assert session.protocol_version == "2026-07-28"
            assert stream.honored.resource_subscriptions == [uri]
            await asyncio.to_thread(elsewhere.cancel)  # another run changes: no update
            await asyncio.to_thread(run.cancel, "listened to it")
            event = await asyncio.wait_for(anext(stream), timeout=20)
            assert event == ResourceUpdated(uri=uri)
            result = await session.read_resource(uri)
            assert json.loads(result.contents[0].text)["storedState"] == "CANCELLED"
            with pytest.raises(TimeoutError):  # nothing for the outsider, who cannot read the run
                await asyncio.wait_for(anext(other_stream), timeout=1.0)

    asyncio.run(main())
    rs.close()


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
