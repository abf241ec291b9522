"""``/v1/claims/watch``: what stops a worker's claims, pushed to it as Server-Sent Events."""

from rest_framework import serializers

from coordination.api.longpoll import in_request, park
from coordination.api.serializers import EventCursorField
from coordination.api.sse import BATCH, HELD_CLAIMS, feed_frames, frame
from coordination.api.views.stream import StreamView, present, present_bound, stream_after, stream_schema
from coordination.domain.states import Permission
from coordination.reads import selectors

# The first frame of every watch: its ``id`` is the cursor the watch starts after, so a client
# that received nothing else still resumes from there (and misses nothing in between).
READY = "watch.ready"

WATCH_DESCRIPTION = f"""\
Server-Sent Events naming the claims of one worker that something other than the worker
itself stopped: a task cancel (`task.cancellation_requested`), a run or group end
(`task.cancelled`, `task.expired`), a lease that ran out (`task.requeued`, `task.failed`,
`task.cancelled` after a cancel's grace). Each frame is one event, its `data` naming the claim
(`claimId`) and the worker (`heldBy`: the `workerId` the claim was taken with):

```
id: <event id>
event: task.cancelled
data: <the event as JSON, as in GET /v1/events; its "data" holds "claimId" and "heldBy">
```

One watch per worker process is enough, whatever its number of claims. It opens with a frame
`event: {READY}` whose `id` is the cursor it starts after (`Last-Event-ID`, else `?after=`,
else now): a client that reconnects with the last id it received (that one included) is sent
every event it missed. A claim taken without a `workerId` is never named; renewal reports a
cancel as before, the fallback when the watch is down. A watch is a wait: it counts towards
`RUNSTATE_MAX_WAITS_PER_KEY` (429 `RATE_LIMITED` past it). Comments (`: keepalive`) come
after 15 s without events; a reader too slow to keep up is dropped, as on
`/v1/events/stream`. Needs `coordination_write` (the permission claims need).
"""


class ClaimWatchQuery(serializers.Serializer):
    """Query of ``GET /v1/claims/watch``."""

    workerId = serializers.CharField(max_length=200)
    after = EventCursorField(required=False, allow_blank=True, max_length=100)


class ClaimWatchView(StreamView):
    """Push to a worker what stops its claims, resumable with ``Last-Event-ID``."""

    required_permissions = {"GET": Permission.COORDINATION_WRITE}
    query_class = ClaimWatchQuery

    @stream_schema(operation_id="claims_watch", description=WATCH_DESCRIPTION, query=ClaimWatchQuery)
    async def get(self, request):
        """Stream the events stopping ``workerId``'s claims after ``Last-Event-ID`` / ``after`` (else now)."""
        return await self.stream(request)

    async def frames(self, request, query, visibility):
        """Return the watch's frames: check the cursor now, stream from the claim watches' feed."""
        after = stream_after(request.headers.get("Last-Event-ID"), query)

        def start() -> str:
            # A malformed cursor is refused now, with a JSON error, not inside the stream.
            if after is not None:
                selectors.event_cursor_parse(after)
                return after
            return selectors.event_head(visibility)

        cursor = await in_request(start)
        await park()
        return watch_frames(visibility, query["workerId"], cursor)


def watch_frames(visibility, worker_id: str, cursor: str):
    """Return the frames of a watch checked already (``cursor`` well formed), from the claim watches' shared feed."""
    project_id, bound_path = visibility.project_id, visibility.bound_path

    def catch_up(after_cursor: str):
        return selectors.held_event_list(visibility, worker_id=worker_id, after=after_cursor, limit=BATCH)

    def matches(event) -> bool:
        # What held_event_list selects, for the events of the shared feed.
        return (
            event.project_id == project_id
            and event.data.get("heldBy") == worker_id
            and (bound_path is None or event.run_path.startswith(bound_path))
        )

    ready = frame(event_id=cursor, event_type=READY, data={"workerId": worker_id, "after": cursor})
    return feed_frames(
        project_id=project_id,
        after=cursor,
        catch_up=catch_up,
        matches=matches,
        present=present if bound_path is None else present_bound,
        kind=HELD_CLAIMS,
        preamble=ready,
    )
