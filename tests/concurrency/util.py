"""Run a function in real threads, each with its own database connection."""

import threading
import time
from collections.abc import Callable

from django.db import connection

from coordination import exceptions


def run_in_threads(targets, *, timeout=120):
    """Start every callable in ``targets`` at once (behind a barrier) and wait for all.

    Return their results in order; re-raise the first exception any of them raised.
    """
    barrier = threading.Barrier(len(targets))
    results = [None] * len(targets)
    errors = []

    def wrap(index, target):
        try:
            barrier.wait()
            results[index] = target()
        except BaseException as exc:  # noqa: BLE001 - reported to the test below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=wrap, args=(i, t), daemon=True) for i, t in enumerate(targets)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
        assert not thread.is_alive(), "a thread did not finish in time"
    if errors:
        raise errors[0]
    return results


def race_a_cancel(cancel: Callable[[], object], create: Callable[[], object], *, creators: int = 7) -> None:
    """Race ``cancel`` against ``creators`` threads calling ``create`` back to back until refused.

    The cancel starts 5 ms in, among the creators. Assert that nothing was granted once the
    cancel had committed and that every creator was refused in the end (``SCOPE_CANCELLED``):
    creators that keep coming never hold the cancel off (the fair gate, ``locking``).
    """
    cancelled_at = []

    def cancel_soon():
        time.sleep(0.005)
        cancel()
        cancelled_at.append(time.monotonic())

    def creator():
        attempts = []  # (started, granted)
        give_up = time.monotonic() + 60
        while time.monotonic() < give_up:
            started = time.monotonic()
            try:
                create()
                attempts.append((started, True))
            except exceptions.ScopeCancelled:
                attempts.append((started, False))
                break
        return attempts

    results = run_in_threads([cancel_soon] + [creator] * creators, timeout=90)
    attempts = [attempt for per_thread in results[1:] for attempt in per_thread]
    assert [started for started, granted in attempts if granted and started > cancelled_at[0]] == []
    assert all(per_thread and not per_thread[-1][1] for per_thread in results[1:])
