"""Run the review swarm against a running service, over HTTP only.

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
``--accept``, ``--min-score``, ``--topic``.
"""

import argparse
import os
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx

from examples.review_swarm import MAILBOX

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 30


def parse_args(argv):
    """Read the options; the API key defaults to the development key `scripts/start` keeps."""
    parser = argparse.ArgumentParser(prog="python -m examples.review_swarm", description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("RUNSTATE_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--key", default=os.environ.get("RUNSTATE_API_KEY"))
    parser.add_argument("--drafts", type=int, default=12)
    parser.add_argument("--accept", type=int, default=5)
    parser.add_argument("--min-score", type=int, default=4)
    parser.add_argument("--topic", default="durable timers for agent swarms")
    args = parser.parse_args(argv)
    if not args.key:
        key_file = Path(os.environ.get("RUNSTATE_VAR_DIR", ROOT / "var")) / "dev-api-key"
        if not key_file.exists():
            parser.error(f"no --key, no RUNSTATE_API_KEY and no {key_file}: is scripts/start running?")
        args.key = key_file.read_text().strip()
    return args


class Api:
    """A thin JSON client: raise with the error envelope on anything but the expected status."""

    def __init__(self, url: str, key: str):
        self.http = httpx.Client(
            base_url=f"{url.rstrip('/')}/v1", headers={"Authorization": f"Bearer {key}"}, timeout=40
        )

    def call(self, method: str, path: str, body=None, expect=(200, 201)):
        response = self.http.request(method, path, json=body)
        if response.status_code not in expect:
            raise SystemExit(f"{method} {path} answered {response.status_code}: {response.text}")
        return response.json()


def say(message: str) -> None:
    """Print a line with the time."""
    print(f"{datetime.now().strftime('%H:%M:%S.%f')[:-3]}  {message}", flush=True)


def main(argv=None) -> int:
    """Run the swarm once; return 0 when the group succeeded."""
    args = parse_args(argv)
    api = Api(args.url, args.key)
    try:
        api.http.get("/healthz").raise_for_status()
    except httpx.HTTPError as error:
        raise SystemExit(f"runstate does not answer at {args.url} ({error}); start it with scripts/start") from None

    api.call("PUT", f"/mailboxes/{MAILBOX}", {"mode": "WORK", "leaseTtlMs": 6000})
    run = api.call("POST", "/runs", {"name": "review swarm"})
    say(f"run {run['id']}")

    # The API validates input against the decorated task's schema: proof that it knows the binding.
    bad = api.http.post(f"/mailboxes/{MAILBOX}/tasks", json={"runId": run["id"], "input": {"topic": "x"}})
    if bad.status_code != 400:
        api.call("POST", f"/runs/{run['id']}/cancel", {"reason": "misconfigured"})
        print(
            "The API accepted a draft the task's schema refuses, so it does not know the decorated task.\n"
            "Start the service with: RUNSTATE_TASK_MODULES=examples.review_swarm.tasks scripts/start",
            file=sys.stderr,
        )
        return 2
    say(f"a draft without an angle is refused: {bad.status_code} {bad.json()['error']['details']}")

    deadline = (datetime.now(UTC) + timedelta(minutes=5)).isoformat()
    group = api.call(
        "POST",
        "/groups",
        {
            "mailbox": MAILBOX,
            "condition": "N_ACCEPTED",
            "threshold": args.accept,
            "expectedMembers": args.drafts,
            "parentScopeId": run["id"],
            "deadline": deadline,
            "name": "review swarm",
        },
    )
    say(f"group {group['id']}: {args.drafts} drafts, the first {args.accept} accepted win")
    for angle in range(1, args.drafts + 1):
        api.call(
            "POST",
            f"/groups/{group['id']}/members",
            {"input": {"topic": args.topic, "angle": angle}, "key": f"draft-{angle}"},
        )
    say(f"submitted {args.drafts} drafts; Celery workers pick them up after commit")

    started_at = time.monotonic()
    reviewed: set[str] = set()
    seen_running = False
    while True:
        status = api.call("GET", f"/groups/{group['id']}")
        seen_running = seen_running or any(m["state"] != "QUEUED" for m in status["members"])
        if status["state"] == "FINALIZED":
            break
        if not seen_running and time.monotonic() - started_at > START_TIMEOUT_S:
            print(
                f"No draft started within {START_TIMEOUT_S} s: is a Celery worker running "
                "(scripts/start without --no-worker, with RUNSTATE_TASK_MODULES=examples.review_swarm.tasks)?",
                file=sys.stderr,
            )
            api.call("POST", f"/runs/{run['id']}/cancel", {"reason": "no worker"})
            return 2
        for member in status["members"]:
            if member["state"] != "SUCCEEDED" or member["verdict"] or member["taskId"] in reviewed:
                continue
            reviewed.add(member["taskId"])
            draft = api.call("GET", f"/tasks/{member['taskId']}")["outcome"]
            verdict = "accept" if draft["score"] >= args.min_score else "reject"
            decided = api.call("POST", f"/groups/{group['id']}/members/{member['taskId']}/{verdict}")
            say(f"{verdict:6} {draft['title']:45} score {draft['score']:2}  -> group {decided['groupState']}")
            if decided["groupState"] == "FINALIZED":
                break
        else:
            time.sleep(0.3)

    final = api.call("GET", f"/groups/{group['id']}")
    say(f"group {final['state']}: {final['outcome']} ({final['outcomeReason']})")
    stopped = never_started = 0
    for member in final["members"]:
        if member["state"] != "CANCELLED":
            continue
        task = api.call("GET", f"/tasks/{member['taskId']}")
        if task["startedAt"]:
            stopped += 1
        else:
            never_started += 1
    accepted = sum(1 for member in final["members"] if member["verdict"] == "ACCEPTED")
    say(
        f"{accepted} accepted; cancelled in the deciding transaction: {stopped} drafts mid-run "
        f"(their handlers stop at the next heartbeat, nothing more is recorded), {never_started} never started"
    )
    return 0 if final["outcome"] == "SUCCESS" else 1


if __name__ == "__main__":
    sys.exit(main())
