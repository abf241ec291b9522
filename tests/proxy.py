"""A TCP proxy the tests put between a client and a server, to cut what crosses it.

It runs on a loop of its own in a thread, so synchronous tests and tests with their own loop
use it alike. ``cut()`` closes every open connection and refuses new ones (they are accepted
and closed at once) until ``restore()``; ``retarget(port)`` sends new connections to another
server (an API process restarted on another port). ``accepted`` counts the connections
passed on.
"""

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator


class Proxy:
    """Forward ``127.0.0.1:<port>`` to ``127.0.0.1:<target_port>``, with faults on demand."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.accepted = 0
        self._refusing = False
        self._links: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="test-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Proxy":
        self._thread.start()
        self._call(self._start())
        return self

    def cut(self) -> None:
        """Close every connection open now, and refuse new ones until ``restore``."""
        self._call(self._cut())

    def restore(self) -> None:
        """Pass new connections on again."""
        self._refusing = False

    def retarget(self, target_port: int) -> None:
        """Send new connections to ``target_port``."""
        self.target_port = target_port

    def close(self) -> None:
        self._call(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(30)

    async def _start(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        self._server = await asyncio.start_server(self._serve, sock=listener)
        self.port = listener.getsockname()[1]

    async def _cut(self) -> None:
        self._refusing = True
        for writer in list(self._links):
            with contextlib.suppress(Exception):
                writer.transport.abort()
        self._links.clear()

    async def _close(self) -> None:
        await self._cut()
        if self._server is not None:
            self._server.close()

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        if self._refusing:
            client_writer.transport.abort()
            return
        try:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            client_writer.transport.abort()
            return
        self.accepted += 1
        self._links.update((client_writer, server_writer))
        await asyncio.gather(
            self._pipe(client_reader, server_writer), self._pipe(server_reader, client_writer), return_exceptions=True
        )
        self._links.difference_update((client_writer, server_writer))

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while chunk := await reader.read(65536):
                writer.write(chunk)
                await writer.drain()
        finally:
            writer.transport.abort()


@contextlib.contextmanager
def proxy_to(target_port: int) -> Iterator[Proxy]:
    """Run a ``Proxy`` to ``target_port`` for the block."""
    proxy = Proxy(target_port).start()
    try:
        yield proxy
    finally:
        proxy.close()
