"""The base of every API view."""

from adrf.views import APIView as AsyncAPIView
from django.http import HttpResponse
from drf_spectacular.utils import OpenApiResponse
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response
from rest_framework.views import APIView

from coordination.api import longpoll, waits
from coordination.api.bodies import plain_body
from coordination.api.serializers import ErrorOut
from coordination.plumbing import metrics
from coordination.plumbing.tracing import TraceContext, request_trace
from coordination.reads.selectors import Visibility

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
        """Return the W3C trace context the request's work continues (``tracing.request_trace``)."""
        meta = self.request.META
        scope = getattr(self.request._request, "scope", None)  # ASGI; a WSGI request has none
        return request_trace(scope, meta.get("HTTP_TRACEPARENT"), meta.get("HTTP_TRACESTATE"))

    def query(self, serializer_class) -> dict:
        """Validate the query string with ``serializer_class`` and return the validated data.

        An empty value (``?runId=``) is validated like any other: given the ``QueryDict``
        itself, DRF would treat it as an omitted form field and silently drop the filter.
        """
        serializer = serializer_class(data=self.request.query_params.dict())
        serializer.is_valid(raise_exception=True)
        return serializer.validated_data


class SharedAnswerResponse(HttpResponse):
    """A wait's answer, rendered once (``AsyncApiView.shared_answer``) and sent to each of its waiters.

    A plain ``HttpResponse`` holding the rendered bytes: Django renders a DRF ``Response`` in
    a thread hop per request, this one has nothing left to render. When its request parked
    (``longpoll.parked()``: its connection closed, its thread given back), nothing of it is
    left on a thread, and ``close_on_loop`` lets the API's ASGI handler finish it (``close``:
    the request-finished signal) on the event loop, without a hop either.
    """

    close_on_loop = False


def shared_response(
    answer: longpoll.Answer, *, wait: str, status: int, renderer: JSONRenderer, media_type: str, context: dict
) -> SharedAnswerResponse:
    """Return ``answer`` as a ``SharedAnswerResponse``: rendered by ``renderer`` the first time, its bytes after.

    The rendering is kept on ``answer`` by renderer class, media type and status, so the
    waits' views and the hot path (``coordination/api/hot/waits.py``) answered by the same
    read send the same bytes, rendered once (``runstate_wait_answers_rendered_total``).
    """

    def render() -> tuple[str | None, bytes]:
        response = Response(answer.data, status=status)
        response.accepted_renderer, response.accepted_media_type = renderer, media_type
        response.renderer_context = context
        content = response.rendered_content
        metrics.WAIT_ANSWERS_RENDERED.labels(wait).inc()
        return response.get("Content-Type"), content

    content_type, content = answer.rendered((type(renderer), media_type, status), render)
    response = SharedAnswerResponse(content, status=status)
    if content_type is None:
        del response["Content-Type"]
    else:
        response["Content-Type"] = content_type
    return response


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

    def shared_answer(self, answer: longpoll.Answer, *, wait: str, status: int = 200) -> HttpResponse:
        """Answer with ``answer``'s body, rendered once for every request that answers with it.

        The rendering is DRF's own (the ``Response`` this view would return, rendered by the
        negotiated renderer), kept on ``answer`` by renderer, media type and status: the
        waiters a read answers get the same bytes and ``Content-Type``, and each then goes
        through ``finalize_response`` and the middleware like any answer (``Allow``, the
        request id, the security headers). A renderer other than JSON renders per request.
        """
        request = self.request
        renderer, media_type = request.accepted_renderer, request.accepted_media_type
        if type(renderer) is not JSONRenderer:
            return Response(answer.data, status=status)
        context = self.get_renderer_context()
        response = shared_response(
            answer, wait=wait, status=status, renderer=renderer, media_type=media_type, context=context
        )
        response.close_on_loop = longpoll.parked()
        return response

    def hand_over_wait(self) -> waits.Place:
        """Take a place for a wait that outlives the view (a stream): whoever ends the wait releases it."""
        return waits.wait_take(api_key_id=self.request.user.api_key.id)
