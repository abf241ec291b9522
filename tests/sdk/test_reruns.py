"""``ticket.rerun()`` against the live service, async and sync (issue 20)."""

import asyncio

import pytest

from runstate import AsyncRunstate, ConflictError, NotFoundError, Runstate, ScopeCancelledError

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]


def test_async_rerun_submits_a_new_task_idempotently_by_key(sdk):
    async def scenario():
        async with AsyncRunstate() as rs:
            await rs.mailboxes.ensure("jobs", mode="WORK")
            run = await rs.scopes.create()
            ticket = await run.tasks.submit("jobs", {"a": 1}, priority=3)
            with pytest.raises(ConflictError) as excinfo:
                await ticket.rerun()
            assert excinfo.value.code == "INVALID_STATE"
            (claim,) = await run.tasks.claim("jobs")
            await claim.fail("boom")

            again = await ticket.rerun()
            assert again.id != ticket.id
            assert (again.data["rerunOf"], again.data["input"], again.data["priority"]) == (ticket.id, {"a": 1}, 3)
            assert (await rs.tasks.get(again.id).status())["rerunOf"] == ticket.id

            fixed = await ticket.rerun(key="fix", input={"a": 2})
            assert (fixed.data["input"], fixed.data["key"]) == ({"a": 2}, "fix")
            assert (await ticket.rerun(key="fix", input={"a": 2})).id == fixed.id
            with pytest.raises(ConflictError) as excinfo:
                await ticket.rerun(key="fix", input={"other": True})
            assert excinfo.value.code == "KEY_CONFLICT"
            with pytest.raises(NotFoundError):
                await rs.tasks.get("01234567-89ab-7def-8123-456789abcdef").rerun()

    asyncio.run(scenario())


def test_sync_rerun_and_its_refusal_under_a_cancelled_run(sdk):
    with Runstate() as rs:
        rs.mailboxes.ensure("jobs", mode="WORK")
        run = rs.scopes.create()
        ticket = run.tasks.submit("jobs", {"b": 2})
        ticket.cancel()
        again = ticket.rerun(input={"b": 3})
        assert (again.data["rerunOf"], again.data["input"], again.data["state"]) == (ticket.id, {"b": 3}, "QUEUED")
        run.cancel()
        with pytest.raises(ScopeCancelledError):
            ticket.rerun()
