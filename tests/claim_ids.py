"""Claim ids in event data, made comparable between worlds whose tasks have their own ids."""

import uuid

from coordination.services.claims import parse_claim_id


def claim_named(task_id: uuid.UUID | str, claim_id: str) -> tuple[bool, int]:
    """Return whether ``claim_id`` names the task ``task_id``, and its attempt.

    Two paths run on two tasks (one per world) write the same claim ids but for their task's
    id: this is what they can agree on. ``task.claimed`` data has the attempt beside it; the
    events that stop a held claim (``heldBy``) have the claim id alone.
    """
    named_task, attempt = parse_claim_id(claim_id)
    return named_task == uuid.UUID(str(task_id)), attempt
