"""Handlers for the ``runstate worker`` tests (not a test module).

Each prints ``started <task id>`` on stdout when it begins, so a test knows the task is held.
"""

import asyncio
import time


def echo(ctx):
    print(f"started {ctx.task_id}", flush=True)
    return {
        "echo": ctx.input,
        "thread_event": hasattr(ctx.signal, "wait") and not asyncio.iscoroutinefunction(ctx.signal.wait),
    }


async def finish_in_one_second(ctx):
    print(f"started {ctx.task_id}", flush=True)
    await asyncio.sleep(1)
    return {"finished": True}


async def hang(ctx):
    print(f"started {ctx.task_id}", flush=True)
    await asyncio.sleep(3600)


def hang_sync(ctx):
    print(f"started {ctx.task_id}", flush=True)
    time.sleep(3600)


class Namespace:
    @staticmethod
    async def nested(ctx):
        return "nested"


not_callable = 42


def message_echo(ctx):
    print(f"received {ctx.body['n']} attempt {ctx.attempt}", flush=True)


async def message_reject_odd(ctx):
    from runstate import Reject

    print(f"received {ctx.body['n']} attempt {ctx.attempt}", flush=True)
    if ctx.body["n"] % 2:
        raise Reject("odd")
