"""The base of every API view."""

from adrf.views import APIView as AsyncAPIView
from drf_spectacular.utils import OpenApiResponse
from rest_framework.views import APIView

from coordination.api import waits
from coordination.api.bodies import plain_body
from coordination.api.serializers import ErrorOut
from coordination.selectors import Visibility
from coordination.tracing import TraceContext

ERRORS = {
    status: OpenApiResponse(ErrorOut, description=description)
    for status, description in [
        (400, "VALIDATION_ERROR"),
        (401, "UNAUTHENTICATED"),
        (403, "PERMISSION_DENIED"),
        (404, "NOT_FOUND"),
        (409, "A conflict code (see DESIGN.md)"),
    ]
}


def with_errors(responses: dict) -> dict:
    """Add the error envelope responses to an operation's documented responses."""
    return {**responses, **ERRORS}


class ApiView(APIView):
    """An authenticated, project-scoped API view."""

    required_permissions: dict = {}
    # Methods that reach the whole project, refused to a key bound to a run (HasKeyPermission).
    project_wide: frozenset[str] = frozenset()

    @property
    def visibility(self) -> Visibility:
        """Return what the caller's key can see."""
        return self.request.user.visibility

    @property
    def project_id(self):
        """Return the caller's project id."""
        return self.request.user.api_key.project_id

    def body(self, serializer_class) -> dict:
        """Validate the JSON body with ``serializer_class`` and return the validated data.

        A plain body is checked by the serializer's fields without building the serializer
        (``coordination.api.bodies``); anything else gets the serializer and its exact errors.
        """
        data = plain_body(serializer_class, self.request.data)
        if data is not None:
            return data
        serializer = serializer_class(data=self.request.data)
        serializer.is_valid(raise_exception=True)
        return serializer.validated_data

    def caller_trace(self) -> TraceContext:
        """Return the W3C trace context of the request's ``traceparent``/``tracestate`` headers (none if invalid)."""
        meta = self.request.META
        traceparent = meta.get("HTTP_TRACEPARENT")
        if traceparent is None:
            return TraceContext()
        return TraceContext.from_headers(traceparent, meta.get("HTTP_TRACESTATE"))

    def query(self, serializer_class) -> dict:
        """Validate the query string with ``serializer_class`` and return the validated data.

        An empty value (``?runId=``) is validated like any other: given the ``QueryDict``
        itself, DRF would treat it as an omitted form field and silently drop the filter.
        """
        serializer = serializer_class(data=self.request.query_params.dict())
        serializer.is_valid(raise_exception=True)
        return serializer.validated_data


class AsyncApiView(AsyncAPIView, ApiView):
    """An API view whose handlers are ``async def`` (long-polls).

    Authentication and permission checks run before the handler (in a thread); the handler
    then calls services through ``coordination.api.longpoll.db``, which returns the
    connection after each call, so a waiting request holds no database connection.

    A handler that waits calls ``hold_wait`` first, before it changes anything: the wait
    counts against its key's ``RUNSTATE_MAX_WAITS_PER_KEY`` (``coordination/api/waits.py``)
    until the view returns, however it returns.
    """

    _wait: waits.Place | None = None

    async def async_dispatch(self, request, *args, **kwargs):  # noqa: D102 - see the class
        try:
            return await super().async_dispatch(request, *args, **kwargs)
        finally:  # an answer, an error, or the client gone (the task cancelled)
            if self._wait is not None:
                self._wait.release()

    def hold_wait(self, wait_ms: int) -> None:
        """Count this request against its key's waits if it may wait (``wait_ms`` above 0).

        ``RATE_LIMITED`` beyond the cap.
        """
        if wait_ms > 0 and self._wait is None:
            self._wait = waits.wait_take(api_key_id=self.request.user.api_key.id)

    def hand_over_wait(self) -> waits.Place:
        """Take a place for a wait that outlives the view (a stream): whoever ends the wait releases it."""
        return waits.wait_take(api_key_id=self.request.user.api_key.id)
