"""A message consumer in a process of its own, for the SIGTERM tests (not a test module).

    python -m tests.sdk.message_consumer_process MAILBOX MODE [DRAIN_TIMEOUT]

Uses the sync client configured from RUNSTATE_URL / RUNSTATE_API_KEY / RUNSTATE_SCOPE_ID and
calls ``rs.scope(scope_id).consume_messages(mailbox, handler, concurrency=1)`` as the
``runstate worker --queue`` command does. Prints ``received <message id> <attempt>`` when a
handler starts and ``summary ...`` on return. MODE: ``hang`` (the handler never returns,
ignoring its signal) or ``finish`` (it returns after one second).
"""

import os
import sys
import time

from runstate import Runstate
from tests.sdk.cli_handlers import say


def main(mailbox: str, mode: str, drain_timeout: float) -> None:
    def handler(ctx):
        say(f"received {ctx.message_id} {ctx.attempt}")
        if mode == "hang":
            time.sleep(3600)
        elif mode == "finish":
            time.sleep(1)
        return {"mode": mode}

    with Runstate() as rs:
        summary = rs.scope(os.environ["RUNSTATE_SCOPE_ID"]).consume_messages(
            mailbox, handler, concurrency=1, drain_timeout=drain_timeout
        )
    print(
        f"summary completed={summary.completed} retried={summary.retried} rejected={summary.rejected} "
        f"lost={summary.lost} released={summary.released} stop_reason={summary.stop_reason}",
        flush=True,
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]) if len(sys.argv) > 3 else 30.0)
