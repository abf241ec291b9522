"""A consumer in a process of its own, for the kill and SIGTERM tests (not a test module).

    python -m tests.sdk.consumer_process MAILBOX MODE [DRAIN_TIMEOUT]

Uses the sync client configured from RUNSTATE_URL / RUNSTATE_API_KEY / RUNSTATE_SCOPE_ID.
Prints ``claimed <task id> <attempt>`` when a handler starts and ``summary ...`` on return.
MODE: ``hang`` (the handler never returns, ignoring its signal), ``finish`` (it returns after
one second), ``cooperate`` (it returns as soon as its signal is set).
"""

import sys
import time

from runstate import Runstate


def main(mailbox: str, mode: str, drain_timeout: float) -> None:
    def handler(ctx):
        print(f"claimed {ctx.task_id} {ctx.attempt}", flush=True)
        if mode == "hang":
            time.sleep(3600)
        elif mode == "finish":
            time.sleep(1)
        elif mode == "cooperate":
            ctx.signal.wait(60)
        return {"mode": mode, "stop_reason": ctx.stop_reason}

    with Runstate() as rs:
        summary = rs.scope().consume(mailbox, handler, concurrency=1, drain_timeout=drain_timeout)
    print(
        f"summary completed={summary.completed} failed={summary.failed} lost={summary.lost} "
        f"released={summary.released} stop_reason={summary.stop_reason}",
        flush=True,
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]) if len(sys.argv) > 3 else 30.0)
