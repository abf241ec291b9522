"""Server-Sent Events that hold no database connection between notifications.

A stream subscribes to every event (``ANY_TOPIC``) before its first read, so a commit
between a read and the wait still wakes it; each read borrows a connection only for its own
duration (``longpoll.db``). Like the long-polls it also re-reads at least every
``RECHECK_S`` (events of a transaction that committed while an older one was still running
only become readable once that one ends), and on SQLite, which has no NOTIFY, it polls.
"""

import asyncio
import json
import logging
import uuid
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
from django.http import StreamingHttpResponse

from coordination.api import draining
from coordination.api.longpoll import db, shared_db
from coordination.models import Event
from coordination.plumbing.notify import (
    ANY_TOPIC,
    CHASE_EVERY_S,
    CHASE_FOR_S,
    HELD_TOPIC,
    RECHECK_S,
    SQLITE_POLL_S,
    hub,
)
from coordination.reads import selectors

# Events read per database round trip; a full batch is followed by the next one at once.
BATCH = 500
# Frames are sent in pieces of about this many bytes: a reader's stall is measured per piece.
CHUNK_BYTES = 64 * 1024
# The last frame of a stream dropped for falling behind (no id: the client resumes after its last event).
DROPPED = "stream.dropped"
# How long a client waits before reconnecting after the connection drops (the SSE "retry").
RECONNECT_MS = 1000

logger = logging.getLogger(__name__)

ReadAfter = Callable[[str], tuple[list[Event], str]]
# A feed's read: the events of some projects after a position, oldest first, at most ``limit``.
FeedRead = Callable[[tuple[int, int], int, list[uuid.UUID]], list[Event]]


@dataclass(frozen=True)
class FeedKind:
    """Which events a feed reads (``read``) and which notifications wake it (``topic``)."""

    read: FeedRead
    topic: str


# The event streams' feed: every event, woken by every notification.
EVENTS = FeedKind(selectors.event_feed, ANY_TOPIC)
# The claim watches' feed: the events that name a held claim, woken by those alone (a drain's
# claims and completions never make it read).
HELD_CLAIMS = FeedKind(selectors.held_event_feed, HELD_TOPIC)


def frame(*, event_id: str | None, event_type: str, data: object) -> bytes:
    """Return one SSE frame: ``id``, ``event`` and one ``data`` line of JSON."""
    lines = [] if event_id is None else [f"id: {event_id}"]
    lines += [f"event: {event_type}", f"data: {json.dumps(data, cls=DjangoJSONEncoder, separators=(',', ':'))}"]
    return ("\n".join(lines) + "\n\n").encode()


def heartbeat_s() -> float:
    """Return the interval of heartbeat comments (``RUNSTATE_SSE_HEARTBEAT_S``, 15 s)."""
    return float(getattr(settings, "RUNSTATE_SSE_HEARTBEAT_S", 15.0))


class Keepalive:
    """When a stream is due its keepalive comment: after ``heartbeat_s()`` without a frame.

    The one definition for every stream (the API's ``feed_frames`` and the dashboard's
    ``event_frames``): call ``sent()`` after each frame, wait at most ``due_in_s()``, and
    send ``comment()`` once that is not positive.
    """

    # A comment line: keeps proxies and clients from timing a quiet stream out.
    COMMENT = b": keepalive\n\n"

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._every_s = heartbeat_s()
        self._quiet_since = self._loop.time()

    def sent(self) -> None:
        """Note that a frame was just sent: the stream is not quiet."""
        self._quiet_since = self._loop.time()

    def due_in_s(self) -> float:
        """Return the seconds until the comment is due (zero or less: due now)."""
        return self._every_s - (self._loop.time() - self._quiet_since)

    def comment(self) -> bytes:
        """Return the comment to send now, counting it as a frame sent."""
        self.sent()
        return self.COMMENT


async def event_frames(
    read: ReadAfter, *, after: str, present: Callable[[Event], tuple[str | None, str, object]]
) -> AsyncIterator[bytes]:
    """Yield a frame for every event after ``after``, forever, with heartbeat comments.

    ``read(cursor)`` returns the next events and the cursor after them; ``present(event)``
    returns the frame's id, event name and data. The stream ends when the client goes away
    (the ASGI server cancels the iteration; the ``finally`` unsubscribes).
    """
    waiter = hub.subscribe([ANY_TOPIC])
    try:
        await hub.ready()
        yield f"retry: {RECONNECT_MS}\n\n".encode()
        cursor = after
        keepalive = Keepalive()
        while True:
            events, cursor = await db(read, cursor)
            for event in events:
                event_id, event_type, data = present(event)
                yield frame(event_id=event_id, event_type=event_type, data=data)
            if events:
                keepalive.sent()
                if len(events) >= BATCH:
                    continue
            if draining.draining():
                return  # the process is stopping: the client reconnects with its last event's id
            remaining = keepalive.due_in_s()
            if remaining <= 0:
                yield keepalive.comment()
                continue
            if hub.enabled():
                await waiter.wait(min(remaining, RECHECK_S))
            else:
                await asyncio.sleep(min(remaining, SQLITE_POLL_S))
    finally:
        hub.unsubscribe(waiter)


def releasing(frames: AsyncIterator[bytes], release: Callable[[], None]) -> AsyncIterator[bytes]:
    """Return ``frames``, calling ``release`` once when the stream ends, however it ends.

    Also when it never starts (the client gone before the first frame): then when it is
    garbage collected.
    """

    async def stream() -> AsyncIterator[bytes]:
        try:
            async for piece in frames:
                yield piece
        finally:
            try:
                await frames.aclose()
            finally:
                release()

    wrapped = stream()
    weakref.finalize(wrapped, release)
    return wrapped


def event_stream_response(frames: AsyncIterator[bytes]) -> StreamingHttpResponse:
    """Wrap ``frames`` in an uncached ``text/event-stream`` response; ``response.frames`` are ``frames``.

    Whoever sends the response closes ``frames`` once sending ends, however it ends (the
    hot router, ``runstate_project.asgi``): Django closes only its own wrappers, so a stream
    cancelled while it stood on a frame would keep its place and its feed until collected.
    """
    response = StreamingHttpResponse(frames, content_type="text/event-stream")
    response.frames = frames
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # nginx: pass frames on as they come
    return response


# The shared feed ---------------------------------------------------------------------------


def feed_buffer() -> int:
    """Return how many recent events the feed keeps for its streams (``RUNSTATE_SSE_BUFFER``)."""
    return int(getattr(settings, "RUNSTATE_SSE_BUFFER", 10_000))


def stall_s() -> float:
    """Return how long a stream may stall on a reader that takes nothing (``RUNSTATE_SSE_STALL_S``)."""
    return float(getattr(settings, "RUNSTATE_SSE_STALL_S", 10.0))


Position = tuple[int, int]  # an event's (txid, id): the order of the event log


class _Entry:
    """One event in the feed, rendered at most once per presenter."""

    __slots__ = ("event", "position", "rendered")

    def __init__(self, event: Event) -> None:
        self.event = event
        self.position: Position = (event.txid, event.id)
        self.rendered: dict[Callable, bytes] = {}

    def frame(self, present: Callable[[Event], tuple[str | None, str, object]]) -> bytes:
        rendered = self.rendered.get(present)
        if rendered is None:
            event_id, event_type, data = present(self.event)
            rendered = self.rendered[present] = frame(event_id=event_id, event_type=event_type, data=data)
        return rendered


class _Stream:
    """What the feed knows of one stream: where it is, and since when it waits for its reader to take a frame."""

    __slots__ = ("_clock", "position", "served", "stalled_since", "task")

    def __init__(self, position: Position) -> None:
        self.position = position
        self.served = False  # once taken from the buffer, it must keep up with it
        self.stalled_since: float | None = None
        self.task = asyncio.current_task()
        self._clock = asyncio.get_running_loop().time

    def offering(self) -> "_Stream":
        """Return a context in which the time until the reader takes the frame yielded is a stall.

        Every frame, not only an event's: a stream stands on a keepalive as long as on an
        event when its reader's socket is full. (A context of its own, not a generator's:
        it is entered for every frame of every stream.)
        """
        return self

    def __enter__(self) -> None:
        self.stalled_since = self._clock()

    def __exit__(self, *exc_info) -> None:
        self.stalled_since = None


class EventFeed:
    """The events of the projects streamed, read once per batch of notifications for every stream of a process.

    ``kind`` says which events and which notifications: every event on every notification
    (``EVENTS``, the event streams'), or those naming a held claim on the notifications that
    carry one (``HELD_CLAIMS``, the claim watches'; after such a notification it re-reads
    every ``CHASE_EVERY_S`` until it finds something, for ``CHASE_FOR_S`` at most); a process
    has one feed per kind. Either way it re-reads every ``RECHECK_S`` too.

    It keeps the last ``feed_buffer()`` events: every event after ``start`` up to ``cursor``
    (both positions), in order. Events at or before a position the feed has read past are
    final (see ``selectors.event_list``), so a stream at a position the buffer covers takes
    the rest from the buffer; one further behind (resuming with an old ``Last-Event-ID``,
    or fallen behind) reads from the database on its own until it is covered. A stream
    whose reader takes nothing of a frame for ``stall_s()`` is dropped: its request is
    cancelled and the connection closed. A stream that was served from the buffer and fell
    out of it (its reader was slow) ends with a ``stream.dropped`` frame. Either way the
    client resumes with ``Last-Event-ID``, and other streams never wait for it.
    """

    def __init__(self, project_id: uuid.UUID, kind: FeedKind) -> None:
        self.first_project = project_id
        self.kind = kind
        # The projects read, each from the position the feed had when its first stream came.
        self.projects: dict[uuid.UUID, Position] = {project_id: (0, 0)}
        self.entries: deque[_Entry] = deque()
        self.start: Position = (0, 0)
        self.cursor: Position = (0, 0)
        self.started = asyncio.Event()
        self.streams: set[_Stream] = set()
        self.reads = 0
        self.dropped = 0
        loop = asyncio.get_running_loop()
        self.next: asyncio.Future = loop.create_future()
        self.subscription = hub.subscribe([kind.topic])
        self.task = loop.create_task(self._run(), name="runstate-event-feed")

    def covers(self, position: Position, project_id: uuid.UUID) -> bool:
        """Tell whether every event of the project after ``position`` is in the buffer (once started)."""
        return self.started.is_set() and position >= self.start and position >= self.projects[project_id]

    def add_project(self, project_id: uuid.UUID) -> None:
        """Read the project's events too, from the feed's position on."""
        if project_id not in self.projects:
            self.projects[project_id] = self.cursor if self.started.is_set() else (0, 0)

    def since(self, position: Position) -> list[_Entry]:
        """Return the buffered entries after ``position`` (which the buffer covers)."""
        entries = self.entries
        if not entries or entries[-1].position <= position:
            return []
        # Binary search on the deque's positions (O(log n) index lookups into a deque of blocks).
        low, high = 0, len(entries)
        while low < high:
            middle = (low + high) // 2
            if entries[middle].position <= position:
                low = middle + 1
            else:
                high = middle
        return [entries[i] for i in range(low, len(entries))]

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        await hub.ready()
        limit, pause = BATCH, RECHECK_S if hub.enabled() else SQLITE_POLL_S
        while not self.started.is_set():
            try:
                self.cursor = self.start = await shared_db(selectors.event_feed_head, self.first_project)
                self.started.set()
            except Exception:  # noqa: BLE001 - the database is away: try again
                logger.warning("the event feed could not read the head; retrying", exc_info=True)
                await asyncio.sleep(pause)
        chase_until = 0.0
        while True:
            woken = False
            if hub.enabled():
                woken = await self.subscription.wait(CHASE_EVERY_S if loop.time() < chase_until else pause)
            else:
                await asyncio.sleep(pause)
            found = False
            try:
                while True:
                    events = await shared_db(self.kind.read, self.cursor, limit, list(self.projects))
                    self.reads += 1
                    if events:
                        found = True
                        self._append(events)
                        future, self.next = self.next, loop.create_future()
                        future.set_result(None)
                    if len(events) < limit:
                        break
            except Exception:  # noqa: BLE001 - the database is away: streams wait, the next wake-up retries
                logger.warning("the event feed could not read; retrying", exc_info=True)
            if self.kind.topic != ANY_TOPIC:
                if found:
                    chase_until = 0.0
                elif woken:
                    chase_until = loop.time() + CHASE_FOR_S
            self._drop_stalled(loop.time())

    def _append(self, events: list[Event]) -> None:
        entries, keep = self.entries, feed_buffer()
        entries.extend(_Entry(event) for event in events)
        self.cursor = entries[-1].position
        # Streams not (yet) stuck on their reader keep what they have yet to take (a burst
        # read in several batches while they were sending), up to 4 buffers' worth.
        stuck_since = asyncio.get_running_loop().time() - stall_s()
        floor = min(
            (s.position for s in self.streams if s.stalled_since is None or s.stalled_since > stuck_since),
            default=None,
        )
        while len(entries) > keep:
            if floor is not None and floor < entries[0].position and len(entries) <= 4 * keep:
                break
            self.start = entries.popleft().position

    def _drop_stalled(self, now: float) -> None:
        limit = stall_s()
        for stream in list(self.streams):
            stalled = stream.stalled_since
            if stalled is not None and now - stalled >= limit:
                logger.info("dropping an event stream whose reader took nothing for %.1f s", now - stalled)
                self.streams.discard(stream)
                self.dropped += 1
                if stream.task is not None:
                    stream.task.cancel()

    def drain(self) -> None:
        """Wake the streams now: the process is stopping (``draining``), they end."""
        future, self.next = self.next, asyncio.get_running_loop().create_future()
        future.set_result(None)

    async def wait_past(self, position: Position, timeout_s: float) -> bool:
        """Wait until the feed has read past ``position``, at most ``timeout_s``; tell whether it has."""
        if self.cursor > position:
            return True
        try:
            await asyncio.wait_for(asyncio.shield(self.next), max(timeout_s, 0))
        except TimeoutError:
            return self.cursor > position
        return True


def pieces(frames: list[bytes], size: int = CHUNK_BYTES) -> Iterator[bytes]:
    """Join ``frames`` into pieces of about ``size`` bytes (whole frames): one send each."""
    piece: list[bytes] = []
    length = 0
    for frame_bytes in frames:
        piece.append(frame_bytes)
        length += len(frame_bytes)
        if length >= size:
            yield b"".join(piece)
            piece, length = [], 0
    if piece:
        yield b"".join(piece)


# The feeds of each event loop, by their kind.
_feeds: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[FeedKind, EventFeed]] = weakref.WeakKeyDictionary()


def event_feed(kind: FeedKind = EVENTS) -> EventFeed | None:
    """Return the running loop's feed of ``kind`` (the event streams' by default), if a stream is open."""
    return _feeds.get(asyncio.get_running_loop(), {}).get(kind)


def feeds() -> list[tuple[asyncio.AbstractEventLoop, EventFeed]]:
    """Return every feed open, with its loop (the tests stop them)."""
    return [(loop, feed) for loop, by_read in list(_feeds.items()) for feed in list(by_read.values())]


def _drain_feeds() -> None:
    for feed in list(_feeds.get(asyncio.get_running_loop(), {}).values()):
        feed.drain()
    hub.wake_all()  # the waits of ``event_frames``


draining.on_drain(_drain_feeds)


def _feed_join(stream: _Stream, project_id: uuid.UUID, kind: FeedKind) -> EventFeed:
    by_kind = _feeds.setdefault(asyncio.get_running_loop(), {})
    feed = by_kind.get(kind)
    if feed is None:
        feed = by_kind[kind] = EventFeed(project_id, kind)
    feed.add_project(project_id)
    feed.streams.add(stream)
    return feed


def _feed_leave(feed: EventFeed, stream: _Stream) -> None:
    feed.streams.discard(stream)
    by_kind = _feeds.get(asyncio.get_running_loop(), {})
    if not feed.streams and by_kind.get(feed.kind) is feed:
        del by_kind[feed.kind]
        feed.task.cancel()
        hub.unsubscribe(feed.subscription)


async def feed_frames(
    *,
    project_id: uuid.UUID,
    after: str,
    catch_up: ReadAfter,
    matches: Callable[[Event], bool],
    present: Callable[[Event], tuple[str | None, str, object]],
    kind: FeedKind = EVENTS,
    preamble: bytes = b"",
) -> AsyncIterator[bytes]:
    """Yield the frames of the events after ``after`` that ``matches`` accepts, forever, from the shared feed.

    ``kind`` names the feed (see ``EventFeed``); ``matches`` must accept only events it reads.
    ``preamble`` (frames) is sent first, after the ``retry`` line.

    ``catch_up(cursor)`` reads this stream's next events from the database (as
    ``event_frames`` reads) while the feed does not cover its position; ``present`` must be
    a function of the module (not made per request), so that its frames are rendered once
    per event for every stream. Each wake-up sends what is new in one chunk.
    """
    stream = _Stream(selectors.event_position(after))
    feed = _feed_join(stream, project_id, kind)
    try:
        with stream.offering():
            yield f"retry: {RECONNECT_MS}\n\n".encode() + preamble
        await feed.started.wait()
        keepalive = Keepalive()
        while True:
            position = stream.position
            if stream.served and not feed.covers(position, project_id):
                # Fallen out of the buffer while its reader was slow: end the stream plainly.
                # The client reconnects with Last-Event-ID (the frame has no id) and catches up.
                with stream.offering():
                    yield frame(event_id=None, event_type=DROPPED, data={"reason": "slow_reader"})
                return
            if feed.covers(position, project_id):
                stream.served = True
                chunk = [entry.frame(present) for entry in feed.since(position) if matches(entry.event)]
                stream.position = max(position, feed.cursor)
                behind = False
            else:
                # Every event at or before the feed's cursor now is final before this read starts.
                read_past = feed.cursor
                events, cursor = await db(catch_up, f"{position[0]}-{position[1]}")
                chunk = [frame(event_id=i, event_type=t, data=d) for i, t, d in map(present, events)]
                behind = len(events) >= BATCH
                stream.position = selectors.event_position(cursor)
                if not behind:
                    stream.position = max(stream.position, read_past)
            if chunk:
                for piece in pieces(chunk):
                    with stream.offering():
                        yield piece
                keepalive.sent()
                continue
            if behind:
                continue
            if draining.draining():
                return  # the process is stopping: the client reconnects with its last event's id
            remaining = keepalive.due_in_s()
            if remaining <= 0:
                with stream.offering():
                    yield keepalive.comment()
                continue
            await feed.wait_past(stream.position, remaining)
    finally:
        _feed_leave(feed, stream)
