"""What a claim is: a task handed to a worker under a lease, and its opaque id ``c_<task>_<attempt>``."""

import uuid
from dataclasses import dataclass
from datetime import datetime

from coordination.domain import exceptions
from coordination.domain.ids import CLAIM_PREFIX, claim_id_for, claim_id_sql, parse_fence_id
from coordination.models import Task


@dataclass(frozen=True)
class Claim:
    """A task handed to a worker under a lease: ``claim_id`` fences every later operation."""

    task: Task
    attempt: int
    lease_expires_at: datetime
    # The lease granted, when the claimer knows it without another query (claims by id).
    lease_ttl_ms: int | None = None

    @property
    def claim_id(self) -> str:
        """Return the opaque claim id."""
        return claim_id_for(self.task.id, self.attempt)


def claimed_event_data(task: Task, worker_id: str) -> dict[str, object]:
    """Return the data of the ``task.claimed`` event of ``task``, just claimed (its ``attempts`` counted).

    ``claimId`` lets a claimer that lost the answer (its request cancelled in flight) find and
    release what it took, by its ``workerId``, without building claim ids itself.
    """
    return {"attempt": task.attempts, "workerId": worker_id, "claimId": claim_id_for(task.id, task.attempts)}


# ``claimed_event_data`` as an expression over the claimed task's row, for the single statements.
CLAIMED_EVENT_DATA_SQL = (
    f"jsonb_build_object('attempt', attempts, 'workerId', worker_id, 'claimId', {claim_id_sql('id', 'attempts')})"
)


def parse_claim_id(claim_id: str) -> tuple[uuid.UUID, int]:
    """Split a claim id into task id and attempt; a malformed one is ``NOT_FOUND``."""
    try:
        return parse_fence_id(CLAIM_PREFIX, claim_id)
    except ValueError:
        raise exceptions.NotFound("Claim not found.", claimId=str(claim_id)) from None
