"""Quotas: token buckets refilled in the statement that takes from them. The only writer of ``Quota``.

A bucket is stored as "``level_micro`` micro-tokens at ``level_at``". Whoever takes (or
reads, or changes the limit) computes the level at its own ``now``:

    level(now) = min(limit, level_micro + elapsed × limit / period)

in integer micro-tokens, the refill rounded down, ``elapsed`` in whole microseconds,
clamped at 0 (a taker whose ``now`` is older than the row's ``level_at`` refills nothing)
and at one period (after a period the bucket is full whatever it held, which also keeps the
product small). Integers make PostgreSQL (``numeric``) and SQLite (Python ints) agree to
the micro-token, and rounding down means the bucket never grants more than its rate: a take
forgets less than one micro-token of refill, which the next take cannot claim.

On PostgreSQL a take is one guarded UPDATE: the refill in its WHERE and its SET, the run
chain locked ``FOR KEY SHARE`` in a CTE first (house lock order: run chain, then the
quota). Row locking serializes concurrent takes on the bucket, and PostgreSQL re-evaluates
the WHERE on the row a concurrent take left, so two takes never spend the same tokens. When
it touches no row, the careful ORM path decides the exact answer (unknown quota, run
refused, too few tokens and when they will be there). SQLite always takes the careful path.
"""

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import IntegrityError, transaction
from django.utils import timezone

from coordination.domain import exceptions
from coordination.models import Quota
from coordination.models.limits import MICRO
from coordination.services import sql
from coordination.services.events import event_row, events_record_many
from coordination.services.locking import CHAIN_ACTIVE_SQL, CHAIN_KEY_SHARE_CTE, chain_refusal, run_chain_lock
from coordination.services.mailboxes import NAME_PATTERN

MAX_LIMIT = 10**12  # tokens; times MICRO it still fits a bigint
MAX_PERIOD_MS = 366 * 24 * 3600 * 1000


def refilled_micro(quota: Quota, now: datetime) -> int:
    """Return the bucket's level at ``now``, in micro-tokens (see the module docstring)."""
    elapsed_us = max(0, (now - quota.level_at) // timedelta(microseconds=1))
    elapsed_us = min(elapsed_us, quota.period_ms * 1000)
    return min(quota.limit * MICRO, quota.level_micro + elapsed_us * quota.limit * 1000 // quota.period_ms)


def available(quota: Quota, now: datetime | None = None) -> int:
    """Return the whole tokens the bucket holds at ``now``."""
    return refilled_micro(quota, now or timezone.now()) // MICRO


def retry_after_ms(quota: Quota, level_micro: int, amount: int) -> int:
    """Return in how many ms ``amount`` tokens will be there, from ``level_micro``, if nobody else takes."""
    deficit = amount * MICRO - level_micro
    if deficit <= 0:
        return 0
    # Refill is limit * 1000 / period_ms micro-tokens per microsecond: round the wait up.
    return -(-deficit * quota.period_ms // (quota.limit * MICRO))


def _check_name(name: str) -> None:
    if not NAME_PATTERN.fullmatch(name or ""):
        raise exceptions.ValidationFailed("Invalid quota name.", name="1-100 of A-Z a-z 0-9 . _ -")


def _must_exist_by_name(name: str) -> None:
    """Refuse a name no quota can have as ``NotFound`` before asking the database (which a NUL would fail)."""
    if not NAME_PATTERN.fullmatch(name or ""):
        raise exceptions.NotFound("Quota not found.", quota=name)


@transaction.atomic
def quota_put(*, project_id: uuid.UUID, name: str, limit: int, period_ms: int) -> tuple[Quota, bool]:
    """Create the quota full, or change its limit and period; return it and whether it was created.

    A changed quota keeps its current level (refilled at the old rate up to now), capped at
    the new limit.
    """
    _check_name(name)
    if not 1 <= limit <= MAX_LIMIT:
        raise exceptions.ValidationFailed("Invalid limit.", limit=f"between 1 and {MAX_LIMIT}")
    if not 1 <= period_ms <= MAX_PERIOD_MS:
        raise exceptions.ValidationFailed("Invalid period.", periodMs=f"between 1 and {MAX_PERIOD_MS}")
    now = timezone.now()
    # Lock the bucket: a take between our refill and our write would otherwise be undone.
    quota = Quota.objects.select_for_update().filter(project_id=project_id, name=name).first()
    if quota is None:
        try:
            with transaction.atomic():
                quota = Quota.objects.create(
                    project_id=project_id,
                    name=name,
                    limit=limit,
                    period_ms=period_ms,
                    level_micro=limit * MICRO,
                    level_at=now,
                    created_at=now,
                    updated_at=now,
                )
            return quota, True
        except IntegrityError:
            # A concurrent put created it first (its commit released our wait on the unique
            # index): lock that row and change it like any existing quota.
            quota = Quota.objects.select_for_update().get(project_id=project_id, name=name)
    level = min(refilled_micro(quota, now), limit * MICRO)
    quota.limit, quota.period_ms = limit, period_ms
    quota.level_micro, quota.level_at = level, max(quota.level_at, now)
    quota.updated_at = now
    quota.save(update_fields=["limit", "period_ms", "level_micro", "level_at", "updated_at"])
    return quota, False


@dataclass(frozen=True)
class TakeOutcome:
    """A take's answer: granted with the whole tokens left, or refused with when to retry."""

    granted: bool
    remaining: int = 0
    retry_after_ms: int = 0
    # Refused for good: the tokens will not be there within the caller's wait (event written).
    final: bool = False


# One statement: lock the run chain (refusing an inactive one), then refill and take from the
# bucket only when the refilled level holds the amount. See the module docstring.
_REFILL_SQL = """LEAST(q."limit" * 1000000, q.level_micro + floor(
    LEAST(GREATEST(floor(extract(epoch FROM (%(now)s - q.level_at)) * 1000000), 0), q.period_ms * 1000)
    * q."limit" * 1000 / q.period_ms)::bigint)"""
TAKE_SQL = f"""
WITH {CHAIN_KEY_SHARE_CTE}
UPDATE coordination_quota q
SET level_micro = {_REFILL_SQL} - %(need)s, level_at = GREATEST(q.level_at, %(now)s)
WHERE q.project_id = %(project_id)s AND q.name = %(name)s
  AND {_REFILL_SQL} >= %(need)s
  AND (SELECT {CHAIN_ACTIVE_SQL} FROM chain)
RETURNING q.level_micro
"""


def quota_take(
    *, project_id: uuid.UUID, run_id: uuid.UUID, name: str, amount: int = 1, wait_left_ms: int = 0
) -> TakeOutcome:
    """Take ``amount`` tokens for work under ``run_id``, or say when they will be there.

    ``wait_left_ms`` is how much longer the caller would wait: a refusal whose tokens come
    later than that is final and writes ``quota.exhausted``; an earlier one is retried by
    the caller after ``retry_after_ms``, without an event.
    """
    _must_exist_by_name(name)
    if amount < 1:
        raise exceptions.ValidationFailed("Invalid amount.", amount="at least 1")
    if sql.fast_paths_enabled():
        rows = sql.fetch(
            TAKE_SQL,
            {
                "project_id": project_id,
                "run_id": run_id,
                "name": name,
                "need": amount * MICRO,
                "now": timezone.now(),
            },
        )
        if rows:
            return TakeOutcome(granted=True, remaining=rows[0][0] // MICRO)
    return _take_careful(project_id=project_id, run_id=run_id, name=name, amount=amount, wait_left_ms=wait_left_ms)


@transaction.atomic
def _take_careful(
    *, project_id: uuid.UUID, run_id: uuid.UUID, name: str, amount: int, wait_left_ms: int
) -> TakeOutcome:
    known = Quota.objects.filter(project_id=project_id, name=name).values_list("limit", flat=True).first()
    if known is None:
        raise exceptions.NotFound("Quota not found.", quota=name)
    # The run chain first (house order): a cancel committing after this waits for us, and
    # one committed before is seen here, so nothing is granted after a cancel commits.
    chain = run_chain_lock(run_id, project_id=project_id)
    # Lock the bucket: concurrent takes serialize on it, each refilling from the last one's level.
    quota = Quota.objects.select_for_update().get(project_id=project_id, name=name)
    if amount > quota.limit:
        raise exceptions.ValidationFailed("The amount exceeds the quota's limit.", amount=f"at most {quota.limit}")
    refusal = chain_refusal(chain)
    if refusal is not None:
        raise refusal
    now = timezone.now()
    level = refilled_micro(quota, now)
    if level >= amount * MICRO:
        quota.level_micro, quota.level_at = level - amount * MICRO, max(quota.level_at, now)
        quota.save(update_fields=["level_micro", "level_at"])
        return TakeOutcome(granted=True, remaining=quota.level_micro // MICRO)
    wait = retry_after_ms(quota, level, amount)
    final = wait > wait_left_ms
    if final:
        run = chain[-1]
        events_record_many(
            [
                event_row(
                    project_id=project_id,
                    type="quota.exhausted",
                    run_id=run.id,
                    run_path=run.path,
                    subject_id=quota.id,
                    data={"quota": quota.name, "amount": amount, "available": level // MICRO, "retryAfterMs": wait},
                )
            ]
        )
    return TakeOutcome(granted=False, remaining=level // MICRO, retry_after_ms=wait, final=final)


def quota_get(*, project_id: uuid.UUID, name: str) -> Quota:
    """Return the project's quota ``name``, or raise ``NotFound``."""
    _must_exist_by_name(name)
    quota = Quota.objects.filter(project_id=project_id, name=name).first()
    if quota is None:
        raise exceptions.NotFound("Quota not found.", quota=name)
    return quota
