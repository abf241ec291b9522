"""Handlers for the ``runstate worker`` tests (not a test module).

Each says ``started <task id>`` on stdout when it begins, so a test knows the task is held.
"""

import asyncio
import sys
import threading
import time

_STDOUT = threading.Lock()


def say(line: str) -> None:
    """Write ``line`` to stdout whole: sync handlers run in threads, and ``print`` writes the newline apart."""
    with _STDOUT:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def echo(ctx):
    say(f"started {ctx.task_id}")
    return {
        "echo": ctx.input,
        "thread_event": hasattr(ctx.signal, "wait") and not asyncio.iscoroutinefunction(ctx.signal.wait),
    }


async def finish_in_one_second(ctx):
    say(f"started {ctx.task_id}")
    await asyncio.sleep(1)
    return {"finished": True}


async def hang(ctx):
    say(f"started {ctx.task_id}")
    await asyncio.sleep(3600)


def hang_sync(ctx):
    say(f"started {ctx.task_id}")
    time.sleep(3600)


class Namespace:
    @staticmethod
    async def nested(ctx):
        return "nested"


not_callable = 42


def message_echo(ctx):
    say(f"received {ctx.body['n']} attempt {ctx.attempt}")


async def message_reject_odd(ctx):
    from runstate import Reject

    say(f"received {ctx.body['n']} attempt {ctx.attempt}")
    if ctx.body["n"] % 2:
        raise Reject("odd")
