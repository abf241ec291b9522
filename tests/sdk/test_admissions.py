"""``run.admissions`` against the live service, async and sync."""

import asyncio

import pytest

from runstate import AsyncRunstate, ConflictError, Runstate, ScopeCancelledError

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]


def test_async_request_wait_admit_and_withdraw(sdk):
    async def scenario():
        async with AsyncRunstate() as rs:
            job = await rs.scopes.create(name="job")
            config = await job.admissions.configure(max_active=1)
            assert (config["maxActive"], config["admitted"], config["waiting"]) == (1, 0, 0)
            first = await job.admissions.request(name="agent-1")
            assert first.state == "ADMITTED" and first.position is None
            child = first.run
            assert child is not None and child.data["parentId"] == job.id
            second = await job.admissions.request(name="agent-2", key="agent-2", wait_ms=100)
            assert (second.state, second.position, second.run) == ("WAITING", 1, None)
            third = await job.admissions.request(name="agent-3")
            assert third.position == 2
            assert await second.wait(100) is second and second.state == "WAITING"  # timed out, still in line
            waiter = asyncio.create_task(second.wait(10_000))
            await asyncio.sleep(0.2)
            await child.complete()
            admitted = await waiter
            assert admitted.state == "ADMITTED" and admitted.run.data["name"] == "agent-2"
            assert (await third.withdraw())["state"] == "WITHDRAWN"
            with pytest.raises(ConflictError) as excinfo:
                await second.withdraw()
            assert excinfo.value.code == "INVALID_STATE"
            again = job.admissions.get(second.id)
            assert (await again.status())["state"] == "ADMITTED"
            assert (await job.admissions.status())["admitted"] == 1

    asyncio.run(scenario())


def test_sync_parent_cancel_answers_the_waiter_with_its_code(sdk):
    with Runstate() as rs:
        job = rs.scopes.create()
        job.admissions.configure(max_active=1)
        assert job.admissions.request().state == "ADMITTED"
        waiting = job.admissions.request(key="w")
        assert waiting.state == "WAITING"
        job.cancel()
        with pytest.raises(ScopeCancelledError):
            waiting.wait(1000)
        assert rs.scope(job.id).admissions.get(waiting.id).status()["state"] == "CANCELLED"
        with pytest.raises(ScopeCancelledError):
            job.admissions.request()
