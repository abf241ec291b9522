"""``/v1/events``: the cursor-paged event log."""

from drf_spectacular.utils import extend_schema
from rest_framework.response import Response

from coordination.api import serializers as s
from coordination.api.longpoll import Watched, long_poll
from coordination.api.presenters import present_event
from coordination.api.views.base import AsyncApiView, with_errors
from coordination.domain.states import Permission
from coordination.plumbing.notify import ANY_TOPIC
from coordination.reads import selectors
from coordination.reads.selectors import Visibility


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
        page = await long_poll(
            **event_page_watched(visibility, query)._asdict(), timeout_ms=s.clamp_wait_ms(query["waitMs"])
        )
        return Response(present_page(visibility, *page))


def event_page_types(query: dict) -> list[str]:
    """Return the event types a page's query asks for (none: every type)."""
    return (query.get("types") or "").split(",")


def event_page_watched(visibility: Visibility, query: dict) -> Watched:
    """Return what a long-poll of the events watches (its view and the hot path): a page, until it has an event.

    Each waiter has its own watch (no share key): its page depends on its own cursor.
    """

    def read():
        return selectors.event_list(
            visibility,
            after=query.get("after"),
            types=event_page_types(query),
            run_id=query.get("runId"),
            limit=query["limit"],
        )

    return Watched(read, lambda page: bool(page[0]), [ANY_TOPIC], None)


def present_page(visibility: Visibility, events: list, next_cursor: str) -> dict:
    """Return the API shape of a page of events for a caller of ``visibility``."""
    bound = visibility.bound_path is not None
    return {"events": [present_event(e, bound=bound) for e in events], "nextCursor": next_cursor}
