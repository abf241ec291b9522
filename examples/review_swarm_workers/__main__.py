r"""Run the review swarm with its drafts written by ``runstate worker`` processes (no Celery).

    scripts/start                                                        # terminal 1
    .venv/bin/python -m examples.review_swarm_workers                    # terminal 2
    # terminal 3, with the run id terminal 2 printed:
    export RUNSTATE_API_KEY=$(cat var/dev-api-key) RUNSTATE_SCOPE_ID=<run id>
    .venv/bin/runstate worker examples.review_swarm_workers.handlers:draft \
        --mailbox worker-drafts --scope $RUNSTATE_SCOPE_ID --concurrency 4

The same swarm as ``examples.review_swarm``: a task group of 12 drafts (``N_ACCEPTED``,
threshold 5) under a run. Its members are tasks in the ``worker-drafts`` mailbox whose run is
the group's own run (the gate): workers attach to that run, whose id this process prints.
This process is the reviewer; the fifth acceptance decides the group, and in that same
transaction runstate cancels the gate run. The drafts still being written are cancelled
(their handlers see the signal at the next renewal), those never started too, and the
workers, refused by the cancelled run, exit on their own.

Options: ``--url`` (``RUNSTATE_URL``), ``--key`` (``RUNSTATE_API_KEY``, default: the
development key in ``var/dev-api-key``), ``--drafts``, ``--accept``, ``--min-score``,
``--topic``, ``--start-timeout`` (default 300 s: time to start a worker).
"""

import asyncio
import sys

from examples.review_swarm.reviewer import (
    check_service,
    parse_args,
    report,
    review,
    say,
    submit_swarm,
    wait_for_writers,
)
from examples.review_swarm_workers import MAILBOX
from runstate import AsyncRunstate

WORKER = (
    ".venv/bin/runstate worker examples.review_swarm_workers.handlers:draft "
    "--mailbox {mailbox} --scope $RUNSTATE_SCOPE_ID --concurrency 4"
)


async def main(argv: list[str] | None = None) -> int:
    """Run the swarm once; return 0 when the group succeeded."""
    args = parse_args("python -m examples.review_swarm_workers", __doc__.splitlines()[0], argv, start_timeout=300)
    async with AsyncRunstate(args.url, args.key) as rs:
        await check_service(rs)
        await rs.mailboxes.ensure(MAILBOX, mode="WORK", lease_ttl_ms=6000)
        run = await rs.scopes.create(name="review swarm (runstate worker)")
        say(f"run {run.id}")
        group, tickets = await submit_swarm(run, args, MAILBOX)

        # Workers must attach to the group's own run to receive its members.
        group_run_id = (await group.status())["scopeId"]
        say(f"submitted {len(tickets)} drafts; start workers on the group's run:")
        print(
            f"\n    export RUNSTATE_URL={rs.config.base_url} RUNSTATE_API_KEY={args.key_in_shell}"
            f"\n    export RUNSTATE_SCOPE_ID={group_run_id}"
            f"\n    {WORKER.format(mailbox=MAILBOX)}\n",
            flush=True,
        )
        if not await wait_for_writers(group, args.start_timeout):
            print(
                f"No draft started within {args.start_timeout:g} s: no worker on run {group_run_id}.", file=sys.stderr
            )
            await run.cancel(reason="no worker")
            return 2

        finished = await review(group, tickets, args.min_score)
        return await report(group, finished)


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
