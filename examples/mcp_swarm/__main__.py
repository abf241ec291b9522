"""Scripted agents (no LLM) coordinating through ``runstate mcp``: plan, review, judge, cancel.

Every agent is an MCP client of its own ``runstate mcp`` process over stdio, as Claude Code
or any agent framework would be; they share nothing but runstate. A planner fans reviews
out as a quorum group, three reviewers claim and do them (heartbeating between steps), a
judge records verdicts until the group is decided, and the planner's cancel of the run
stops everything left. ``RUNSTATE_URL`` and ``RUNSTATE_API_KEY`` (or ``--url`` / ``--key``,
default: ``var/dev-api-key`` of ``scripts/start``) say where runstate is.
"""

import argparse
import asyncio
import json
import os
import sys
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from examples.review_swarm.reviewer import dev_api_key_file

ROOT = Path(__file__).resolve().parents[2]
MAILBOX = "mcp-reviews"


class Refused(Exception):
    """A tool answered isError: ``code`` and the server's ``nextStep``."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(f"{error['code']}: {error['message']} ({error['nextStep']})")
        self.code = error["code"]


@asynccontextmanager
async def agent(url: str, key: str):
    """One agent: an MCP session with a ``runstate mcp`` process of its own."""
    env = dict(os.environ, RUNSTATE_URL=url, RUNSTATE_API_KEY=key)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    params = StdioServerParameters(command=sys.executable, args=["-m", "runstate.cli", "mcp"], env=env, cwd=str(ROOT))
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        yield session


async def call(session: ClientSession, tool: str, **arguments: Any) -> dict[str, Any]:
    """Call a tool and return its structured answer; raise ``Refused`` when it answered isError."""
    result = await session.call_tool(tool, arguments)
    body = result.structured_content or json.loads(result.content[0].text)
    if result.is_error:
        raise Refused(body["error"])
    return body


async def plan(session: ClientSession, reviews: int, threshold: int) -> tuple[str, dict[str, Any], list[str]]:
    """Create the run and the quorum group, and fan the reviews out as its members."""
    await call(session, "mailbox_ensure", name=MAILBOX, mode="WORK", leaseTtlMs=6000)
    run = (await call(session, "run_create", name="mcp swarm"))["run"]
    group = (
        await call(
            session,
            "group_create",
            mailbox=MAILBOX,
            condition="N_ACCEPTED",
            threshold=threshold,
            expectedMembers=reviews,
            parentScopeId=run["id"],
            name="approve the release",
        )
    )["group"]
    members = []
    for pr in range(1, reviews + 1):
        task = (await call(session, "group_submit", groupId=group["id"], input={"pr": pr}, key=f"pr-{pr}"))["task"]
        members.append(task["id"])
    print(f"planner: run {run['id']}, {reviews} reviews in group {group['id']} (N_ACCEPTED, threshold {threshold})")
    return run["id"], group, members


async def review(session: ClientSession, name: str, gate: str) -> None:
    """Claim reviews of the group's run and do them until there are none, or the run is stopped."""
    while True:
        try:
            answer = await call(session, "task_claim", mailbox=MAILBOX, runId=gate, waitMs=2000)
        except Refused as refused:
            print(f"{name}: stopping, the run is {refused.code}")
            return
        if not answer["claims"]:
            return
        for claim in answer["claims"]:
            pr = claim["task"]["input"]["pr"]
            stopped = False
            for _ in range(3):  # three steps of "reading the diff"
                await asyncio.sleep(0.1)
                if (await call(session, "task_heartbeat", claimId=claim["claimId"]))["cancellationRequested"]:
                    stopped = True
                    break
            approve = pr % 3 != 0
            done = await call(
                session, "task_complete", claimId=claim["claimId"], outcome=None if stopped else {"approve": approve}
            )
            word = "stopped on cancellation" if stopped else ("approves" if approve else "rejects")
            print(f"{name}: PR {pr} {word} -> {done['task']['state']}")


async def judge(session: ClientSession, group_id: str, members: list[str]) -> dict[str, Any]:
    """Record a verdict on each finished review, in order, until the group is decided."""
    for task_id in members:
        task = (await call(session, "task_result", taskId=task_id, timeoutMs=30_000))["task"]
        if task["state"] != "SUCCEEDED":
            continue
        verdict = "accept" if (task["outcome"] or {}).get("approve") else "reject"
        decided = (await call(session, "group_verdict", groupId=group_id, taskId=task_id, verdict=verdict))["verdict"]
        print(f"judge: {verdict} PR {task['input']['pr']}")
        if decided["groupState"] == "FINALIZED":
            break
    return (await call(session, "group_wait", groupId=group_id, timeoutMs=30_000))["group"]


async def main(url: str, key: str, reviews: int, threshold: int) -> int:
    """Run the swarm; return 0 when the group was approved."""
    async with agent(url, key) as planner, agent(url, key) as judge_session:
        run_id, group, members = await plan(planner, reviews, threshold)
        async with agent(url, key) as a, agent(url, key) as b, agent(url, key) as c:
            reviewers = [
                review(session, name, group["scopeId"]) for name, session in zip("abc", (a, b, c), strict=True)
            ]
            decision, *_ = await asyncio.gather(judge(judge_session, group["id"], members), *reviewers)
            print(f"group {decision['state']}: {decision['outcome']} ({decision['outcomeReason']})")
            await call(planner, "run_cancel", runId=run_id, reason="release decided")
            print(f"planner: cancelled run {run_id}")
        counts: dict[str, int] = {}
        for member in decision["members"]:
            label = member["verdict"] or member["state"]
            counts[label] = counts.get(label, 0) + 1
        print("members: " + ", ".join(f"{n} {label}" for label, n in sorted(counts.items())))
        return 0 if decision["outcome"] == "SUCCESS" else 1


def default_key() -> str | None:
    """Return the development key ``scripts/start`` wrote, if any."""
    path = dev_api_key_file()
    return path.read_text().strip() if path.exists() else None


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m examples.mcp_swarm", description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("RUNSTATE_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--key", default=os.environ.get("RUNSTATE_API_KEY") or default_key())
    parser.add_argument("--reviews", type=int, default=6)
    parser.add_argument("--threshold", type=int, default=2)
    args = parser.parse_args()
    if not args.key:
        parser.error("no API key: pass --key, set RUNSTATE_API_KEY, or run scripts/start first")
    sys.exit(asyncio.run(main(args.url, args.key, args.reviews, args.threshold)))
