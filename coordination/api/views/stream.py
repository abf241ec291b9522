"""``/v1/events/stream``: the event log as Server-Sent Events."""

from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import serializers

from coordination.api.longpoll import in_request, park
from coordination.api.negotiation import FirstRenderer
from coordination.api.presenters import present_event
from coordination.api.serializers import EVENT_CURSOR, EventCursorField
from coordination.api.sse import BATCH, event_stream_response, feed_frames, releasing
from coordination.api.views.base import ERRORS, AsyncApiView
from coordination.domain.states import Permission
from coordination.reads import selectors

STREAM_DESCRIPTION = """\
Server-Sent Events, one frame per event, oldest first:

```
id: <event id>
event: <type>
data: <the event as JSON, as in GET /v1/events>
```

The stream starts after `Last-Event-ID` (the header a browser's EventSource sends when it
reconnects) or `?after=`, else with new events only. A reader that reconnects with the last
id it received misses nothing and sees nothing twice. A comment line (`: keepalive`) is sent
after 15 s without events. A reader too slow to keep up is dropped: its stream ends with a
frame `event: stream.dropped` (no id), or, if it takes nothing at all for a while, its
connection is closed; it reconnects with `Last-Event-ID` and misses nothing. Needs
`coordination_read`.
"""


# One event of the stream, as OpenAPI describes ``text/event-stream`` (3.2's ``itemSchema``;
# on 3.0 and 3.1 the ``schema`` is read as the schema of each event): the parsed fields of a
# frame. ``data`` is JSON text, the event as ``GET /v1/events`` lists it; the frame that
# ends a dropped stream has no ``id``.
SSE_EVENT_SCHEMA = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "id": {"type": "string", "description": "The event's cursor: resume after it with `Last-Event-ID`."},
        "event": {"type": "string", "description": "The event's type, or `stream.dropped`."},
        "data": {"type": "string", "description": "The event as JSON, as `GET /v1/events` lists it."},
        "retry": {"type": "integer", "minimum": 0},
    },
}


def stream_schema(*, operation_id: str, description: str, query: type[serializers.Serializer]):
    """Return the OpenAPI description of a Server-Sent Events operation: its query, ``Last-Event-ID``, its frames."""
    return extend_schema(
        operation_id=operation_id,
        description=description,
        parameters=[
            query,
            OpenApiParameter(
                "Last-Event-ID",
                # An empty header is no header: the stream starts after ``after``.
                {"type": "string", "pattern": f"^(?:{EVENT_CURSOR})?$"},
                OpenApiParameter.HEADER,
                description="Resume after this event id (wins over `after`).",
            ),
        ],
        responses={
            (200, "text/event-stream"): OpenApiResponse(
                SSE_EVENT_SCHEMA, description="An endless stream of `id`/`event`/`data` frames."
            ),
            **ERRORS,
        },
    )


class EventStreamQuery(serializers.Serializer):
    """Query of ``GET /v1/events/stream``."""

    after = EventCursorField(required=False, allow_blank=True, max_length=100)
    types = serializers.CharField(required=False, allow_blank=True, max_length=2000)
    runId = serializers.CharField(required=False, max_length=100)


class StreamView(AsyncApiView):
    """A view answering Server-Sent Events: ``frames`` makes the stream once its query (``query_class``) is checked."""

    # The stream answers text/event-stream itself; refusals before it starts are the JSON
    # envelope (the first renderer) even for a client accepting only text/event-stream.
    content_negotiation_class = FirstRenderer
    query_class: type[serializers.Serializer]

    async def stream(self, request):
        """Check the query, take a place among the key's waits, and answer the frames."""
        query = self.query(self.query_class)
        visibility = self.visibility
        # The stream outlives this view: the place is given back when the stream ends.
        place = self.hand_over_wait()
        try:
            frames = await self.frames(request, query, visibility)
        except BaseException:
            place.release()
            raise
        return event_stream_response(releasing(frames, place.release))

    async def frames(self, request, query: dict, visibility):
        """Return the stream's frames (an async iterator of bytes); refuse bad input before it starts."""
        raise NotImplementedError


class EventStreamView(StreamView):
    """Stream events as they commit, resumable with ``Last-Event-ID``."""

    required_permissions = {"GET": Permission.COORDINATION_READ}
    query_class = EventStreamQuery

    @stream_schema(operation_id="events_stream", description=STREAM_DESCRIPTION, query=EventStreamQuery)
    async def get(self, request):
        """Stream events after ``Last-Event-ID`` / ``after`` (else new ones), filtered by ``types`` and ``runId``."""
        return await self.stream(request)

    async def frames(self, request, query, visibility):
        """Return the stream's frames: check the cursor and the run now, stream from the shared feed."""
        after = stream_after(request.headers.get("Last-Event-ID"), query)
        run_id = query.get("runId")

        def start() -> tuple[str, str | None]:
            # Refuse a malformed cursor or an unknown run now, with a JSON error, rather
            # than inside the stream once its 200 is sent.
            run_path = selectors.run_get(visibility, run_id).path if run_id is not None else None
            if after is not None:
                selectors.event_cursor_parse(after)
                return after, run_path
            return selectors.event_head(visibility), run_path

        cursor, run_path = await in_request(start)
        # From here on the stream borrows a connection (and a thread) only for its own
        # catch-up reads.
        await park()
        return stream_frames(visibility, query, cursor=cursor, run_path=run_path)


def stream_after(last_event_id: str | None, query: dict) -> str | None:
    """Return the cursor a stream starts after: ``Last-Event-ID``, else ``?after=``, else None (new events only)."""
    return last_event_id or query.get("after") or None


def stream_frames(visibility, query: dict, *, cursor: str, run_path: str | None):
    """Return the frames of a stream checked already (``cursor`` well formed, the run visible), from the shared feed.

    The view and the hot path (``coordination/api/hot/stream.py``) both stream through here.
    """
    types = [t for t in (query.get("types") or "").split(",") if t]
    run_id = query.get("runId")

    def catch_up(after_cursor: str):
        return selectors.event_list(visibility, after=after_cursor, types=types, run_id=run_id, limit=BATCH)

    project_id, bound_path, wanted = visibility.project_id, visibility.bound_path, frozenset(types)

    def matches(event) -> bool:
        # What event_list selects, for the events of the shared feed.
        return (
            event.project_id == project_id
            and (not wanted or event.type in wanted)
            and (bound_path is None or event.run_path.startswith(bound_path))
            and (run_path is None or event.run_path.startswith(run_path))
        )

    return feed_frames(
        project_id=project_id,
        after=cursor,
        catch_up=catch_up,
        matches=matches,
        present=present if bound_path is None else present_bound,
    )


# Module functions, not made per request: the shared feed renders each event once per presenter
# for every stream (``sse.feed_frames``).


def present(event):
    """Return an event's frame: its cursor as the id, its type as the event name, its API shape as data."""
    body = present_event(event)
    return body["id"], event.type, body


def present_bound(event):
    """Return an event's frame as a key bound to a run may read it (``PROJECT_WIDE_EVENT_DATA`` left out)."""
    body = present_event(event, bound=True)
    return body["id"], event.type, body
