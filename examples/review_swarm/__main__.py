"""Run the review swarm against a running service, on the ``runstate`` SDK.

    RUNSTATE_TASK_MODULES=examples.review_swarm.tasks scripts/start      # terminal 1
    .venv/bin/python -m examples.review_swarm                            # terminal 2

A task group of 12 drafts (``N_ACCEPTED``, threshold 5) is created under a run; its members
are runstate tasks in the ``drafts`` mailbox, executed by the service's Celery worker
(``examples.review_swarm.tasks.write_draft``). This process is the reviewer: it reads each
finished draft, accepts it when its score is high enough and rejects it otherwise. The fifth
acceptance decides the group; in that same transaction runstate cancels the drafts still
being written (their handlers stop at their next heartbeat) and those never started.

Options: ``--url`` (``RUNSTATE_URL``, default http://127.0.0.1:8000), ``--key``
(``RUNSTATE_API_KEY``, default: the development key in ``var/dev-api-key``), ``--drafts``,
``--accept``, ``--min-score``, ``--topic``, ``--start-timeout``.
"""

import asyncio
import sys

from examples.review_swarm import MAILBOX
from examples.review_swarm.reviewer import (
    check_service,
    parse_args,
    report,
    review,
    say,
    submit_swarm,
    wait_for_writers,
)
from runstate import AsyncRunstate, ValidationError


async def main(argv: list[str] | None = None) -> int:
    """Run the swarm once; return 0 when the group succeeded."""
    args = parse_args("python -m examples.review_swarm", __doc__.splitlines()[0], argv)
    async with AsyncRunstate(args.url, args.key) as rs:
        await check_service(rs)
        await rs.mailboxes.ensure(MAILBOX, mode="WORK", lease_ttl_ms=6000)
        run = await rs.scopes.create(name="review swarm")
        say(f"run {run.id}")

        # The API validates input against the decorated task's schema: proof that it knows the binding.
        try:
            await run.tasks.submit(MAILBOX, {"topic": "x"})
        except ValidationError as refused:
            say(f"a draft without an angle is refused: {refused.status_code} {refused.details}")
        else:
            await run.cancel(reason="misconfigured")
            print(
                "The API accepted a draft the task's schema refuses, so it does not know the decorated task.\n"
                "Start the service with: RUNSTATE_TASK_MODULES=examples.review_swarm.tasks scripts/start",
                file=sys.stderr,
            )
            return 2

        group, tickets = await submit_swarm(run, args, MAILBOX)
        say(f"submitted {len(tickets)} drafts; Celery workers pick them up after commit")
        if not await wait_for_writers(group, args.start_timeout):
            print(
                f"No draft started within {args.start_timeout:g} s: is a Celery worker running "
                "(scripts/start without --no-worker, with RUNSTATE_TASK_MODULES=examples.review_swarm.tasks)?",
                file=sys.stderr,
            )
            await run.cancel(reason="no worker")
            return 2

        finished = await review(group, tickets, args.min_score)
        return await report(group, finished)


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
