"""Server-Sent Events that hold no database connection between notifications.

A stream subscribes to every event (``ANY_TOPIC``) before its first read, so a commit
between a read and the wait still wakes it; each read borrows a connection only for its own
duration (``longpoll.db``). Like the long-polls it also re-reads at least every
``RECHECK_S`` (events of a transaction that committed while an older one was still running
only become readable once that one ends), and on SQLite, which has no NOTIFY, it polls.
"""

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
from django.http import StreamingHttpResponse

from coordination.api.longpoll import RECHECK_S, db
from coordination.models import Event
from coordination.notify import ANY_TOPIC, SQLITE_POLL_S, hub

# Events read per database round trip; a full batch is followed by the next one at once.
BATCH = 500
# How long a client waits before reconnecting after the connection drops (the SSE "retry").
RECONNECT_MS = 1000

ReadAfter = Callable[[str], tuple[list[Event], str]]


def frame(*, event_id: str | None, event_type: str, data: object) -> bytes:
    """Return one SSE frame: ``id``, ``event`` and one ``data`` line of JSON."""
    lines = [] if event_id is None else [f"id: {event_id}"]
    lines += [f"event: {event_type}", f"data: {json.dumps(data, cls=DjangoJSONEncoder, separators=(',', ':'))}"]
    return ("\n".join(lines) + "\n\n").encode()


def heartbeat_s() -> float:
    """Return the interval of heartbeat comments (``RUNSTATE_SSE_HEARTBEAT_S``, 15 s)."""
    return float(getattr(settings, "RUNSTATE_SSE_HEARTBEAT_S", 15.0))


async def event_frames(
    read: ReadAfter, *, after: str, present: Callable[[Event], tuple[str | None, str, object]]
) -> AsyncIterator[bytes]:
    """Yield a frame for every event after ``after``, forever, with heartbeat comments.

    ``read(cursor)`` returns the next events and the cursor after them; ``present(event)``
    returns the frame's id, event name and data. The stream ends when the client goes away
    (the ASGI server cancels the iteration; the ``finally`` unsubscribes).
    """
    loop = asyncio.get_running_loop()
    waiter = hub.subscribe([ANY_TOPIC])
    try:
        await hub.ready()
        yield f"retry: {RECONNECT_MS}\n\n".encode()
        cursor = after
        quiet_since = loop.time()
        beat = heartbeat_s()
        while True:
            events, cursor = await db(read, cursor)
            for event in events:
                event_id, event_type, data = present(event)
                yield frame(event_id=event_id, event_type=event_type, data=data)
            if events:
                quiet_since = loop.time()
                if len(events) >= BATCH:
                    continue
            remaining = beat - (loop.time() - quiet_since)
            if remaining <= 0:
                # A comment line: keeps proxies and clients from timing the stream out.
                yield b": keepalive\n\n"
                quiet_since = loop.time()
                continue
            if hub.enabled():
                await waiter.wait(min(remaining, RECHECK_S))
            else:
                await asyncio.sleep(min(remaining, SQLITE_POLL_S))
    finally:
        hub.unsubscribe(waiter)


def event_stream_response(frames: AsyncIterator[bytes]) -> StreamingHttpResponse:
    """Wrap ``frames`` in an uncached ``text/event-stream`` response."""
    response = StreamingHttpResponse(frames, content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # nginx: pass frames on as they come
    return response
