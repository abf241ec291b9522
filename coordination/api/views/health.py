"""Liveness and readiness probes (no key needed)."""

from django.db import connection
from drf_spectacular.utils import extend_schema
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from coordination.api.serializers import HealthOut


class HealthView(APIView):
    """Liveness: the process answers; touches no dependency."""

    authentication_classes: list = []
    permission_classes = [AllowAny]

    @extend_schema(operation_id="healthz", responses={200: HealthOut})
    def get(self, request):
        """Answer 200 while the process runs."""
        return Response({"status": "ok"})


def check_database() -> str | None:
    """Return None when the database answers, else the error."""
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except Exception as exc:  # noqa: BLE001 - any failure means not ready
        return f"{type(exc).__name__}: {exc}"
    return None


def check_broker() -> str | None:
    """Return None when the Celery broker accepts a connection, else the error."""
    from runstate_project.celery import app

    try:
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=2)
    except Exception as exc:  # noqa: BLE001 - any failure means not ready
        return f"{type(exc).__name__}: {exc}"
    return None


class ReadyView(APIView):
    """Readiness: the database and the broker are reachable."""

    authentication_classes: list = []
    permission_classes = [AllowAny]

    @extend_schema(operation_id="readyz", responses={200: HealthOut, 503: HealthOut})
    def get(self, request):
        """Answer 200 when the database and broker answer, else 503 naming what is down."""
        checks = {"database": check_database(), "broker": check_broker()}
        ready = all(error is None for error in checks.values())
        body = {
            "status": "ok" if ready else "unavailable",
            "checks": {name: error or "ok" for name, error in checks.items()},
        }
        if not ready:
            body["error"] = {
                "code": "SERVICE_UNAVAILABLE",
                "message": "A dependency is down.",
                "details": body["checks"],
            }
        return Response(body, status=200 if ready else 503)
