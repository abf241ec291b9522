"""How every test waits for a server to reach a state: poll until it holds, give up after ``WAIT_S``.

``WAIT_S`` is the one deadline of such waits: 60 s, or the seconds in the environment variable
``RUNSTATE_TEST_WAIT_S`` (e.g. ``RUNSTATE_TEST_WAIT_S=180`` on a slow or loaded machine). It is
only ever reached when a test fails, so it is long: a wait that holds returns as soon as it holds,
and a deadline guessed small is what makes a test flaky on a loaded two-core machine. A test
asserts what the server does, never how quickly it gets there on this machine.

Between two calls of its predicate a wait pauses 2 ms at first, then twice as long each time up to
its ``interval_s``: a state reached in a few milliseconds (a notification, a commit) is seen a few
milliseconds later, not a whole interval later, and a long wait still polls every ``interval_s``.

``wait_until`` (sync) and ``until`` (async) are the only polling helpers of the suite; a loop that
must stay hand-written (it also reads a child process's output, say) takes ``WAIT_S`` as its
deadline too, and so does a ``thread.join`` or ``Event.wait`` that only detects a hang. Two
keywords change the deadline, each for one kind of wait only:

- ``waits``: how many ``WAIT_S`` (at least one) a wait may take that is more than one state
  reached: a workload (a hundred tasks done one after another, work taken over after a kill)
  or child processes started from nothing (a server importing the project, a virtualenv built
  first). It still scales with ``RUNSTATE_TEST_WAIT_S``.
- ``limit_s``: a limit the test asserts, a product guarantee such as "writes are taken again
  within 30 s of a promotion", which must hold whatever ``WAIT_S`` is. Never a guess at how
  long a state takes to reach.
"""

import asyncio
import inspect
import os
import time
from collections.abc import Callable

WAIT_S = float(os.environ.get("RUNSTATE_TEST_WAIT_S", "60"))
FIRST_PAUSE_S = 0.002  # the first pause between two calls of a predicate; each next one doubles


def pauses(interval_s: float):
    """Yield the pauses between a wait's calls: ``FIRST_PAUSE_S``, doubling up to ``interval_s``, then it."""
    pause = min(FIRST_PAUSE_S, interval_s)
    while True:
        yield pause
        pause = min(2 * pause, interval_s)


def _deadline_s(waits: float, limit_s: float | None) -> float:
    if limit_s is not None:
        assert waits == 1, "a limit the test asserts is not a multiple of WAIT_S"
        return limit_s
    assert waits >= 1, "a wait for a server state is never shorter than WAIT_S"
    return waits * WAIT_S


def _give_up(what: str, started: float, waits: float, limit_s: float | None, explain) -> AssertionError:
    waited = time.monotonic() - started
    if limit_s is not None:
        message = f"{what} did not hold within its limit of {limit_s:g} s (waited {waited:.1f} s)"
    else:
        times = "" if waits == 1 else f"{waits:g} × "
        message = f"gave up waiting for {what} after {waited:.1f} s ({times}WAIT_S = {WAIT_S:g} s)"
    return AssertionError(message if explain is None else f"{message}:\n{explain()}")


def wait_until(
    predicate,
    *,
    what: str,
    interval_s: float = 0.05,
    waits: float = 1,
    limit_s: float | None = None,
    explain: Callable[[], object] | None = None,
):
    """Call ``predicate`` until it returns a truthy value, pausing as ``pauses`` says, and return that value.

    Fail with an AssertionError naming ``what`` and the seconds waited once ``waits`` × ``WAIT_S``
    (or the asserted limit ``limit_s``) has passed: no call of ``predicate`` starts after that.
    ``explain``, when given, is called then and what it returns (a log, the states seen) ends
    the message.
    """
    started = time.monotonic()
    deadline = started + _deadline_s(waits, limit_s)
    pause = pauses(interval_s)
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(max(0.0, min(next(pause), deadline - time.monotonic())))
    raise _give_up(what, started, waits, limit_s, explain)


async def until(
    predicate,
    *,
    what: str,
    interval_s: float = 0.01,
    waits: float = 1,
    limit_s: float | None = None,
    explain: Callable[[], object] | None = None,
):
    """``wait_until`` on an event loop: sleep with ``asyncio.sleep``; ``predicate`` may be a coroutine function."""
    started = time.monotonic()
    deadline = started + _deadline_s(waits, limit_s)
    pause = pauses(interval_s)
    while time.monotonic() < deadline:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        await asyncio.sleep(max(0.0, min(next(pause), deadline - time.monotonic())))
    raise _give_up(what, started, waits, limit_s, explain)
