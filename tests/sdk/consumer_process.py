"""A consumer in a process of its own, for the kill and SIGTERM tests (not a test module).

    python -m tests.sdk.consumer_process MAILBOX MODE [DRAIN_TIMEOUT]

Uses the sync client configured from RUNSTATE_URL / RUNSTATE_API_KEY / RUNSTATE_SCOPE_ID.
Prints ``claimed <task id> <attempt>`` when a handler starts and ``summary ...`` on return.
MODE: ``hang`` (the handler never returns, ignoring its signal), ``finish`` (it returns after
one second), ``cooperate`` (it returns as soon as its signal is set), ``buffer`` (it returns
at once, and its completion stays in the loop's buffer: ``buffered <task id>`` is printed
once it is there; only stopping the loop sends it).
"""

import asyncio
import sys
import time

import runstate._worker.completer
from runstate import Runstate
from tests.sdk.cli_handlers import say


def hold_completions_back() -> None:
    """Keep completions in the buffer (no size or delay reached) and print each one buffered."""
    runstate._worker.completer.FLUSH_SIZE = 10_000
    runstate._worker.completer.FLUSH_DELAY_S = 3600.0
    complete = runstate._worker.completer._Completer.complete

    async def buffered(self, claim, outcome):
        sending = asyncio.ensure_future(complete(self, claim, outcome))
        await asyncio.sleep(0)  # its first step ran: the completion is in the buffer
        if claim.id in self._pending:
            say(f"buffered {claim.task_id}")
        return await sending

    runstate._worker.completer._Completer.complete = buffered


def main(mailbox: str, mode: str, drain_timeout: float) -> None:
    if mode == "buffer":
        hold_completions_back()

    def handler(ctx):
        say(f"claimed {ctx.task_id} {ctx.attempt}")
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
