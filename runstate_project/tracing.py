"""OpenTelemetry setup of the service's processes: API (ASGI, WSGI), Celery workers and beat.

One call, ``setup_tracing(role)``, from each entry point, before the process serves anything.
The provider comes from ``runstate._tracing.configure`` (the same rules as ``runstate worker``
and ``runstate mcp``): nothing is created unless the ``OTEL_*`` variables ask for an
exporter, and then the maintained instrumentations are switched on as well: Django (the
admin and dashboard requests), Celery (the wake-up messages) and psycopg (every statement).
``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS`` (``django,celery,psycopg``) leaves any of them out.

The work's own spans (``send`` / ``process`` / ``settle``, cancels, finalizes...) come from
``coordination.tracing`` and ``runstate._tracing``; see docs/operations.md, "Tracing".
"""

import logging
import os

from runstate._tracing import configure

logger = logging.getLogger(__name__)

# The service name of each role, when OTEL_SERVICE_NAME gives none.
SERVICE_NAMES = {
    "api": "runstate-api",
    "celery-worker": "runstate-celery-worker",
    "beat": "runstate-beat",
}


def setup_tracing(role: str) -> bool:
    """Set tracing up for this process (``role``: ``api``, ``celery-worker`` or ``beat``); return whether it is on."""
    provider = configure(SERVICE_NAMES.get(role, f"runstate-{role}"))
    if provider is None:
        return False
    disabled = {name.strip() for name in os.environ.get("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "").split(",")}
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
