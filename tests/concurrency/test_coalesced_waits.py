"""Coalesced waits and shared event streams: many waiters on one object cost one read per wake-up.

A thousand group waits through two real uvicorn processes are all answered with the decided
group, and each process re-reads the group once per wake-up (the watch's debug log line is
counted, next to the notifications PostgreSQL sent about the group). A wait arriving after
the decision is answered at once; a wait or a stream whose client goes away leaves no watch,
subscription or feed behind; a slow SSE reader is dropped and resumes with ``Last-Event-ID``
without a gap. No duration is asserted.
"""

import asyncio
import re
import socket
import uuid
from pathlib import Path

import httpx
import pytest
from django.db import connection, transaction
from django.utils import timezone

from coordination.api.longpoll import watches
from coordination.api.sse import Keepalive, event_feed
from coordination.api.waits import waits_held
from coordination.domain.states import Permission
from coordination.models import Event
from coordination.plumbing.notify import CHANNEL, hub
from coordination.reads.selectors import event_cursor
from coordination.services.barriers import barrier_arrive, barrier_create
from coordination.services.events import events_record_many
from coordination.services.groups import group_close, group_create
from coordination.services.keys import api_key_create
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.runs import run_create
from tests.operator.live import Reader, asgi_http_scope, parse_frame, uvicorn_server
from tests.waiting import WAIT_S, until, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

WAITERS = 1000


def read_key(project) -> str:
    return api_key_create(project_id=project.id, permissions=[Permission.COORDINATION_READ]).plaintext


def undecided_group(project):
    """An empty ALL_TERMINAL group: closing it decides it (FAILURE, all_terminal)."""
    mailbox_ensure(project_id=project.id, name="jobs", mode="WORK")
    return group_create(project_id=project.id, mailbox_name="jobs", condition="ALL_TERMINAL", name="g")


def log_lines(path: Path, start: int = 0) -> list[str]:
    with open(path, "rb") as log:
        log.seek(start)
        return log.read().decode(errors="replace").splitlines()


def decide_and_count_notifications(project, group) -> int:
    """Close the group (deciding it); return how many notifications named it (read from our own LISTEN)."""
    listener = hub._connect()
    try:
        group_close(project_id=project.id, group_id=group.id)
        marker = f"marker-{uuid.uuid4()}"
        listener.execute("SELECT pg_notify(%s, %s)", [CHANNEL, marker])
        named = 0
        for notify in listener.notifies(timeout=WAIT_S):
            if notify.payload == marker:
                return named
            named += str(group.id) in notify.payload.split()
        raise AssertionError("the marker notification never arrived")
    finally:
        listener.close()
        connection.close()


@pytest.mark.postgres_only
def test_a_thousand_waiters_through_two_processes_are_answered_with_one_read_per_wake_up(project, tmp_path):
    group = undecided_group(project)
    key = read_key(project)
    env = {"LOG_LEVEL": "DEBUG", "LOG_FORMAT": "text", "RUNSTATE_DB_POOL_SIZE": "8"}
    with uvicorn_server(tmp_path / "a", **env) as a, uvicorn_server(tmp_path / "b", **env) as b:
        servers = (a, b)

        def parked(server) -> int:
            return sum("a waiter parked" in line and str(group.id) in line for line in log_lines(server.log_path))

        async def scenario():
            limits = httpx.Limits(max_connections=WAITERS + 10, max_keepalive_connections=0)
            async with httpx.AsyncClient(
                headers={"Authorization": f"Bearer {key}"}, limits=limits, timeout=120
            ) as client:
                waits = [
                    asyncio.create_task(client.get(f"{servers[i % 2].url}/v1/groups/{group.id}/wait?timeoutMs=30000"))
                    for i in range(WAITERS)
                ]

                def all_parked() -> bool:
                    if sum(map(parked, servers)) >= WAITERS:
                        return True
                    assert not any(w.done() for w in waits), "a wait was answered before the decision"
                    return False

                await until(all_parked, what=f"{WAITERS} waits parked", interval_s=0.2, waits=2)
                offsets = [s.log_path.stat().st_size for s in servers]
                notified = await asyncio.to_thread(decide_and_count_notifications, project, group)
                answers = await asyncio.gather(*waits)
                return offsets, notified, answers

        offsets, notified, answers = asyncio.run(scenario())
        # Let the logs settle: every answer is out, so every read that produced one is logged.
        reads = [
            [line for line in log_lines(s.log_path, offset) if ": read " in line and str(group.id) in line]
            for s, offset in zip(servers, offsets, strict=True)
        ]

    assert [r.status_code for r in answers] == [200] * WAITERS
    assert {(r.json()["state"], r.json()["outcome"]) for r in answers} == {("FINALIZED", "FAILURE")}
    assert notified >= 1
    for server_reads in reads:
        # Each process answered its 500 waiters from the reads of one watch: one per
        # wake-up (a notification naming the group, or a recheck in the meantime).
        notified_reads = [line for line in server_reads if "(notified)" in line]
        assert 1 <= len(server_reads) and len(notified_reads) <= notified, server_reads
        assert len(server_reads) <= notified + 2, server_reads  # at most 2 rechecks of 1 s besides


def test_a_wait_arriving_after_the_decision_is_answered_by_its_first_read(api, project):
    group = undecided_group(project)
    group_close(project_id=project.id, group_id=group.id)
    response = api.get(f"/v1/groups/{group.id}/wait?timeoutMs=30000")
    assert response.status_code == 200 and response.json()["state"] == "FINALIZED"

    run = run_create(project_id=project.id)
    barrier = barrier_create(project_id=project.id, run_id=run.id, target=1)
    barrier_arrive(project_id=project.id, barrier_id=barrier.id, key="only")
    response = api.get(f"/v1/barriers/{barrier.id}/wait?timeoutMs=30000")
    assert response.status_code == 200 and response.json()["state"] == "RELEASED"


def asgi_request(path: str, query: str, key: str | None, *, headers: dict | None = None, repeated=(), send=None):
    """Call the ASGI application for a GET; return (task, disconnect event, sent messages).

    ``headers`` are sent beside the key's (``key`` None: none), then ``repeated`` (raw
    ``(name, value)`` pairs, a name possibly again); ``send(message)``, if given, is
    awaited after each message is kept (a reader that takes its time).
    """
    from runstate_project.asgi import application

    disconnect = asyncio.Event()
    sent: list[dict] = []
    received = []
    named = {} if key is None else {"authorization": f"Bearer {key}"}
    named |= {name.lower(): value for name, value in (headers or {}).items()}
    pairs = [(name.encode(), value.encode()) for name, value in named.items()] + list(repeated)

    async def receive():
        if not received:
            received.append(True)
            return {"type": "http.request", "body": b"", "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def keep(message):
        sent.append(message)
        if send is not None:
            await send(message)

    scope = asgi_http_scope(path, query, pairs)
    return asyncio.create_task(application(scope, receive, keep)), disconnect, sent


def test_a_wait_whose_client_goes_away_leaves_no_watch_and_no_subscription(project):
    group = undecided_group(project)
    key = read_key(project)

    async def scenario():
        call, disconnect, sent = asgi_request(f"/v1/groups/{group.id}/wait", "timeoutMs=30000", key)
        await until(lambda: any(w.primed.is_set() for w in watches().values()), what="the wait parked")
        during = (len(watches()), hub.waiting_on(group.id))
        disconnect.set()
        await asyncio.wait_for(call, 30)
        return during, (len(watches()), hub.waiting_on(group.id)), sent

    during, after, sent = asyncio.run(scenario())
    assert during == (1, 1)
    assert after == (0, 0)
    assert not [m for m in sent if m["type"] == "http.response.body" and m.get("body")]


def test_a_stream_whose_client_goes_away_leaves_no_feed_behind(project):
    key = read_key(project)

    async def scenario():
        call, disconnect, sent = asgi_request("/v1/events/stream", "", key)
        await until(lambda: any(m.get("body", b"").startswith(b"retry:") for m in sent), what="the stream started")
        feed = event_feed()
        during = (feed is not None and len(feed.streams), hub.waiting_on("*"))
        disconnect.set()
        await asyncio.wait_for(call, 30)
        return during, (event_feed(), hub.waiting_on("*"))

    during, after = asyncio.run(scenario())
    assert during == (1, 1)
    assert after == (None, 0)


STREAM_FRAMES = pytest.mark.parametrize("frame", [b"retry:", Keepalive.COMMENT], ids=["its preamble", "a keepalive"])


async def stream_held_on(frame: bytes, key: str) -> tuple[int, object]:
    """Open a stream whose reader takes nothing from ``frame`` on; return the feed's drop count and the feed after.

    The stream then waits in ``send`` on that frame, as a server's send waits for a full
    socket to drain. Call with ``RUNSTATE_SSE_HEARTBEAT_S`` and ``RUNSTATE_SSE_STALL_S``
    short.
    """
    never = asyncio.Event()

    async def takes_nothing_from_the_frame(message):
        if message.get("body", b"").startswith(frame):
            await never.wait()

    call, disconnect, sent = asgi_request("/v1/events/stream", "", key, send=takes_nothing_from_the_frame)
    await until(lambda: any(m.get("body", b"").startswith(frame) for m in sent), what="the frame sent")
    feed = event_feed()
    try:
        await until(lambda: feed.dropped == 1, what="the stream dropped")
        # Its request ends, and the stream leaves the feed, which stops: no client going away is needed.
        await asyncio.wait_for(call, WAIT_S)
        return feed.dropped, event_feed()
    finally:
        disconnect.set()
        await asyncio.wait_for(call, WAIT_S)


@STREAM_FRAMES
def test_a_reader_that_stops_taking_at_any_frame_is_dropped(project, settings, frame):
    """A stream held on any frame its reader does not take is dropped, not only on an event's.

    The loaded landing once saw a slow reader never dropped: its last chunk of events was
    taken, the socket was then full, and the stream stood on the next keepalive, which did
    not count as a stall. The hot path's twin is in ``tests/api/test_hot_stream.py``.
    """
    settings.RUNSTATE_SSE_HEARTBEAT_S = 0.05
    settings.RUNSTATE_SSE_STALL_S = 0.2
    issued = api_key_create(project_id=project.id, permissions=[Permission.COORDINATION_READ])
    dropped, feed_after = asyncio.run(stream_held_on(frame, issued.plaintext))
    assert dropped == 1
    assert feed_after is None  # the dropped stream left the feed at once (not when collected): it stopped
    assert waits_held(api_key_id=issued.api_key.id) == 0  # its place given back


# A slow SSE reader -------------------------------------------------------------------------


class SlowReader:
    """An SSE client on a raw socket with a tiny receive buffer, which reads only when told."""

    def __init__(self, url: str, path: str, key: str) -> None:
        host, port = re.match(r"http://([^:]+):(\d+)", url).groups()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect((host, int(port)))
        self.sock.sendall(
            f"GET {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
            "Accept: text/event-stream\r\n\r\n".encode()
        )
        self.raw = b""
        self.body = b""

    def _fill(self) -> bool:
        data = self.sock.recv(65536)
        self.raw += data
        return bool(data)

    def wait_started(self) -> None:
        """Read until the stream's ``retry`` preamble arrived (the server subscribed)."""
        self.sock.settimeout(30)
        while b"retry:" not in self.raw:
            assert self._fill(), "closed before the stream started"

    def read_to_end(self) -> list[dict]:
        """Read until the server closes; return the complete event frames (a cut last one is dropped)."""
        self.sock.settimeout(60)
        while self._fill():
            pass
        self.sock.close()
        head, _, chunked = self.raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        body = b""
        while chunked:  # undo the chunked transfer encoding, as far as it got
            size_line, sep, rest = chunked.partition(b"\r\n")
            if not sep:
                break
            size = int(size_line, 16)
            if size == 0 or len(rest) < size:
                body += rest[:size]
                break
            body += rest[:size]
            chunked = rest[size + 2 :]
        frames = [parse_frame(block) for block in body.decode(errors="replace").split("\n\n")[:-1]]
        return [f for f in frames if f is not None and "event" in f]


@pytest.mark.postgres_only
def test_a_slow_reader_is_dropped_and_resumes_with_last_event_id_without_a_gap(project, tmp_path):
    key = read_key(project)
    run = run_create(project_id=project.id)
    path = f"/v1/events/stream?runId={run.id}&types=test.burst"
    env = {"RUNSTATE_SSE_BUFFER": "5000", "RUNSTATE_SSE_STALL_S": "2", "RUNSTATE_SSE_HEARTBEAT_S": "0.5"}
    with uvicorn_server(tmp_path / "uvicorn", **env) as server:
        slow = SlowReader(server.url, path, key)
        slow.wait_started()
        # A fast reader alongside, which must not be slowed or dropped.
        fast = Reader(f"{server.url}{path}", key)
        assert fast.connected.wait(WAIT_S) and fast.error is None, fast.error
        total = 3000
        for start in range(0, total, 100):
            with transaction.atomic():
                events_record_many(
                    [
                        Event(
                            project_id=project.id,
                            type="test.burst",
                            run_id=run.id,
                            run_path=run.path,
                            subject_id=str(n),
                            data={"n": n, "padding": "x" * 3000},
                            created_at=timezone.now(),
                        )
                        for n in range(start, start + 100)
                    ]
                )
        try:
            fast_frames = [fast.next()[1] for _ in range(total)]
        finally:
            fast.close()
        # The slow reader has taken nothing for a while: the server closes its connection.
        wait_until(
            lambda: "dropping an event stream" in server.log(),
            what="the slow reader dropped",
            interval_s=0.2,
            explain=server.log,
        )
        first = slow.read_to_end()  # what was already on its way, then the end
        received = [f for f in first if f["event"] == "test.burst"]
        assert 0 < len(received) < total, "the slow reader was never dropped"
        second = Reader(f"{server.url}{path}", key, last_event_id=received[-1]["id"])
        try:
            assert second.connected.wait(WAIT_S) and second.error is None, second.error
            received += [second.next()[1] for _ in range(total - len(received))]
        finally:
            second.close()

    expected = [event_cursor(e) for e in Event.objects.filter(run_id=run.id, type="test.burst").order_by("txid", "id")]
    assert len(expected) == total
    assert [f["id"] for f in fast_frames] == expected
    assert [f["id"] for f in received] == expected  # no gap, no repeat
    assert [f["data"]["data"]["n"] for f in received] == list(range(total))
