"""Decorated tasks the live tests run in real Celery workers (loaded with ``--include``).

Handlers write what they do to the log file named in their input (one line per step, with
``O_APPEND``), so a test can count executions apart from the completions runstate recorded.
"""

import asyncio
import os
import time

from workers import runstate_task

PROJECT = "celery-live"


def note(path: str, *parts: object) -> None:
    """Append one line to ``path`` (atomic for a short line, from any process)."""
    line = (" ".join(str(part) for part in parts) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_notes(path) -> list[list[str]]:
    """Return the lines of a log written with ``note``, split into words."""
    try:
        with open(path) as handle:
            return [line.split() for line in handle if line.strip()]
    except FileNotFoundError:
        return []


@runstate_task(mailbox="celery-live-bulk", project=PROJECT, lease_ttl=10)
def bulk(ctx, i: int, log: str):
    note(log, "done", ctx.task_id, ctx.attempt, i)
    return {"i": i}


# Heartbeat every 0.5 s (a third of the lease).
@runstate_task(mailbox="celery-live-coop", project=PROJECT, lease_ttl=1.5, max_attempts=1)
def cooperative(ctx, mode: str, log: str, seconds: float = 30, release: str = ""):
    note(log, "start", ctx.task_id, time.time())
    if mode == "returns":
        ctx.signal.wait(seconds)
        note(log, "signal", ctx.task_id, time.time())
        return "stopped"
    if mode == "checks":
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            ctx.check()
            time.sleep(0.02)
        return "not stopped"
    if mode == "raises":
        ctx.signal.wait(seconds)
        note(log, "signal", ctx.task_id, time.time())
        raise RuntimeError("gave up after the cancel request")
    # "ignores": carry on through the request until the test creates the file ``release``.
    while not os.path.exists(release):
        time.sleep(0.05)
    note(log, "returned", ctx.task_id, time.time())
    return "ignored"


@runstate_task(mailbox="celery-live-coop-async", project=PROJECT, lease_ttl=1.5, max_attempts=1)
async def cooperative_async(ctx, log: str):
    note(log, "start", ctx.task_id, time.time())
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        note(log, "signal", ctx.task_id, time.time())
        raise
    return "slept"


@runstate_task(mailbox="celery-live-limit", project=PROJECT, max_attempts=1, soft_time_limit=1, time_limit=20)
def overrun(ctx, log: str):
    note(log, "start", ctx.task_id, time.time())
    time.sleep(10)
    return "finished"


@runstate_task(mailbox="celery-live-flaky", project=PROJECT, max_attempts=3, retry_delay=0.5)
def flaky(ctx, log: str):
    note(log, "attempt", ctx.task_id, ctx.attempt, time.time())
    if ctx.attempt == 1:
        raise ValueError("the first attempt fails")
    return {"attempt": ctx.attempt}


@runstate_task(mailbox="celery-live-crash", project=PROJECT, lease_ttl=3, max_attempts=5)
def crashy(ctx, i: int, log: str, seconds: float):
    note(log, "start", ctx.task_id, ctx.attempt)
    time.sleep(seconds)
    note(log, "done", ctx.task_id, ctx.attempt)
    return {"i": i}


def _work_until_stopped(ctx, log: str, seconds: float):
    note(log, "start", ctx.task_id, time.time())
    if ctx.signal.wait(seconds):
        note(log, "stopped", ctx.task_id, time.time(), ctx.lost)
        return "stopped"
    note(log, "finished", ctx.task_id, time.time())
    return "finished"


@runstate_task(mailbox="celery-live-cancel", project=PROJECT, lease_ttl=1.5)
def step(ctx, log: str, seconds: float):
    return _work_until_stopped(ctx, log, seconds)


@runstate_task(mailbox="celery-live-drafts", project=PROJECT, lease_ttl=1.5)
def draft(ctx, log: str, seconds: float):
    return _work_until_stopped(ctx, log, seconds)


# Renewed every 200 s: a handler told of a cancel within a test was told by the claim watch.
@runstate_task(mailbox="celery-live-push", project=PROJECT, lease_ttl=600, max_attempts=1)
def long_lease(ctx, log: str, seconds: float):
    return _work_until_stopped(ctx, log, seconds)
