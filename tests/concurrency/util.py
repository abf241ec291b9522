"""Run a function in real threads, each with its own database connection; force a race's order."""

import threading
import time
import uuid
from collections.abc import Callable

from django.conf import settings
from django.db import connection, transaction

from coordination.domain import exceptions
from tests.waiting import WAIT_S, wait_until


def rounds(*, postgresql: int, sqlite: int) -> int:
    """Return how many rounds a random race repeats on this database.

    On SQLite every write transaction takes the database's one write lock (``IMMEDIATE``), so
    the racers of a round run one after another whatever the threads do: a round there checks
    the rule under one more arrival order, not a new interleaving of row locks, and a few
    rounds check what many would. On PostgreSQL each round is a fresh race of row locks.
    """
    return sqlite if connection.vendor == "sqlite" else postgresql


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
        give_up = time.monotonic() + WAIT_S
        while time.monotonic() < give_up:
            started = time.monotonic()
            try:
                create()
                attempts.append((started, True))
            except exceptions.ScopeCancelled:
                attempts.append((started, False))
                break
        return attempts

    results = run_in_threads([cancel_soon] + [creator] * creators, timeout=WAIT_S + 30)  # the creators give up first
    attempts = [attempt for per_thread in results[1:] for attempt in per_thread]
    assert [started for started, granted in attempts if granted and started > cancelled_at[0]] == []
    assert all(per_thread and not per_thread[-1][1] for per_thread in results[1:])


def backend_pid() -> int | str:
    """What finds this thread's connection's PostgreSQL backend in ``pg_stat_activity``: its process id.

    Behind a pooler in transaction mode (``RUNSTATE_DB_POOLER=transaction``, tests/reliability/
    test_pgbouncer_load.py) a connection has no backend of its own: each transaction runs on
    whichever server connection PgBouncer lends it, and the process id psycopg reports is
    PgBouncer's. The connection then gets an ``application_name`` of its own instead, which
    PgBouncer sets on every server connection it lends it, and that name is returned.
    """
    connection.ensure_connection()
    if getattr(settings, "RUNSTATE_DB_POOLER", "") != "transaction":
        return connection.connection.info.backend_pid
    name = f"runstate-race-{uuid.uuid4().hex[:12]}"
    with connection.cursor() as cursor:
        cursor.execute("SELECT set_config('application_name', %s, false)", [name])
    return name


def waiting_on_a_lock(pid: int | str) -> bool:
    """Whether the PostgreSQL backend ``pid`` (``backend_pid``'s) waits on a lock now (``pg_stat_activity``)."""
    column = "application_name" if isinstance(pid, str) else "pid"
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT wait_event_type FROM pg_stat_activity WHERE {column} = %s", [pid])  # noqa: S608
        rows = cursor.fetchall()
    return any(row[0] == "Lock" for row in rows)


def run_closing(target, errors):
    """Run ``target`` on this thread's own connection, closed after; record what it raised in ``errors``."""

    def wrapped():
        try:
            target()
        except BaseException as exc:  # noqa: BLE001 - asserted by the test
            errors.append(exc)
        finally:
            connection.close()

    return wrapped


def force_order(first: Callable[[], object], second: Callable[[], object]) -> tuple[object, object]:
    """Race ``first`` and ``second`` so that ``first`` commits first while ``second`` contends for its locks.

    ``first`` runs in a transaction that stays open until ``second`` is held up by it, then
    commits; ``second`` then goes on and must see what ``first`` wrote. Held up means:

    - PostgreSQL: ``second``'s backend waits on a lock (``pg_stat_activity`` shows
      ``wait_event_type = 'Lock'``), so ``second`` takes the path of the side that lost the race
      for a row, not of one that simply came later. If ``second`` finishes without waiting, the
      two did not contend, and this fails.
    - SQLite: ``second`` is about to begin its transaction. With ``transaction_mode``
      ``IMMEDIATE`` (the settings) that ``BEGIN`` waits for ``first``'s commit to take the
      database's write lock, so ``second`` reads nothing inside its transaction before that
      commit whether it waited a moment or not: SQLite has no other order to force.

    Return ``(first's result, second's result)``; re-raise the first exception either raised.
    """
    postgres = connection.vendor == "postgresql"
    holding, second_held_up = threading.Event(), threading.Event()
    pids, results, errors = {}, {}, []

    def run_first():
        with transaction.atomic():
            results["first"] = first()
            holding.set()
            assert second_held_up.wait(WAIT_S), "the second side never contended"

    def flag_begin(execute, sql, params, many, context):
        if sql.lstrip().upper().startswith("BEGIN"):
            second_held_up.set()
        return execute(sql, params, many, context)

    def run_second():
        try:
            if postgres:
                pids["second"] = backend_pid()
                results["second"] = second()
            else:
                with connection.execute_wrapper(flag_begin):
                    results["second"] = second()
        finally:
            second_held_up.set()  # a second side that ended without contending must not hold up the first

    threads = [threading.Thread(target=run_closing(target, errors)) for target in (run_first, run_second)]
    try:
        threads[0].start()
        wait_until(lambda: holding.is_set() or errors, what="the first side holds its locks", interval_s=0.01)
        assert not errors, errors
        threads[1].start()
        if postgres:
            wait_until(
                lambda: "second" in results or errors or ("second" in pids and waiting_on_a_lock(pids["second"])),
                what="the second side waits on a lock",
                interval_s=0.01,
            )
            assert "second" not in results, "the second side finished without waiting for the first"
            assert not errors, errors
            second_held_up.set()
    finally:
        second_held_up.set()
        for thread in threads:
            if thread.ident is not None:  # started
                thread.join(WAIT_S)
    assert not any(thread.is_alive() for thread in threads), "a side did not finish in time"
    if errors:
        raise errors[0]
    return results["first"], results["second"]


def read_events_until(done: threading.Event, visibility, *, limit: int = 7) -> list[int]:
    """Page through the event log by cursor until ``done`` is set and a page comes back empty; return the ids read.

    ``done`` is read before each page, so a page read after the last write has committed
    comes back empty only once every event has been read.
    """
    from coordination.reads.selectors import event_list

    seen, cursor = [], None
    while True:
        finished = done.is_set()
        events, cursor = event_list(visibility, after=cursor, limit=limit)
        seen += [e.id for e in events]
        if finished and not events:
            return seen
        if not events:
            time.sleep(0.001)
