"""The handlers of docs/sdk.md, run as written against the live service (issue 38).

docs/sdk.md's ``rebuild_index`` is read from the page and executed, then consumed with the
mailbox's default lease (30 s: a renewal every 10 s). Its search API holds the request until
the client lets go; the task is cancelled as soon as the request arrives. The cancel reaches
the handler through the claim watch and aborts the request: the task ends ``CANCELLED``.
(The example once left httpx's 5 s default read timeout in place, and a cancel heard only at
the next renewal, 10 s on, ended ``FAILED``: the timeout fired first.)
"""

import asyncio
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from runstate import AsyncRunstate
from tests.sdk.conftest import ROOT
from tests.waiting import WAIT_S

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]


def docs_block(page: str, defines: str) -> str:
    """Return the Python block of ``docs/<page>`` that defines ``defines`` (``async def name(``)."""
    text = (ROOT / "docs" / page).read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    (block,) = [block for block in blocks if defines in block]
    return block


@pytest.fixture
def search_api():
    """A search API that holds every request until the client goes away; ``arrived`` is set per request."""
    arrived, gone = threading.Event(), threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's naming
            arrived.set()
            # Never answers: read until the client closes its side.
            self.connection.settimeout(WAIT_S)
            try:
                while self.connection.recv(1024):
                    pass
            except OSError:
                pass
            gone.set()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", arrived, gone
    finally:
        server.shutdown()
        server.server_close()


def test_the_rebuild_index_example_cancelled_mid_request_ends_cancelled(sdk, search_api, monkeypatch):
    url, arrived, gone = search_api
    monkeypatch.setenv("SEARCH_API_URL", url)
    namespace: dict = {}
    exec(compile(docs_block("sdk.md", "async def rebuild_index(ctx)"), "docs/sdk.md", "exec"), namespace)  # noqa: S102
    rebuild_index = namespace["rebuild_index"]

    async def scenario():
        async with AsyncRunstate() as rs:
            await rs.mailboxes.ensure("search", mode="WORK")  # the default lease: 30 s
            run = await rs.scopes.create()
            ticket = await run.tasks.submit("search", {"indexId": "products"})
            worker = rs.scope(run.id).worker("search", rebuild_index, handle_signals=False)
            running = asyncio.create_task(worker.run())
            assert await asyncio.to_thread(arrived.wait, WAIT_S), "the handler never called the search API"
            await ticket.cancel(reason="customer_deleted_project")
            task = await ticket.result(timeout_ms=int(WAIT_S * 1000))
            worker.stop()
            return task, await running

    task, summary = asyncio.run(scenario())
    assert task["state"] == "CANCELLED", task
    assert (task["outcome"], task["attempts"], task["cancelReason"]) == (None, 1, "customer_deleted_project")
    assert (summary.completed, summary.failed, summary.lost) == (1, 0, 0)
    assert gone.wait(WAIT_S)  # the request was aborted, not answered
