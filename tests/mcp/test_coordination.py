"""Groups, barriers, timers, shared limits and messages through real MCP sessions."""

import asyncio
import time

from runstate import Runstate
from tests.mcp.conftest import call, stdio_session


def test_a_judges_verdicts_decide_a_group_that_another_session_waits_on(sdk):
    rs = Runstate()
    mailbox = f"reviews-{time.monotonic_ns()}"
    rs.mailboxes.ensure(mailbox, mode="WORK")
    rs.close()

    async def main():
        async with stdio_session(sdk.url, sdk.api_key) as judge, stdio_session(sdk.url, sdk.api_key) as reviewer:
            error, body = await call(judge, "group_create", mailbox=mailbox, condition="N_ACCEPTED", threshold=2)
            assert not error, body
            group = body["group"]
            members = []
            for n in range(3):
                error, body = await call(judge, "group_submit", groupId=group["id"], input={"n": n}, key=f"m{n}")
                members.append(body["task"]["id"])
            waiting = asyncio.create_task(call(reviewer, "group_wait", groupId=group["id"], timeoutMs=20_000))
            reviewed = []
            for _ in range(2):
                error, body = await call(judge, "task_claim", mailbox=mailbox, runId=group["scopeId"])
                claim = body["claims"][0]
                error, body = await call(judge, "task_complete", claimId=claim["claimId"], outcome="looks good")
                assert not error and body["task"]["state"] == "SUCCEEDED", body
                reviewed.append(claim["task"]["id"])
            for task_id in reviewed:
                error, body = await call(judge, "group_verdict", groupId=group["id"], taskId=task_id, verdict="accept")
                assert not error, body
            assert body["verdict"]["groupState"] == "FINALIZED" and body["verdict"]["outcome"] == "SUCCESS"
            error, decided = await waiting
            assert not error and decided["group"]["outcome"] == "SUCCESS", decided
            states = {member["taskId"]: member["state"] for member in decided["group"]["members"]}
            (unfinished,) = set(members) - set(reviewed)
            assert states[unfinished] == "CANCELLED"

    asyncio.run(main())


def test_a_barrier_of_three_sessions_releases_all_three(sdk):
    rs = Runstate()
    run = rs.scopes.create(name="barrier")
    rs.close()

    async def agent(name, barrier_id):
        async with stdio_session(sdk.url, sdk.api_key) as session:
            error, body = await call(session, "barrier_arrive", barrierId=barrier_id, key=name)
            assert not error, body
            return await call(session, "barrier_wait", barrierId=barrier_id, timeoutMs=20_000)

    async def main():
        async with stdio_session(sdk.url, sdk.api_key) as session:
            error, body = await call(session, "barrier_create", runId=run.id, target=3)
            assert not error, body
        return await asyncio.gather(*(agent(name, body["barrier"]["id"]) for name in ("a", "b", "c")))

    for error, body in asyncio.run(main()):
        assert not error and body["barrier"]["state"] == "RELEASED", body


def test_timers_limits_and_messages_through_one_session(sdk):
    rs = Runstate()
    run = rs.scopes.create(name="limits")
    suffix = time.monotonic_ns()
    pool, quota, queue = f"gpu-{suffix}", f"llm-{suffix}", f"inbox-{suffix}"
    rs.pools.put(pool, capacity=1)
    rs.quotas.put(quota, limit=1, period_ms=3_600_000)
    run.budgets.create("tokens", 100)
    rs.mailboxes.ensure(queue, mode="QUEUE")
    rs.close()

    async def main():
        async with stdio_session(sdk.url, sdk.api_key) as session:
            error, body = await call(session, "timer_create", runId=run.id, at="2000-01-01T00:00:00Z")
            assert not error, body
            error, body = await call(session, "timer_wait", timerId=body["timer"]["id"], timeoutMs=10_000)
            assert not error and body["timer"]["state"] == "ACKNOWLEDGED", body

            error, body = await call(session, "pool_acquire", pool=pool, runId=run.id)
            assert not error, body
            lease_id = body["lease"]["leaseId"]
            assert body["cancellation"] == []  # a held lease: answers carry the field
            error, body = await call(session, "pool_acquire", pool=pool, runId=run.id)
            assert error and body["error"]["code"] == "POOL_EXHAUSTED" and body["error"]["nextStep"], body
            error, body = await call(session, "pool_release", leaseId=lease_id)
            assert not error, body
            assert "cancellation" not in body

            error, body = await call(session, "quota_take", quota=quota, runId=run.id)
            assert not error and body["take"]["granted"], body
            error, body = await call(session, "quota_take", quota=quota, runId=run.id)
            assert error and body["error"]["code"] == "QUOTA_EXHAUSTED", body

            error, body = await call(session, "budget_reserve", budget="tokens", runId=run.id, amount=60)
            assert not error, body
            reservation_id = body["reservation"]["reservationId"]
            error, body = await call(session, "budget_reserve", budget="tokens", runId=run.id, amount=60)
            assert error and body["error"]["code"] == "BUDGET_EXHAUSTED", body
            error, body = await call(session, "budget_commit", reservationId=reservation_id, amount=25)
            assert not error, body

            error, body = await call(session, "message_send", mailbox=queue, runId=run.id, body={"hi": 1})
            assert not error, body
            error, body = await call(session, "message_receive", mailbox=queue, runId=run.id, waitMs=5000)
            (delivery,) = body["deliveries"]
            assert delivery["body"] == {"hi": 1}
            error, body = await call(session, "message_complete", deliveryId=delivery["deliveryId"])
            assert not error and body["message"]["state"] == "COMPLETED", body

    asyncio.run(main())
