"""The client surface against the live service: runs, tasks, claims, messages, groups, barriers, timers, events.

Each live error is checked for its class and code, so the mapping is proven end to end and
not only against a mock.
"""

import asyncio
import time
from datetime import UTC, datetime, timedelta

import pytest

from runstate import (
    AsyncRunstate,
    AuthenticationError,
    ConflictError,
    DeadlineExceededError,
    LeaseLostError,
    NotFoundError,
    PermissionDeniedError,
    Runstate,
    ScopeCancelledError,
    ScopeCompletedError,
    ValidationError,
)
from tests.waiting import WAIT_S

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]

# How long an event may take to become readable (see test_events_list_filters_and_follow): more
# than one state, since other suites' long transactions on a shared cluster hold it back too.
EVENT_BUDGET_S = 2 * WAIT_S


def test_runs_children_cancel_complete_and_their_refusals(sdk):
    with Runstate() as rs:
        parent = rs.scopes.create(name="parent", child_limit=1)
        child = parent.child(name="shard")
        assert child.data["parentId"] == parent.id
        with pytest.raises(ConflictError) as excinfo:
            parent.child()
        assert excinfo.value.code == "CHILD_LIMIT_REACHED"
        assert rs.scopes.list(parent_id=parent.id)["results"][0]["id"] == child.id

        assert parent.cancel(reason="stop")["storedState"] == "CANCELLED"
        assert parent.cancel()["cancelReason"] == "stop"  # idempotent
        with pytest.raises(ScopeCancelledError) as excinfo:
            parent.complete()
        assert excinfo.value.code == "SCOPE_CANCELLED" and isinstance(excinfo.value, ConflictError)

        done = rs.scopes.create()
        done.complete()
        with pytest.raises(ScopeCompletedError):
            done.cancel()
        with pytest.raises(ScopeCompletedError):
            done.child()

        rs.mailboxes.ensure("jobs", mode="WORK")
        late = rs.scopes.create(deadline=datetime.now(UTC) + timedelta(seconds=1))
        time.sleep(1.2)
        with pytest.raises(DeadlineExceededError):
            late.tasks.submit("jobs", {})  # refused at once, without waiting for a sweep
        assert late.status()["inactiveReason"] == "DEADLINE_EXCEEDED"

        with pytest.raises(ValidationError) as excinfo:
            rs.scopes.create(deadline=datetime.now(UTC) - timedelta(seconds=5))
        assert "deadline" in excinfo.value.details
        with pytest.raises(NotFoundError):
            rs.scope("01a00000-0000-7000-8000-000000000000").status()


def test_tasks_submit_idempotently_read_wait_and_cancel(sdk):
    async def scenario():
        async with AsyncRunstate() as rs:
            await rs.mailboxes.ensure("jobs", mode="WORK", max_attempts=2)
            assert (await rs.mailboxes.ensure("jobs", mode="WORK"))["maxAttempts"] == 2
            with pytest.raises(ConflictError) as excinfo:
                await rs.mailboxes.ensure("jobs", mode="QUEUE")
            assert excinfo.value.code == "MAILBOX_MODE_CONFLICT"
            run = await rs.scopes.create()
            first = await run.tasks.submit("jobs", {"a": 1}, key="k1", priority=5)
            again = await run.tasks.submit("jobs", {"a": 1}, key="k1")
            assert again.id == first.id
            with pytest.raises(ConflictError) as excinfo:
                await run.tasks.submit("jobs", {"a": 2}, key="k1")
            assert excinfo.value.code == "KEY_CONFLICT"

            ticket = rs.tasks.get(first.id)  # no request
            assert ticket.data is None
            assert (await ticket.status())["priority"] == 5
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                await ticket.result(timeout_ms=300)
            assert 0.25 < time.monotonic() - started < 5
            cancelled = await ticket.cancel(reason="not needed")
            assert cancelled["state"] == "CANCELLED"
            assert (await ticket.result(timeout_ms=0))["state"] == "CANCELLED"
            with pytest.raises(NotFoundError):
                await run.tasks.submit("nowhere", {})

    asyncio.run(scenario())


def test_claims_renew_complete_fail_release_and_fencing(sdk):
    with Runstate() as rs:
        rs.mailboxes.ensure("manual", mode="WORK", lease_ttl_ms=5000)
        run = rs.scopes.create()
        tasks = [run.tasks.submit("manual", {"n": n}) for n in range(3)]
        claims = run.tasks.claim("manual", max=3, worker_id="me")
        assert [c.task_id for c in claims] == [t.id for t in tasks]
        first, second, third = claims
        assert first.attempt == 1 and first.lease_expires_at is not None
        renewed = first.renew(lease_ttl_ms=10_000)
        assert renewed["cancellationRequested"] is False
        assert first.complete({"ok": True})["state"] == "SUCCEEDED"
        with pytest.raises(LeaseLostError) as excinfo:
            first.complete({"again": True})
        assert excinfo.value.code == "LEASE_LOST" and isinstance(excinfo.value, ConflictError)
        assert second.fail({"why": "flaky"}, retry=True)["state"] == "QUEUED"
        assert third.release()["state"] == "QUEUED"
        (retaken,) = run.tasks.claim("manual", max=1)
        assert retaken.attempt == 2
        with pytest.raises(LeaseLostError):
            second.renew()
        assert run.tasks.claim("manual", max=1, wait_ms=200) != []  # the released one
        assert run.tasks.claim("manual", max=1, wait_ms=200) == []
        run.cancel()
        with pytest.raises(ScopeCancelledError):
            run.tasks.claim("manual")
        with pytest.raises(ScopeCancelledError):
            retaken.renew()


def test_queue_messages_send_receive_complete_retry_reject(sdk):
    async def scenario():
        async with AsyncRunstate() as rs:
            await rs.mailboxes.ensure("inbox", mode="QUEUE")
            run = await rs.scopes.create()
            sent = await run.messages.send("inbox", {"hello": 1}, key="m1")
            assert (await run.messages.send("inbox", {"hello": 1}, key="m1"))["id"] == sent["id"]
            for n in (2, 3):
                await run.messages.send("inbox", {"hello": n})
            deliveries = await run.messages.receive("inbox", max=3, visibility_ms=5000)
            assert [d.body for d in deliveries] == [{"hello": 1}, {"hello": 2}, {"hello": 3}]
            one, two, three = deliveries
            assert (await one.complete())["state"] == "COMPLETED"
            assert (await two.retry(delay_ms=0))["state"] == "QUEUED"
            assert (await three.reject(reason="bad"))["state"] == "DEAD_LETTERED"
            (again,) = await run.messages.receive("inbox", wait_ms=2000)
            assert again.message_id == two.message_id and again.attempt == 2
            assert await run.messages.receive("inbox", wait_ms=100) == []
            assert (await rs.messages.retrieve(three.message_id))["deadLetterReason"] == "bad"
            await run.cancel()
            with pytest.raises(ScopeCancelledError):
                await again.complete()
            with pytest.raises(ScopeCancelledError):
                await run.messages.send("inbox", {})

    asyncio.run(scenario())


def test_groups_re_attach_join_seal_verdict_conflicts_and_wait_timeout(sdk):
    with Runstate() as rs:
        rs.mailboxes.ensure("reviews", mode="WORK")
        run = rs.scopes.create()
        group = run.groups.create(
            mailbox="reviews", condition="FIRST_ACCEPTED", parent_scope_id=run.id, name="pick one"
        )
        assert group.data["parentScopeId"] == run.id
        gate = rs.scope(group.data["scopeId"])
        loose = gate.tasks.submit("reviews", {"draft": "joined"})
        joined = group.join_task(loose.id)
        assert joined["groupState"] == "OPEN" and joined["groupId"] == group.id
        member = group.submit({"draft": "submitted"}, key="m")
        assert member.data["groupState"] == "OPEN"

        with pytest.raises(ConflictError) as excinfo:
            group.accept(member.id)
        assert excinfo.value.code == "TASK_NOT_SUCCEEDED"
        with pytest.raises(ConflictError) as excinfo:
            group.reject(member.id)
        assert excinfo.value.code == "TASK_NOT_FINISHED"
        with pytest.raises(TimeoutError):
            group.wait(timeout_ms=200)

        (claim,) = gate.tasks.claim("reviews", max=1)
        assert claim.task_id == loose.id  # oldest first
        claim.complete({"score": 9})
        again = rs.groups.by_id(group.id)  # re-attach: no request
        assert again.data is None
        verdict = again.accept(claim.task_id)
        assert verdict["groupState"] == "FINALIZED" and verdict["outcomeReason"] == "first_accepted"
        with pytest.raises(ConflictError) as excinfo:
            again.reject(claim.task_id)
        assert excinfo.value.code == "VERDICT_CONFLICT"
        assert again.wait(timeout_ms=1000)["outcome"] == "SUCCESS"
        assert again.close()["state"] == "FINALIZED"  # idempotent
        with pytest.raises(ConflictError) as excinfo:
            again.seal()
        assert excinfo.value.code == "GROUP_FINALIZED"
        with pytest.raises(ConflictError) as excinfo:
            again.submit({"late": True})
        assert excinfo.value.code == "GROUP_CLOSED"
        states = {m["taskId"]: m["state"] for m in again.status()["members"]}
        assert states == {loose.id: "SUCCEEDED", member.id: "CANCELLED"}  # the decision cancelled the rest
        with pytest.raises(ScopeCancelledError):
            gate.tasks.claim("reviews")  # the decision cancelled the gate: workers are refused


def test_barriers_epochs_release_and_cancel(sdk):
    async def scenario():
        async with AsyncRunstate() as rs:
            run = await rs.scopes.create()
            barrier = await run.barriers.create(target=2, name="merge")
            handle = rs.scope(run.id).barriers.get(barrier.id)
            assert handle.data is None
            await handle.arrive(key="a")
            assert (await handle.arrive(key="a"))["arrivals"] == 1  # idempotent per key
            with pytest.raises(TimeoutError):
                await handle.wait(timeout_ms=200)
            with pytest.raises(ConflictError) as excinfo:
                await handle.next_epoch()
            assert excinfo.value.code == "BARRIER_NOT_RELEASED"
            waiter = asyncio.create_task(handle.wait(timeout_ms=10_000))
            await asyncio.sleep(0.2)
            await handle.arrive(key="b")
            assert (await waiter)["state"] == "RELEASED"
            with pytest.raises(ConflictError) as excinfo:
                await handle.arrive(key="c")
            assert excinfo.value.code == "BARRIER_RELEASED"
            assert (await handle.next_epoch())["epoch"] == 2
            waiter = asyncio.create_task(handle.wait(timeout_ms=10_000))
            await asyncio.sleep(0.2)
            await run.cancel()
            with pytest.raises(ConflictError) as excinfo:
                await waiter
            assert excinfo.value.code == "BARRIER_CANCELLED"
            with pytest.raises(ConflictError) as excinfo:
                await handle.arrive(key="d")
            assert excinfo.value.code == "BARRIER_CANCELLED"
            with pytest.raises(ScopeCancelledError):
                await run.barriers.create(target=1)

    asyncio.run(scenario())


def test_timers_get_status_cancel_and_conflicts(sdk):
    with Runstate() as rs:
        run = rs.scopes.create()
        armed = run.timers.create(at=datetime.now(UTC) + timedelta(hours=1))
        handle = run.timers.get(armed.id)
        assert handle.fire_at is None  # a handle from get() loads it with status()
        assert handle.status()["state"] == "ARMED"
        assert handle.fire_at == armed.fire_at
        with pytest.raises(TimeoutError):
            handle.wait(timeout_ms=200)
        assert handle.cancel()["state"] == "CANCELLED"
        assert handle.cancel()["state"] == "CANCELLED"  # unchanged
        with pytest.raises(ConflictError) as excinfo:
            handle.wait(timeout_ms=200)
        assert excinfo.value.code == "INVALID_STATE"

        past = run.timers.create(at=datetime.now(UTC) - timedelta(seconds=1))  # fires at once
        fired = past.wait(timeout_ms=5_000)
        assert fired["state"] == "ACKNOWLEDGED" and isinstance(fired["fired_at"], datetime)
        with pytest.raises(ConflictError) as excinfo:
            past.cancel()
        assert excinfo.value.code == "TIMER_FIRED"
        run.cancel()
        with pytest.raises(ScopeCancelledError):
            run.timers.create(after_seconds=1)


def test_events_list_filters_and_follow(sdk):
    async def scenario():
        async with AsyncRunstate() as rs:
            first = await rs.events.list(limit=1000)
            cursor = first["nextCursor"]
            run = await rs.scopes.create()
            await run.child()
            await run.cancel()
            # Events show once every older transaction on the PostgreSQL cluster has ended (the
            # cursor never skips one; docs/internals.md), so collect with long-polls, allowing for
            # other test suites' long transactions when the cluster is shared.
            seen, after = [], cursor
            deadline = time.monotonic() + EVENT_BUDGET_S
            while len(seen) < 3 and time.monotonic() < deadline:
                page = await rs.events.list(
                    after=after, types=["run.created", "run.cancelled"], run_id=run.id, wait_ms=30_000
                )
                seen += page["events"]
                after = page["nextCursor"]
            assert [e["type"] for e in seen] == ["run.created", "run.created", "run.cancelled"]
            assert [e["runId"] == run.id for e in seen] == [True, False, True]

            started = time.monotonic()
            empty = await rs.events.list(after=after, run_id=run.id, wait_ms=300)
            assert empty["events"] == [] and time.monotonic() - started >= 0.25

            follow = rs.events.follow(after=cursor, types="run.cancelled")
            assert (await anext(follow))["runId"] == run.id
            later = asyncio.create_task(anext(follow))
            await asyncio.sleep(0.2)
            other = await rs.scopes.create()
            await other.cancel()
            assert (await asyncio.wait_for(later, EVENT_BUDGET_S))["runId"] == other.id
            await follow.aclose()

    asyncio.run(scenario())


def test_keys_without_permission_or_identity_are_refused(sdk, make_key):
    with Runstate(api_key="rs_nonsense_key") as rs, pytest.raises(AuthenticationError) as excinfo:
        rs.scopes.create()
    assert excinfo.value.status_code == 401 and excinfo.value.code == "UNAUTHENTICATED"

    with Runstate(api_key=make_key(["coordination_read"])) as reader:
        with pytest.raises(PermissionDeniedError) as excinfo:
            reader.mailboxes.ensure("jobs", mode="WORK")
        assert excinfo.value.code == "PERMISSION_DENIED"
        assert reader.health() == {"status": "ok"}

    with Runstate() as rs:
        run = rs.scopes.create()
        other = rs.scopes.create()
    with Runstate(api_key=make_key(["coordination_read", "coordination_write"], run_id=run.id)) as bound:
        assert bound.scope(run.id).status()["id"] == run.id
        with pytest.raises(NotFoundError):
            bound.scope(other.id).status()  # outside the bound run: never a hint that it exists


def test_the_sync_client_has_the_same_surface_as_the_async_one():
    import runstate

    pairs = [
        (runstate.AsyncRunstate, runstate.Runstate),
        (runstate.AsyncScope, runstate.Scope),
        (runstate.AsyncScopes, runstate.Scopes),
        (runstate.AsyncGroup, runstate.Group),
        (runstate.AsyncGroups, runstate.Groups),
        (runstate.AsyncBarrier, runstate.Barrier),
        (runstate.AsyncTimer, runstate.Timer),
        (runstate.AsyncTicket, runstate.Ticket),
        (runstate.AsyncClaim, runstate.Claim),
        (runstate.AsyncDelivery, runstate.Delivery),
        (runstate.AsyncTasks, runstate.Tasks),
        (runstate.AsyncMessages, runstate.Messages),
        (runstate.AsyncEvents, runstate.Events),
        (runstate.AsyncMailboxes, runstate.Mailboxes),
        (runstate.AsyncWorker, runstate.Worker),
    ]
    for async_cls, sync_cls in pairs:
        public = {name for name in dir(async_cls) if not name.startswith("_")} - {"aclose"}
        assert public <= set(dir(sync_cls)), (async_cls, public - set(dir(sync_cls)))


def test_events_stream_yields_sse_events_and_resumes_after_a_cursor(sdk):
    async def scenario():
        async with AsyncRunstate() as rs:
            cursor = (await rs.events.list(limit=1000))["nextCursor"]
            run = await rs.scopes.create()
            await run.child()
            await run.cancel()
            stream = rs.events.stream(after=cursor, run_id=run.id)
            seen = [await asyncio.wait_for(anext(stream), EVENT_BUDGET_S) for _ in range(3)]
            await stream.aclose()
            assert [e["type"] for e in seen] == ["run.created", "run.created", "run.cancelled"]
            # Resuming after the first event gives exactly the two that followed it.
            resumed = rs.events.stream(after=seen[0]["id"], run_id=run.id)
            again = [await asyncio.wait_for(anext(resumed), EVENT_BUDGET_S) for _ in range(2)]
            await resumed.aclose()
            assert [e["id"] for e in again] == [e["id"] for e in seen[1:]]
            with pytest.raises(NotFoundError):
                await anext(rs.events.stream(run_id="00000000-0000-7000-8000-000000000000"))

    asyncio.run(scenario())
