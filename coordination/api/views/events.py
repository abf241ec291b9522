"""``/v1/events``: the cursor-paged event log."""

from drf_spectacular.utils import extend_schema
from rest_framework.response import Response

from coordination import selectors
from coordination.api import serializers as s
from coordination.api.presenters import present_event
from coordination.api.views.base import ApiView, with_errors
from coordination.states import Permission


class EventListView(ApiView):
    """Page through events with a cursor that never skips one."""

    required_permissions = {"GET": Permission.COORDINATION_READ}

    @extend_schema(
        operation_id="events_list", parameters=[s.EventListQuery], responses=with_errors({200: s.EventPageOut})
    )
    def get(self, request):
        """Return events after ``after`` (oldest first), filtered by ``types`` and ``runId``."""
        query = self.query(s.EventListQuery)
        events, next_cursor = selectors.event_list(
            self.visibility,
            after=query.get("after"),
            types=(query.get("types") or "").split(","),
            run_id=query.get("runId"),
            limit=query["limit"],
        )
        return Response({"events": [present_event(e) for e in events], "nextCursor": next_cursor})
