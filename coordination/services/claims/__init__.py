"""Claims: hand queued tasks out under a lease, and the operations fenced by the claim.

A claim is ``(task id, attempt)``. Every operation on it is fenced: a stale worker (its
lease taken over, its task cancelled) changes nothing and hears ``LEASE_LOST`` or the
run's own refusal code.

The package, one concern a module:

- ``claim``: the ``Claim`` handed out and its id;
- ``leases``: the rules (claimable, the fence, takeover, expiry), each defined once and
  rendered as Python, SQL and ORM filters;
- ``statements``: the single statements of the PostgreSQL fast paths;
- ``careful``: the ORM paths that decide every case a statement declines;
- ``operations``: the service functions, statement first, then the careful path;
- ``batches``: many claims completed or renewed at once, answered per item;
- ``narrow``: the claim by id and the completion a Celery worker runs per task, on a raw
  cursor returning only what it uses (the same statements, the operations' answers).
"""

from coordination.services.claims.batches import MAX_BATCH, claims_complete_many, claims_renew_many
from coordination.services.claims.claim import Claim, claim_id_for, parse_claim_id
from coordination.services.claims.leases import lease_expired, takeover_due
from coordination.services.claims.narrow import NarrowClaim, claim_complete_narrow, task_claim_by_id_narrow
from coordination.services.claims.operations import (
    MAX_CLAIMS_PER_CALL,
    claim_complete,
    claim_fail,
    claim_release,
    claim_renew,
    task_claim,
    task_claim_by_id,
)
from coordination.services.claims.statements import (
    CLAIM_BY_ID_SQL,
    CLAIM_SQL,
    COMPLETE_MANY_SQL,
    COMPLETE_SQL,
    FAIL_SQL,
    RELEASE_SQL,
    RENEW_MANY_SQL,
    RENEW_SQL,
)

__all__ = [
    "CLAIM_BY_ID_SQL",
    "CLAIM_SQL",
    "COMPLETE_MANY_SQL",
    "COMPLETE_SQL",
    "FAIL_SQL",
    "MAX_BATCH",
    "MAX_CLAIMS_PER_CALL",
    "RELEASE_SQL",
    "RENEW_MANY_SQL",
    "RENEW_SQL",
    "Claim",
    "NarrowClaim",
    "claim_complete",
    "claim_complete_narrow",
    "claim_fail",
    "claim_id_for",
    "claim_release",
    "claim_renew",
    "claims_complete_many",
    "claims_renew_many",
    "lease_expired",
    "parse_claim_id",
    "takeover_due",
    "task_claim",
    "task_claim_by_id",
    "task_claim_by_id_narrow",
]
