"""The one place where errors become HTTP responses with the error envelope."""

import logging

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.db import DatabaseError, InterfaceError, OperationalError, transaction
from django.http import Http404, JsonResponse
from rest_framework import exceptions as drf
from rest_framework.response import Response
from rest_framework.views import set_rollback

from coordination.domain import exceptions
from runstate_project.postgresql.base import read_only_server

logger = logging.getLogger(__name__)

_DRF_CODES: list[tuple[type[drf.APIException], str]] = [
    (drf.ValidationError, "VALIDATION_ERROR"),
    (drf.ParseError, "VALIDATION_ERROR"),
    (drf.UnsupportedMediaType, "UNSUPPORTED_MEDIA_TYPE"),
    (drf.NotAuthenticated, "UNAUTHENTICATED"),
    (drf.AuthenticationFailed, "UNAUTHENTICATED"),
    (drf.PermissionDenied, "PERMISSION_DENIED"),
    (drf.NotFound, "NOT_FOUND"),
    (drf.MethodNotAllowed, "METHOD_NOT_ALLOWED"),
    (drf.NotAcceptable, "NOT_ACCEPTABLE"),
    (drf.Throttled, "RATE_LIMITED"),
]


def envelope(code: str, message: str, details: dict | None = None) -> dict:
    """Return the error body: ``{"error": {"code", "message", "details"}}``."""
    return {"error": {"code": code, "message": message, "details": details or {}}}


def _flatten(detail, prefix: str = "") -> dict[str, str]:
    """Turn DRF's nested validation detail into ``{"field.sub": "message"}``."""
    if isinstance(detail, dict):
        flat: dict[str, str] = {}
        for key, value in detail.items():
            flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    if isinstance(detail, list):
        if all(not isinstance(item, dict | list) for item in detail):
            return {prefix or "non_field_errors": " ".join(str(item) for item in detail)}
        flat = {}
        for index, item in enumerate(detail):
            flat.update(_flatten(item, f"{prefix}.{index}" if prefix else str(index)))
        return flat
    return {prefix or "non_field_errors": str(detail)}


def body_too_large() -> dict:
    """Return the error body of a request body over ``DATA_UPLOAD_MAX_MEMORY_SIZE`` (answered with 413)."""
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    return envelope("VALIDATION_ERROR", f"The request body is larger than {limit} bytes.", {"body": "too large"})


def database_unavailable() -> dict:
    """Return the error body of a request the database cannot serve now (answered with 503, ``Retry-After: 1``)."""
    return envelope("SERVICE_UNAVAILABLE", "The database is unavailable; retry shortly.")


def exception_handler(exc, context):
    """Map domain, DRF, Django and database errors to the envelope; roll back the request."""
    if isinstance(exc, RequestDataTooBig):
        return Response(body_too_large(), status=413)
    if isinstance(exc, Http404):
        exc = exceptions.NotFound()
    if isinstance(exc, exceptions.CoordinationError):
        set_rollback()
        return Response(envelope(exc.code, exc.message, exc.details), status=exc.http_status)
    if isinstance(exc, drf.APIException):
        set_rollback()
        code = next((c for cls, c in _DRF_CODES if isinstance(exc, cls)), "ERROR")
        if isinstance(exc, drf.ValidationError):
            details = _flatten(exc.detail)
            message = "The request is not valid."
        else:
            details = {}
            message = str(exc.detail)
        headers = {}
        if getattr(exc, "auth_header", None):
            headers["WWW-Authenticate"] = exc.auth_header
        if getattr(exc, "wait", None):
            headers["Retry-After"] = str(int(exc.wait))
        return Response(envelope(code, message, details), status=exc.status_code, headers=headers)
    if isinstance(exc, OperationalError | InterfaceError) or (isinstance(exc, DatabaseError) and read_only_server(exc)):
        set_rollback()
        logger.warning("database unavailable: %s", exc)
        return Response(database_unavailable(), status=503, headers={"Retry-After": "1"})
    if isinstance(exc, DatabaseError) and transaction.get_connection().in_atomic_block:
        # Roll back whatever the request wrote; let Django's 500 handler report it.
        transaction.set_rollback(True)
    return None


def json_not_found(request, exception=None):
    """Answer an unknown URL with the error envelope."""
    return JsonResponse(envelope("NOT_FOUND", "No such endpoint."), status=404)


def json_server_error(request):
    """Answer an unhandled error with the error envelope (details go to the log only)."""
    return JsonResponse(envelope("INTERNAL", "Internal error."), status=500)


def json_bad_request(request, exception=None):
    """Answer a request Django itself refused (e.g. a suspicious one) with the error envelope."""
    return JsonResponse(envelope("VALIDATION_ERROR", "Bad request."), status=400)
