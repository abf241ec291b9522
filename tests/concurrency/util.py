"""Run a function in real threads, each with its own database connection."""

import threading

from django.db import connection


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
