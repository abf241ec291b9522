"""``tests/failure_digest.py``: what a failing test leaves for the end of ``scripts/test``'s output.

A small suite runs in a pytest of its own (no Django, none of this project's settings) with
the plugin loaded as ``scripts/test`` loads it; the digest file must name each failing test,
say where and what it asserted, and hold the last 200 lines it logged, and nothing of a test
that passed.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.failure_digest import ENV, LOG_TAIL_LINES

pytestmark = pytest.mark.single_backend

ROOT = Path(__file__).resolve().parents[2]

SUITE = """
import logging

def test_passes():
    logging.getLogger("demo").warning("nothing to see")

def test_fails_with_a_long_log():
    for i in range(250):
        logging.getLogger("demo").warning("line %d", i)
    print("said on stdout")
    assert 1 + 1 == 3, "one plus one is not three"

def test_fails_in_setup(broken):
    pass

import pytest

@pytest.fixture
def broken():
    raise RuntimeError("the fixture broke")
"""


def run_suite(tmp_path: Path, suite: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run ``suite`` in a pytest of its own in ``tmp_path``, the plugin loaded, ``env`` added to the environment."""
    (tmp_path / "test_suite.py").write_text(suite)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    inherited = {key: value for key, value in os.environ.items() if key not in (ENV, "DJANGO_SETTINGS_MODULE")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:django", "-p", "no:cacheprovider", "-p", "tests.failure_digest"]
        + ["-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=tmp_path,
        env=inherited | {"PYTHONPATH": str(ROOT)} | env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_digest_names_each_failure_with_its_assertion_and_log_tail(tmp_path):
    digest = tmp_path / "digest.txt"
    result = run_suite(tmp_path, SUITE, {ENV: str(digest)})
    assert result.returncode == 1, result.stdout + result.stderr
    text = digest.read_text()

    entries = text.strip().split("\n\n")
    assert [entry.splitlines()[0] for entry in entries] == [
        "FAILED test_suite.py::test_fails_with_a_long_log",
        "FAILED test_suite.py::test_fails_in_setup (in setup)",
    ]
    long_log, setup = entries
    assert f"  at {tmp_path / 'test_suite.py'}:11" in long_log.splitlines()
    assert "  AssertionError: one plus one is not three" in long_log.splitlines()
    tail = [line for line in long_log.splitlines() if line.startswith("  | ")]
    assert len(tail) == LOG_TAIL_LINES
    assert tail[-1].endswith("line 249")  # the end of the log, not its start
    assert not any(line.endswith("line 0") for line in tail)
    assert "RuntimeError: the fixture broke" in setup
    assert "nothing to see" not in text


def test_without_its_variable_the_plugin_writes_nothing(tmp_path):
    result = run_suite(tmp_path, "def test_fails():\n    assert False\n", {})
    assert result.returncode == 1, result.stdout + result.stderr
    assert "INTERNALERROR" not in result.stdout + result.stderr
    written = {path.name for path in tmp_path.iterdir()} - {"__pycache__"}
    assert written == {"pytest.ini", "test_suite.py"}
