"""The SDK is typed (``py.typed``, ``mypy --strict`` clean) and its sync half is up to date."""

import subprocess
import sys

import pytest

from tests.sdk.conftest import ROOT

# No database: mypy and the generator read files only (a second run proves nothing more).
pytestmark = pytest.mark.single_backend


def test_mypy_strict_passes_on_the_sdk():
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "runstate"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (ROOT / "runstate" / "py.typed").exists()


def test_the_sync_client_is_generated_from_the_async_one():
    """``runstate/_sync`` is ``sdk/unasync.py``'s rewrite of ``runstate/_async``: regenerate after editing."""
    done = subprocess.run(
        [sys.executable, "sdk/unasync.py", "--check"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, f"run `python sdk/unasync.py`:\n{done.stdout}{done.stderr}"
