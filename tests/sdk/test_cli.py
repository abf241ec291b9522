"""The ``runstate`` command (runstate/cli.py) without a server: help, configuration errors (exit 2).

The live-server tests are in tests/sdk/test_cli_live.py and use the helpers here.
"""

import argparse
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from runstate import Runstate, cli
from tests.sdk.conftest import ROOT

# No server and no database: the command and its configuration errors (a second run proves nothing more).
pytestmark = pytest.mark.single_backend

# The console script ``pip install --no-deps -e .`` puts next to the interpreter (scripts/lib.sh ensure_venv).
SCRIPT = Path(sys.executable).parent / "runstate"


def command(*args, env=None, **kwargs):
    return subprocess.Popen(
        [str(SCRIPT), *args],
        cwd=ROOT,
        env=env if env is not None else dict(os.environ, PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def run_command(*args, env=None, timeout=60):
    process = command(*args, env=env)
    try:
        out, err = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return process.returncode, out, err


def read_line(process, timeout_s=30.0):
    result = []
    reader = threading.Thread(target=lambda: result.append(process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not result or not result[0]:
        process.kill()
        raise AssertionError(f"no output from the worker:\n{process.stderr.read()}")
    return result[0].strip()


def stop(process, timeout_s=30.0):
    """SIGTERM the worker, wait for it, and return its exit status and stderr."""
    process.send_signal(signal.SIGTERM)
    try:
        _, err = process.communicate(timeout=timeout_s)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return process.returncode, err


def prepare(mailbox, *, lease_ttl_ms=30_000, inputs=({"n": 1},)):
    with Runstate() as rs:
        rs.mailboxes.ensure(mailbox, mode="WORK", lease_ttl_ms=lease_ttl_ms)
        run = rs.scopes.create(name=f"cli-{mailbox}")
        tickets = [run.tasks.submit(mailbox, value) for value in inputs]
    return run.id, [ticket.id for ticket in tickets]


def test_the_command_is_installed_and_its_help_lists_the_verbs():
    assert SCRIPT.exists(), "pip install --no-deps -e . (scripts/lib.sh ensure_venv) installs the runstate command"
    code, out, _ = run_command("--help", env=dict(os.environ))
    assert code == 0
    for verb in ("worker", "status", "cancel"):
        assert verb in out
    code, out, _ = run_command("worker", "--help", env=dict(os.environ))
    assert code == 0
    assert "--mailbox" in out and "--grace-s" in out and "--queue" in out


@pytest.mark.parametrize(
    ("handler", "message"),
    [
        ("tests.sdk.no_such_module:echo", "no module named 'tests.sdk.no_such_module'"),
        ("tests.sdk.cli_handlers:missing", "has no attribute 'missing'"),
        ("tests.sdk.cli_handlers:not_callable", "is not callable"),
        ("tests.sdk.cli_handlers", "is not of the form 'pkg.module:function'"),
    ],
)
def test_a_bad_handler_path_is_a_clear_error_with_status_2(handler, message):
    env = dict(os.environ, RUNSTATE_URL="http://127.0.0.1:9", RUNSTATE_API_KEY="k", RUNSTATE_SCOPE_ID="r")
    code, out, err = run_command("worker", handler, "--mailbox", "m", env=env)
    assert code == 2
    assert message in err
    assert "Traceback" not in err
    assert err.startswith("runstate worker: ")


@pytest.mark.parametrize(
    ("unset", "message"),
    [
        ("RUNSTATE_SCOPE_ID", "no run: pass --scope RUN_ID or set RUNSTATE_SCOPE_ID"),
        ("RUNSTATE_API_KEY", "no API key"),
    ],
)
def test_a_missing_run_url_or_key_is_a_configuration_error(unset, message):
    env = dict(os.environ, RUNSTATE_URL="http://127.0.0.1:9", RUNSTATE_API_KEY="k", RUNSTATE_SCOPE_ID="r")
    del env[unset]
    code, _, err = run_command("worker", "tests.sdk.cli_handlers:echo", "--mailbox", "m", env=env)
    assert code == 2
    assert message in err


def test_without_runstate_url_the_command_uses_the_clients_default(monkeypatch):
    """``runstate worker`` / ``status`` default the URL as ``Runstate()`` does: only the key is required."""
    monkeypatch.delenv("RUNSTATE_URL", raising=False)
    monkeypatch.setenv("RUNSTATE_API_KEY", "rs_k_s")
    args = argparse.Namespace(url=None, api_key=None)
    assert cli._client_options(args) == ("http://127.0.0.1:8000", "rs_k_s")
    with Runstate() as rs:
        assert rs.config.base_url == "http://127.0.0.1:8000"  # the clients' own default
