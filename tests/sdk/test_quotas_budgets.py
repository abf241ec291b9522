"""The SDK's quotas and budgets against the live service (sync and async)."""

import asyncio

import pytest

from runstate import (
    AsyncRunstate,
    BudgetExhaustedError,
    ConflictError,
    QuotaExhaustedError,
    Runstate,
    ScopeCancelledError,
    ValidationError,
)

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]


def test_quotas_put_take_and_refuse(sdk):
    with Runstate() as rs:
        run = rs.scopes.create()
        created = rs.quotas.put("openai", limit=2, period_ms=3_600_000)
        assert (created["limit"], created["available"]) == (2, 2)
        assert rs.quotas.take("openai", run_id=run.id) == {"granted": True, "remaining": 1}
        assert rs.quotas.take("openai", run_id=run.id, amount=1, wait_ms=0)["remaining"] == 0
        with pytest.raises(QuotaExhaustedError) as excinfo:
            rs.quotas.take("openai", run_id=run.id, wait_ms=1000)  # the token is 30 minutes away
        assert excinfo.value.code == "QUOTA_EXHAUSTED" and excinfo.value.details["retryAfterMs"] > 1000
        with pytest.raises(ValidationError):
            rs.quotas.take("openai", run_id=run.id, amount=3)
        assert rs.quotas.get("openai")["available"] == 0


def test_async_quota_take_waits_for_the_refill(sdk):
    async def main():
        async with AsyncRunstate() as rs:
            run = await rs.scopes.create()
            await rs.quotas.put("fast", limit=10, period_ms=500)
            await rs.quotas.take("fast", run_id=run.id, amount=10)
            granted = await rs.quotas.take("fast", run_id=run.id, amount=3, wait_ms=5000)
            assert granted["granted"] is True

    asyncio.run(main())


def test_budgets_reserve_as_a_context_manager(sdk):
    with Runstate() as rs:
        run = rs.scopes.create()
        child = run.child()
        parent_budget = run.budgets.create("usd", 1000)
        assert parent_budget.data["remaining"] == 1000
        with rs.budgets.reserve("usd", run_id=child.id, amount=300) as reservation:
            assert parent_budget.status()["reserved"] == 300
            reservation.spend(120)
            reservation.spend(5)
        assert reservation.data["state"] == "COMMITTED" and reservation.data["committed"] == 125
        assert (parent_budget.status()["spent"], parent_budget.data["reserved"]) == (125, 0)

        with child.budgets.reserve("usd", amount=50) as unused:  # nothing reported: released
            pass
        assert unused.data["state"] == "RELEASED"

        with pytest.raises(RuntimeError), rs.budgets.reserve("usd", run_id=child.id, amount=100) as failed:
            failed.spend(10)  # spent before the failure: still committed
            raise RuntimeError("boom")
        assert failed.data["state"] == "COMMITTED" and failed.data["committed"] == 10

        with rs.budgets.reserve("usd", run_id=child.id, amount=10) as explicit:
            explicit.commit(7)
        assert explicit.data["committed"] == 7
        assert parent_budget.status()["spent"] == 142

        with pytest.raises(BudgetExhaustedError) as excinfo:
            rs.budgets.reserve("usd", run_id=child.id, amount=10_000).open()
        assert excinfo.value.code == "BUDGET_EXHAUSTED"
        assert excinfo.value.details == {"remaining": 858, "budgetId": parent_budget.id, "runId": run.id}
        assert parent_budget.set_limit(10_142)["remaining"] == 10_000  # spent 142
        held = rs.budgets.reserve("usd", run_id=child.id, amount=9_000).open()
        with pytest.raises(ValidationError):
            parent_budget.set_limit(9_141)  # below spent 142 + reserved 9,000
        held.release()
        assert parent_budget.status()["limit"] == 10_142
        with pytest.raises(ConflictError) as excinfo:
            run.budgets.create("usd", 5)
        assert excinfo.value.code == "KEY_CONFLICT"

        kept = rs.budgets.reserve("usd", run_id=child.id, amount=1, key="k").open()
        again = rs.budgets.reserve("usd", run_id=child.id, amount=1, key="k").open()
        assert kept.id == again.id
        run.cancel()
        with pytest.raises(ScopeCancelledError):
            rs.budgets.reserve("usd", run_id=child.id, amount=1).open()
        assert kept.commit(1)["state"] == "COMMITTED"  # allowed under the cancelled run


def test_async_budgets(sdk):
    async def main():
        async with AsyncRunstate() as rs:
            run = await rs.scopes.create()
            budget = await run.budgets.create("tokens", 100)
            async with run.budgets.reserve("tokens", amount=40) as reservation:
                reservation.spend(40)
            assert (await budget.status())["spent"] == 40
            assert (await rs.budgets.get(budget.id).status())["remaining"] == 60

    asyncio.run(main())
