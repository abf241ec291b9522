"""``/v1/events``: the cursor-paged event log."""

from drf_spectacular.utils import extend_schema
from rest_framework.response import Response

from coordination import selectors
from coordination.api import serializers as s
from coordination.api.longpoll import long_poll
from coordination.api.presenters import present_event
from coordination.api.views.base import AsyncApiView, with_errors
from coordination.notify import ANY_TOPIC
from coordination.states import Permission


class EventListView(AsyncApiView):
    """Page through events with a cursor that never skips one."""

    required_permissions = {"GET": Permission.COORDINATION_READ}

    @extend_schema(
        operation_id="events_list", parameters=[s.EventListQuery], responses=with_errors({200: s.EventPageOut})
    )
    async def get(self, request):
        """Return events after ``after`` (oldest first), filtered by ``types`` and ``runId``.

        With ``waitMs`` (max 30 s) and nothing to return yet, wait for the next event.
        """
        query = self.query(s.EventListQuery)
        self.hold_wait(query["waitMs"])
        visibility = self.visibility

        def read():
            return selectors.event_list(
                visibility,
                after=query.get("after"),
                types=(query.get("types") or "").split(","),
                run_id=query.get("runId"),
                limit=query["limit"],
            )

        events, next_cursor = await long_poll(
            read, done=lambda page: bool(page[0]), topics=[ANY_TOPIC], timeout_ms=s.clamp_wait_ms(query["waitMs"])
        )
        bound = visibility.bound_path is not None
        return Response({"events": [present_event(e, bound=bound) for e in events], "nextCursor": next_cursor})
