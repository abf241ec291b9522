"""OpenTelemetry setup of the service's processes: API (ASGI, WSGI), Celery workers and beat.

One call, ``setup_tracing(role)``, from each entry point, before the process serves anything.
The provider comes from ``runstate._tracing.configure`` (the same rules as ``runstate worker``
and ``runstate mcp``): nothing is created unless the ``OTEL_*`` variables ask for an
exporter, and then the maintained instrumentations are switched on as well: Django (the
admin and dashboard requests), Celery (the wake-up messages) and psycopg (every statement).
The API's ``/v1`` requests, which run ``API_MIDDLEWARE`` rather than Django's ``MIDDLEWARE``
(where the Django instrumentation puts its own), get their SERVER span from the ASGI
instrumentation (``server_spans``), whichever path answers them, the hot path or DRF.
``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS`` (``django,asgi,celery,psycopg``) leaves any of them out.

The work's own spans (``send`` / ``process`` / ``settle``, cancels, finalizes...) come from
``coordination.plumbing.tracing`` and ``runstate._tracing``; see docs/operations.md, "Tracing".
"""

import logging
import os

from django.urls import Resolver404, resolve
from opentelemetry import trace

from coordination.plumbing.tracing import SERVER_SPAN
from runstate._tracing import configure, tracing_on

logger = logging.getLogger(__name__)

# The service name of each role, when OTEL_SERVICE_NAME gives none.
SERVICE_NAMES = {
    "api": "runstate-api",
    "celery-worker": "runstate-celery-worker",
    "beat": "runstate-beat",
}


def _disabled() -> set[str]:
    return {name.strip() for name in os.environ.get("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "").split(",")}


def setup_tracing(role: str) -> bool:
    """Set tracing up for this process (``role``: ``api``, ``celery-worker`` or ``beat``); return whether it is on."""
    provider = configure(SERVICE_NAMES.get(role, f"runstate-{role}"))
    if provider is None:
        return False
    disabled = _disabled()
    if "django" not in disabled and role == "api":
        from opentelemetry.instrumentation.django import DjangoInstrumentor

        if not DjangoInstrumentor().is_instrumented_by_opentelemetry:
            DjangoInstrumentor().instrument(tracer_provider=provider)
    if "celery" not in disabled and role != "api":
        from opentelemetry.instrumentation.celery import CeleryInstrumentor

        if not CeleryInstrumentor().is_instrumented_by_opentelemetry:
            CeleryInstrumentor().instrument(tracer_provider=provider)
    if "psycopg" not in disabled:
        from opentelemetry.instrumentation.psycopg import PsycopgInstrumentor

        if not PsycopgInstrumentor().is_instrumented_by_opentelemetry:
            PsycopgInstrumentor().instrument(tracer_provider=provider, skip_dep_check=True)
    logger.info("tracing on (%s)", role)
    return True


def span_details(scope: dict) -> tuple[str, dict]:
    """Name a request's server span by its route, as the Django instrumentation does: ``POST v1/runs/<str:run_id>``.

    The ASGI instrumentation's default is the path, one name per run and task id.
    """
    method = scope.get("method", "HTTP")
    try:
        route = resolve(scope["path"]).route
    except Resolver404:
        return method, {}
    return f"{method} {route}", {"http.route": route}


def _keep_server_span(span, scope: dict) -> None:
    # coordination.plumbing.tracing.request_trace reads it, on the hot path and in a view's thread.
    scope[SERVER_SPAN] = span


def server_spans(app):
    """Wrap the ASGI ``app`` so that, while this process traces, each request runs under a SERVER span.

    The span is opentelemetry-instrumentation-asgi's (``OpenTelemetryMiddleware``): the
    caller's ``traceparent`` its parent, the method, route, status and sizes its attributes,
    one span a request (no span per ASGI message). Untraced, the request goes straight to
    ``app``: one global lookup. The middleware is built for the tracer provider in place, and
    again if another is set (tests set one per test).
    """
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

    built: dict[object, OpenTelemetryMiddleware] = {}

    async def traced(scope, receive, send):
        if not tracing_on() or "asgi" in _disabled():
            return await app(scope, receive, send)
        provider = trace.get_tracer_provider()
        middleware = built.get(provider)
        if middleware is None:
            built.clear()
            middleware = built[provider] = OpenTelemetryMiddleware(
                app,
                default_span_details=span_details,
                server_request_hook=_keep_server_span,
                tracer_provider=provider,
                exclude_spans=["receive", "send"],
            )
        return await middleware(scope, receive, send)

    return traced
