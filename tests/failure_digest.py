"""A pytest plugin that writes each failing test's digest to a file, for the end of a CI log.

``scripts/test`` loads it (``-p tests.failure_digest``) in every run and sets
``RUNSTATE_TEST_DIGEST`` to a file of that run; once all the runs have ended it prints the
files after everything else, so a failed landing explains itself in one screen: each
failing test's id, where and what it asserted, and the last lines of what it logged.
Without ``RUNSTATE_TEST_DIGEST`` the plugin does nothing.
"""

import os

import pytest

ENV = "RUNSTATE_TEST_DIGEST"
LOG_TAIL_LINES = 200
MESSAGE_LINES = 40


def _tail(text: str, lines: int) -> list[str]:
    return text.rstrip("\n").splitlines()[-lines:] if text.strip() else []


def digest(report: pytest.TestReport) -> str:
    """Return the digest of one failed report: id, phase, assertion, and its captured output's tail."""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        where = f"{crash.path}:{crash.lineno}"
        message = crash.message
    else:  # a skip-like or plain-string longrepr (collection errors, xfail strict)
        where = report.location[0]
        message = str(report.longrepr)
    message_lines = message.splitlines() or [""]
    if len(message_lines) > MESSAGE_LINES:
        message_lines = [*message_lines[:MESSAGE_LINES], f"[… {len(message_lines) - MESSAGE_LINES} more lines]"]
    phase = "" if report.when == "call" else f" (in {report.when})"
    out = [f"FAILED {report.nodeid}{phase}", f"  at {where}"]
    out += [f"  {line}" for line in message_lines]
    captured = "\n".join(f"--- {title} ---\n{text}" for title, text in report.sections if text.strip())
    tail = _tail(captured, LOG_TAIL_LINES)
    if tail:
        out.append(f"  last {len(tail)} lines of what it captured:")
        out += [f"  | {line}" for line in tail]
    return "\n".join(out) + "\n\n"


def _write(text: str) -> None:
    path = os.environ.get(ENV)
    if path:
        with open(path, "a", encoding="utf-8") as file:
            file.write(text)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        _write(digest(report))


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _write(
            f"ERROR collecting {report.nodeid}\n"
            + "\n".join(f"  {line}" for line in _tail(str(report.longrepr), 60))
            + "\n\n"
        )
