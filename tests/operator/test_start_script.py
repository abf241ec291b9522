"""``scripts/start`` runs the API as ``WEB_CONCURRENCY`` uvicorn processes, and Ctrl-C stops them all.

The script runs as a person runs it, on the test database: it migrates (nothing to do),
prepares the development project and starts ``uvicorn --workers``; the test counts the
worker processes under uvicorn's master, then sends the script the SIGINT of a Ctrl-C.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.operator.live import ROOT, database_env
from tests.processes import free_port, stop_process_groups
from tests.waiting import WAIT_S, wait_until

# The script's processes read the test database through their own connections.
pytestmark = pytest.mark.django_db(transaction=True)

# Bounded waits, not measures: the script checks the virtualenv, migrates and starts its
# processes before its banner, more than one state's wait.
START_WAITS = 2


def children(pid: int) -> list[int]:
    """Return the live child processes of ``pid`` (from /proc: psutil is not a dependency)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # The command name (field 2) may hold spaces and parentheses: split after its last ")".
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue  # gone meanwhile
        state, ppid = fields[0], int(fields[1])
        if ppid == pid and state != "Z":
            found.append(int(entry.name))
    return found


def command_line(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_scripts_start_runs_web_concurrency_processes_and_sigint_stops_them_all(tmp_path):
    port, mcp_port = free_port(), free_port()
    env = {
        **os.environ,
        **database_env(),
        "PORT": str(port),
        "MCP_PORT": str(mcp_port),
        "WEB_CONCURRENCY": "2",
        "RUNSTATE_VAR_DIR": str(tmp_path / "var"),
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env.pop("DEBUG", None)  # as in a fresh shell: the script turns it on for development
    env.pop("SECRET_KEY", None)
    output = tmp_path / "start.out"
    # A shell started in the background may inherit SIGINT ignored, and bash cannot trap a
    # signal ignored at its start: give the script SIGINT's default, as a terminal does.
    launcher = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
    )
    with open(output, "wb") as out:
        script = subprocess.Popen(
            [sys.executable, "-c", launcher, str(ROOT / "scripts" / "start"), "--no-worker"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def log() -> str:
        api_log = tmp_path / "var" / "log" / "api.log"
        text = output.read_text(errors="replace")
        if api_log.exists():
            text += "\n--- api.log ---\n" + api_log.read_text(errors="replace")[-3000:]
        return text

    def banner() -> bool:
        return "Press Ctrl-C to stop." in output.read_text(errors="replace")

    seen: list[int] = []
    try:
        # The script prints its banner once /v1/healthz answers.
        wait_until(
            lambda: banner() or script.poll() is not None,
            what="scripts/start to come up",
            interval_s=0.2,
            waits=START_WAITS,
            explain=log,
        )
        assert banner(), f"scripts/start exited ({script.returncode}):\n{log()}"
        assert httpx.get(f"http://127.0.0.1:{port}/v1/healthz", timeout=10).json() == {"status": "ok"}
        assert "DEBUG=1 (development" in output.read_text(), "the script says it turned DEBUG on"

        (master,) = [pid for pid in children(script.pid) if "uvicorn" in command_line(pid)]
        assert "--workers 2" in command_line(master)
        # The limits against slow and greedy clients (docs/deploy.md).
        for limit in ("--timeout-keep-alive 5", "--h11-max-incomplete-event-size 16384", "--limit-concurrency 2048"):
            assert limit in command_line(master), command_line(master)

        # uvicorn's master starts its workers through multiprocessing (beside a resource tracker).
        def workers() -> list[int]:
            return [pid for pid in children(master) if "multiprocessing.spawn" in command_line(pid)]

        wait_until(
            lambda: len(workers()) == 2,
            what="uvicorn's two workers",
            interval_s=0.2,
            waits=START_WAITS,
            explain=lambda: f"{workers()}\n{log()}",
        )
        # The MCP server for agents, printed beside the API key (it refuses a foreign Host).
        assert f"MCP:      http://127.0.0.1:{mcp_port}/mcp" in output.read_text(), log()
        (mcp,) = [pid for pid in children(script.pid) if "runstate.cli mcp --http" in command_line(pid)]
        answer = httpx.post(f"http://127.0.0.1:{mcp_port}/mcp", headers={"Host": "evil.example"}, json={}, timeout=10)
        assert answer.status_code == 421
        seen = [master, *children(master), mcp]

        script.send_signal(signal.SIGINT)
        assert script.wait(WAIT_S) == 130, log()
        wait_until(
            lambda: not any(alive(pid) for pid in seen),
            what="every process to stop",
            interval_s=0.2,
            explain=lambda: f"{[pid for pid in seen if alive(pid)]}\n{log()}",
        )
        assert "Stopping api" in output.read_text()
    finally:
        stop_process_groups([script], grace_s=15)
        for pid in seen:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
