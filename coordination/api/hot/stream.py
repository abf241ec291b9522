"""The event stream the hot path serves: ``GET /v1/events/stream`` (Server-Sent Events).

What its view (``EventStreamView``) does before the stream starts, on the event loop: the
query checked by its serializer's fields, ``Last-Event-ID`` (else ``?after=``) parsed, the
run found in the process cache (a run not seen before: one thread hop, which caches it), a
place among the key's waits (``waits.wait_take``, held until the stream ends however it
ends), and, for "new events only", the head of the log read in one statement on the hot
pool (``selectors.event_head_query``). Then the frames come from the process's shared feed
(``views.stream.stream_frames``: each event rendered once for every stream of the process,
the view's streams and the hot path's alike), and the router writes each piece straight to
the ASGI ``send`` (``HotRouter``).

Declined to the view, before anything is counted: a malformed cursor or ``Last-Event-ID``
sent twice (its ``400``), a run
id that is malformed or, cached, not the caller's (its ``404``). A run the thread hop does
not find, or no pooled connection for the head, leaves the request, counted already, to the
view (its ``404``; its read).
"""

from coordination.api import waits
from coordination.api.hot import db
from coordination.api.hot.endpoints import Call, Endpoint
from coordination.api.sse import event_stream_response, releasing
from coordination.api.views import stream
from coordination.domain import exceptions
from coordination.reads import selectors


class EventStream(Endpoint):
    """``GET /v1/events/stream``: the checks before the stream, a place among the key's waits, the frames."""

    view, serializer = stream.EventStreamView, stream.EventStreamQuery
    method = "GET"
    waits = True  # its query is validated, and the client going away ends it
    media = Endpoint.media | {b"text/event-stream"}

    def accepts(self, call: Call) -> bool:  # noqa: D102 - a malformed cursor, a run it cannot show: the view
        sent = [value for name, value in call.scope["headers"] if name.lower() == b"last-event-id"]
        if len(sent) > 1:  # the view reads them joined by commas (a malformed cursor)
            return False
        last_event_id = sent[0].decode("latin-1") if sent else None
        after = stream.stream_after(last_event_id, call.data)
        run_id = call.data.get("runId")
        try:
            if after is not None:
                selectors.event_cursor_parse(after)
            run = None if run_id is None else selectors.run_ref(call.visibility, run_id, cached_only=True)
        except exceptions.CoordinationError:
            return False
        call.target = (after, run)
        return True

    async def answer(self, call, hop):  # noqa: D102
        after, run = call.target
        run_id = call.data.get("runId")
        place = waits.wait_take(api_key_id=call.api_key.id)
        streaming = False
        try:
            if run_id is not None and run is None:  # a run this process has not seen: read (and cache) it
                try:
                    run = await hop(selectors.run_ref, call.visibility, run_id)
                except exceptions.NotFound:
                    return None
            if after is None:
                statement, params = selectors.event_head_query(call.project_id).query.sql_with_params()
                after = selectors.event_head_cursor(await db.fetch(statement, params))
            frames = stream.stream_frames(
                call.visibility, call.data, cursor=after, run_path=None if run is None else run.path
            )
            frames = releasing(frames, place.release)
            streaming = True
        finally:
            if not streaming:  # refused, or left to the view (which takes a place of its own)
                place.release()
        return event_stream_response(frames)  # the router writes its ``frames`` to ``send`` itself


ENDPOINTS: dict[type, Endpoint] = {EventStream.view: EventStream()}
