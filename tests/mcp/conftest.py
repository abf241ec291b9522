"""Real MCP clients against ``runstate mcp``: stdio (a spawned process per session) and streamable HTTP.

The servers run THIS checkout's code (``python -m runstate.cli`` with the checkout first on
``PYTHONPATH``) against the SDK tests' live API server (``tests/sdk/conftest.py``).
"""

import json
import math
import os
import socket
import subprocess
import sys
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx2
import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.message import SessionMessage
from mcp_types import JSONRPCResponse

from tests.processes import free_port
from tests.sdk.conftest import make_key, sdk, sdk_server  # noqa: F401 - fixtures
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


class AnswerGate:
    """Between a stdio server and its client: holds back the server's next answer while asked to.

    Set ``hold_next``; the next answer the server writes is kept (``holding`` is then set) until
    ``release`` is set: what the client does meanwhile (cancel the call, say) reaches the server
    after its answer was written and before the client read it.
    """

    def __init__(self) -> None:
        self.hold_next = False
        self.holding = anyio.Event()
        self.release = anyio.Event()

    async def pump(self, read, send) -> None:
        async with send:
            async for item in read:
                answer = isinstance(item, SessionMessage) and isinstance(item.message, JSONRPCResponse)
                if answer and self.hold_next:
                    self.hold_next = False
                    self.holding.set()
                    await self.release.wait()
                await send.send(item)


@asynccontextmanager
async def stdio_session(
    url: str, api_key: str, env: dict[str, str] | None = None, *, gate: AnswerGate | None = None, **options
):
    """One MCP session over stdio: a ``runstate mcp`` process of its own (``options`` for ``ClientSession``).

    ``env``: more variables for the process (``OTEL_*``, say). ``gate``: the client reads the
    server's messages through it.
    """
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "runstate.cli", "mcp"],
        env=child_env(RUNSTATE_URL=url, RUNSTATE_API_KEY=api_key, **(env or {})),
        cwd=str(ROOT),
    )
    async with stdio_client(params) as (server_out, write), anyio.create_task_group() as pumps:
        read = server_out
        if gate is not None:
            send, read = anyio.create_memory_object_stream(math.inf)
            pumps.start_soon(gate.pump, server_out, send)
        async with ClientSession(read, write, **options) as session:
            await session.initialize()
            yield session
        pumps.cancel_scope.cancel()


@asynccontextmanager
async def http_session(url: str, api_key: str, *, modern: bool = False):
    """One MCP session over streamable HTTP, sending its key (if any) as ``Authorization: Bearer``.

    ``modern``: speak protocol 2026-07-28 (``server/discover``, no handshake) instead of 2025-11-25.
    """
    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {api_key}"} if api_key else {}, timeout=60) as client,
        streamable_http_client(url, http_client=client) as streams,
        ClientSession(streams[0], streams[1]) as session,
    ):
        await (session.discover() if modern else session.initialize())
        yield session


@pytest.fixture(scope="module")
def mcp_http(sdk_server):  # noqa: F811
    """``runstate mcp --http`` on a free port for the module; yields its /mcp URL."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "runstate.cli", "mcp", "--http", f"127.0.0.1:{port}"],
        cwd=ROOT,
        env=child_env(RUNSTATE_URL=sdk_server.url),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def listening() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            if process.poll() is not None:
                raise RuntimeError("runstate mcp --http did not start") from None
            return False

    try:
        wait_until(listening, what="runstate mcp --http to listen", interval_s=0.1)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        process.terminate()
        process.wait(timeout=10)


async def call(session: ClientSession, tool: str, **arguments):
    """Call a tool; return ``(is_error, structured content)``."""
    result = await session.call_tool(tool, arguments)
    body = result.structured_content
    if body is None:
        body = json.loads(result.content[0].text)
    return bool(result.is_error), body
