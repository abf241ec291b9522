"""What a refused call answers: a tool result with ``isError``, the runstate code and what to do next.

A refusal is never a protocol error: the agent reads it like any answer. Every code the service
answers has one sentence here telling the agent its next step.
"""

from typing import Any

from runstate._errors import RunstateError

# One sentence per runstate code: what the agent should do next.
NEXT_STEP: dict[str, str] = {
    "VALIDATION_ERROR": "Fix the arguments named in details and call again.",
    "UNAUTHENTICATED": "The runstate API key is missing or revoked: ask the user for a valid key.",
    "PERMISSION_DENIED": "This API key lacks the permission for that call: ask the user for a key that has it.",
    "NOT_FOUND": "Check the id: it does not exist or is outside what this key may see.",
    "SCOPE_CANCELLED": "The run was cancelled: stop working on it and start no new work in it.",
    "SCOPE_COMPLETED": "The run is completed: start no new work in it.",
    "DEADLINE_EXCEEDED": "The run is past its deadline: stop working on it and start no new work in it.",
    "CHILD_LIMIT_REACHED": "The run has its maximum of child runs: finish some or use another parent.",
    "KEY_CONFLICT": "That key was used with other input: pick another key or send the same input.",
    "MAILBOX_MODE_CONFLICT": "That mailbox exists with the other mode: use another mailbox name.",
    "LEASE_LOST": "You no longer hold this claim (its lease ran out or it was taken over): drop the work, "
    "record nothing, and claim again.",
    "GROUP_CLOSED": "The group takes no more members: read its decision with group_wait.",
    "GROUP_FINALIZED": "The group is already decided: read its decision with group_wait.",
    "GROUP_FULL": "The group has its maximum of members: submit no more.",
    "TASK_NOT_SUCCEEDED": "Only a succeeded member can be accepted: reject it or wait until it succeeds.",
    "TASK_NOT_FINISHED": "The member is still running: wait with task_result, then record the verdict.",
    "VERDICT_CONFLICT": "The member already has the opposite verdict, which stands: move on.",
    "BARRIER_RELEASED": "The barrier already released: go on without arriving.",
    "BARRIER_CANCELLED": "The barrier was cancelled with its run: stop waiting on it.",
    "BARRIER_NOT_RELEASED": "The barrier has not released yet: wait with barrier_wait.",
    "TIMER_FIRED": "The timer already fired: nothing to disarm.",
    "POOL_EXHAUSTED": "No units are free: call again later or with a longer waitMs.",
    "QUOTA_EXHAUSTED": "The rate limit is spent: call again after details.retryAfterMs.",
    "BUDGET_EXHAUSTED": "The budget has no room for that amount: reserve less or stop.",
    "INVALID_STATE": "The object is not in a state that allows this: read it and decide again.",
    "RATE_LIMITED": "Too many requests: wait a second and call again.",
    "TRANSPORT_ERROR": "runstate did not answer: call again in a few seconds.",
    "TIMEOUT": "Nothing happened within the wait: call again to keep waiting.",
}
DEFAULT_NEXT_STEP = "Read the message, then decide whether to call again or stop."


def refusal_body(error: RunstateError) -> dict[str, Any]:
    """Return the structured content of a refused call: ``{error: {code, message, details, nextStep}}``."""
    code = error.code or "ERROR"
    return {
        "error": {
            "code": code,
            "message": error.message,
            "details": error.details or {},
            "nextStep": NEXT_STEP.get(code, DEFAULT_NEXT_STEP),
        }
    }
