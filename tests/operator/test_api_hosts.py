"""``ALLOWED_HOSTS`` holds on ``/v1`` as on the admin (issue 25): a wrong ``Host`` (DNS rebinding) is 400.

These go through the ASGI application that uvicorn serves, with the API's own middleware
stack: Django's test client takes the admin's stack, whose ``CommonMiddleware`` checks the
host already and so would hide a stack that does not.
"""

import asyncio
import json

import pytest
from asgiref.testing import ApplicationCommunicator

from runstate_project.asgi import _view_is_async, application
from tests.operator.live import asgi_http_scope

pytestmark = pytest.mark.django_db(transaction=True)

NO_SUCH_ID = "00000000-0000-0000-0000-000000000000"


async def call(path: str, host: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> tuple[int, dict, bytes]:
    scope = asgi_http_scope(path)
    scope["headers"] = [(b"host", host), *(headers or [])]
    communicator = ApplicationCommunicator(application, scope)
    await communicator.send_input({"type": "http.request", "body": b"", "more_body": False})
    start = await communicator.receive_output(10)
    body = await communicator.receive_output(10)
    await communicator.wait(10)
    return start["status"], {name.lower(): value for name, value in start["headers"]}, body.get("body", b"")


def refused(status: int, headers: dict, body: bytes) -> bool:
    return (
        status == 400
        and headers.get(b"content-type") == b"application/json"
        and json.loads(body)["error"]["code"] == "VALIDATION_ERROR"
    )


@pytest.mark.parametrize(
    "path",
    [
        "/v1/healthz",  # synchronous, no key
        "/v1/metrics",  # synchronous, the data a rebinding page would want
        "/v1/runs",  # synchronous, keyed
        f"/v1/groups/{NO_SUCH_ID}/wait",  # a long-poll (async view)
        "/v1/events/stream",  # the event stream (async view)
        "/v1/no-such-endpoint",
    ],
)
def test_a_host_not_in_allowed_hosts_is_400_with_the_envelope(path):
    answer = asyncio.run(call(path, b"attacker.example:8000"))
    assert refused(*answer), answer


def test_the_async_paths_above_are_async_views():
    """The wait and the stream take Django's own ASGI path, not the one-hop one: both are covered."""
    assert _view_is_async(f"/v1/groups/{NO_SUCH_ID}/wait")
    assert _view_is_async("/v1/events/stream")
    assert not _view_is_async("/v1/healthz")


@pytest.mark.parametrize("host", [b"localhost", b"localhost:8000", b"127.0.0.1:8000", b"[::1]:8000", b"testserver"])
def test_the_default_allowed_hosts_are_answered(host):
    status, headers, _ = asyncio.run(call("/v1/healthz", host))
    assert status == 200, host
    assert b"x-request-id" in headers


def test_a_wrong_host_is_400_even_with_a_valid_key(api):
    key = api.issued.plaintext
    status, headers, body = asyncio.run(
        call("/v1/runs", b"evil.example", [(b"authorization", f"Bearer {key}".encode())])
    )
    assert refused(status, headers, body)
    # The same request with a good host is answered.
    status, _, _ = asyncio.run(call("/v1/runs", b"localhost", [(b"authorization", f"Bearer {key}".encode())]))
    assert status == 200
