"""What both clients' batch calls share: the items they take, how they split, what they answer.

``tasks.submit_many`` sends ``POST /v1/mailboxes/{name}/tasks/batch`` (up to 1,000 tasks a
request, all or nothing); ``tasks.complete_many`` and ``tasks.renew_many`` send
``POST /v1/claims/complete`` and ``/renew`` (up to 500 items a request, answered per item).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypedDict

from runstate._config import JsonDict, compact, wire_time
from runstate._errors import RunstateError, error_from_item

# The server's limits per request (DESIGN.md "HTTP API").
MAX_SUBMIT_BATCH = 1_000
MAX_CLAIM_BATCH = 500


class TaskItem(TypedDict, total=False):
    """One task of ``tasks.submit_many``: the arguments of ``tasks.submit`` after ``mailbox``."""

    input: Any
    key: str | None
    priority: int | None
    max_attempts: int | None
    expires_at: datetime | str | None


def task_body(
    input: Any = None,
    *,
    key: str | None = None,
    priority: int | None = None,
    max_attempts: int | None = None,
    expires_at: datetime | str | None = None,
) -> JsonDict:
    """Return one task as the API takes it (without ``runId``); no input is ``{}``."""
    body = compact(key=key, priority=priority, maxAttempts=max_attempts, expiresAt=wire_time(expires_at))
    body["input"] = {} if input is None else input
    return body


def chunks[T](items: Sequence[T], size: int) -> Iterator[tuple[int, Sequence[T]]]:
    """Yield ``(offset, slice)`` pieces of ``items``, ``size`` at most each, in order."""
    for offset in range(0, len(items), size):
        yield offset, items[offset : offset + size]


def rebase_index(error: RunstateError, offset: int) -> None:
    """Make a refused request's item index (``details``) count from the start of the whole list."""
    if not offset or not isinstance(error.details.get("index"), int):
        return
    prefix = f"tasks.{error.details['index']}."
    error.details = {
        (f"tasks.{error.details['index'] + offset}.{name[len(prefix) :]}" if name.startswith(prefix) else name): value
        for name, value in error.details.items()
    }
    error.details["index"] += offset


def check_unique_claims(claim_ids: list[str]) -> None:
    """Refuse a claim listed twice: the server refuses it within one request, so refuse it across requests too."""
    seen: set[str] = set()
    for claim_id in claim_ids:
        if claim_id in seen:
            raise ValueError(f"Claim {claim_id} appears twice in one batch.")
        seen.add(claim_id)


@dataclass(frozen=True)
class ClaimResult:
    """One item's answer of ``complete_many`` or ``renew_many``, in the order of the request.

    ``ok`` with ``task`` (the completed task) or ``claim`` (the renewed claim), else ``error``:
    the exception that item would have raised alone (``LeaseLostError``, ``NotFoundError``,
    ``ScopeCancelledError``...), not raised.
    """

    claim_id: str
    ok: bool
    task: JsonDict | None = None
    claim: JsonDict | None = None
    error: RunstateError | None = None

    @classmethod
    def from_answer(cls, answer: JsonDict) -> ClaimResult:
        """Build the result of one item of ``{results: [...]}``."""
        if not answer["ok"]:
            return cls(answer["claimId"], False, error=error_from_item(answer["error"]))
        return cls(answer["claimId"], True, task=answer.get("task"), claim=answer.get("claim"))
