"""Real servers (uvicorn, ``manage.py runserver``) on the suite's test database, and an SSE reader for them."""

import json
import os
import queue
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from django.db import connection

from tests import waiting
from tests.processes import answers_health, free_port, stop_process_groups
from tests.waiting import wait_until

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
    with _serve(
        "uvicorn",
        lambda port: [
            *("-m", "uvicorn", "runstate_project.asgi:application"),
            *("--host", "127.0.0.1", "--port", str(port), "--log-level", log_level),
        ],
        log_dir,
        env,
    ) as server:
        yield server


@contextmanager
def runserver(log_dir: Path, **env):
    """Run ``python manage.py runserver`` (the README's development server) on a free port.

    As a developer runs it: with the autoreloader and the settings' ``DEBUG``.
    """
    with _serve("runserver", lambda port: ["manage.py", "runserver", f"127.0.0.1:{port}"], log_dir, env) as server:
        yield server


@contextmanager
def _serve(name: str, arguments, log_dir: Path, env: dict[str, str]):
    """Run ``python *arguments(port)`` on a free port, wait for ``/v1/healthz``, stop it at the end."""
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    child_env = {
        **os.environ,
        **database_env(),
        "DJANGO_SETTINGS_MODULE": "runstate_project.settings",
        "PYTHONUNBUFFERED": "1",
        **env,
    }
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, *arguments(port)],
            cwd=ROOT,
            env=child_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = Server(url=f"http://127.0.0.1:{port}", process=process, log_path=log_path)

    def healthy() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited ({process.returncode}):\n{server.log()}")
        return answers_health(server.url)

    try:
        wait_until(healthy, what=f"{name} to answer /v1/healthz", interval_s=0.1, explain=server.log)
        yield server
    finally:
        stop_process_groups([process], grace_s=15)


# Reading Server-Sent Events from a live server ----------------------------------------------


def parse_frame(block: str) -> dict | None:
    """Parse one SSE frame; None for a bare ``retry``."""
    frame: dict = {}
    for line in block.split("\n"):
        if line.startswith(":"):
            return {"comment": line[1:].strip()}
        field, _, value = line.partition(": ")
        if field == "data":
            frame["data"] = json.loads(value)
        elif field in ("id", "event"):
            frame[field] = value
    return frame if "event" in frame else None


class Reader:
    """Read an SSE stream in a thread with httpx, timestamping each frame on arrival.

    ``key`` authenticates with an API key, ``cookies`` with a session (the staff stream).
    ``connected`` is set once the ``retry`` preamble arrives: the server has subscribed and
    chosen where the stream starts, so anything committed after it is sent.
    """

    def __init__(
        self,
        url: str,
        key: str | None = None,
        last_event_id: str | None = None,
        *,
        cookies: dict[str, str] | None = None,
    ) -> None:
        self.url, self.key, self.last_event_id, self.cookies = url, key, last_event_id, cookies
        self.frames: queue.Queue = queue.Queue()
        self.connected = threading.Event()
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        if self.last_event_id:
            headers["Last-Event-ID"] = self.last_event_id
        try:
            with httpx.Client(timeout=httpx.Timeout(10, read=30), cookies=self.cookies) as client:
                with client.stream("GET", self.url, headers=headers) as response:
                    assert response.status_code == 200, response.read()
                    assert response.headers["Content-Type"] == "text/event-stream"
                    lines: list[str] = []
                    for line in response.iter_lines():
                        if self.stop.is_set():
                            return
                        if line:
                            lines.append(line)
                            continue
                        block, lines = "\n".join(lines), []
                        if block.startswith("retry:"):
                            self.connected.set()  # the server has subscribed and chosen its start
                        frame = parse_frame(block)
                        if frame is not None and "event" in frame:
                            self.frames.put((time.monotonic(), frame))
        except BaseException as error:  # noqa: BLE001 - reported by next()
            self.error = error
        finally:
            self.connected.set()

    def next(self, timeout_s: float | None = None) -> tuple[float, dict]:
        """The next frame and when it arrived; wait ``WAIT_S`` for it, or ``timeout_s`` to check none comes."""
        timeout_s = waiting.WAIT_S if timeout_s is None else timeout_s
        try:
            return self.frames.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"no frame within {timeout_s} s (reader error: {self.error!r})") from None

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


def asgi_http_scope(path: str, query: str = "", headers: list[tuple[bytes, bytes]] | None = None) -> dict:
    """Return the ASGI scope of a ``GET path?query`` to call the application in-process."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": [(b"host", b"testserver"), *(headers or [])],
        "client": ("127.0.0.1", 40000),
        "server": ("testserver", 80),
    }
