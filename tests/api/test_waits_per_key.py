"""Long-polls and event streams are capped per API key and process (``RUNSTATE_MAX_WAITS_PER_KEY``).

Requests go through the API's ASGI application in this process, as uvicorn would send them,
so that a wait really parks and a client really goes away.
"""

import asyncio
import json

import pytest
from django.test import override_settings

from coordination.api.waits import waits_held
from coordination.domain.states import Permission
from coordination.services.keys import api_key_create
from tests.concurrency.test_coalesced_waits import asgi_request, undecided_group
from tests.waiting import until

pytestmark = pytest.mark.django_db(transaction=True)


def key_of(project):
    issued = api_key_create(project_id=project.id, permissions=list(Permission))
    return issued.plaintext, issued.api_key.id


async def answer(call, sent) -> tuple[int, dict]:
    await asyncio.wait_for(call, 30)
    [start] = [m for m in sent if m["type"] == "http.response.start"]
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], json.loads(body) if body else {}


@override_settings(RUNSTATE_MAX_WAITS_PER_KEY=2)
def test_a_wait_beyond_the_cap_is_rate_limited_for_that_key_only_until_a_wait_ends(project):
    group = undecided_group(project)
    (key, key_id), (other, _) = key_of(project), key_of(project)
    wait = f"/v1/groups/{group.id}/wait"

    async def scenario():
        first, first_gone, _ = asgi_request(wait, "timeoutMs=30000", key)
        stream, stream_gone, stream_sent = asgi_request("/v1/events/stream", "", key)
        await until(lambda: waits_held(api_key_id=key_id) == 2, what="two waits held")
        await until(
            lambda: any(m.get("body", b"").startswith(b"retry:") for m in stream_sent), what="the stream started"
        )

        # A third wait of the same key, long-poll or stream: refused at once.
        third, _, sent = asgi_request(wait, "timeoutMs=30000", key)
        refused = await answer(third, sent)
        third_stream, _, sent = asgi_request("/v1/events/stream", "", key)
        refused_stream = await answer(third_stream, sent)
        # A request that does not wait is not counted; another key is not limited.
        no_wait, _, sent = asgi_request(wait, "timeoutMs=0", key)
        not_waiting = await answer(no_wait, sent)
        others, _, sent = asgi_request(wait, "timeoutMs=50", other)
        other_key = await answer(others, sent)

        # The clients go away: their places come back, and the key may wait again.
        first_gone.set()
        stream_gone.set()
        await asyncio.wait_for(asyncio.gather(first, stream), 30)
        await until(lambda: waits_held(api_key_id=key_id) == 0, what="the places given back")
        again, _, sent = asgi_request(wait, "timeoutMs=50", key)
        after = await answer(again, sent)
        return refused, refused_stream, not_waiting, other_key, after

    refused, refused_stream, not_waiting, other_key, after = asyncio.run(scenario())
    for status, body in (refused, refused_stream):
        assert (status, body["error"]["code"]) == (429, "RATE_LIMITED"), body
        assert body["error"]["details"] == {"maxWaitsPerKey": 2}
    assert not_waiting[0] == 200
    assert other_key[0] == 200
    assert after[0] == 200
    assert waits_held(api_key_id=key_id) == 0


@override_settings(RUNSTATE_MAX_WAITS_PER_KEY=1)
def test_a_wait_that_ends_with_an_error_or_a_timeout_gives_its_place_back(project):
    (key, key_id) = key_of(project)
    group = undecided_group(project)

    async def scenario():
        statuses = []
        for path, query in [
            ("/v1/groups/g_nope/wait", "timeoutMs=30000"),  # 404 before it waits
            (f"/v1/groups/{group.id}/wait", "timeoutMs=100"),  # times out
            ("/v1/events/stream", "after=not-a-cursor"),  # refused before the stream starts
        ]:
            call, _, sent = asgi_request(path, query, key)
            statuses.append((await answer(call, sent))[0])
            assert waits_held(api_key_id=key_id) == 0, path
        return statuses

    assert asyncio.run(scenario()) == [404, 200, 400]


def test_the_default_cap_leaves_room_for_the_suites_thousand_waiters():
    from django.conf import settings

    assert settings.RUNSTATE_MAX_WAITS_PER_KEY >= 1000
