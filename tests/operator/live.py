"""A real uvicorn process serving the suite's test database (PostgreSQL or the SQLite file)."""

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from django.db import connection

from tests.processes import free_port, stop_process_groups

ROOT = Path(__file__).resolve().parents[2]


def database_env() -> dict[str, str]:
    """Return the environment that points a child process at the test database."""
    s = connection.settings_dict
    if connection.vendor == "postgresql":
        auth = s["USER"] or ""
        if s.get("PASSWORD"):
            auth += f":{s['PASSWORD']}"
        host = s["HOST"] or "127.0.0.1"
        port = s["PORT"] or 5432
        return {"DATABASE_URL": f"postgres://{auth}@{host}:{port}/{s['NAME']}"}
    return {"DATABASE_URL": "", "RUNSTATE_SQLITE_PATH": str(s["NAME"])}


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]


@contextmanager
def uvicorn_server(log_dir: Path, *, log_level: str = "warning", **env):
    """Run ``uvicorn runstate_project.asgi:application`` on a free port until the block ends.

    ``log_level`` is uvicorn's (``info`` writes its access log, as a default deployment does).
    """
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "uvicorn.log"
    child_env = {
        **os.environ,
        **database_env(),
        "DJANGO_SETTINGS_MODULE": "runstate_project.settings",
        "PYTHONUNBUFFERED": "1",
        **env,
    }
    command = [sys.executable, "-m", "uvicorn", "runstate_project.asgi:application"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--log-level", log_level]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, cwd=ROOT, env=child_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    server = Server(url=f"http://127.0.0.1:{port}", process=process, log_path=log_path)
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"uvicorn exited ({process.returncode}):\n{server.log()}")
            try:
                if httpx.get(f"{server.url}/v1/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not answer within 60 s:\n{server.log()}")
            time.sleep(0.1)
        yield server
    finally:
        stop_process_groups([process], grace_s=15)
