"""Run the examples as the README says: ``scripts/start`` in one shell, the example in another.

The commands are the README's own lines, run through ``bash -c`` from the repository root;
the test only chooses the environment a person would have (the suite's test database, a
free ``PORT``, a private ``RUNSTATE_VAR_DIR``, and on PostgreSQL the suite's Redis broker).
"""

import os
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

from tests.operator.live import ROOT, database_env
from tests.processes import free_port, stop_process_groups
from tests.waiting import WAIT_S, wait_until

README = ROOT / "README.md"
# Bounded waits, not measures, in WAIT_S (tests/waiting.py): scripts/start checks the virtualenv,
# migrates and starts three processes before its banner; an example runs a whole swarm.
START_WAITS = 2
SWARM_WAITS = 4


def readme_commands() -> str:
    """Return the README's text, where each command a test runs must appear verbatim."""
    return README.read_text()


def person_env(var_dir: Path, **extra: str) -> dict[str, str]:
    """The environment of a person's shell pointed at the suite's database (and broker)."""
    env = {**os.environ, **database_env(), "RUNSTATE_VAR_DIR": str(var_dir), "PYTHONUNBUFFERED": "1"}
    for name in ("PROMETHEUS_MULTIPROC_DIR", "RUNSTATE_URL", "RUNSTATE_API_KEY", "RUNSTATE_SCOPE_ID"):
        env.pop(name, None)
    if settings.CELERY_BROKER_URL.startswith("filesystem://"):
        # Nothing configured (the SQLite runs): scripts/start uses its filesystem broker under var/.
        env.pop("CELERY_BROKER_URL", None)
    else:
        # The broker the suite was given (Redis or RabbitMQ; each developer has their own).
        env["CELERY_BROKER_URL"] = settings.CELERY_BROKER_URL
    env.update(extra)
    return env


@dataclass
class Service:
    url: str
    var_dir: Path
    output: Path
    process: subprocess.Popen

    def env(self, **extra: str) -> dict[str, str]:
        """A second terminal's environment: the service's URL (its key is in var/dev-api-key)."""
        return person_env(self.var_dir, RUNSTATE_URL=self.url, **extra)

    def log(self) -> str:
        text = self.output.read_text(errors="replace")[-4000:]
        for name in ("api", "worker", "beat"):
            path = self.var_dir / "log" / f"{name}.log"
            if path.exists():
                text += f"\n--- {name}.log ---\n" + path.read_text(errors="replace")[-4000:]
        return text


def shell(command: str, env: dict[str, str], output: Path) -> subprocess.Popen:
    """Start ``command`` as a person types it, from the repository root, in its own process group."""
    with open(output, "wb") as out:
        return subprocess.Popen(
            ["bash", "-c", command],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


@contextmanager
def started(command: str, tmp_path: Path):
    """Run ``command`` (a README line that runs ``scripts/start``) until it prints its banner; stop it at the end."""
    port = free_port()
    var_dir = tmp_path / "var"
    # One API process keeps the suite's share of PostgreSQL connections small. The MCP server
    # gets a free port of its own: PORT+1, the default, may be any other process's port by then.
    env = person_env(var_dir, PORT=str(port), MCP_PORT=str(free_port()), WEB_CONCURRENCY="1")
    output = tmp_path / "start.out"
    service = Service(f"http://127.0.0.1:{port}", var_dir, output, shell(command, env, output))

    def banner() -> bool:
        return "Press Ctrl-C to stop." in output.read_text(errors="replace")

    try:
        wait_until(
            lambda: banner() or service.process.poll() is not None,
            what=f"{command} to come up",
            interval_s=0.2,
            waits=START_WAITS,
            explain=service.log,
        )
        assert banner(), f"{command} exited:\n{service.log()}"
        yield service
    finally:
        stop_process_groups([service.process], grace_s=30)


def finish(process: subprocess.Popen, output: Path, *, waits: float = SWARM_WAITS) -> str:
    """Wait for ``process`` (``waits`` x ``WAIT_S`` at most: an example's run by default) and return what it printed."""
    timeout_s = waits * WAIT_S
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        stop_process_groups([process], grace_s=5)
        raise AssertionError(f"still running after {timeout_s:g} s:\n{output.read_text(errors='replace')}") from None
    return output.read_text(errors="replace")
