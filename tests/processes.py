"""Child processes of the live tests: free ports, ``manage.py`` commands, stopping process groups."""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import httpx

from devservers.net import free_port

ROOT = Path(__file__).resolve().parents[1]
__all__ = ["ROOT", "answers_health", "free_port", "manage", "stop_process_groups"]


def answers_health(url: str, timeout_s: float = 2) -> bool:
    """Whether the API at ``url`` answers ``/v1/healthz`` with 200; False while it cannot be reached."""
    try:
        return httpx.get(f"{url}/v1/healthz", timeout=timeout_s).status_code == 200
    except httpx.TransportError:
        return False


def stop_process_groups(processes: Iterable[subprocess.Popen], grace_s: float = 20) -> None:
    """SIGTERM each child's process group, wait up to ``grace_s`` in all, then SIGKILL what is left.

    Children must have been started with ``start_new_session=True`` (their pid is their group).
    """
    processes = list(processes)
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def manage(env: dict[str, str], *args: str) -> str:
    """Run ``manage.py`` with ``args`` in ``env`` (its own ``DATABASE_URL``...); return its output, fail on an error."""
    done = subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, f"manage.py {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout
