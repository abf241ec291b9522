"""The exception tree of the SDK and the mapping from an HTTP error answer to it.

Every error the service answers carries ``{"error": {"code", "message", "details"}}``;
the status picks the class and, for a 409, the ``code`` picks the subclass.
"""

from __future__ import annotations

from typing import Any

import httpx


class RunstateError(Exception):
    """Base of every error raised by the SDK.

    ``status_code`` is the HTTP status (``None`` when no answer arrived), ``code`` the
    service's stable error code, ``details`` the error's details (per field for
    ``VALIDATION_ERROR``).
    """

    def __init__(
        self,
        message: str,
        *,
        code: str = "ERROR",
        status_code: int | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.status_code = status_code
        self.details: dict[str, Any] = details or {}

    def __str__(self) -> str:
        return f"{self.code}: {self.message}" if self.code else self.message


class TransportError(RunstateError):
    """No answer arrived: the connection failed or timed out (after retries, when allowed)."""


class ValidationError(RunstateError):
    """400 ``VALIDATION_ERROR``: the request is malformed (``details`` names the fields)."""


class AuthenticationError(RunstateError):
    """401 ``UNAUTHENTICATED``: no key, or an invalid, revoked or expired key."""


class PermissionDeniedError(RunstateError):
    """403 ``PERMISSION_DENIED``: the key lacks the permission for this operation."""


class NotFoundError(RunstateError):
    """404 ``NOT_FOUND``: unknown, or another project's (or outside a bound key's run)."""


class ConflictError(RunstateError):
    """409: the request is well formed but the object's state refuses it (see ``code``)."""


class ScopeInactiveError(ConflictError):
    """409: the run (or an ancestor) refuses new work: cancelled, completed or past its deadline."""


class ScopeCancelledError(ScopeInactiveError):
    """409 ``SCOPE_CANCELLED``: the run or an ancestor is cancelled."""


class ScopeCompletedError(ScopeInactiveError):
    """409 ``SCOPE_COMPLETED``: the run or an ancestor is completed."""


class DeadlineExceededError(ScopeInactiveError):
    """409 ``DEADLINE_EXCEEDED``: the run or an ancestor is past its deadline."""


class LeaseLostError(ConflictError):
    """409 ``LEASE_LOST``: the claim or delivery no longer holds its task or message."""


class LimitExhaustedError(ConflictError):
    """409: a shared limit has no room now (``details`` says how much there is)."""


class PoolExhaustedError(LimitExhaustedError):
    """409 ``POOL_EXHAUSTED``: not granted in time (``details``: capacity, inUse, waiting)."""


class QuotaExhaustedError(LimitExhaustedError):
    """409 ``QUOTA_EXHAUSTED``: the tokens are not there (``details["retryAfterMs"]``: when they will be)."""


class BudgetExhaustedError(LimitExhaustedError):
    """409 ``BUDGET_EXHAUSTED``: a budget of the chain lacks room (``details["remaining"]``)."""


class RateLimitedError(RunstateError):
    """429 ``RATE_LIMITED``; ``retry_after`` is the server's hint in seconds, if any."""

    retry_after: float | None = None


class ServiceUnavailableError(RunstateError):
    """503 ``SERVICE_UNAVAILABLE``: a dependency of the service (the database) is down."""


class ServerError(RunstateError):
    """Any other 5xx answer (``INTERNAL``, or a proxy's 502/504)."""


# The codes DESIGN.md lists under 409, each with the class that represents it.
CONFLICT_CLASSES: dict[str, type[ConflictError]] = {
    "SCOPE_CANCELLED": ScopeCancelledError,
    "SCOPE_COMPLETED": ScopeCompletedError,
    "DEADLINE_EXCEEDED": DeadlineExceededError,
    "LEASE_LOST": LeaseLostError,
    "CHILD_LIMIT_REACHED": ConflictError,
    "KEY_CONFLICT": ConflictError,
    "MAILBOX_MODE_CONFLICT": ConflictError,
    "GROUP_CLOSED": ConflictError,
    "GROUP_FINALIZED": ConflictError,
    "GROUP_FULL": ConflictError,
    "TASK_NOT_SUCCEEDED": ConflictError,
    "TASK_NOT_FINISHED": ConflictError,
    "VERDICT_CONFLICT": ConflictError,
    "BARRIER_RELEASED": ConflictError,
    "BARRIER_CANCELLED": ConflictError,
    "BARRIER_NOT_RELEASED": ConflictError,
    "TIMER_FIRED": ConflictError,
    "POOL_EXHAUSTED": PoolExhaustedError,
    "QUOTA_EXHAUSTED": QuotaExhaustedError,
    "BUDGET_EXHAUSTED": BudgetExhaustedError,
    "INVALID_STATE": ConflictError,
}

# The other codes name their class whatever the status (a 413 is a ``VALIDATION_ERROR`` too).
CODE_CLASSES: dict[str, type[RunstateError]] = {
    "VALIDATION_ERROR": ValidationError,
    "UNAUTHENTICATED": AuthenticationError,
    "PERMISSION_DENIED": PermissionDeniedError,
    "NOT_FOUND": NotFoundError,
    "RATE_LIMITED": RateLimitedError,
    "SERVICE_UNAVAILABLE": ServiceUnavailableError,
}

STATUS_CLASSES: dict[int, type[RunstateError]] = {
    400: ValidationError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    429: RateLimitedError,
    503: ServiceUnavailableError,
}


def retry_after_seconds(response: httpx.Response) -> float | None:
    """Return the ``Retry-After`` header in seconds, when it is a number."""
    value = response.headers.get("Retry-After")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def error_class(code: str, status: int | None) -> type[RunstateError]:
    """Return the class of an error ``code`` answered with ``status``.

    A 409 picks its class by code (``ConflictError`` for a code it does not know); any other
    answer by its code when the code is known, else by its status. ``status`` is ``None`` for
    one item of a batch answer (the call itself answered 200): the code alone decides.
    """
    if status == 409 or (status is None and code in CONFLICT_CLASSES):
        return CONFLICT_CLASSES.get(code, ConflictError)
    if code in CODE_CLASSES:
        return CODE_CLASSES[code]
    if status is None:
        return RunstateError
    if status in STATUS_CLASSES:
        return STATUS_CLASSES[status]
    return ServerError if status >= 500 else RunstateError


def error_from_item(error: dict[str, Any]) -> RunstateError:
    """Build the exception for one refused item of a batch answer (``{code, message}``).

    It is the class the item would have raised alone; ``status_code`` is ``None``.
    """
    code = str(error.get("code") or "ERROR")
    message = str(error.get("message") or code)
    return error_class(code, None)(message, code=code)


def error_from_response(response: httpx.Response) -> RunstateError:
    """Build the exception that represents an error answer (status >= 400); see ``error_class``."""
    status = response.status_code
    code, message, details = f"HTTP_{status}", response.reason_phrase or f"HTTP {status}", {}
    try:
        body = response.json()
    except ValueError:
        body = None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        code = str(error.get("code") or code)
        message = str(error.get("message") or message)
        if isinstance(error.get("details"), dict):
            details = error["details"]
    exc = error_class(code, status)(message, code=code, status_code=status, details=details)
    if isinstance(exc, RateLimitedError):
        exc.retry_after = retry_after_seconds(response)
    return exc
