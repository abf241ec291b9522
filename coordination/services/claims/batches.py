"""Batches: many claims completed or renewed in one statement, each item answered on its own."""

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from django.utils import timezone

from coordination.domain import exceptions
from coordination.domain.exceptions import CoordinationError
from coordination.models import Task
from coordination.services import sql
from coordination.services.claims import careful
from coordination.services.claims.claim import Claim, parse_claim_id
from coordination.services.claims.statements import COMPLETE_MANY_SQL, RENEW_MANY_SQL
from coordination.services.mailboxes import validate_lease_ttl_ms
from coordination.services.sql import fast_paths_enabled

MAX_BATCH = 1000


@dataclass
class ClaimBatch:
    """A batch of claim operations, checked: each item's answer so far, and the statement for the held ones.

    Whoever runs the statement (``claims_complete_many`` on Django's connection, the API's hot
    path on its own) passes its rows to ``take``; ``finish`` answers what the statement did not
    decide through the careful path, each item in its own transaction, as ``answer`` holds it.
    """

    statement: str
    project_id: uuid.UUID
    items: list[tuple[str, str | None]]
    careful: Callable[[str, int], object]
    answer: Callable[[Task], object]
    answers: list = field(default_factory=list)
    parsed: dict[int, tuple[uuid.UUID, int]] = field(default_factory=dict)

    def params(self, now) -> dict | None:
        """Return the statement's parameters, or None when no item has a well-formed claim id."""
        if not self.parsed:
            return None
        return {
            "project_id": self.project_id,
            "now": now,
            "task_ids": [self.parsed[index][0] for index in self.parsed],
            "attempts": [self.parsed[index][1] for index in self.parsed],
            "values": [self.items[index][1] for index in self.parsed],
        }

    def take(self, tasks: list[Task]) -> None:
        """Answer the items the statement changed (its rows, as tasks)."""
        done = {(task.id, task.attempts): task for task in tasks}
        for index, fence in self.parsed.items():
            if fence in done:
                self.answers[index] = self.answer(done[fence])

    @property
    def undecided(self) -> list[int]:
        """Return the items still without an answer (the careful path decides them)."""
        return [index for index in self.parsed if self.answers[index] is None]

    def finish(self) -> list:
        """Answer the undecided items through the careful path; return every item's answer, in order."""
        for index in self.undecided:
            try:
                self.answers[index] = self.careful(self.items[index][0], index)
            except CoordinationError as error:
                self.answers[index] = error
        return self.answers


def complete_batch(*, project_id: uuid.UUID, items: list[tuple[str, object]]) -> ClaimBatch:
    """Check a batch complete (``claims_complete_many``) and return it, its statement not yet run."""
    return _checked(
        ClaimBatch(
            COMPLETE_MANY_SQL,
            project_id,
            [(claim_id, json.dumps(outcome) if outcome is not None else None) for claim_id, outcome in items],
            careful=lambda claim_id, index: careful.claim_complete(
                project_id=project_id, claim_id=claim_id, outcome=items[index][1]
            ),
            answer=lambda task: task,
        )
    )


def renew_batch(*, project_id: uuid.UUID, items: list[tuple[str, int | None]]) -> ClaimBatch:
    """Check a batch renew (``claims_renew_many``) and return it, its statement not yet run."""
    for index, (_, lease_ttl_ms) in enumerate(items):
        try:
            validate_lease_ttl_ms(lease_ttl_ms)
        except exceptions.ValidationFailed as error:
            raise exceptions.ValidationFailed(f"Item {index}: {error.message}", index=index, **error.details) from None
    return _checked(
        ClaimBatch(
            RENEW_MANY_SQL,
            project_id,
            [(claim_id, str(ttl) if ttl is not None else None) for claim_id, ttl in items],
            careful=lambda claim_id, index: careful.claim_renew(
                project_id=project_id, claim_id=claim_id, lease_ttl_ms=items[index][1]
            ),
            answer=_claim_of,
        )
    )


def claims_complete_many(*, project_id: uuid.UUID, items: list[tuple[str, object]]) -> list[Task | CoordinationError]:
    """Complete many claims; answer per item, in order: the task, or the error that item alone met.

    Items still held are completed by one statement (rows locked in id order); every other
    item takes the careful path in its own transaction, so a stale claim is ``LEASE_LOST``
    in its own item while the others succeed.
    """
    return _run(complete_batch(project_id=project_id, items=items))


def claims_renew_many(*, project_id: uuid.UUID, items: list[tuple[str, int | None]]) -> list[Claim | CoordinationError]:
    """Renew many claims (``(claim_id, lease_ttl_ms or None)``); answer per item, as ``claims_complete_many``."""
    return _run(renew_batch(project_id=project_id, items=items))


def _claim_of(task: Task) -> Claim:
    return Claim(task, task.attempts, task.lease_expires_at)


def _checked(batch: ClaimBatch) -> ClaimBatch:
    """Refuse a batch of the wrong size or with a claim twice; answer the malformed claim ids (``NOT_FOUND``)."""
    items = batch.items
    if not 1 <= len(items) <= MAX_BATCH:
        raise exceptions.ValidationFailed("Invalid batch.", items=f"must hold between 1 and {MAX_BATCH} claims")
    if len({claim_id for claim_id, _ in items}) != len(items):
        raise exceptions.ValidationFailed("Invalid batch.", items="a claim may appear once per batch")
    batch.answers = [None] * len(items)
    for index, (claim_id, _) in enumerate(items):
        try:
            batch.parsed[index] = parse_claim_id(claim_id)
        except exceptions.NotFound as error:
            batch.answers[index] = error
    return batch


def _run(batch: ClaimBatch) -> list:
    params = batch.params(timezone.now()) if fast_paths_enabled() else None
    if params is not None:
        batch.take([task for (task,) in sql.fetch_models(Task, batch.statement, params)])
    return batch.finish()
