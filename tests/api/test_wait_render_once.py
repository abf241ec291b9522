"""Wait answers rendered once per process and change, and waiters that cost nothing while parked (issue 27 item 2).

Through two real uvicorn processes on the PostgreSQL test database, as a deployment runs
them: 1,000 long-polls of one group (500 per process) parked, one verdict decides the group,
and every waiter gets the same bytes, rendered once in each process
(``runstate_wait_answers_rendered_total`` on each process's ``/v1/metrics``). A parked
waiter holds no thread; a waiter whose client goes away gives back its place and its watch.
"""

import asyncio
import re
import uuid
from pathlib import Path

import httpx
import pytest

from coordination.api.longpoll import db
from coordination.domain.states import Permission, Verdict
from coordination.services.claims import claim_complete, task_claim
from coordination.services.groups import group_create, group_submit, group_verdict
from coordination.services.keys import api_key_create
from coordination.services.mailboxes import mailbox_ensure
from tests.operator.live import uvicorn_server
from tests.waiting import until

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]

SCRAPE_TOKEN = f"scrape-{uuid.uuid4().hex}"
WAITERS = 1000
# Headers that differ per answer by design: the request id, and the second the server wrote it.
PER_REQUEST = {"x-request-id", "date"}


@pytest.fixture
def servers(tmp_path):
    """Two API processes, each counting its own metrics (a multiprocess directory each)."""
    env = {"RUNSTATE_METRICS_TOKEN": SCRAPE_TOKEN, "RUNSTATE_DB_POOL_SIZE": "5"}
    for name in ("first", "second"):
        (tmp_path / f"{name}-metrics").mkdir()
    with (
        uvicorn_server(tmp_path / "first", PROMETHEUS_MULTIPROC_DIR=str(tmp_path / "first-metrics"), **env) as first,
        uvicorn_server(tmp_path / "second", PROMETHEUS_MULTIPROC_DIR=str(tmp_path / "second-metrics"), **env) as second,
    ):
        yield [first, second]


def undecided_group(project):
    """A threshold-1 group with one succeeded member: one accept finalizes it."""
    mailbox, _ = mailbox_ensure(project_id=project.id, name="reviews", mode="WORK")
    group = group_create(project_id=project.id, mailbox_name="reviews", condition="N_ACCEPTED", threshold=1)
    task, _, _ = group_submit(project_id=project.id, group_id=group.id, input={"n": 1})
    (claim,) = task_claim(project_id=project.id, mailbox=mailbox, run_id=group.scope_id)
    claim_complete(project_id=project.id, claim_id=claim.claim_id, outcome={"ok": True})
    return group, task


def metric(server, name: str, labels: str = "") -> float:
    """Return one series of ``server``'s own metrics (0 before its first sample)."""
    auth = {"Authorization": f"Bearer {SCRAPE_TOKEN}"}
    text = httpx.get(f"{server.url}/v1/metrics", headers=auth, timeout=60).text
    found = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def threads_of(server) -> int:
    return int(re.search(r"^Threads:\s+(\d+)", Path(f"/proc/{server.process.pid}/status").read_text(), re.M).group(1))


def scraped(condition):
    """``condition`` as a predicate for ``until`` whose scrape (a blocking HTTP request) runs off the event loop."""
    return lambda: asyncio.to_thread(condition)


async def open_get(server, path: str, key: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Send one GET on its own connection (a bare client: a thousand of them stay light)."""
    port = int(server.url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\nConnection: close\r\n\r\n".encode()
    )
    await writer.drain()
    return reader, writer


async def answer_of(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple[int, dict, bytes]:
    """Read the whole answer: (status, headers with lower-case names, body)."""
    try:
        raw = await asyncio.wait_for(reader.read(), 120)
    finally:
        writer.close()
    head, _, rest = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            body, rest = body + rest[:size], rest[size + 2 :]
    else:
        body = rest
    return int(status_line.split(" ", 2)[1]), headers, body


def test_a_thousand_waiters_in_two_processes_get_the_same_bytes_rendered_once_per_process(project, servers):
    group, task = undecided_group(project)
    key = api_key_create(project_id=project.id, permissions=[Permission.COORDINATION_READ]).plaintext
    path = f"/v1/groups/{group.id}/wait?timeoutMs=30000"
    renders_before = [metric(server, "runstate_wait_answers_rendered_total", '{wait="group"}') for server in servers]

    async def scenario():
        connections = [await open_get(servers[n % 2], path, key) for n in range(WAITERS)]
        answers = [asyncio.create_task(answer_of(*connection)) for connection in connections]
        for server in servers:
            await until(
                scraped(lambda s=server: metric(s, "runstate_waiters_parked") == WAITERS // 2),
                what="every waiter parked",
                interval_s=0.2,
                waits=2,
            )
        threads = [threads_of(server) for server in servers]
        assert not any(answer.done() for answer in answers)
        await db(group_verdict, project_id=project.id, group_id=group.id, task_id=task.id, verdict=Verdict.ACCEPTED)
        return threads, await asyncio.gather(*answers)

    threads, answers = asyncio.run(scenario())

    # A parked waiter holds no thread: 500 waiters, far fewer threads than that.
    assert all(count < 100 for count in threads), threads
    assert {status for status, _, _ in answers} == {200}
    bodies = {body for _, _, body in answers}
    assert len(bodies) == 1
    (body,) = bodies
    assert b'"state":"FINALIZED"' in body
    shared_headers = {tuple(sorted((k, v) for k, v in h.items() if k not in PER_REQUEST)) for _, h, _ in answers}
    assert len(shared_headers) == 1
    assert len({headers["x-request-id"] for _, headers, _ in answers}) == WAITERS
    # Exactly one rendering per process for the change.
    renders_after = [metric(server, "runstate_wait_answers_rendered_total", '{wait="group"}') for server in servers]
    assert [after - before for before, after in zip(renders_before, renders_after, strict=True)] == [1, 1]
    # The bytes and headers are what DRF answers for the group (its detail view, rendered per request).
    detail = httpx.get(f"{servers[0].url}/v1/groups/{group.id}", headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert detail.content == body
    (headers,) = shared_headers
    transport = PER_REQUEST | {"connection"}  # the waiters asked to close their connections
    assert {k: v for k, v in headers if k not in transport} == {
        k.lower(): v for k, v in detail.headers.items() if k.lower() not in transport
    }
    for server in servers:
        assert metric(server, "runstate_waiters_parked") == 0
        assert metric(server, "runstate_watches") == 0
        assert metric(server, "runstate_waits_held") == 0


def test_a_waiter_whose_client_leaves_gives_back_its_place_and_its_watch(project, servers):
    group, _ = undecided_group(project)
    key = api_key_create(project_id=project.id, permissions=[Permission.COORDINATION_READ]).plaintext
    server = servers[0]
    path = f"/v1/groups/{group.id}/wait?timeoutMs=30000"

    async def scenario():
        connections = [await open_get(server, path, key) for _ in range(3)]
        await until(
            scraped(lambda: metric(server, "runstate_waiters_parked") == 3), what="the waiters parked", interval_s=0.2
        )
        assert metric(server, "runstate_watches") == 1
        assert metric(server, "runstate_waits_held") == 3
        for _, writer in connections[:2]:
            writer.close()
        await until(
            scraped(lambda: metric(server, "runstate_waiters_parked") == 1), what="two waiters gone", interval_s=0.2
        )
        assert metric(server, "runstate_waits_held") == 1
        assert metric(server, "runstate_watches") == 1  # the last waiter still watches
        connections[2][1].close()
        await until(
            scraped(lambda: metric(server, "runstate_watches") == 0),
            what="the watch removed with its last waiter",
            interval_s=0.2,
        )

    asyncio.run(scenario())
    assert metric(server, "runstate_waiters_parked") == 0
    assert metric(server, "runstate_waits_held") == 0
    # The places are really back: the key can wait again, and is answered.
    answer = httpx.get(
        f"{server.url}/v1/groups/{group.id}/wait?timeoutMs=1", headers={"Authorization": f"Bearer {key}"}
    )
    assert answer.status_code == 200
