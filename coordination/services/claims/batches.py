"""Batches: many claims completed or renewed in one statement, each item answered on its own."""

import json
import uuid

from django.utils import timezone

from coordination import exceptions
from coordination.exceptions import CoordinationError
from coordination.models import Task
from coordination.services import sql
from coordination.services.claims import careful
from coordination.services.claims.claim import Claim, parse_claim_id
from coordination.services.claims.statements import COMPLETE_MANY_SQL, RENEW_MANY_SQL
from coordination.services.mailboxes import validate_lease_ttl_ms
from coordination.services.sql import fast_paths_enabled

MAX_BATCH = 1000


def claims_complete_many(*, project_id: uuid.UUID, items: list[tuple[str, object]]) -> list[Task | CoordinationError]:
    """Complete many claims; answer per item, in order: the task, or the error that item alone met.

    Items still held are completed by one statement (rows locked in id order); every other
    item takes the careful path in its own transaction, so a stale claim is ``LEASE_LOST``
    in its own item while the others succeed.
    """
    return _per_item(
        COMPLETE_MANY_SQL,
        project_id,
        [(claim_id, json.dumps(outcome) if outcome is not None else None) for claim_id, outcome in items],
        careful=lambda claim_id, index: careful.claim_complete(
            project_id=project_id, claim_id=claim_id, outcome=items[index][1]
        ),
    )


def claims_renew_many(*, project_id: uuid.UUID, items: list[tuple[str, int | None]]) -> list[Claim | CoordinationError]:
    """Renew many claims (``(claim_id, lease_ttl_ms or None)``); answer per item, as ``claims_complete_many``."""
    for index, (_, lease_ttl_ms) in enumerate(items):
        try:
            validate_lease_ttl_ms(lease_ttl_ms)
        except exceptions.ValidationFailed as error:
            raise exceptions.ValidationFailed(f"Item {index}: {error.message}", index=index, **error.details) from None
    answers = _per_item(
        RENEW_MANY_SQL,
        project_id,
        [(claim_id, str(ttl) if ttl is not None else None) for claim_id, ttl in items],
        careful=lambda claim_id, index: careful.claim_renew(
            project_id=project_id, claim_id=claim_id, lease_ttl_ms=items[index][1]
        ),
    )
    return [answer if isinstance(answer, Claim | CoordinationError) else _claim_of(answer) for answer in answers]


def _claim_of(task: Task) -> Claim:
    return Claim(task, task.attempts, task.lease_expires_at)


def _per_item(statement: str, project_id: uuid.UUID, items: list[tuple[str, str | None]], *, careful) -> list:
    if not 1 <= len(items) <= MAX_BATCH:
        raise exceptions.ValidationFailed("Invalid batch.", items=f"must hold between 1 and {MAX_BATCH} claims")
    if len({claim_id for claim_id, _ in items}) != len(items):
        raise exceptions.ValidationFailed("Invalid batch.", items="a claim may appear once per batch")
    answers: list = [None] * len(items)
    parsed = {}
    for index, (claim_id, _) in enumerate(items):
        try:
            parsed[index] = parse_claim_id(claim_id)
        except exceptions.NotFound as error:
            answers[index] = error
    if fast_paths_enabled() and parsed:
        rows = sql.fetch_models(
            Task,
            statement,
            {
                "project_id": project_id,
                "now": timezone.now(),
                "task_ids": [parsed[index][0] for index in parsed],
                "attempts": [parsed[index][1] for index in parsed],
                "values": [items[index][1] for index in parsed],
            },
        )
        done = {(task.id, task.attempts): task for (task,) in rows}
        for index, fence in parsed.items():
            answers[index] = done.get(fence)
    for index in parsed:
        if answers[index] is None:
            try:
                answers[index] = careful(items[index][0], index)
            except CoordinationError as error:
                answers[index] = error
    return answers
