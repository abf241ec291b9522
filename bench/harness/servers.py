"""The servers a benchmark starts: the API under uvicorn on a free port, and an OTLP sink for traced runs."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from typing import Any

from bench.harness.env import ROOT, bench_environment


def free_port() -> int:
    """Return a TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class UvicornServer:
    """``uvicorn runstate_project.asgi:application`` as a subprocess on a free local port.

    Started as ``scripts/start`` starts it: ``--workers`` processes, uvicorn's defaults for
    the event loop and the HTTP parser (uvloop and httptools, from ``uvicorn[standard]``).
    With ``pooler``, its requests go through that PgBouncer (``BenchPgBouncer.server_env``).
    """

    def __init__(
        self,
        processes: int = 1,
        extra_env: dict[str, str] | None = None,
        name: str = "bench-uvicorn",
        pooler: Any = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.processes = processes
        self.pooler = pooler  # a bench.pooler.BenchPgBouncer the server's DATABASE_URL goes through, or None
        self.extra_env = (pooler.server_env() if pooler else {}) | (extra_env or {})
        self.log_path = ROOT / "var" / f"{name}.log"

    def __enter__(self) -> UvicornServer:
        import httpx

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("w")
        options = ["--host", "127.0.0.1", "--port", str(self.port), "--no-access-log", "--log-level", "warning"]
        if self.processes > 1:
            options += ["--workers", str(self.processes)]
        command = [sys.executable, "-m", "uvicorn", "runstate_project.asgi:application", *options]
        env = bench_environment() | self.extra_env
        self.process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=self._log, stderr=self._log)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"uvicorn exited ({self.process.returncode}); see {self.log_path}")
            try:
                if httpx.get(f"{self.url}/v1/healthz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.__exit__()
        raise RuntimeError(f"uvicorn did not answer /v1/healthz within 60 s; see {self.log_path}")

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


class DiscardingOtlpReceiver:
    """An OTLP/HTTP endpoint on a free local port that reads each export and discards it (``--tracing``).

    What a collector costs the exporter (a request per batch, answered 200) without keeping
    anything; it counts the bytes it was sent, for the record.
    """

    def __enter__(self) -> DiscardingOtlpReceiver:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - the http.server convention
                receiver.received_bytes += len(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                receiver.requests += 1
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.received_bytes = 0
        self.requests = 0
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def tracing_env(endpoint: str) -> dict[str, str]:
    """Return the ``OTEL_*`` variables of a traced API server: every trace sampled, OTLP to ``endpoint``."""
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_TRACES_SAMPLER": "always_on",
        "OTEL_SERVICE_NAME": "runstate-bench",
    }


def checked(response: Any) -> dict:
    """Return a 200/201 answer's JSON; raise with the request and the answer otherwise."""
    if response.status_code not in (200, 201):
        request = response.request
        raise RuntimeError(f"{request.method} {request.url}: {response.status_code} {response.text[:500]}")
    return response.json()
