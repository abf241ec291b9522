"""stdio for ``runstate mcp`` on the event loop's own pipes, without a thread hop per message.

The ``mcp`` package's ``stdio_server()`` reads and writes its lines through worker threads
(``anyio.wrap_file``): two thread hand-offs per tool call, which ``bench/mcp.py``'s profile
showed among the server's largest costs on a busy machine. Given async line streams, it
uses them as they are; these read and write the pipes with asyncio's pipe transports. As
``stdio_server()`` does for its own streams, fd 0 then reads EOF and fd 1 goes to stderr, so
stray reads and prints miss the wire. Where stdin or stdout is not a pipe (a regular file,
say), the package's own streams serve.
"""

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from mcp.server.mcpserver import MCPServer
from mcp.server.stdio import stdio_server

LINE_LIMIT = 64 * 1024 * 1024  # one JSON-RPC message per line: a large task input is one long line


class _Lines:
    """The lines of the wire's read end, as ``stdio_server()`` iterates them."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader

    def __aiter__(self) -> "_Lines":
        return self

    async def __anext__(self) -> str:
        line = await self._reader.readline()
        if not line:
            raise StopAsyncIteration
        return line.decode("utf-8", errors="replace")


class _Writer:
    """The wire's write end, as ``stdio_server()`` writes and flushes it."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer

    async def write(self, text: str) -> None:
        self._writer.write(text.encode("utf-8"))

    async def flush(self) -> None:
        await self._writer.drain()


@asynccontextmanager
async def _pipes() -> AsyncIterator[tuple[_Lines, _Writer] | None]:
    loop = asyncio.get_running_loop()
    wire_in, wire_out = os.dup(0), os.dup(1)
    reader = asyncio.StreamReader(limit=LINE_LIMIT)
    try:
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(wire_in, "rb", 0))
        transport, protocol = await loop.connect_write_pipe(
            asyncio.streams.FlowControlMixin, os.fdopen(wire_out, "wb", 0)
        )
    except (OSError, ValueError):  # not pipes (epoll refuses regular files): the package's streams serve
        yield None
        return
    saved = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    try:
        yield _Lines(reader), _Writer(asyncio.StreamWriter(transport, protocol, None, loop))
    finally:
        transport.close()
        for fd, original in zip((0, 1), saved, strict=True):
            os.dup2(original, fd)
            os.close(original)


async def serve(server: MCPServer) -> None:
    """Serve one MCP session on this process's stdin and stdout until the client closes it."""
    async with _pipes() as pipes:
        if pipes is None:
            await server.run_stdio_async()
            return
        lines, writer = pipes
        async with stdio_server(lines, writer) as (read_stream, write_stream):  # type: ignore[arg-type]
            lowlevel = server._lowlevel_server
            await lowlevel.run(read_stream, write_stream, lowlevel.create_initialization_options())


def run(server: MCPServer) -> None:
    """Run ``serve`` on an event loop of its own."""
    anyio.run(serve, server)
