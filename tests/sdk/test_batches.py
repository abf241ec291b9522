"""Batch calls against the live service: ``submit_many`` splits at 1,000 and each request is all
or nothing; ``complete_many`` / ``renew_many`` answer each claim on its own.

Requests are counted by wrapping the real transport, so the split is seen on the wire.
"""

import asyncio

import httpx
import pytest

from coordination.models import Task
from runstate import (
    AsyncRunstate,
    ClaimResult,
    ConflictError,
    LeaseLostError,
    NotFoundError,
    Runstate,
    ScopeCancelledError,
    ValidationError,
)

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]


class CountingAsyncTransport(httpx.AsyncHTTPTransport):
    """The real async transport, recording each request's path and JSON body size."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[tuple[str, int]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        record(self.batches, request)
        return await super().handle_async_request(request)


class CountingTransport(httpx.HTTPTransport):
    """The real sync transport, recording like ``CountingAsyncTransport``."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[tuple[str, int]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        record(self.batches, request)
        return super().handle_request(request)


def record(batches: list[tuple[str, int]], request: httpx.Request) -> None:
    """Note a batch request: its path and how many items it carries."""
    path = request.url.path
    if path.endswith(("/tasks/batch", "/claims/complete", "/claims/renew")):
        body = httpx.Response(200, content=request.content).json()
        batches.append((path.rsplit("/v1", 1)[1], len(body.get("tasks") or body.get("items"))))


def tasks_of(run_id):
    return Task.objects.filter(run_id=run_id)


def test_submit_many_splits_at_1000_answers_in_order_and_resubmits_idempotently(sdk):
    items = [{"input": {"i": i}, "key": f"k{i}", "priority": i % 3} for i in range(2_500)]

    async def first():
        transport = CountingAsyncTransport()
        async with AsyncRunstate(transport=transport) as rs:
            await rs.mailboxes.ensure("jobs", mode="WORK")
            run = await rs.scopes.create()
            tickets = await run.tasks.submit_many("jobs", items)
        assert transport.batches == [("/mailboxes/jobs/tasks/batch", n) for n in (1_000, 1_000, 500)]
        return run.id, tickets

    run_id, tickets = asyncio.run(first())
    assert len(tickets) == 2_500
    assert [t.data["input"]["i"] for t in tickets] == list(range(2_500))
    assert [t.data["priority"] for t in tickets] == [i % 3 for i in range(2_500)]
    assert len({t.id for t in tickets}) == 2_500
    assert tasks_of(run_id).count() == 2_500

    transport = CountingTransport()
    with Runstate(transport=transport) as rs:
        again = rs.scope(run_id).tasks.submit_many("jobs", items)
        assert [t.id for t in again] == [t.id for t in tickets]
        assert rs.tasks.get(again[-1].id).status()["input"] == {"i": 2_499}
    assert [n for _, n in transport.batches] == [1_000, 1_000, 500]
    assert tasks_of(run_id).count() == 2_500, "an idempotent resubmit wrote tasks"


def test_submit_many_refuses_a_request_with_one_bad_item_and_writes_nothing(sdk):
    with Runstate() as rs:
        rs.mailboxes.ensure("jobs", mode="WORK")
        run = rs.scopes.create()
        bad = [{"input": {"i": 0}}, {"input": {"i": 1}, "max_attempts": 0}, {"input": {"i": 2}}]
        with pytest.raises(ValidationError) as excinfo:
            run.tasks.submit_many("jobs", bad)
        assert excinfo.value.code == "VALIDATION_ERROR" and excinfo.value.status_code == 400
        assert "tasks.1.maxAttempts" in excinfo.value.details
        assert tasks_of(run.id).count() == 0

        run.tasks.submit("jobs", {"a": 1}, key="taken")
        with pytest.raises(ConflictError) as excinfo:
            run.tasks.submit_many("jobs", [{"input": {}, "key": "fresh"}, {"input": {"a": 2}, "key": "taken"}])
        assert excinfo.value.code == "KEY_CONFLICT" and excinfo.value.details["index"] == 1
        assert tasks_of(run.id).count() == 1

        # Split: each request of 1,000 is atomic, the list is not; the index counts from the list's start.
        split = [{"input": {"i": i}} for i in range(1_010)]
        split[1_005]["expires_at"] = "2001-01-01T00:00:00Z"
        with pytest.raises(ValidationError) as excinfo:
            run.tasks.submit_many("jobs", split)
        assert excinfo.value.details["index"] == 1_005
        assert "tasks.1005.expiresAt" in excinfo.value.details, excinfo.value.details
        assert tasks_of(run.id).count() == 1 + 1_000

        with pytest.raises(ValueError, match="needs a run"):
            rs.tasks.submit_many("jobs", [{"input": {}}])
        assert run.tasks.submit_many("jobs", []) == []
        run.cancel()
        with pytest.raises(ScopeCancelledError):
            run.tasks.submit_many("jobs", [{"input": {}}])


def assert_refused(result: ClaimResult, claim_id: str, cls: type, code: str) -> None:
    """The item was refused with the SDK's own exception for ``code`` (not raised)."""
    assert isinstance(result, ClaimResult) and result.claim_id == claim_id
    assert not result.ok and result.task is None and result.claim is None
    assert type(result.error) is cls and result.error.code == code, result.error


def test_complete_many_answers_each_claim_on_its_own_async(sdk):
    async def scenario():
        async with AsyncRunstate() as rs:
            await rs.mailboxes.ensure("jobs", mode="WORK")
            run = await rs.scopes.create()
            await run.tasks.submit_many("jobs", [{"input": {"i": i}} for i in range(4)])
            claims = await run.tasks.claim("jobs", max=4)
            await claims[1].complete("first")  # now stale
            results = await rs.tasks.complete_many(  # no run needed
                [
                    (claims[0], {"ok": 0}),
                    (claims[1].id, "again"),
                    ("c_nonsense", None),
                    (claims[2], None),
                ]
            )
            assert [r.claim_id for r in results] == [claims[0].id, claims[1].id, "c_nonsense", claims[2].id]
            assert [r.ok for r in results] == [True, False, False, True]
            assert results[0].task["state"] == "SUCCEEDED" and results[0].task["outcome"] == {"ok": 0}
            assert results[3].task["outcome"] is None and results[3].error is None
            assert_refused(results[1], claims[1].id, LeaseLostError, "LEASE_LOST")
            assert_refused(results[2], "c_nonsense", NotFoundError, "NOT_FOUND")
            assert (await rs.tasks.get(claims[1].task_id).status())["outcome"] == "first"
            assert (await claims[3].renew())["task"]["state"] == "RUNNING"  # untouched
            with pytest.raises(ValueError, match="twice"):
                await rs.tasks.complete_many([(claims[3], 1), (claims[3].id, 2)])
            assert await rs.tasks.complete_many([]) == []

    asyncio.run(scenario())


def test_complete_many_answers_each_claim_on_its_own_sync(sdk):
    with Runstate() as rs:
        rs.mailboxes.ensure("jobs", mode="WORK")
        run = rs.scopes.create()
        run.tasks.submit_many("jobs", [{"input": {"i": i}} for i in range(3)])
        claims = run.tasks.claim("jobs", max=3)
        claims[0].complete()
        results = run.tasks.complete_many([(claim, {"n": n}) for n, claim in enumerate(claims)])
        assert [r.ok for r in results] == [False, True, True]
        assert_refused(results[0], claims[0].id, LeaseLostError, "LEASE_LOST")
        assert [r.task["outcome"] for r in results[1:]] == [{"n": 1}, {"n": 2}]
        # A run that refuses work refuses each item with its own code.
        run.tasks.submit("jobs", {})
        (late,) = run.tasks.claim("jobs")
        run.cancel()
        (refused,) = run.tasks.complete_many([(late, None)])
        assert_refused(refused, late.id, ScopeCancelledError, "SCOPE_CANCELLED")


def test_renew_many_answers_each_claim_on_its_own_and_updates_handles_sync(sdk):
    with Runstate() as rs:
        rs.mailboxes.ensure("jobs", mode="WORK", lease_ttl_ms=5_000)
        run = rs.scopes.create()
        tickets = run.tasks.submit_many("jobs", [{"input": {"i": i}} for i in range(3)])
        first, stale, cancelled = run.tasks.claim("jobs", max=3)
        before = first.lease_expires_at
        stale.complete()
        tickets[2].cancel(reason="enough")
        results = rs.tasks.renew_many([first, stale.id, cancelled], lease_ttl_ms=600_000)
        assert [r.ok for r in results] == [True, False, True]
        assert results[0].claim["claimId"] == first.id and results[0].task is None
        assert first.lease_expires_at > before, "the handle was not updated"
        assert_refused(results[1], stale.id, LeaseLostError, "LEASE_LOST")
        assert results[2].claim["cancellationRequested"] is True and cancelled.cancellation_requested
        assert first.cancellation_requested is False
        with pytest.raises(ValueError, match="twice"):
            rs.tasks.renew_many([first, first.id])


def test_renew_many_answers_each_claim_on_its_own_async(sdk):
    async def scenario():
        async with AsyncRunstate() as rs:
            await rs.mailboxes.ensure("jobs", mode="WORK")
            run = await rs.scopes.create()
            await run.tasks.submit_many("jobs", [{"input": {}} for _ in range(2)])
            held, lost = await run.tasks.claim("jobs", max=2)
            await lost.release()
            results = await run.tasks.renew_many([held, lost])
            assert results[0].ok and results[0].claim["task"]["state"] == "RUNNING"
            assert_refused(results[1], lost.id, LeaseLostError, "LEASE_LOST")
            await run.cancel()
            (refused,) = await run.tasks.renew_many([held])
            assert_refused(refused, held.id, ScopeCancelledError, "SCOPE_CANCELLED")

    asyncio.run(scenario())
