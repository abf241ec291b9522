"""Headless Chromium (Debian's package) driven by Playwright for Python, against a real uvicorn.

These tests never skip: without Chromium they fail and say how to install it
(``scripts/ensure_chromium.sh``; the test command runs it). Playwright's own browser
download is not used: the browser is ``/usr/bin/chromium``.
"""

import os
import shutil
import uuid
from pathlib import Path

import pytest
from django.contrib.auth.models import User

from tests.operator.live import ROOT, uvicorn_server

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
# Git-ignored (.gitignore): look at them after a run.
SCREENSHOTS = ROOT / "test-artifacts" / "screenshots"


def chromium_executable() -> str:
    """Return Chromium's path, or fail the test saying how to install it."""
    path = os.environ.get("RUNSTATE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).exists():
        pytest.fail(
            "Chromium is not installed, and the browser tests do not skip. Install Debian's package with "
            "scripts/ensure_chromium.sh (apt-get install chromium chromium-driver), or point RUNSTATE_CHROMIUM "
            "at a Chromium binary.",
            pytrace=False,
        )
    try:
        import playwright.async_api  # noqa: F401
    except ImportError:
        pytest.fail(
            "Playwright for Python is missing: pip install --require-hashes -r requirements-dev.txt", pytrace=False
        )
    return path


@pytest.fixture
def chromium():
    return chromium_executable()


@pytest.fixture
def screenshots(request, db) -> Path:
    from django.db import connection

    folder = SCREENSHOTS / connection.vendor
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture
def operator(db):
    """A superuser with a known password, to log in through the login form."""
    password = uuid.uuid4().hex
    user = User.objects.create_superuser("operator", "operator@example.com", password)
    user.plain_password = password
    return user


@pytest.fixture
def live_server_url(tmp_path):
    with uvicorn_server(tmp_path / "uvicorn") as server:
        yield server.url


async def launch(playwright, executable: str):
    return await playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS, headless=True)


async def log_in(page, base_url: str, user) -> None:
    await page.goto(f"{base_url}/admin/login/?next=/admin/")
    await page.fill("#id_username", user.username)
    await page.fill("#id_password", user.plain_password)
    await page.click("input[type=submit]")
    await page.wait_for_url(f"{base_url}/admin/")
