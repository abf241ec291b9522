"""The command line of a benchmark's Celery worker: the project's app, quiet, no gossip, mingle or heartbeat."""

from __future__ import annotations

import sys


def celery_worker_command(
    *, pool: str, concurrency: int, include: str, queue: str, hostname: str | None = None
) -> list[str]:
    """Return the command of a Celery worker of ``pool`` running the tasks of module ``include`` from ``queue``."""
    command = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "runstate_project",
        "worker",
        f"--pool={pool}",
        f"--concurrency={concurrency}",
        f"--include={include}",
        f"--queues={queue}",
        "--loglevel=WARNING",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
    ]
    return command + ([f"--hostname={hostname}"] if hostname else [])
