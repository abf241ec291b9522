"""Requests under /v1/ take the API's short middleware stack; the admin keeps Django's full one."""

import asyncio
import re

import pytest
from asgiref.testing import ApplicationCommunicator

from runstate_project.asgi import application
from tests.operator.live import asgi_http_scope

pytestmark = pytest.mark.django_db(transaction=True)


async def call(path: str) -> tuple[int, dict[bytes, bytes]]:
    communicator = ApplicationCommunicator(application, asgi_http_scope(path))
    await communicator.send_input({"type": "http.request", "body": b"", "more_body": False})
    start = await communicator.receive_output(10)
    await communicator.receive_output(10)  # the body
    return start["status"], {name.lower(): value for name, value in start["headers"]}


def test_the_api_skips_the_admin_middleware_and_the_admin_keeps_it():
    asyncio.run(scenario())


async def scenario():
    status, api = await call("/v1/healthz")
    assert status == 200
    assert b"x-request-id" in api, "the API's own stack (request id) ran"
    assert api.get(b"x-content-type-options") == b"nosniff", "security headers still apply to the API"
    # Clickjacking and session middleware are the admin's: they leave these marks.
    assert b"x-frame-options" not in api
    assert b"Cookie" not in api.get(b"vary", b"")
    status, admin = await call("/admin/login/")
    assert status == 200
    assert admin.get(b"x-frame-options") == b"DENY"
    assert b"x-request-id" in admin


def test_every_api_route_is_sent_down_the_path_its_view_needs():
    """Synchronous views take the one-hop path; async views (long-polls, streams) Django's own."""
    from asgiref.sync import iscoroutinefunction

    from runstate_project.asgi import _view_is_async, routes

    checked = {True: 0, False: 0}
    for regex, callback in routes():
        # A path of the route: every parameter "x", every anchor and optional slash dropped.
        path = re.sub(r"\(\?P<\w+>[^)]*\)", "x", regex).removeprefix("^").removesuffix(r"\Z").replace("/?", "/")
        if not path.startswith("/v1/") or "(" in path or "\\" in path:
            continue
        expected = iscoroutinefunction(callback)
        assert _view_is_async(path) is expected, (path, callback)
        checked[expected] += 1
    assert checked[True] >= 8 and checked[False] >= 30, checked


def test_a_sync_view_answers_through_the_one_hop_path_with_its_middleware():
    async def scenario():
        status, headers = await call("/v1/nope")
        assert status == 404
        assert b"x-request-id" in headers and headers.get(b"x-content-type-options") == b"nosniff"

    asyncio.run(scenario())
