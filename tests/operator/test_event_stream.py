"""``GET /v1/events/stream``: Server-Sent Events, filtered, resumable, with no gap.

The first tests go through Django's ``AsyncClient`` (both databases); the last ones serve
the stream from a real uvicorn process on the PostgreSQL test database and read it with
httpx, as a client would.
"""

import asyncio
import statistics
import time

import pytest
from django.test import AsyncClient, override_settings

from coordination.api.longpoll import db
from coordination.domain.states import Permission
from coordination.models import Event
from coordination.reads.selectors import Visibility, event_cursor, event_list
from coordination.services.groups import group_close, group_create
from coordination.services.keys import api_key_create
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.pools import pool_acquire, pool_put
from coordination.services.runs import run_cancel, run_create
from tests.operator.live import Reader, parse_frame, uvicorn_server
from tests.waiting import WAIT_S

# The stream reads through other connections: the data must be committed.
pytestmark = pytest.mark.django_db(transaction=True)

STREAM = "/v1/events/stream"


class Frames:
    """Read SSE frames from a streaming response of Django's AsyncClient."""

    def __init__(self, response) -> None:
        self.chunks = aiter(response.streaming_content)
        self.buffer = b""
        self.comments: list[str] = []

    async def next(self) -> dict:
        """Return the next frame with an event as {id, event, data}; comments are kept aside."""
        while True:
            while b"\n\n" not in self.buffer:
                self.buffer += await asyncio.wait_for(anext(self.chunks), WAIT_S)
            block, self.buffer = self.buffer.split(b"\n\n", 1)
            frame = parse_frame(block.decode())
            if frame is None:
                continue
            if "comment" in frame:
                self.comments.append(frame["comment"])
                continue
            return frame

    async def next_comment(self) -> str:
        while not self.comments:
            while b"\n\n" not in self.buffer:
                self.buffer += await asyncio.wait_for(anext(self.chunks), WAIT_S)
            block, self.buffer = self.buffer.split(b"\n\n", 1)
            frame = parse_frame(block.decode())
            if frame is not None and "comment" in frame:
                self.comments.append(frame["comment"])
        return self.comments.pop(0)

    async def close(self) -> None:
        await self.chunks.aclose()


def key_of(project, permissions=(Permission.COORDINATION_READ,), **kwargs) -> str:
    return api_key_create(project_id=project.id, permissions=list(permissions), **kwargs).plaintext


async def open_stream(key: str, path: str = STREAM, **headers):
    response = await AsyncClient().get(path, headers={"Authorization": f"Bearer {key}", **headers})
    assert response.status_code == 200, response.content
    assert response["Content-Type"] == "text/event-stream"
    assert response["Cache-Control"] == "no-cache"
    return Frames(response)


def test_a_stream_without_a_cursor_sends_new_events_only_in_the_documented_frame(project):
    key = key_of(project)
    before = run_create(project_id=project.id, name="before")

    async def scenario():
        frames = await open_stream(key)
        try:
            after = await db(run_create, project_id=project.id, name="after")
            frame = await frames.next()
            return before, after, frame
        finally:
            await frames.close()

    before, after, frame = asyncio.run(scenario())
    assert frame["event"] == "run.created" == frame["data"]["type"]
    assert frame["data"]["subjectId"] == str(after.id) != str(before.id)
    assert frame["id"] == frame["data"]["id"] == event_cursor(Event.objects.get(subject_id=str(after.id)))
    assert set(frame["data"]) == {"id", "type", "runId", "subjectId", "data", "createdAt"}


@pytest.mark.parametrize("how", ["header", "query"])
def test_a_stream_resumes_after_last_event_id_or_after(project, how):
    key = key_of(project)
    runs = [run_create(project_id=project.id, name=f"r{n}") for n in range(3)]
    events, _ = event_list(Visibility(project.id), after=None, limit=100)
    first = events[0].txid, events[0].id
    cursor = f"{first[0]}-{first[1]}"

    async def scenario():
        if how == "header":
            frames = await open_stream(key, **{"Last-Event-ID": cursor})
        else:
            frames = await open_stream(key, f"{STREAM}?after={cursor}")
        try:
            return [await frames.next() for _ in range(2)]
        finally:
            await frames.close()

    received = asyncio.run(scenario())
    assert [frame["data"]["subjectId"] for frame in received] == [str(runs[1].id), str(runs[2].id)]


def test_a_stream_filters_by_types_and_by_run_subtree(project):
    key = key_of(project)
    watched = run_create(project_id=project.id, name="watched")
    other = run_create(project_id=project.id, name="other")

    async def scenario():
        frames = await open_stream(key, f"{STREAM}?types=run.created,run.cancelled&runId={watched.id}")
        try:
            await db(run_create, project_id=project.id, parent_id=other.id, name="elsewhere")
            child = await db(run_create, project_id=project.id, parent_id=watched.id, name="child")
            await db(mailbox_ensure, project_id=project.id, name="unwatched", mode="WORK")
            await db(run_cancel, run_id=watched.id, project_id=project.id)
            return child, [await frames.next() for _ in range(2)]
        finally:
            await frames.close()

    child, received = asyncio.run(scenario())
    assert [(f["event"], f["data"]["subjectId"]) for f in received] == [
        ("run.created", str(child.id)),
        ("run.cancelled", str(watched.id)),
    ]


def test_a_quiet_stream_sends_keepalive_comments(project):
    key = key_of(project)

    async def scenario():
        with override_settings(RUNSTATE_SSE_HEARTBEAT_S=0.2):
            frames = await open_stream(key)
            try:
                return await frames.next_comment()
            finally:
                await frames.close()

    assert asyncio.run(scenario()) == "keepalive"


def test_a_stream_is_refused_with_the_error_envelope_before_it_starts(project, other_project, anon):
    reader = key_of(project)
    other_run = run_create(project_id=other_project.id)
    writer_only = key_of(project, permissions=[Permission.COORDINATION_WRITE])
    cases = [
        ({"HTTP_AUTHORIZATION": f"Bearer {reader}"}, f"{STREAM}?after=nonsense", 400, "VALIDATION_ERROR"),
        ({"HTTP_AUTHORIZATION": f"Bearer {reader}"}, f"{STREAM}?runId={other_run.id}", 404, "NOT_FOUND"),
        ({"HTTP_AUTHORIZATION": f"Bearer {writer_only}"}, STREAM, 403, "PERMISSION_DENIED"),
        ({}, STREAM, 401, "UNAUTHENTICATED"),
        ({"HTTP_AUTHORIZATION": f"Bearer {reader}", "HTTP_LAST_EVENT_ID": "1-x"}, STREAM, 400, "VALIDATION_ERROR"),
    ]
    # A browser's EventSource accepts text/event-stream alone: the refusal is JSON all the same.
    for accept in ({}, {"HTTP_ACCEPT": "text/event-stream"}):
        for headers, path, status, code in cases:
            response = anon.get(path, **headers, **accept)
            assert (response.status_code, response.json()["error"]["code"]) == (status, code), (path, accept)
            assert response["Content-Type"] == "application/json", (path, accept)


def test_a_key_bound_to_a_run_streams_only_its_subtree(project):
    bound_run = run_create(project_id=project.id, name="mine")
    key = key_of(project, run_id=bound_run.id)

    async def scenario():
        frames = await open_stream(key)
        try:
            await db(run_create, project_id=project.id, name="not mine")
            mine = await db(run_create, project_id=project.id, parent_id=bound_run.id, name="child")
            return mine, await frames.next()
        finally:
            await frames.close()

    mine, frame = asyncio.run(scenario())
    assert frame["data"]["subjectId"] == str(mine.id)


def test_a_bound_keys_stream_omits_the_projects_pool_figures(project):
    """Issue 25: ``pool.exhausted`` under the bound run, without the sibling runs' ``inUse``/``waiting``."""
    bound_run = run_create(project_id=project.id, name="mine")
    sibling = run_create(project_id=project.id, name="not mine")
    pool_put(project_id=project.id, name="gpu", capacity=1)
    pool_acquire(project_id=project.id, name="gpu", run_id=sibling.id)
    assert pool_acquire(project_id=project.id, name="gpu", run_id=bound_run.id).refusal is not None
    start = event_cursor(Event.objects.get(run_id=bound_run.id, type="run.created"))
    key = key_of(project, run_id=bound_run.id)

    async def scenario():
        frames = await open_stream(key, f"{STREAM}?types=pool.exhausted&after={start}")
        try:
            return await frames.next()
        finally:
            await frames.close()

    frame = asyncio.run(scenario())
    assert frame["event"] == "pool.exhausted"
    assert frame["data"]["data"] == {"pool": "gpu", "units": 1, "capacity": 1}


def test_the_schema_documents_the_stream_as_text_event_stream(anon):
    schema = anon.get("/v1/schema", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    operation = schema["paths"]["/v1/events/stream"]["get"]
    assert "text/event-stream" in operation["responses"]["200"]["content"]
    assert {p["name"] for p in operation["parameters"]} >= {"types", "runId", "after", "Last-Event-ID"}
    assert operation["security"] == [{"bearerAuth": []}]


# Through a real uvicorn process ----------------------------------------------------------


@pytest.fixture
def server(tmp_path):
    # A short heartbeat lets a reader thread notice its stop flag quickly.
    with uvicorn_server(tmp_path / "uvicorn", RUNSTATE_SSE_HEARTBEAT_S="0.5") as server:
        yield server


@pytest.mark.postgres_only
def test_a_reader_receives_group_finalized_after_the_commit(project, server):
    """Measure how long after the deciding commit the frame arrives (printed, never asserted)."""
    mailbox_ensure(project_id=project.id, name="jobs", mode="WORK")
    key = key_of(project)
    reader = Reader(f"{server.url}{STREAM}?types=group.finalized", key)
    latencies_ms = []
    try:
        assert reader.connected.wait(WAIT_S) and reader.error is None, (reader.error, server.log())
        for n in range(5):
            group = group_create(project_id=project.id, mailbox_name="jobs", condition="ALL_TERMINAL", name=f"g{n}")
            # Closing an empty ALL_TERMINAL group decides it: FAILURE (all_terminal), committed on return.
            decided = group_close(project_id=project.id, group_id=group.id)
            committed_at = time.monotonic()
            assert decided.state == "FINALIZED"
            arrived_at, frame = reader.next()
            assert frame["event"] == "group.finalized"
            assert frame["data"]["subjectId"] == str(group.id)
            assert frame["data"]["data"] == {"outcome": "FAILURE", "reason": "all_terminal"}
            latencies_ms.append((arrived_at - committed_at) * 1000)
    finally:
        reader.close()
    print(
        f"\ngroup.finalized delivered after commit: "
        f"median {statistics.median(latencies_ms):.1f} ms, max {max(latencies_ms):.1f} ms "
        f"({', '.join(f'{ms:.1f}' for ms in latencies_ms)})"
    )


@pytest.mark.postgres_only
def test_a_reader_resumes_after_a_disconnect_with_no_gap_and_no_repeat(project, server):
    key = key_of(project)
    root = run_create(project_id=project.id, name="root")
    url = f"{server.url}{STREAM}?runId={root.id}"

    first = Reader(url, key)
    try:
        assert first.connected.wait(WAIT_S) and first.error is None, first.error
        before = [run_create(project_id=project.id, parent_id=root.id, name=f"a{n}") for n in range(5)]
        seen = [first.next()[1] for _ in before]
    finally:
        first.close()
    # Disconnected: these commit while nobody listens.
    during = [run_create(project_id=project.id, parent_id=root.id, name=f"b{n}") for n in range(5)]
    second = Reader(url, key, last_event_id=seen[-1]["id"])
    try:
        assert second.connected.wait(WAIT_S) and second.error is None, second.error
        after = [run_create(project_id=project.id, parent_id=root.id, name=f"c{n}") for n in range(5)]
        seen += [second.next()[1] for _ in during + after]
        with pytest.raises(AssertionError):
            second.next(timeout_s=1)  # nothing more: no event twice
    finally:
        second.close()

    expected, _ = event_list(Visibility(project.id), after=None, run_id=root.id, limit=1000)
    expected = [e for e in expected if e.subject_id != str(root.id)]  # the root's own creation came first
    assert [frame["id"] for frame in seen] == [event_cursor(e) for e in expected]
    assert [frame["data"]["subjectId"] for frame in seen] == [str(run.id) for run in before + during + after]
