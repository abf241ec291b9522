"""tests/waiting.py, the suite's one way to wait for a server state: what it returns, how it gives up."""

import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import waiting
from tests.waiting import until, wait_until

pytestmark = pytest.mark.single_backend

ROOT = Path(__file__).resolve().parents[2]


def counting(holds_from: int, value="ready"):
    """A predicate false on its first ``holds_from - 1`` calls, then returning ``value``; and its calls."""
    calls = []

    def predicate():
        calls.append(1)
        return value if len(calls) >= holds_from else None

    return predicate, calls


def test_wait_until_returns_the_predicates_truthy_value_once_it_holds():
    predicate, calls = counting(3, value=["a span"])
    assert wait_until(predicate, what="the span", interval_s=0.001) == ["a span"]
    assert len(calls) == 3


def test_pauses_start_at_two_ms_and_double_up_to_the_interval():
    pause = waiting.pauses(0.05)
    assert [next(pause) for _ in range(8)] == [0.002, 0.004, 0.008, 0.016, 0.032, 0.05, 0.05, 0.05]
    pause = waiting.pauses(0.001)  # an interval under the first pause is kept
    assert [next(pause) for _ in range(3)] == [0.001] * 3


def test_a_wait_sleeps_the_growing_pauses_between_calls(monkeypatch):
    slept = []
    monkeypatch.setattr(waiting.time, "sleep", slept.append)
    predicate, calls = counting(5)
    assert wait_until(predicate, what="the fifth call", interval_s=0.01) == "ready"
    assert slept == [0.002, 0.004, 0.008, 0.01]

    async def asleep(seconds):
        slept.append(seconds)

    slept.clear()
    monkeypatch.setattr(waiting.asyncio, "sleep", asleep)
    predicate, calls = counting(4)
    assert asyncio.run(until(predicate, what="the fourth call", interval_s=0.2)) == "ready"
    assert slept == [0.002, 0.004, 0.008]


def test_wait_until_gives_up_after_wait_s_naming_what_it_waited_for(monkeypatch):
    monkeypatch.setattr(waiting, "WAIT_S", 0.2)
    started = time.monotonic()
    # How long it waited past the deadline is up to the machine: only the lower bound is asserted.
    with pytest.raises(AssertionError, match=r"gave up waiting for the task to succeed after \d+\.\d s") as late:
        wait_until(lambda: 0, what="the task to succeed")
    assert time.monotonic() - started >= 0.2
    assert float(re.search(r"after (\S+) s", str(late.value)).group(1)) >= 0.2


def test_explain_ends_the_message_with_what_it_returns(monkeypatch):
    monkeypatch.setattr(waiting, "WAIT_S", 0.05)
    with pytest.raises(AssertionError, match=r"gave up waiting for the worker .*:\nCounter\(\{'QUEUED': 1\}\)$"):
        wait_until(lambda: False, what="the worker", explain=lambda: "Counter({'QUEUED': 1})")

    async def never():
        return False

    with pytest.raises(AssertionError, match=r"did not hold within its limit of 0\.05 s .*:\n--- api log$"):
        asyncio.run(until(never, what="the drain", limit_s=0.05, explain=lambda: "--- api log"))


def test_waits_is_a_multiple_of_wait_s_never_less_than_one(monkeypatch):
    monkeypatch.setattr(waiting, "WAIT_S", 0.1)
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"gave up waiting for 200 tasks after \d+\.\d s \(2 × WAIT_S = 0\.1 s\)"):
        wait_until(lambda: False, what="200 tasks", waits=2)
    assert time.monotonic() - started >= 0.2
    with pytest.raises(AssertionError, match="never shorter than WAIT_S"):
        wait_until(lambda: True, what="a guess", waits=0.5)


def test_limit_s_is_the_deadline_of_a_limit_the_test_asserts(monkeypatch):
    monkeypatch.setattr(waiting, "WAIT_S", 3600.0)
    with pytest.raises(AssertionError, match=r"the takeover did not hold within its limit of 0\.1 s"):
        wait_until(lambda: False, what="the takeover", limit_s=0.1)
    calls = []
    with pytest.raises(AssertionError, match="the takeover did not hold"):
        wait_until(lambda: calls.append(1), what="the takeover", limit_s=-1.0)
    assert calls == [], "no check starts once the limit has passed"


def test_until_awaits_sync_and_async_predicates():
    predicate, calls = counting(2, value=7)

    async def eventually_async():
        await asyncio.sleep(0)
        return predicate()

    assert asyncio.run(until(predicate, what="the sync predicate", interval_s=0.001)) == 7
    assert len(calls) == 2
    calls.clear()
    assert asyncio.run(until(eventually_async, what="the async predicate", interval_s=0.001)) == 7
    assert len(calls) == 2


def test_until_gives_up_after_wait_s_naming_what_it_waited_for(monkeypatch):
    monkeypatch.setattr(waiting, "WAIT_S", 0.2)

    async def never():
        return False

    with pytest.raises(AssertionError, match=r"gave up waiting for three waiters parked after \d+\.\d s"):
        asyncio.run(until(never, what="three waiters parked"))


def test_wait_s_is_read_from_runstate_test_wait_s():
    def wait_s(**env) -> str:
        environ = {k: v for k, v in os.environ.items() if k != "RUNSTATE_TEST_WAIT_S"} | env
        command = [sys.executable, "-c", "import tests.waiting as w; print(w.WAIT_S)"]
        done = subprocess.run(
            command, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=waiting.WAIT_S, check=True
        )
        return done.stdout.strip()

    assert wait_s() == "60.0"
    assert wait_s(RUNSTATE_TEST_WAIT_S="180") == "180.0"
    assert wait_s(RUNSTATE_TEST_WAIT_S="2.5") == "2.5"


# A helper that polls for a state under another name, with its own deadline, is what this module replaced.
COPY = re.compile(r"^\s*(async\s+)?def\s+(_?wait_until|_?until|_?until_async|_?wait_for)\s*\(", re.MULTILINE)


def test_no_test_module_keeps_a_polling_helper_of_its_own():
    copies = [
        f"{path.relative_to(ROOT)}: {match.group(0).strip()}"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        if path != ROOT / "tests" / "waiting.py"
        for match in COPY.finditer(path.read_text())
    ]
    assert copies == [], "import wait_until/until from tests/waiting.py instead"
