"""Timed work on many threads started together, and the percentile every benchmark reports."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

from bench.harness.meters import QUIET, CpuMeter, process_tree_seconds, wait_for_quiet


def backend_seconds() -> tuple[int | None, float]:
    """Return this thread's PostgreSQL backend pid (if connected) and its CPU-seconds so far."""
    from django.db import connection

    if connection.connection is None or connection.vendor != "postgresql":
        return None, 0.0
    pid = connection.connection.info.backend_pid
    return pid, process_tree_seconds(pid)


def run_threads(
    count: int,
    work: Callable[[int, Any], Any],
    *,
    setup: Callable[[int], Any] | None = None,
    teardown: Callable[[Any], None] | None = None,
    server_pid: int | None = None,
    pooler_pid: int | None = None,
) -> tuple[float, list[Any], CpuMeter]:
    """Run ``work(i, setup(i))`` on ``count`` threads started together; return (seconds, results, cpu).

    First waits for the machine to be quiet (``QUIET``). Setup (connections, HTTP clients)
    happens before the clock starts. Every thread closes its Django connection at the end.
    """
    from django.db import connection

    note = wait_for_quiet(**QUIET)
    barrier = threading.Barrier(count + 1)
    results: list[Any] = [None] * count
    errors: list[BaseException] = []
    backend_s = [0.0] * count

    def body(index: int) -> None:
        context = None
        try:
            context = setup(index) if setup else None
            pid, cpu_before = backend_seconds()
            barrier.wait()
            results[index] = work(index, context)
            if pid is not None:
                backend_s[index] = process_tree_seconds(pid) - cpu_before
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)
            barrier.abort()
        finally:
            if teardown and context is not None:
                teardown(context)
            connection.close()

    threads = [threading.Thread(target=body, args=(i,), name=f"bench-{i}") for i in range(count)]
    for thread in threads:
        thread.start()
    try:
        barrier.wait(timeout=120)
    except threading.BrokenBarrierError:
        pass
    with CpuMeter(server_pid, pooler_pid) as cpu:
        started = time.perf_counter()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - started
    if errors:
        raise errors[0]
    cpu.backend_s = sum(backend_s)
    cpu.note = note
    return elapsed, results, cpu


def percentile(values: list[float], fraction: float) -> float:
    """Nearest-rank percentile of ``values`` (0 when empty)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def in_threads(count: int, threads: int, action) -> None:
    """Call ``action(i)`` for i in range(count), spread over ``threads`` threads."""
    from django.db import connection

    def work(start: int) -> None:
        try:
            for i in range(start, count, threads):
                action(i)
        finally:
            connection.close()

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()


def wait_for(predicate, timeout_s: float, what: str) -> None:
    """Poll ``predicate`` every 20 ms until it holds; stop the benchmark when ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.02)
