"""Domain errors with stable codes (DESIGN.md "Error codes").

Services raise these; ``coordination.api.errors.exception_handler`` maps them to HTTP in one
place and renders ``{"error": {"code", "message", "details"}}``.
"""

from typing import Any, ClassVar


class CoordinationError(Exception):
    """Base of every domain error: a stable ``code`` and its HTTP status."""

    code: ClassVar[str] = "INTERNAL"
    http_status: ClassVar[int] = 500
    default_message: ClassVar[str] = "Internal error."

    def __init__(self, message: str | None = None, **details: Any) -> None:
        self.message = message or self.default_message
        self.details = details
        super().__init__(self.message)


class ValidationFailed(CoordinationError):
    code = "VALIDATION_ERROR"
    http_status = 400
    default_message = "The request is not valid."


class Unauthenticated(CoordinationError):
    code = "UNAUTHENTICATED"
    http_status = 401
    default_message = "A valid API key is required."


class PermissionDenied(CoordinationError):
    code = "PERMISSION_DENIED"
    http_status = 403
    default_message = "The API key lacks the permission for this operation."


class NotFound(CoordinationError):
    code = "NOT_FOUND"
    http_status = 404
    default_message = "Not found."


class Conflict(CoordinationError):
    """A 409: the request is well formed but the object's state refuses it."""

    code = "CONFLICT"
    http_status = 409
    default_message = "The object's state does not allow this."


class ScopeCancelled(Conflict):
    code = "SCOPE_CANCELLED"
    default_message = "The run (or an ancestor) is cancelled."


class ScopeCompleted(Conflict):
    code = "SCOPE_COMPLETED"
    default_message = "The run (or an ancestor) is completed."


class DeadlineExceeded(Conflict):
    code = "DEADLINE_EXCEEDED"
    default_message = "The run (or an ancestor) is past its deadline."


# The refusal a run's ended subtree answers, by the cause its events record (``cancel``,
# ``complete``, a passed deadline: ``services.cascade.SubtreeEnd.cause``).
SUBTREE_END_CODES = {
    "run_cancelled": ScopeCancelled.code,
    "run_completed": ScopeCompleted.code,
    "run_deadline": DeadlineExceeded.code,
}


class ChildLimitReached(Conflict):
    code = "CHILD_LIMIT_REACHED"
    default_message = "The run has reached its child limit."


class KeyConflict(Conflict):
    code = "KEY_CONFLICT"
    default_message = "The idempotency key is already used with another input."


class MailboxModeConflict(Conflict):
    code = "MAILBOX_MODE_CONFLICT"
    default_message = "The mailbox exists with another mode."


class LeaseLost(Conflict):
    code = "LEASE_LOST"
    default_message = "The claim's lease is no longer held."


class GroupClosed(Conflict):
    code = "GROUP_CLOSED"
    default_message = "The group is closed to new members."


class GroupFinalized(Conflict):
    code = "GROUP_FINALIZED"
    default_message = "The group is already finalized."


class GroupFull(Conflict):
    code = "GROUP_FULL"
    default_message = "The group has its maximum number of members."


class TaskNotSucceeded(Conflict):
    code = "TASK_NOT_SUCCEEDED"
    default_message = "Only a succeeded task can be accepted."


class TaskNotFinished(Conflict):
    code = "TASK_NOT_FINISHED"
    default_message = "Only a finished task can be rejected."


class VerdictConflict(Conflict):
    code = "VERDICT_CONFLICT"
    default_message = "The member already has the opposite verdict."


class BarrierReleased(Conflict):
    code = "BARRIER_RELEASED"
    default_message = "The barrier is released."


class BarrierCancelled(Conflict):
    code = "BARRIER_CANCELLED"
    default_message = "The barrier is cancelled."


class BarrierNotReleased(Conflict):
    code = "BARRIER_NOT_RELEASED"
    default_message = "The barrier is not released."


class TimerFired(Conflict):
    code = "TIMER_FIRED"
    default_message = "The timer has already fired."


class PoolExhausted(Conflict):
    code = "POOL_EXHAUSTED"
    default_message = "The pool has no room for this request within waitMs."


class InvalidState(Conflict):
    code = "INVALID_STATE"
    default_message = "The object's state does not allow this."


class RateLimited(CoordinationError):
    code = "RATE_LIMITED"
    http_status = 429
    default_message = "Too many requests."


class ServiceUnavailable(CoordinationError):
    code = "SERVICE_UNAVAILABLE"
    http_status = 503
    default_message = "A dependency of the service is unavailable."


class QuotaExhausted(Conflict):
    code = "QUOTA_EXHAUSTED"
    default_message = "The quota does not hold the tokens asked for."


class BudgetExhausted(Conflict):
    code = "BUDGET_EXHAUSTED"
    default_message = "A budget on the run's chain lacks room for the amount."
