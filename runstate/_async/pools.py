"""Pools (concurrency limits): ``rs.pools`` and the leases it hands out.

Written by hand on both sides (like ``consume.py``): the background renewal is an asyncio
task here and a daemon thread in ``runstate/_sync/pools.py``.

    await rs.pools.put("gpu", capacity=4)
    async with rs.pools.acquire("gpu", run_id=run.id, units=1, wait_ms=10_000) as lease:
        ...  # renewed in the background; lease.signal is set if it is lost
"""

import asyncio
import logging
from collections.abc import Generator
from types import TracebackType
from typing import Any

from runstate._async.http import AsyncHttp
from runstate._config import MAX_SERVER_WAIT_MS, JsonDict, compact, segment
from runstate._errors import LeaseLostError, ScopeInactiveError, TransportError

logger = logging.getLogger(__name__)

DEFAULT_LEASE_TTL_MS = 30_000


class AsyncPoolLease:
    """A lease on units of a pool; ``data`` is the lease as last seen.

    ``lost`` turns true (and ``signal``, an ``asyncio.Event``, is set) when a renewal is
    refused: the lease was released or expired (``LEASE_LOST``), or its run is no longer
    active (``SCOPE_CANCELLED``, ``SCOPE_COMPLETED``, ``DEADLINE_EXCEEDED``). ``lost_reason``
    says which: ``"lease_lost"`` or ``"scope_refused"``, as for a claim.
    """

    def __init__(self, http: AsyncHttp, data: JsonDict) -> None:
        self._http = http
        self.data = data
        self.id: str = data["leaseId"]
        self.pool: str = data["pool"]
        self.units: int = data["units"]
        self.lost = False
        self.lost_reason: str | None = None
        self.signal = asyncio.Event()
        self._renewer: asyncio.Task[None] | None = None
        self._lease_ttl_ms = DEFAULT_LEASE_TTL_MS

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} {self.units} of {self.pool}>"

    @property
    def _path(self) -> str:
        return f"/pool-leases/{segment(self.id)}"

    def _lose(self, reason: str) -> None:
        if not self.lost:
            logger.info("pool lease %s (%s) lost: %s", self.id, self.pool, reason)
        self.lost = True
        self.lost_reason = self.lost_reason or reason
        self.signal.set()

    async def status(self) -> JsonDict:
        """Return the lease: ``leaseId, pool, runId, units, key, state, expiresAt, grantedAt``."""
        self.data = await self._http.request("GET", self._path, idempotent=True)
        return self.data

    async def renew(self, lease_ttl_ms: int | None = None) -> JsonDict:
        """Extend the lease; a refusal marks it lost (and is raised)."""
        try:
            self.data = await self._http.request(
                "POST", f"{self._path}/renew", idempotent=True, json=compact(leaseTtlMs=lease_ttl_ms)
            )
        except LeaseLostError:
            self._lose("lease_lost")
            raise
        except ScopeInactiveError:
            self._lose("scope_refused")
            raise
        return self.data

    async def release(self) -> JsonDict:
        """Hand the units back (idempotent; allowed under an inactive run) and stop renewing."""
        await self._stop_renewing()
        self.data = await self._http.request("POST", f"{self._path}/release", idempotent=True)
        return self.data

    def start_renewing(self, lease_ttl_ms: int | None = None) -> None:
        """Renew the lease in the background every third of its TTL until released or lost."""
        if self._renewer is None:
            self._lease_ttl_ms = lease_ttl_ms or self._lease_ttl_ms
            self._renewer = asyncio.get_running_loop().create_task(self._renew_forever())

    async def stop_renewing(self) -> None:
        """Stop the background renewal without releasing: the lease then expires after its TTL."""
        await self._stop_renewing()

    async def _stop_renewing(self) -> None:
        renewer, self._renewer = self._renewer, None
        if renewer is not None and renewer is not asyncio.current_task():
            renewer.cancel()
            try:
                await renewer
            except asyncio.CancelledError:
                pass

    async def _renew_forever(self) -> None:
        period_s = max(self._lease_ttl_ms / 3000, 0.05)
        while not self.lost:
            await asyncio.sleep(period_s)
            try:
                await self.renew(self._lease_ttl_ms)
            except (LeaseLostError, ScopeInactiveError):
                return
            except TransportError as error:  # the server is away: try again, the lease may still hold
                logger.warning("pool lease %s: renewal failed (%s); retrying", self.id, error)
            except Exception:  # noqa: BLE001 - never let a renewal error kill the loop silently
                logger.exception("pool lease %s: renewal failed; retrying", self.id)

    async def __aenter__(self) -> "AsyncPoolLease":
        self.start_renewing()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.release()


class AsyncPoolAcquire:
    """What ``rs.pools.acquire`` returns: await it for the lease, or use it with ``async with``.

    ``async with`` acquires, renews in the background and releases on exit.
    """

    def __init__(self, pools: "AsyncPools", name: str, body: JsonDict, wait_ms: int) -> None:
        self._pools = pools
        self._name = name
        self._body = body
        self._wait_ms = wait_ms
        self._lease: AsyncPoolLease | None = None

    async def _acquire(self) -> AsyncPoolLease:
        self._lease = await self._pools._acquire(self._name, self._body, self._wait_ms)
        return self._lease

    def __await__(self) -> Generator[Any, None, AsyncPoolLease]:
        return self._acquire().__await__()

    async def __aenter__(self) -> AsyncPoolLease:
        lease = await self._acquire()
        lease.start_renewing(self._body.get("leaseTtlMs"))
        return lease

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._lease is not None:
            await self._lease.release()


class AsyncPools:
    """``rs.pools``: configure pools and acquire leases on them."""

    def __init__(self, http: AsyncHttp) -> None:
        self._http = http

    async def put(self, name: str, *, capacity: int) -> JsonDict:
        """Create the pool or set its capacity (needs ``resource_config``): ``{name, capacity, inUse, waiting}``.

        A key bound to a run is refused (``PERMISSION_DENIED``): pools belong to the project.
        """
        pool: JsonDict = await self._http.request(
            "PUT", f"/pools/{segment(name)}", idempotent=True, json={"capacity": capacity}
        )
        return pool

    ensure = put

    async def retrieve(self, name: str) -> JsonDict:
        """Return the pool and its use: ``{name, capacity, inUse, waiting}``.

        For a key bound to a run, ``inUse`` and ``waiting`` count its subtree's leases only.
        """
        pool: JsonDict = await self._http.request("GET", f"/pools/{segment(name)}", idempotent=True)
        return pool

    def lease(self, lease_id: str) -> AsyncPoolLease:
        """Return a handle on a lease (no request; ``status()`` loads it)."""
        return AsyncPoolLease(self._http, {"leaseId": lease_id, "pool": "", "units": 0})

    def acquire(
        self,
        name: str,
        *,
        run_id: str,
        units: int = 1,
        lease_ttl_ms: int | None = None,
        wait_ms: int = 0,
        key: str | None = None,
    ) -> AsyncPoolAcquire:
        """Acquire ``units`` of the pool under ``run_id``, waiting in its queue up to ``wait_ms``.

        Granted strictly first come, first served. ``ConflictError`` with code
        ``POOL_EXHAUSTED`` (``details``: capacity, inUse, waiting) when not granted in time;
        the run's code (``ScopeCancelledError``...) when the run is or becomes inactive. The
        server holds a wait 30 s at most, and leaving its queue loses the place, so
        ``wait_ms`` is capped at 30 s. With ``key`` the call is idempotent (and retried).
        """
        wait = max(0, min(wait_ms, MAX_SERVER_WAIT_MS))
        body = compact(runId=run_id, units=units, leaseTtlMs=lease_ttl_ms, waitMs=wait or None, key=key)
        return AsyncPoolAcquire(self, name, body, wait)

    async def _acquire(self, name: str, body: JsonDict, wait_ms: int) -> AsyncPoolLease:
        data: JsonDict = await self._http.request(
            "POST", f"/pools/{segment(name)}/leases", idempotent="key" in body, json=body, wait_ms=wait_ms
        )
        return AsyncPoolLease(self._http, data)
