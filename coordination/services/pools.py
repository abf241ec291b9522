"""Pools: concurrency limits with leases. The only writer of ``Pool.in_use`` and ``PoolLease.state``.

A request for units is a ``PoolLease`` row: ``WAITING`` while queued, ``HELD`` once granted.
Everything that changes what a pool hands out (acquire, release, expiry, a waiter leaving or
cancelled with its run) runs under the pool row's ``FOR UPDATE`` lock, so the grant path is
plain code over exact numbers: ``in_use`` never exceeds ``capacity`` and waiters are granted
strictly by ``arrival``. The cost is that one pool's changes are serialized, which is what a
scarce resource asks for anyway.

``Pool.waiting`` counts the pool's WAITING rows (gone waiters included until a walk times them
out), kept exact under the same lock by every path that queues, grants or ends a waiter. On
PostgreSQL a plain acquire, a release and a renewal are each one guarded statement (see
``ACQUIRE_SQL``, ``RELEASE_SQL``, ``RENEW_SQL``) that applies only while ``waiting`` is 0 and
the outcome is certain; when it touches no row, the careful path below decides, unchanged.
Answers (``POOL_EXHAUSTED``'s ``waiting``) still count only waiters whose caller is there
(``_waiting``), not the counter.

Lock order (house rule): the run chain, then the pool, then lease rows. Renewals touch only
their own lease row (after the chain); nothing here locks a run after a pool.
"""

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import IntegrityError, transaction
from django.db.models import Count, Q, Sum
from django.utils import timezone

from coordination.domain import exceptions
from coordination.domain.ids import path_ids, uuid7
from coordination.domain.states import POOL_LEASE_OPEN, PoolLeaseState
from coordination.models import Event, Pool, PoolLease, Run
from coordination.services import sql
from coordination.services.cascade import SubtreeEnd, cascade_step
from coordination.services.events import event_for, event_insert_sql, event_row, events_record_many
from coordination.services.locking import (
    CHAIN_ACTIVE_SQL,
    CHAIN_KEY_SHARE_CTE,
    chain_key_share_cte,
    chain_refusal,
    run_chain_lock,
    run_chain_lock_active,
)
from coordination.services.mailboxes import NAME_PATTERN

_HELD = sql.literal(PoolLeaseState.HELD)

MAX_CAPACITY = 1_000_000
MAX_LEASE_TTL_MS = 24 * 3600 * 1000
DEFAULT_LEASE_TTL_MS = 30_000
# A waiter row outlives its caller's waitMs by this much: a caller that went away (a crashed
# API process) stops blocking the queue then, even if no timeout answer removed its row.
WAITER_SLACK = timedelta(seconds=5)


@dataclass(frozen=True)
class Acquired:
    """What an acquire or the end of a wait answers: a lease (HELD or WAITING) or a refusal to raise."""

    lease: PoolLease | None
    refusal: exceptions.CoordinationError | None = None
    created: bool = True


def _event(lease: PoolLease, type: str, pool: Pool, **data) -> Event:
    return event_for(lease, type, pool=pool.name, units=lease.units, **data)


def _lock_pool(project_id: uuid.UUID, name: str) -> Pool:
    # No pool has a name pool_put refuses; asking the database could fail on it (a NUL).
    pool = None
    if NAME_PATTERN.fullmatch(name):
        pool = Pool.objects.select_for_update().filter(project_id=project_id, name=name).first()
    if pool is None:
        raise exceptions.NotFound("Pool not found.", pool=name)
    return pool


def pool_get(*, project_id: uuid.UUID, name: str) -> Pool:
    """Return the project's pool ``name``, or raise ``NotFound``."""
    pool = Pool.objects.filter(project_id=project_id, name=name).first() if NAME_PATTERN.fullmatch(name) else None
    if pool is None:
        raise exceptions.NotFound("Pool not found.", pool=name)
    return pool


def _waiting(pool: Pool, now: datetime) -> int:
    return PoolLease.objects.filter(pool=pool, state=PoolLeaseState.WAITING, expires_at__gt=now).count()


def _chain_refusal_of(run_path: str, now: datetime) -> exceptions.Conflict | None:
    """Say why the run at ``run_path`` refuses new work (an unlocked read, see ``_grant_heads``)."""
    ids = path_ids(run_path)
    runs = {r.id: r for r in Run.objects.filter(id__in=ids).only("id", "stored_state", "deadline")}
    return chain_refusal([runs[i] for i in ids if i in runs], now)


def _end(lease: PoolLease, state: PoolLeaseState, now: datetime) -> None:
    lease.state = state
    lease.ended_at = now
    lease.save(update_fields=["state", "ended_at"])


def _queue(pool: Pool, batch: int = 16) -> Iterator[PoolLease]:
    """Yield the pool's waiters in arrival order, a few at a time (the walk usually stops early).

    No row locks: every writer of a waiter's state holds the pool's lock, as the caller does.
    """
    after = 0
    while True:
        rows = list(
            PoolLease.objects.filter(pool=pool, state=PoolLeaseState.WAITING, arrival__gt=after).order_by("arrival")[
                :batch
            ]
        )
        yield from rows
        if len(rows) < batch:
            return
        after = rows[-1].arrival


def _grant_heads(pool: Pool, now: datetime, *, save: bool = False) -> tuple[list[Event], bool]:
    """Expire run-out leases, drop gone waiters, and grant the head waiters that fit.

    Return the events to record and whether anyone still waits. The pool row is saved when
    anything changed (or ``save``: the caller changed its counters before the walk).

    The caller holds the pool's lock. Expired leases are freed here, not only by the sweep, so
    correctness never waits for it. A waiter is granted only when its units fit and no
    earlier waiter remains: the first that does not fit stops the walk (no overtaking).
    Waiters' runs are read without a lock: a cancel that has not committed yet will, in its
    cascade, wait for this pool's lock, so a grant here commits before that cancel does;
    one that committed is seen, and its waiters are answered with its code.
    """
    events: list[Event] = []
    # A renewal locks only its lease row (not the pool): lock the run-out ones so that one of
    # us sees the other.
    expired = list(
        PoolLease.objects.filter(pool=pool, state=PoolLeaseState.HELD, expires_at__lte=now)
        .order_by("id")
        .select_for_update()
    )
    for lease in expired:
        _end(lease, PoolLeaseState.EXPIRED, now)
        pool.in_use -= lease.units
        events.append(_event(lease, "pool.expired", pool))
    still_waiting = False
    waiting_before = pool.waiting
    for waiter in _queue(pool):
        if waiter.expires_at <= now:
            _end(waiter, PoolLeaseState.TIMED_OUT, now)  # its caller is gone
            pool.waiting -= 1
            continue
        if pool.in_use + waiter.units > pool.capacity:
            still_waiting = True
            break  # strictly first come, first served: nobody behind it goes first
        refusal = _chain_refusal_of(waiter.run_path, now)
        if refusal is not None:
            _end(waiter, PoolLeaseState.CANCELLED, now)
            pool.waiting -= 1
            events.append(_event(waiter, "pool.cancelled", pool, code=refusal.code))
            continue
        waiter.state = PoolLeaseState.HELD
        waiter.granted_at = now
        waiter.expires_at = now + timedelta(milliseconds=waiter.lease_ttl_ms)
        waiter.save(update_fields=["state", "granted_at", "expires_at"])
        pool.in_use += waiter.units
        pool.waiting -= 1
        # The event's subject is the lease: it wakes the waiter's long-poll (NOTIFY on commit).
        events.append(_event(waiter, "pool.acquired", pool, waited=True))
    if expired or events or pool.waiting != waiting_before or save:
        pool.updated_at = now
        pool.save(update_fields=["in_use", "waiting", "updated_at"])
    return events, still_waiting


@transaction.atomic
def pool_put(*, project_id: uuid.UUID, name: str, capacity: int) -> tuple[Pool, bool]:
    """Create the pool or change its capacity; return (pool, created).

    A shrink revokes nothing; a growth grants the head waiters that now fit.
    """
    if not 1 <= capacity <= MAX_CAPACITY:
        raise exceptions.ValidationFailed("Invalid capacity.", capacity=f"between 1 and {MAX_CAPACITY}")
    if not NAME_PATTERN.fullmatch(name or ""):
        raise exceptions.ValidationFailed("Invalid pool name.", name="1-100 of A-Z a-z 0-9 . _ -")
    now = timezone.now()
    try:
        with transaction.atomic():
            pool = Pool.objects.create(project_id=project_id, name=name, capacity=capacity, created_at=now)
        return pool, True
    except IntegrityError:
        pass  # it exists: change it under its lock
    pool = _lock_pool(project_id, name)
    if pool.capacity != capacity:
        pool.capacity = capacity
        pool.updated_at = now
        pool.save(update_fields=["capacity", "updated_at"])
    events_record_many(_grant_heads(pool, now)[0])
    return pool, False


# The data of pool.acquired and pool.released, as ``_event`` writes it.
_EVENT_DATA_SQL = "jsonb_build_object('pool', pool_name, 'units', units)"
_LEASE_COLUMNS = ", ".join(field.column for field in PoolLease._meta.concrete_fields)

# The fast acquire: one statement that locks the run chain FOR KEY SHARE (refusing an inactive
# one, house order: chain then pool), takes the units on the pool row only when they certainly
# fit and nobody waits, inserts the HELD lease with the next arrival number, and writes its
# pool.acquired. Row locking serializes it with every other change of the pool, and PostgreSQL
# re-evaluates the WHERE on the row a concurrent change left. Expired leases still counted in
# in_use only make it refuse (the careful path then expires them), never over-grant.
ACQUIRE_SQL = f"""
WITH {CHAIN_KEY_SHARE_CTE}, p AS (
    UPDATE coordination_pool pl
    SET in_use = pl.in_use + %(units)s, arrivals = pl.arrivals + 1, updated_at = %(now)s
    WHERE pl.project_id = %(project_id)s AND pl.name = %(name)s
      AND pl.waiting = 0 AND pl.in_use + %(units)s <= pl.capacity
      AND (SELECT {CHAIN_ACTIVE_SQL} FROM chain)
    RETURNING pl.id AS pool_id, pl.name AS pool_name, pl.arrivals
), l AS (
    INSERT INTO coordination_poollease ({_LEASE_COLUMNS})
    SELECT %(lease_id)s, %(project_id)s, p.pool_id, %(run_id)s,
        (SELECT path FROM chain ORDER BY length(path) DESC LIMIT 1),
        %(units)s, %(lease_ttl_ms)s, '', {_HELD}, p.arrivals, %(expires_at)s, %(now)s, %(now)s, NULL
    FROM p
    RETURNING *
), ev AS (
    {event_insert_sql("l CROSS JOIN p", type_sql="'pool.acquired'", data_sql=_EVENT_DATA_SQL)}
)
SELECT {sql.columns(PoolLease, "l")} FROM l
"""


def pool_acquire(
    *,
    project_id: uuid.UUID,
    name: str,
    run_id: uuid.UUID,
    units: int = 1,
    lease_ttl_ms: int | None = None,
    wait_ms: int = 0,
    key: str = "",
) -> Acquired:
    """Grant ``units`` of the pool to ``run_id`` now, or queue a waiter (``wait_ms`` > 0), or refuse.

    Granted only when the units fit and nobody waits before it. A refusal is returned (its
    ``pool.exhausted`` event commits with it) for the caller to raise. On PostgreSQL a plain
    grant (no ``key``, nobody waiting, room for certain) is one statement; anything else is the
    careful path's to decide.
    """
    lease_ttl_ms = DEFAULT_LEASE_TTL_MS if lease_ttl_ms is None else lease_ttl_ms
    if units < 1:
        raise exceptions.ValidationFailed("Invalid units.", units="at least 1")
    if not 1 <= lease_ttl_ms <= MAX_LEASE_TTL_MS:
        raise exceptions.ValidationFailed("Invalid leaseTtlMs.", leaseTtlMs=f"between 1 and {MAX_LEASE_TTL_MS}")
    # A key asks for "the lease already held under it": the careful path looks it up.
    if not key and sql.fast_paths_enabled() and NAME_PATTERN.fullmatch(name):
        now = timezone.now()
        rows = sql.fetch_models(
            PoolLease,
            ACQUIRE_SQL,
            {
                "project_id": project_id,
                "run_id": run_id,
                "name": name,
                "units": units,
                "lease_ttl_ms": lease_ttl_ms,
                "lease_id": uuid7(),
                "now": now,
                "expires_at": now + timedelta(milliseconds=lease_ttl_ms),
            },
        )
        if rows:
            return Acquired(rows[0][0])
    return _acquire_careful(
        project_id=project_id,
        name=name,
        run_id=run_id,
        units=units,
        lease_ttl_ms=lease_ttl_ms,
        wait_ms=wait_ms,
        key=key,
    )


@transaction.atomic
def _acquire_careful(
    *,
    project_id: uuid.UUID,
    name: str,
    run_id: uuid.UUID,
    units: int,
    lease_ttl_ms: int,
    wait_ms: int,
    key: str,
) -> Acquired:
    # Once the chain is locked, a cancel of any run in it waits for this commit and its
    # cascade then sees (and answers) a waiter queued here.
    chain = run_chain_lock_active(run_id, project_id=project_id)
    run = chain[-1]
    # Every change to what the pool hands out serializes on its row.
    pool = _lock_pool(project_id, name)
    if units > pool.capacity:
        raise exceptions.ValidationFailed("More units than the pool's capacity.", units=f"at most {pool.capacity}")
    now = timezone.now()
    if key:
        existing = PoolLease.objects.filter(pool=pool, key=key, state__in=POOL_LEASE_OPEN).first()
        if existing is not None and (existing.run_id != run.id or existing.units != units):
            raise exceptions.KeyConflict(key=key)
        if existing is not None and not (existing.state == PoolLeaseState.HELD and existing.expires_at <= now):
            return Acquired(existing, created=False)
    events, someone_waits = _grant_heads(pool, now)
    pool.arrivals += 1
    lease = PoolLease(
        project_id=project_id,
        pool=pool,
        run=run,
        run_path=run.path,
        units=units,
        lease_ttl_ms=lease_ttl_ms,
        key=key,
        arrival=pool.arrivals,
        created_at=now,
    )
    if not someone_waits and pool.in_use + units <= pool.capacity:
        pool.in_use += units
        lease.state = PoolLeaseState.HELD
        lease.granted_at = now
        lease.expires_at = now + timedelta(milliseconds=lease_ttl_ms)
        lease.save(force_insert=True)
        events.append(_event(lease, "pool.acquired", pool))
        refusal = None
    elif wait_ms > 0:
        lease.expires_at = now + timedelta(milliseconds=wait_ms) + WAITER_SLACK
        lease.save(force_insert=True)
        pool.waiting += 1
        refusal = None
    else:
        waiting = _waiting(pool, now)
        refusal = exceptions.PoolExhausted(capacity=pool.capacity, inUse=pool.in_use, waiting=waiting)
        # No row was queued: the refusal's subject is the pool.
        events.append(
            event_row(
                project_id=project_id,
                type="pool.exhausted",
                run_id=run.id,
                run_path=run.path,
                subject_id=pool.id,
                data={
                    "pool": pool.name,
                    "units": units,
                    "capacity": pool.capacity,
                    "inUse": pool.in_use,
                    "waiting": waiting,
                },
            )
        )
        lease = None
    pool.updated_at = now
    pool.save(update_fields=["in_use", "arrivals", "waiting", "updated_at"])
    events_record_many(events)
    return Acquired(lease, refusal)


def pool_wait_read(*, lease_id: uuid.UUID) -> tuple[PoolLease, bool]:
    """Read a waiter and whether its wait is over (granted, ended, or its run went inactive)."""
    lease = PoolLease.objects.get(id=lease_id)
    if lease.state != PoolLeaseState.WAITING:
        return lease, True
    return lease, _chain_refusal_of(lease.run_path, timezone.now()) is not None


@transaction.atomic
def pool_wait_end(*, lease_id: uuid.UUID) -> Acquired:
    """End a waiter's wait: the lease if granted, else take it out of the queue and answer why.

    Leaving the queue may let the waiters behind it fit, so it grants them in the same
    transaction.
    """
    seen = PoolLease.objects.get(id=lease_id)
    if seen.state == PoolLeaseState.HELD:
        # Granted: only its holder ends a held lease (release, or expiry once the holder stops
        # renewing), so the grant stands without the pool's lock, which every other change
        # of the pool waits for.
        return Acquired(seen)
    pool_id, run_path = seen.pool_id, seen.run_path
    # The pool's lock first: a grant or a cancel's cascade may be deciding this waiter.
    pool = Pool.objects.select_for_update().get(id=pool_id)
    lease = PoolLease.objects.select_for_update().get(id=lease_id)
    now = timezone.now()
    if lease.state == PoolLeaseState.HELD:
        return Acquired(lease)
    refusal = _chain_refusal_of(run_path, now)
    events: list[Event] = []
    if lease.state == PoolLeaseState.WAITING:
        if refusal is not None:
            _end(lease, PoolLeaseState.CANCELLED, now)
            events.append(_event(lease, "pool.cancelled", pool, code=refusal.code))
        else:
            _end(lease, PoolLeaseState.TIMED_OUT, now)
        pool.waiting -= 1
        events.extend(_grant_heads(pool, now, save=True)[0])
    if refusal is None and lease.state == PoolLeaseState.CANCELLED:
        refusal = exceptions.ScopeCancelled(runId=str(lease.run_id))
    if refusal is None:
        waiting = _waiting(pool, now)
        refusal = exceptions.PoolExhausted(capacity=pool.capacity, inUse=pool.in_use, waiting=waiting)
        events.append(_event(lease, "pool.exhausted", pool, capacity=pool.capacity, inUse=pool.in_use, waiting=waiting))
    events_record_many(events)
    return Acquired(None, refusal)


def _lease_for_update(project_id: uuid.UUID, lease_id: uuid.UUID) -> PoolLease:
    lease = PoolLease.objects.select_for_update().filter(id=lease_id, project_id=project_id).first()
    if lease is None:
        raise exceptions.NotFound("Pool lease not found.", leaseId=str(lease_id))
    return lease


# The fast renewal: one statement that locks the lease's run chain FOR KEY SHARE (house order:
# chain, then the lease row, as the careful path) and extends the lease only when it is HELD,
# unexpired and the chain active. Expiry locks the lease row too, so one sees the other. A lost
# lease, an inactive run or an unknown lease touches no row: the careful path answers why.
_LEASE_PATH_SQL = "SELECT run_path FROM coordination_poollease WHERE id = %(lease_id)s AND project_id = %(project_id)s"
RENEW_SQL = f"""
WITH {chain_key_share_cte(_LEASE_PATH_SQL)}
UPDATE coordination_poollease l
SET expires_at = %(now)s + COALESCE(%(ttl)s, l.lease_ttl_ms) * interval '1 millisecond',
    lease_ttl_ms = COALESCE(%(ttl)s, l.lease_ttl_ms)
WHERE l.id = %(lease_id)s AND l.project_id = %(project_id)s AND l.state = {_HELD} AND l.expires_at > %(now)s
  AND (SELECT {CHAIN_ACTIVE_SQL} FROM chain)
RETURNING {sql.columns(PoolLease, "l")}
"""


def pool_lease_renew(*, project_id: uuid.UUID, lease_id: uuid.UUID, lease_ttl_ms: int | None = None) -> PoolLease:
    """Extend a held lease; ``LEASE_LOST`` once released or expired, the run's code once it is inactive.

    On PostgreSQL a renewal that succeeds is one statement; a refusal is the careful path's.
    """
    valid_ttl = lease_ttl_ms is None or 1 <= lease_ttl_ms <= MAX_LEASE_TTL_MS
    if valid_ttl and sql.fast_paths_enabled():
        params = {"project_id": project_id, "lease_id": lease_id, "ttl": lease_ttl_ms, "now": timezone.now()}
        rows = sql.fetch_models(PoolLease, RENEW_SQL, params)
        if rows:
            return rows[0][0]
    return _renew_careful(project_id=project_id, lease_id=lease_id, lease_ttl_ms=lease_ttl_ms)


@transaction.atomic
def _renew_careful(*, project_id: uuid.UUID, lease_id: uuid.UUID, lease_ttl_ms: int | None) -> PoolLease:
    run_id = PoolLease.objects.filter(id=lease_id, project_id=project_id).values_list("run_id", flat=True).first()
    if run_id is None:
        raise exceptions.NotFound("Pool lease not found.", leaseId=str(lease_id))
    # The chain's lock makes a concurrent cancel wait for this renewal, or this renewal see it.
    chain = run_chain_lock(run_id, project_id=project_id)
    # Only this row: expiry (under the pool's lock) locks it too, so one of us sees the other.
    lease = _lease_for_update(project_id, lease_id)
    now = timezone.now()
    if lease.state != PoolLeaseState.HELD or lease.expires_at <= now:
        raise exceptions.LeaseLost("The pool lease is no longer held.", leaseId=str(lease.id), state=lease.state)
    refusal = chain_refusal(chain, now)
    if refusal is not None:
        raise refusal
    ttl = lease.lease_ttl_ms if lease_ttl_ms is None else lease_ttl_ms
    if not 1 <= ttl <= MAX_LEASE_TTL_MS:
        raise exceptions.ValidationFailed("Invalid leaseTtlMs.", leaseTtlMs=f"between 1 and {MAX_LEASE_TTL_MS}")
    lease.expires_at = now + timedelta(milliseconds=ttl)
    lease.lease_ttl_ms = ttl
    lease.save(update_fields=["expires_at", "lease_ttl_ms"])
    return lease


# The fast release: one statement that locks the lease's pool only while nobody waits (house
# order: pool, then lease), ends the lease when it is HELD and unexpired, gives its units back
# and writes pool.released. A waiter to grant, an expired or already ended lease, or a waiter
# row leaving the queue touches no row here: the careful path decides those.
RELEASE_SQL = f"""
WITH p AS (
    SELECT pl.id, pl.name AS pool_name
    FROM coordination_pool pl
    WHERE pl.id = (SELECT pool_id FROM coordination_poollease WHERE id = %(lease_id)s AND project_id = %(project_id)s)
      AND pl.waiting = 0
    FOR UPDATE OF pl
), l AS (
    UPDATE coordination_poollease l
    SET state = {sql.literal(PoolLeaseState.RELEASED)}, ended_at = %(now)s
    FROM p
    WHERE l.id = %(lease_id)s AND l.project_id = %(project_id)s AND l.pool_id = p.id
      AND l.state = {_HELD} AND l.expires_at > %(now)s
    RETURNING l.*
), u AS (
    UPDATE coordination_pool pl
    SET in_use = pl.in_use - l.units, updated_at = %(now)s
    FROM l
    WHERE pl.id = l.pool_id
    RETURNING pl.name AS pool_name
), ev AS (
    {event_insert_sql("l CROSS JOIN u", type_sql="'pool.released'", data_sql=_EVENT_DATA_SQL)}
)
SELECT {sql.columns(PoolLease, "l")} FROM l
"""


def pool_lease_release(*, project_id: uuid.UUID, lease_id: uuid.UUID) -> PoolLease:
    """Hand a lease back (idempotent; allowed under an inactive run) and grant the waiters that now fit.

    Releasing a waiter takes it out of the queue. On PostgreSQL releasing a held, unexpired
    lease of a pool nobody waits on is one statement; anything else is the careful path's.
    """
    if sql.fast_paths_enabled():
        rows = sql.fetch_models(
            PoolLease, RELEASE_SQL, {"project_id": project_id, "lease_id": lease_id, "now": timezone.now()}
        )
        if rows:
            return rows[0][0]
    return _release_careful(project_id=project_id, lease_id=lease_id)


@transaction.atomic
def _release_careful(*, project_id: uuid.UUID, lease_id: uuid.UUID) -> PoolLease:
    pool_id = PoolLease.objects.filter(id=lease_id, project_id=project_id).values_list("pool_id", flat=True).first()
    if pool_id is None:
        raise exceptions.NotFound("Pool lease not found.", leaseId=str(lease_id))
    # The pool first (house order), then the lease: in_use changes with the lease's state.
    pool = Pool.objects.select_for_update().get(id=pool_id)
    lease = _lease_for_update(project_id, lease_id)
    now = timezone.now()
    events: list[Event] = []
    left_queue = False
    if lease.state == PoolLeaseState.HELD and lease.expires_at > now:
        _end(lease, PoolLeaseState.RELEASED, now)
        pool.in_use -= lease.units
        pool.updated_at = now
        pool.save(update_fields=["in_use", "updated_at"])
        events.append(_event(lease, "pool.released", pool))
    elif lease.state == PoolLeaseState.WAITING:
        _end(lease, PoolLeaseState.RELEASED, now)
        pool.waiting -= 1
        left_queue = True
    # An expired HELD lease is ended (pool.expired) by the walk below, like the sweep would.
    expired = lease.state == PoolLeaseState.HELD
    events.extend(_grant_heads(pool, now, save=left_queue)[0])
    events_record_many(events)
    if expired:
        lease.refresh_from_db()
    return lease


@cascade_step
def pools_cancel_subtree(end: SubtreeEnd) -> None:
    """Answer the subtree's waiters with the run's code (``CANCELLED``), and grant who now fits.

    Held leases stay held: a cancel frees no units by itself, a release or expiry does. The
    cancel holds the run's lock; the pools come next in the house order, in id order.
    """
    pool_ids = sorted(
        set(
            PoolLease.objects.filter(run_path__startswith=end.path_prefix, state=PoolLeaseState.WAITING)
            .values_list("pool_id", flat=True)
            .distinct()
        )
    )
    events: list[Event] = []
    for pool_id in pool_ids:
        # A grant holding this lock decides first (its grants commit before this cancel).
        pool = Pool.objects.select_for_update().get(id=pool_id)
        code = exceptions.ScopeCancelled.code
        if end.by_deadline:
            code = exceptions.DeadlineExceeded.code
        elif end.cause == "run_completed":
            code = exceptions.ScopeCompleted.code
        waiters = list(
            PoolLease.objects.filter(
                pool=pool, run_path__startswith=end.path_prefix, state=PoolLeaseState.WAITING
            ).select_for_update()
        )
        for waiter in waiters:
            _end(waiter, PoolLeaseState.CANCELLED, end.now)
            events.append(_event(waiter, "pool.cancelled", pool, code=code))
        pool.waiting -= len(waiters)
        events.extend(_grant_heads(pool, end.now, save=bool(waiters))[0])
    events_record_many(events)


def pools_settle_due(*, now: datetime | None = None, batch_size: int = 100) -> int:
    """Expire run-out leases and gone waiters, and grant who now fits; return how many pools were settled.

    One pool per transaction, skipping a pool another transaction holds (it settles it itself).
    """
    now = now or timezone.now()
    pool_ids = list(
        PoolLease.objects.filter(state__in=POOL_LEASE_OPEN, expires_at__lte=now)
        .values_list("pool_id", flat=True)
        .distinct()[:batch_size]
    )
    settled = 0
    for pool_id in pool_ids:
        settled += _settle_pool(pool_id, now)
    return settled


@transaction.atomic
def _settle_pool(pool_id: uuid.UUID, now: datetime) -> int:
    pool = Pool.objects.select_for_update(skip_locked=True).filter(id=pool_id).first()
    if pool is None:
        return 0
    events_record_many(_grant_heads(pool, now)[0])
    return 1


def pool_stats(
    pools: list[Pool], now: datetime | None = None, *, under: str | None = None
) -> dict[uuid.UUID, tuple[int, int]]:
    """Return ``{pool id: (in use, waiting)}``, never counting an expired lease or a gone waiter.

    With ``under`` (a run path: a bound key's run), only the leases of that run's subtree count.
    """
    now = now or timezone.now()
    leases = PoolLease.objects.filter(pool__in=pools, state__in=POOL_LEASE_OPEN, expires_at__gt=now)
    if under is not None:
        leases = leases.filter(run_path__startswith=under)
    rows = leases.values("pool_id").annotate(
        in_use=Sum("units", filter=Q(state=PoolLeaseState.HELD)),
        waiting=Count("id", filter=Q(state=PoolLeaseState.WAITING)),
    )
    stats = {pool.id: (0, 0) for pool in pools}
    for row in rows:
        stats[row["pool_id"]] = (row["in_use"] or 0, row["waiting"])
    return stats
