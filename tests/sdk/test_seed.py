"""Every Python snippet of the reference document runs as written against the service.

Each snippet is compiled verbatim with top-level ``await`` allowed and run in a namespace
holding ``rs = AsyncRunstate()`` (configured from RUNSTATE_URL / RUNSTATE_API_KEY) and what
the document's earlier snippets defined; what it prints is asserted.
"""

import ast
import asyncio
import re
from datetime import datetime

import pytest

from runstate import AsyncRunstate
from tests.sdk import seed_snippets

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]


async def run_snippet(source: str, namespace: dict) -> None:
    """Run ``source`` as the body of an async REPL cell in ``namespace``."""
    code = compile(source, "<reference document>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    result = eval(code, namespace)  # noqa: S307 - our own verbatim snippet
    if result is not None:
        await result


def test_groups_create_submit_close_review_and_wait(sdk, capsys):
    async def scenario():
        rs = AsyncRunstate()
        ns = {"rs": rs, "is_good_draft": lambda outcome: outcome["draft"] % 2 == 0}
        await run_snippet(seed_snippets.GROUP_CREATE_AND_SUBMIT, ns)
        first = capsys.readouterr().out

        # A worker attached to the group's run completes the members meanwhile.
        async def handler(ctx):
            return {"draft": ctx.input["draft"]}

        worker = asyncio.create_task(rs.scope(ns["group_run_id"]).consume("reviews", handler, concurrency=4))
        await run_snippet(seed_snippets.GROUP_VERDICTS_AND_WAIT, ns)
        second = capsys.readouterr().out
        # Finalizing cancelled the group's run: the worker stops on its own.
        summary = await asyncio.wait_for(worker, timeout=30)
        group = await ns["group"].status()
        await rs.aclose()
        return ns, first, second, summary, group

    ns, first, second, summary, group = asyncio.run(scenario())

    assert first == f"start workers with RUNSTATE_SCOPE_ID={ns['group_run_id']}\n"
    assert len(ns["tickets"]) == 12
    assert second == "SUCCESS threshold_reached\n"
    assert summary.stop_reason == "SCOPE_CANCELLED"
    assert group["state"] == "FINALIZED"
    verdicts = {m["key"]: m["verdict"] for m in group["members"] if m["verdict"]}
    assert [k for k, v in verdicts.items() if v == "ACCEPTED"] == [f"draft-{i}" for i in (0, 2, 4, 6, 8)]
    assert [k for k, v in verdicts.items() if v == "REJECTED"] == [f"draft-{i}" for i in (1, 3, 5, 7)]
    # The members nobody judged were completed by the worker or cancelled by the decision.
    assert {m["state"] for m in group["members"]} <= {"SUCCEEDED", "CANCELLED"}


def test_cancel_a_run_with_a_child_shard(sdk, capsys):
    async def scenario():
        rs = AsyncRunstate()
        ns = {"rs": rs}
        await run_snippet(seed_snippets.RUN_CANCEL, ns)
        run = await ns["run"].status()
        await rs.aclose()
        return ns, run

    ns, run = asyncio.run(scenario())

    assert capsys.readouterr().out == "ACTIVE INACTIVE\n"
    assert run["storedState"] == "CANCELLED"
    assert ns["status"]["inactiveReason"] == "CANCELLED"
    assert ns["status"]["inactiveRunId"] == ns["run"].id


def test_barrier_with_three_shards(sdk, capsys):
    async def scenario():
        rs = AsyncRunstate()
        ns = {"rs": rs, "run": await rs.scopes.create()}

        async def other_shard(key):
            while "barrier" not in ns:  # given barrier.id, once the coordinator created it
                await asyncio.sleep(0.01)
            handle = rs.scope(ns["run"].id).barriers.get(ns["barrier"].id)
            await asyncio.sleep(0.2)
            await handle.arrive(key=key)
            return await handle.wait(timeout_ms=30_000)

        _, view1, view3 = await asyncio.gather(
            run_snippet(seed_snippets.BARRIERS, ns), other_shard("shard-1"), other_shard("shard-3")
        )
        await rs.aclose()
        return ns, view1, view3

    ns, view1, view3 = asyncio.run(scenario())

    assert capsys.readouterr().out == "RELEASED 3/3\n"
    assert view1["state"] == view3["state"] == "RELEASED"
    assert ns["view"]["epoch"] == 1


def test_timer_with_a_short_delay(sdk, capsys):
    source = seed_snippets.TIMERS.replace("after_seconds=300", "after_seconds=1")
    assert source != seed_snippets.TIMERS

    async def scenario():
        rs = AsyncRunstate()
        ns = {"rs": rs, "run": await rs.scopes.create()}
        loop = asyncio.get_running_loop()
        started = loop.time()
        await run_snippet(source, ns)
        elapsed = loop.time() - started
        again = await ns["timer"].wait(timeout_ms=1_000)  # waiting is idempotent
        await rs.aclose()
        return ns, elapsed, again

    ns, elapsed, again = asyncio.run(scenario())

    out = capsys.readouterr().out.splitlines()
    fire_at = ns["timer"].fire_at
    fired_at = ns["fired"]["fired_at"]
    assert out == [f"fires at {fire_at.isoformat()}", f"follow-up check at {fired_at.isoformat()}"]
    assert isinstance(fire_at, datetime) and isinstance(fired_at, datetime)
    assert fired_at >= fire_at
    assert 0.8 <= elapsed < 10
    assert re.fullmatch(r"fires at \d{4}-\d\d-\d\dT[\d:.]+\+00:00", out[0])
    assert ns["fired"]["state"] == "ACKNOWLEDGED"
    assert again["fired_at"] == fired_at
