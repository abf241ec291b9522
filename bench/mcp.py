"""What MCP adds per tool call: claim + complete of ``--tasks`` tasks by one agent session, against the SDK.

One uvicorn process serves the API. In the same run, on two runs of the same WORK mailbox:

- **SDK**: ``AsyncRunstate`` claims one task (``run.tasks.claim``) and completes it
  (``claim.complete``), ``--tasks`` times (1,000);
- **MCP**: one ``ClientSession`` over stdio with a ``runstate mcp`` process calls
  ``task_claim`` then ``task_complete``, ``--tasks`` times. The server holds each claim
  (``claim.hold()``: the renewal task, the answer's ``cancellation`` field) as any agent's.

Each pair is timed on the client. ``mcp_call_overhead_p50_ms`` is (p50 of an MCP pair − p50
of an SDK pair) / 2: what one tool call costs beyond the HTTP call it makes. Issue 28's target
is 3 ms at most. ``--json PATH`` writes ``mcp_call_overhead_p50_ms``, ``mcp_tasks_per_s`` and
``sdk_tasks_per_s`` (and the p50s); ``--record`` appends a section to ``docs/benchmarks.md``;
``--profile PATH`` writes the MCP server's cProfile (its figures then carry the profiler's cost).

Run: ``.venv/bin/python -m bench.mcp`` (PostgreSQL at ``DATABASE_URL``, default the
``runstate_bench`` database).
"""

import argparse
import asyncio
import os
import statistics
import sys
import time

from bench.harness.env import RECORD_PATH, ROOT, git_revision, setup_django
from bench.harness.fixtures import http_fixture
from bench.harness.report import write_json
from bench.harness.servers import UvicornServer

MAILBOX = "bench-mcp"


async def sdk_pairs(url: str, key: str, tasks: int) -> tuple[list[float], float]:
    """Claim + complete ``tasks`` tasks through the SDK; return each pair's seconds and the wall time."""
    from runstate import AsyncRunstate

    async with AsyncRunstate(url, key) as rs:
        run = await rs.scopes.create(name="bench sdk")
        await run.tasks.submit_many(MAILBOX, [{"input": {"n": n}} for n in range(tasks)])
        pairs = []
        started = time.perf_counter()
        for _ in range(tasks):
            begin = time.perf_counter()
            (claim,) = await run.tasks.claim(MAILBOX)
            await claim.complete({"ok": True})
            pairs.append(time.perf_counter() - begin)
        return pairs, time.perf_counter() - started


async def mcp_pairs(url: str, key: str, tasks: int, profile: str | None = None) -> tuple[list[float], float]:
    """Claim + complete ``tasks`` tasks through one MCP session over stdio; same figures."""
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    from runstate import AsyncRunstate

    async with AsyncRunstate(url, key) as rs:
        run = await rs.scopes.create(name="bench mcp")
        await run.tasks.submit_many(MAILBOX, [{"input": {"n": n}} for n in range(tasks)])
    env = dict(os.environ, RUNSTATE_URL=url, RUNSTATE_API_KEY=key, PYTHONPATH=str(ROOT))
    server = ["-m", "runstate.cli", "mcp"]
    if profile:  # the server's own profile, written when the session closes
        server = ["-m", "cProfile", "-o", profile, *server]
    params = StdioServerParameters(command=sys.executable, args=server, env=env, cwd=str(ROOT))
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        pairs = []
        started = time.perf_counter()
        for _ in range(tasks):
            begin = time.perf_counter()
            claimed = await session.call_tool("task_claim", {"mailbox": MAILBOX, "runId": run.id})
            (claim,) = claimed.structured_content["claims"]
            done = await session.call_tool("task_complete", {"claimId": claim["claimId"], "outcome": {"ok": True}})
            if done.is_error:
                raise RuntimeError(done.structured_content)
            pairs.append(time.perf_counter() - begin)
        return pairs, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--profile", metavar="PATH", help="write the MCP server's cProfile to PATH")
    args = parser.parse_args(argv)

    setup_django()
    _, key = http_fixture("mcp")
    with UvicornServer(processes=1) as server:
        from runstate import Runstate

        with Runstate(server.url, key) as rs:
            rs.mailboxes.ensure(MAILBOX, mode="WORK")
        sdk, sdk_wall = asyncio.run(sdk_pairs(server.url, key, args.tasks))
        mcp, mcp_wall = asyncio.run(mcp_pairs(server.url, key, args.tasks, args.profile))

    sdk_p50, mcp_p50 = statistics.median(sdk) * 1000, statistics.median(mcp) * 1000
    overhead = (mcp_p50 - sdk_p50) / 2
    figures = json_figures(args.tasks, mcp_wall, sdk_wall, mcp_p50, sdk_p50)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        f"### MCP per-call overhead (`bench/mcp.py`), {when}, revision {git_revision()}",
        "",
        f"{args.tasks} tasks claimed and completed one at a time by one client, one uvicorn process, same run.",
        "",
        "| path | claim + complete p50 | tasks/s |",
        "| --- | ---: | ---: |",
        f"| SDK (`AsyncRunstate`) | {sdk_p50:.2f} ms | {figures['sdk_tasks_per_s']:,.0f} |",
        f"| MCP (`task_claim` + `task_complete`, stdio) | {mcp_p50:.2f} ms | {figures['mcp_tasks_per_s']:,.0f} |",
        "",
        f"MCP adds {overhead:.2f} ms per tool call at p50 (target: 3 ms at most).",
    ]
    print("\n".join(lines))
    if args.json:
        write_json(args.json, figures)
    if args.record:
        with RECORD_PATH.open("a") as out:
            out.write("\n" + "\n".join(lines) + "\n")
    return 0


def json_figures(tasks: int, mcp_wall: float, sdk_wall: float, mcp_p50: float, sdk_p50: float) -> dict:
    """Return what ``--json`` writes, from the tasks, each path's seconds and each path's p50 pair (ms)."""
    return {
        "mcp_call_overhead_p50_ms": round((mcp_p50 - sdk_p50) / 2, 3),
        "mcp_tasks_per_s": round(tasks / mcp_wall, 1),
        "sdk_tasks_per_s": round(tasks / sdk_wall, 1),
        "mcp_pair_p50_ms": round(mcp_p50, 3),
        "sdk_pair_p50_ms": round(sdk_p50, 3),
    }


if __name__ == "__main__":
    sys.exit(main())
