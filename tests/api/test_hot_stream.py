"""The event stream on the hot path (coordination/api/hot/stream.py) streams exactly what its DRF view streams.

The harness of ``tests/api/test_hot_waits.py``: each case's requests go through the real ASGI
application in this process, once with the hot path on and once off, on fresh state built the
same way. A stream is read until the events a case writes after it started have arrived (or
its answer is complete), then its client goes away. Status, headers and the bytes streamed
must be equal once ids, cursors and times are replaced by placeholders; ``hot.SERVED`` shows
the hot path answered. A client that goes away gives its place among the key's waits back and
leaves the shared feed.
"""

import asyncio
import json
import re
import uuid
from dataclasses import dataclass, field

import httpx
import pytest
from django.db import connection, transaction
from django.utils import timezone

from coordination.api import hot, longpoll, sse, waits
from coordination.api.hot import db as hot_db
from coordination.domain.states import Permission
from coordination.models import Event, Project, Run
from coordination.reads import selectors
from coordination.services.events import events_record_many
from coordination.services.runs import run_create
from coordination.services.timers import timer_fire
from tests.api.test_hot_path import _cached_key, api_process, normalized  # noqa: F401 - the fixture
from tests.api.test_hot_waits import UNKNOWN, WaitState, _key_id, cursors_hidden, fresh_wait_state
from tests.api.test_process_cache import caches_on
from tests.concurrency.test_coalesced_waits import STREAM_FRAMES, asgi_request, stream_held_on
from tests.waiting import until, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres_only]

TICK = "test.tick"
STREAM_ACCEPT = {"Accept": "text/event-stream"}  # as EventSource sends it
OTHER = "test.other"


@dataclass
class Stream:
    """One request to the stream: its query, headers, and the events written once it has started."""

    query: str = ""
    key: str | None = None  # None: the state's key
    headers: dict = field(default_factory=dict)
    # What to write once the stream started: (project "own" or "foreign", event type, how many).
    writes: list[tuple[str, str, int]] = field(default_factory=list)
    # The last event written of each of these types must arrive before the client goes away.
    awaited: tuple[str, ...] = (TICK,)
    # Events committed before the stream started (``after=``) that must arrive before the client
    # goes away, by type: without a wait, whether the backlog was sent before the client left
    # was the machine's timing (one path's answer carried it, the other's not).
    backlog: tuple[str, ...] = ()
    repeated: tuple = ()  # raw header pairs sent after the others (a header sent twice)
    anonymous: bool = False


def _write(state: WaitState, writes: list[tuple[str, str, int]], mark: str) -> None:
    """Commit each batch of events in a transaction of its own, numbered from 0 (``data.n``), in order."""
    for owner, event_type, count in writes:
        run = Run.objects.get(id=state.base.run_id if owner == "own" else state.base.foreign_run_id)
        with transaction.atomic():
            events_record_many(
                [
                    Event(
                        project_id=run.project_id,
                        type=event_type,
                        run_id=run.id,
                        run_path=run.path,
                        subject_id="",
                        data={"n": n, "mark": mark, "last": n == count - 1},
                        created_at=timezone.now(),
                    )
                    for n in range(count)
                ]
            )


def _body(sent: list[dict]) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


_FRAME = re.compile(rb"event: ([\w.]+)\ndata: ([^\n]*)\n")


def _arrived(body: bytes, event_type: str, mark: str) -> bool:
    """Tell whether the last event of ``event_type`` written with ``mark`` is among the frames of ``body``."""
    for name, data in _FRAME.findall(body):
        written = json.loads(data)["data"]
        if name == event_type.encode() and written.get("mark") == mark and written.get("last"):
            return True
    return False


def _complete(sent: list[dict]) -> bool:
    return any(m["type"] == "http.response.body" and not m.get("more_body", False) for m in sent)


def settled_wait_state() -> WaitState:
    """``fresh_wait_state()`` with its due timer fired here, before any stream opens.

    Its firing is otherwise a worker's, at a moment neither path controls: a ``timer.fired``
    committed while one stream is open and not the other would differ between the two. Once
    fired here, a worker that comes later finds it fired and writes nothing (``timer_fire``).
    """
    state = fresh_wait_state()
    timer_fire(timer_id=uuid.UUID(state.fired_timer))
    return state


def _horizon_settled() -> None:
    """Wait until every event committed so far is below the event horizon (``selectors.event_head``).

    A stream of "new events only" starts at the head, which stays below an event of a
    transaction that was running when the event's own committed (its txid is above the
    horizon), so such an event still reaches the stream: by contract, a stream may also carry
    events committed just before it started. Something in the test's database (a timer's
    worker, a cascade) may hold such a transaction open for a moment, more so on a loaded
    machine; two streams compared byte for byte must start from the same settled head.
    """
    with connection.cursor() as cursor:

        def settled() -> bool:
            cursor.execute(f"SELECT max(txid) < {selectors.EVENT_HORIZON_SQL} FROM {Event._meta.db_table}")
            [(below,)] = cursor.fetchall()
            return below is not False  # True, or no event at all (NULL)

        wait_until(settled, what="the event horizon to pass the events committed", interval_s=0.02)


async def _stream_once(state: WaitState, stream: Stream, mark: str) -> httpx.Response:
    """Open the stream, write its events once it started, read until they arrived, then go away."""
    await longpoll.db(_horizon_settled)
    key = None if stream.anonymous else stream.key or state.base.key
    headers = STREAM_ACCEPT | stream.headers
    app, gone, sent = asgi_request("/v1/events/stream", stream.query, key, headers=headers, repeated=stream.repeated)
    await until(lambda: _complete(sent) or b"retry:" in _body(sent), what="the answer or the stream's start")
    if not _complete(sent):
        for event_type in stream.backlog:
            await until(
                lambda t=event_type: b"event: %s\n" % t.encode() in _body(sent), what=f"the backlog's {event_type}"
            )
        await longpoll.db(_write, state, stream.writes, mark)
        for event_type in stream.awaited if stream.writes else ():
            await until(lambda t=event_type: _arrived(_body(sent), t, mark), what=f"the last {event_type} streamed")
    gone.set()
    await asyncio.wait_for(app, 30)
    [start] = [m for m in sent if m["type"] == "http.response.start"]
    body = _body(sent)
    if _starts_at_the_head(stream):
        body = _written_after_the_start(body, mark)
    answer = httpx.Response(start["status"], headers=start["headers"], content=body)
    if not any(name.lower() == b"content-length" for name, _ in start["headers"]):
        del answer.headers["content-length"]  # httpx's own, for the bytes given: a stream has none
    return answer


def _starts_at_the_head(stream: Stream) -> bool:
    """Tell whether ``stream`` asks for new events only (no ``after``, no ``Last-Event-ID``)."""
    return "after=" not in stream.query and not any(name.lower() == "last-event-id" for name in stream.headers)


def _written_after_the_start(body: bytes, mark: str) -> bytes:
    """Return ``body`` without the event frames the test did not write once the stream had started.

    A stream of new events only may also carry events committed just before it started (its
    head is below the event horizon, which an unrelated transaction of another database can
    hold back for a statement: ``selectors.EVENT_HORIZON_SQL`` leaves out the other
    databases' transactions it still sees running, and one that commits meanwhile is not left
    out). The same request then starts one event earlier or later by the machine's timing,
    on either path; what both must stream alike is what was written after the start.
    """
    frames = body.split(b"\n\n")
    own = b'"mark":"%s"' % mark.encode()
    return b"\n\n".join(frame for frame in frames if not frame.startswith(b"id: ") or own in frame)


# The SSE frame's id line is an event cursor, as in the long-poll's body.
_FRAME_ID = (re.compile(rb"id: \d+-\d+\n"), b"id: <cursor>\n")


def _hidden(answers: list[tuple]) -> list[tuple]:
    pattern, placeholder = _FRAME_ID
    return [(status, pattern.sub(placeholder, body), headers) for status, body, headers in cursors_hidden(answers)]


def streamed(settings, hot_on: bool, build) -> tuple[list[tuple], int]:
    """Stream ``build(state)``'s requests with the hot path on or off; return the answers and how many it served."""
    settings.RUNSTATE_HOT_PATH = hot_on
    caches_on(settings)
    state = settled_wait_state()
    requests = build(state)
    before = hot.SERVED["EventStream"]

    async def run():
        await (await hot_db.pool()).wait(timeout=30)
        try:
            return [await _stream_once(state, each, f"m{index}") for index, each in enumerate(requests)]
        finally:
            await hot_db.close()

    answers = asyncio.run(run())
    return _hidden(normalized(answers)), hot.SERVED["EventStream"] - before


def _uncached_run(state: WaitState) -> str:
    """A run of the state's project (below its run) that this process has not seen."""
    return str(run_create(project_id=state.project_id, parent_id=uuid.UUID(state.base.run_id)).id)


def _no_read_key(state: WaitState) -> str:
    return _cached_key(Project.objects.get(id=state.project_id), permissions=[Permission.COORDINATION_WRITE])


TICKS = [("own", TICK, 3)]
CASES = {
    "new events only": lambda s: [Stream(writes=TICKS)],
    "new events of some types": lambda s: [
        Stream(f"types={TICK}", writes=[("own", OTHER, 2), *TICKS, ("own", OTHER, 1)])
    ],
    "new events, any Accept": lambda s: [Stream(headers={"Accept": "*/*"}, writes=TICKS)],
    "Last-Event-ID": lambda s: [Stream(headers={"Last-Event-ID": "0-0"}, writes=TICKS)],
    "Last-Event-ID wins over after": lambda s: [
        Stream("after=nonsense", headers={"Last-Event-ID": "0-0"}, writes=TICKS)
    ],
    "after": lambda s: [Stream("after=0-0", writes=TICKS)],
    "after, some types": lambda s: [Stream(f"after=0-0&types=task.submitted,{TICK}", writes=TICKS)],
    "a run's events": lambda s: [Stream(f"runId={s.base.run_id}", writes=TICKS)],
    "a run not cached": lambda s: [Stream(f"runId={_uncached_run(s)}&after=0-0", backlog=("run.created",))],
    "a foreign project's events not shown": lambda s: [Stream(writes=[("foreign", TICK, 2), *TICKS])],
    "the foreign project's key": lambda s: [
        Stream(key=s.base.foreign_key, writes=[*TICKS, ("foreign", TICK, 2)], awaited=(TICK,))
    ],
    "a read-only key": lambda s: [Stream(key=s.base.read_only_key, writes=TICKS)],
    "bad cursor": lambda s: [Stream("after=nonsense")],
    "bad Last-Event-ID": lambda s: [Stream(headers={"Last-Event-ID": "1-x"})],
    "Last-Event-ID twice": lambda s: [
        Stream(headers={"Last-Event-ID": "0-0"}, repeated=((b"last-event-id", b"0-0"),), writes=TICKS)
    ],
    "unknown run": lambda s: [Stream(f"runId={UNKNOWN}")],
    "malformed run": lambda s: [Stream("runId=nonsense")],
    "foreign run": lambda s: [Stream(f"runId={s.base.foreign_run_id}")],
    "an unknown parameter": lambda s: [Stream("bogus=1")],
    "bound key (declined)": lambda s: [Stream(key=s.base.bound_key, writes=TICKS)],
    "uncached key (declined)": lambda s: [Stream(key=s.uncached_key, writes=TICKS)],
    "Accept text/html (declined)": lambda s: [Stream(headers={"Accept": "text/html"})],
    "no key": lambda s: [Stream(anonymous=True)],
    "a key without the read permission": lambda s: [Stream(key=_no_read_key(s))],
}
SERVED_BY_HOT = {
    "new events only": 1,
    "new events of some types": 1,
    "new events, any Accept": 1,
    "Last-Event-ID": 1,
    "Last-Event-ID wins over after": 1,
    "after": 1,
    "after, some types": 1,
    "a run's events": 1,
    "a run not cached": 1,  # read in one thread hop
    "a foreign project's events not shown": 1,
    "the foreign project's key": 1,
    "a read-only key": 1,
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_hot_event_stream_streams_what_drf_streams(api_process, case):  # noqa: F811
    hot_answers, hot_served = streamed(api_process, True, CASES[case])
    drf_answers, drf_served = streamed(api_process, False, CASES[case])
    assert hot_answers == drf_answers
    assert drf_served == 0
    assert hot_served == SERVED_BY_HOT.get(case, 0), "the hot path did not answer what it serves"
    for status, body, headers in hot_answers:
        if status == 200:
            assert ("content-type", b"text/event-stream") in headers
            assert body.startswith(b"retry: 1000\n\n")


def test_streams_show_only_what_they_should(api_process):  # noqa: F811
    """The filters hold on the hot path itself: types, and no other project's events."""
    [(_, typed, _)], _ = streamed(api_process, True, CASES["new events of some types"])
    assert re.findall(rb"event: ([\w.]+)", typed) == [TICK.encode()] * 3
    [(_, own, _)], _ = streamed(api_process, True, CASES["a foreign project's events not shown"])
    assert [json.loads(line)["data"]["n"] for line in re.findall(rb"data: (.*)", own)] == [0, 1, 2]


def test_rate_limited_streams_are_answered_alike(api_process):  # noqa: F811
    api_process.RUNSTATE_RATE_LIMIT = "2/min"

    def build(s):
        return [Stream(), Stream(), Stream()]

    hot_answers, hot_served = streamed(api_process, True, build)
    drf_answers, _ = streamed(api_process, False, build)
    assert [status for status, _, _ in hot_answers] == [200, 200, 429]
    assert hot_answers == drf_answers
    assert hot_served == 2


def _held_open_then_another(settings, hot_on: bool) -> tuple:
    """With one stream held open by a key, open a second of the same key (``RUNSTATE_MAX_WAITS_PER_KEY`` = 1)."""
    settings.RUNSTATE_HOT_PATH = hot_on
    caches_on(settings)
    state = settled_wait_state()
    key_id = _key_id(state.base.key)

    async def run():
        await (await hot_db.pool()).wait(timeout=30)
        try:
            first, gone, sent = asgi_request("/v1/events/stream", "", state.base.key)
            await until(lambda: b"retry:" in _body(sent), what="the first stream started")
            second = await _stream_once(state, Stream(), "m")
            gone.set()
            await asyncio.wait_for(first, 30)
            return second
        finally:
            await hot_db.close()

    answer = asyncio.run(run())
    assert waits.waits_held(api_key_id=key_id) == 0
    return _hidden(normalized([answer]))[0]


def test_the_waits_cap_is_the_views(api_process):  # noqa: F811
    api_process.RUNSTATE_MAX_WAITS_PER_KEY = 1
    hot_answer, drf_answer = _held_open_then_another(api_process, True), _held_open_then_another(api_process, False)
    assert hot_answer == drf_answer
    assert hot_answer[0] == 429
    assert json.loads(hot_answer[1])["error"]["code"] == "RATE_LIMITED"


@pytest.mark.parametrize("when", ["while streaming", "before the first frame is taken"])
def test_a_hot_stream_whose_client_leaves_gives_its_place_back_and_leaves_the_feed(api_process, when):  # noqa: F811
    state = settled_wait_state()
    api_key_id = _key_id(state.base.key)
    served = hot.SERVED["EventStream"]

    async def run():
        await (await hot_db.pool()).wait(timeout=30)
        taken = asyncio.Event()

        async def slowly(message):
            if when != "while streaming" and message.get("body", b"").startswith(b"retry:"):
                await taken.wait()  # a reader that takes nothing: the client leaves meanwhile

        try:
            app, gone, sent = asgi_request("/v1/events/stream", "", state.base.key, send=slowly)
            await until(lambda: b"retry:" in _body(sent), what="the stream started")
            held, feed = waits.waits_held(api_key_id=api_key_id), sse.event_feed()
            streams = None if feed is None else len(feed.streams)
            if when == "while streaming":
                await longpoll.db(_write, state, TICKS, "m")
                await until(lambda: b'"last":true' in _body(sent), what="the events streamed")
            gone.set()
            await asyncio.wait_for(app, 30)
            return held, streams, sse.event_feed(), sent
        finally:
            await hot_db.close()

    held, streams, feed_after, sent = asyncio.run(run())
    assert (held, streams) == (1, 1)
    assert hot.SERVED["EventStream"] == served + 1
    assert waits.waits_held(api_key_id=api_key_id) == 0
    assert feed_after is None  # its last stream left: the feed stopped
    assert not _complete(sent)  # ended by the client, not answered to the end


@STREAM_FRAMES
def test_a_hot_stream_whose_reader_stops_taking_at_any_frame_is_dropped(api_process, frame):  # noqa: F811
    """The view's case in ``tests/concurrency/test_coalesced_waits.py``, answered by the hot path."""
    api_process.RUNSTATE_SSE_HEARTBEAT_S = 0.05
    api_process.RUNSTATE_SSE_STALL_S = 0.2
    state = settled_wait_state()
    api_key_id = _key_id(state.base.key)
    served = hot.SERVED["EventStream"]

    async def run():
        await (await hot_db.pool()).wait(timeout=30)
        try:
            return await stream_held_on(frame, state.base.key)
        finally:
            await hot_db.close()

    dropped, feed_after = asyncio.run(run())
    assert hot.SERVED["EventStream"] == served + 1
    assert dropped == 1
    assert feed_after is None
    assert waits.waits_held(api_key_id=api_key_id) == 0  # its place given back
