"""The SDKs' pools against a live server: ``rs.pools.put`` / ``acquire`` (async and sync)."""

import asyncio
import threading

import pytest

from runstate import AsyncRunstate, PoolExhaustedError, Runstate, ScopeCancelledError
from tests.waiting import WAIT_S, until, wait_until

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]

# Long enough that a loaded machine's scheduling stalls cannot lose the lease between two
# renewals (CI saw 330 ms between two renewals of a 300 ms lease), short enough that the
# renewer (every third of the TTL) renews twice within about 1.4 s. The tests wait for the
# renewals they see, never for a fixed time.
LEASE_TTL_MS = 2_000


class Renewals:
    """The distinct ``expiresAt`` a lease's background renewer has recorded, as a wait polls them."""

    def __init__(self, lease) -> None:
        self.lease = lease
        self.expiries = [lease.data["expiresAt"]]

    def seen(self, count: int) -> bool:
        """Whether ``count`` renewals were recorded (or the lease was lost: the test then says so)."""
        if self.lease.data["expiresAt"] != self.expiries[-1]:
            self.expiries.append(self.lease.data["expiresAt"])
        return len(self.expiries) > count or self.lease.lost


def test_async_acquire_renews_in_the_background_and_releases_on_exit(sdk):
    async def scenario():
        async with AsyncRunstate() as rs:
            assert (await rs.pools.put("gpu", capacity=2))["capacity"] == 2
            assert (await rs.pools.ensure("gpu", capacity=2))["inUse"] == 0
            run = await rs.scopes.create()
            async with rs.pools.acquire("gpu", run_id=run.id, units=2, lease_ttl_ms=LEASE_TTL_MS) as lease:
                renewals = Renewals(lease)
                await until(lambda: renewals.seen(2), what="two renewals")
                assert not lease.lost and not lease.signal.is_set()
                assert len(renewals.expiries) == 3, renewals.expiries
                assert (await lease.status())["expiresAt"] > renewals.expiries[1] > renewals.expiries[0]
                assert (await rs.pools.retrieve("gpu"))["inUse"] == 2
                with pytest.raises(PoolExhaustedError) as excinfo:
                    await rs.pools.acquire("gpu", run_id=run.id)
                assert excinfo.value.code == "POOL_EXHAUSTED"
                assert excinfo.value.details == {"capacity": 2, "inUse": 2, "waiting": 0}
            assert (await lease.status())["state"] == "RELEASED"
            assert (await rs.pools.retrieve("gpu"))["inUse"] == 0

    asyncio.run(scenario())


def test_async_lease_is_marked_lost_with_its_signal_when_the_run_is_cancelled(sdk):
    async def scenario():
        async with AsyncRunstate() as rs:
            await rs.pools.put("gpu", capacity=1)
            run = await rs.scopes.create()
            async with rs.pools.acquire("gpu", run_id=run.id, lease_ttl_ms=3000) as lease:
                await run.cancel()
                await asyncio.wait_for(lease.signal.wait(), WAIT_S)
                assert lease.lost and lease.lost_reason == "scope_refused"
                with pytest.raises(ScopeCancelledError):
                    await lease.renew()
            # Released on exit even under the cancelled run.
            assert (await lease.status())["state"] == "RELEASED"
            assert (await rs.pools.retrieve("gpu"))["inUse"] == 0

    asyncio.run(scenario())


def test_sync_acquire_waits_for_a_release_and_keys_are_idempotent(sdk):
    with Runstate() as rs:
        rs.pools.put("gpu", capacity=1)
        run = rs.scopes.create()
        held = rs.pools.acquire("gpu", run_id=run.id, key="first").lease()
        again = rs.pools.acquire("gpu", run_id=run.id, key="first").lease()
        assert again.id == held.id
        releaser = threading.Timer(0.3, held.release)
        releaser.start()
        with rs.pools.acquire("gpu", run_id=run.id, wait_ms=20_000, lease_ttl_ms=LEASE_TTL_MS) as lease:
            assert lease.data["state"] == "HELD"
            assert held.status()["state"] == "RELEASED"  # granted once the first was handed back
            renewals = Renewals(lease)
            wait_until(lambda: renewals.seen(2), what="two renewals by the renewal thread")
            assert not lease.lost and len(renewals.expiries) == 3, renewals.expiries
            assert lease.status()["state"] == "HELD"
        releaser.join()
        assert lease.status()["state"] == "RELEASED"
        with pytest.raises(ScopeCancelledError):
            run.cancel()
            rs.pools.acquire("gpu", run_id=run.id).lease()
