"""The reviewer both review swarms share: it judges each finished draft, and the group decides.

It is plain SDK code (``runstate.AsyncRunstate``), as in the guide's "Task groups" section:
create a run and a group under it, submit the drafts, accept or reject each finished one,
wait for the decision. Who writes the drafts is the only difference between the examples:
the service's Celery worker (``examples.review_swarm``) or ``runstate worker`` processes
(``examples.review_swarm_workers``).
"""

import argparse
import asyncio
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

from runstate import AsyncGroup, AsyncRunstate, AsyncScope, AsyncTicket, JsonDict, TransportError

ROOT = Path(__file__).resolve().parents[2]
# The group fails with reason "deadline" if it has not decided by then.
GROUP_DEADLINE = timedelta(minutes=5)
# A draft's result is waited for a little longer than the group can live.
RESULT_TIMEOUT_MS = 6 * 60 * 1000


def parse_args(prog: str, description: str, argv: list[str] | None, **defaults: object) -> argparse.Namespace:
    """Read the options; the API key defaults to the development key ``scripts/start`` keeps."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--url", default=os.environ.get("RUNSTATE_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--key", default=os.environ.get("RUNSTATE_API_KEY"))
    parser.add_argument("--drafts", type=int, default=12)
    parser.add_argument("--accept", type=int, default=5)
    parser.add_argument("--min-score", type=int, default=4)
    parser.add_argument("--topic", default="durable timers for agent swarms")
    parser.add_argument("--start-timeout", type=float, default=30, help="seconds to wait for a first draft to start")
    parser.set_defaults(**defaults)
    args = parser.parse_args(argv)
    # How a shell gets the same key (printed for the workers of review_swarm_workers).
    args.key_in_shell = "<your key>"
    if not args.key:
        key_file = dev_api_key_file()
        if not key_file.exists():
            parser.error(f"no --key, no RUNSTATE_API_KEY and no {key_file}: is scripts/start running?")
        args.key = key_file.read_text().strip()
        shown = key_file.relative_to(ROOT) if key_file.is_relative_to(ROOT) else key_file
        args.key_in_shell = f"$(cat {shown})"
    return args


def dev_api_key_file() -> Path:
    """Return where ``scripts/start`` keeps the development key: ``var/dev-api-key`` (or under ``RUNSTATE_VAR_DIR``)."""
    return Path(os.environ.get("RUNSTATE_VAR_DIR", ROOT / "var")) / "dev-api-key"


def say(message: str) -> None:
    """Print a line with the time."""
    print(f"{datetime.now().strftime('%H:%M:%S.%f')[:-3]}  {message}", flush=True)


async def check_service(rs: AsyncRunstate) -> None:
    """Stop with a hint when nothing answers at the client's URL."""
    try:
        await rs.health()
    except TransportError as error:
        raise SystemExit(
            f"runstate does not answer at {rs.config.base_url} ({error}); start it with scripts/start"
        ) from None


async def submit_swarm(run: AsyncScope, args: argparse.Namespace, mailbox: str) -> tuple[AsyncGroup, list[AsyncTicket]]:
    """Create the group under ``run`` and submit one draft per angle; return the group and the tickets."""
    # Done when `accept` drafts are accepted. Knowing the member count up front, the group
    # closes itself on the last submit: from then on it can also fail as unreachable.
    group = await run.groups.create(
        mailbox=mailbox,
        condition="N_ACCEPTED",
        threshold=args.accept,
        expected_members=args.drafts,
        parent_scope_id=run.id,  # cancelling the run also closes the group
        deadline=datetime.now(UTC) + GROUP_DEADLINE,
        name="review swarm",
    )
    say(f"group {group.id}: {args.drafts} drafts, the first {args.accept} accepted win")
    tickets = []
    for angle in range(1, args.drafts + 1):
        # With a key the submit is idempotent: a retry never makes a second draft.
        tickets.append(await group.submit({"topic": args.topic, "angle": angle}, key=f"draft-{angle}"))
    return group, tickets


async def wait_for_writers(group: AsyncGroup, timeout_s: float) -> bool:
    """Return whether some draft left the queue within ``timeout_s`` (someone is writing them)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        status = await group.status()
        if status["state"] == "FINALIZED" or any(member["state"] != "QUEUED" for member in status["members"]):
            return True
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.3)


async def review(group: AsyncGroup, tickets: list[AsyncTicket], min_score: int) -> list[JsonDict]:
    """Judge each draft as soon as it is written, until the group decides; return every draft's final task.

    Accepting needs the member to have ``SUCCEEDED``. The verdict that decides the group also
    cancels, in the same transaction, the drafts still being written and those never started,
    so the remaining results arrive at once (``CANCELLED``) and are not judged.
    """
    decided = False
    finished = []
    for result in asyncio.as_completed([ticket.result(timeout_ms=RESULT_TIMEOUT_MS) for ticket in tickets]):
        task = await result
        finished.append(task)
        if decided or task["state"] != "SUCCEEDED":
            continue
        draft = task["outcome"]
        if draft["score"] >= min_score:
            verdict = await group.accept(task["id"])
        else:
            verdict = await group.reject(task["id"])
        judged = verdict["verdict"].lower()
        say(f"{judged:8} {draft['title']:45} score {draft['score']:2}  -> group {verdict['groupState']}")
        decided = verdict["groupState"] == "FINALIZED"
    return finished


async def report(group: AsyncGroup, finished: list[JsonDict]) -> int:
    """Print the decision and what it cancelled; return 0 when the group succeeded."""
    decision = await group.wait(timeout_ms=RESULT_TIMEOUT_MS)
    say(f"group {decision['state']}: {decision['outcome']} ({decision['outcomeReason']})")
    cancelled = [task for task in finished if task["state"] == "CANCELLED"]
    stopped = sum(1 for task in cancelled if task["startedAt"])
    accepted = sum(1 for member in decision["members"] if member["verdict"] == "ACCEPTED")
    say(
        f"{accepted} accepted; cancelled in the deciding transaction: {stopped} drafts mid-run "
        f"(their handlers are told at their next lease renewal; nothing more is recorded), "
        f"{len(cancelled) - stopped} never started"
    )
    return 0 if decision["outcome"] == "SUCCESS" else 1
