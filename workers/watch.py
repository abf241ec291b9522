"""The claim watch of a Celery worker process: the events that stop a claim it holds, as they commit.

The SDKs' workers follow ``GET /v1/claims/watch``; a Celery worker reads the database itself,
so its watch is one thread per worker process (a forked pool child starts its own, as it
does its renewer), beside the renewer. It LISTENs for the ``claims.held`` notification
(``plumbing.notify.HELD_TOPIC``: a task cancel, a run or group end, a deadline, a lease that
ran out, whenever a worker held the task) and reads those events of the claims its process's
workers hold (``selectors.held_event_feed`` after its cursor, filtered by the prefix of ``heldBy`` that
names the process). It hands
them to its ``Holder`` (the renewer), which trips the handler's signal or drops the claim as
the claim's next renewal would have, a third of the lease later.

Nothing is missed:

- The cursor starts just below the event horizon when the watch first connects
  (``selectors.held_event_start``): every event committed afterwards comes after it, and a
  delivery waits for that (``Renewer.expect``, at most ``READY_TIMEOUT_S``) before it claims.
  Should it not wait long enough, the claims held when the watch starts are renewed once then
  (``Holder.watching``), which reports what happened to them before. A LISTEN connection lost
  (a database restart) reconnects and reads on from the cursor.
- It reads the projects and worker ids of every delivery that was about to claim (``expect``),
  so that an event stopping a claim not registered yet (``execute`` claims, then registers) is
  read too: the holder keeps it for the claim (``Renewer.pushed``). Any read's cursor is below
  every event not committed when the read began, so one begun before a project was expected
  skips none of that project's later events.
- After a notification whose events are not readable yet (an older transaction still running
  holds them behind the horizon), it re-reads every ``CHASE_EVERY_S`` for up to
  ``CHASE_FOR_S``; it re-reads every ``RECHECK_S`` in any case. On SQLite, which has no NOTIFY,
  it polls every ``SQLITE_POLL_S``.
- Renewal stays the fallback: while the watch is down, the next renewal says the same.

The thread holds its two connections (LISTEN, and Django's for the reads) only while the
process works, until it has held no claim and expected none for ``IDLE_CLOSE_S`` (a prefork
child running one task after another keeps them).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Protocol

from django.db import connection

from coordination.models import Event
from coordination.plumbing.notify import (
    CHASE_EVERY_S,
    CHASE_FOR_S,
    HELD_TOPIC,
    RECHECK_S,
    SQLITE_POLL_S,
    listening,
)
from coordination.reads.selectors import event_horizon, held_event_after, held_event_feed, held_event_start

logger = logging.getLogger(__name__)

# Events read per statement; a full batch is followed by the next at once.
BATCH = 500
# How long the watch keeps its connections once the process holds and expects no claim.
IDLE_CLOSE_S = 30.0
# How long a delivery waits for the watch to start reading before it claims anyway.
READY_TIMEOUT_S = 5.0
# Reconnection backoff: doubling from 0.1 s up to this.
MAX_BACKOFF_S = 2.0


class Holder(Protocol):
    """What the watch asks of the claims' holder (``workers.runtime.Renewer``)."""

    def watched(self) -> tuple[frozenset[uuid.UUID], frozenset[str]]:
        """Return the projects of this process's deliveries (claimed or about to) and their worker ids' prefixes."""

    def holding(self) -> bool:
        """Tell whether the process holds a claim now."""

    def watching(self) -> None:
        """Have the claims held now renewed once: the watch has just started reading (its cursor is set)."""

    def pushed(self, events: list[Event]) -> None:
        """Apply events that stop claims of this process's workers (held now, or registered later)."""


class ClaimWatcher:
    """One thread following the events that stop this process's claims; ``want()`` starts it."""

    def __init__(self, holder: Holder) -> None:
        self._holder = holder
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._wanted = threading.Event()
        self._wanted_at = 0.0  # when a delivery last expected a claim (monotonic): the idle close counts from it
        self.ready = threading.Event()  # set while the cursor is set: every later commit will be read
        self.cursor: tuple[int, int] | None = None  # the last position read
        self.reads = 0
        self._stopping = False

    def want(self) -> None:
        """Make sure the thread runs and reads: a delivery is about to claim."""
        self._wanted_at = time.monotonic()
        self._stopping = False
        self._wanted.set()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="runstate-claim-watch", daemon=True)
                self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop watching and end the thread, closing its connections (a test's teardown); ``want`` starts it again."""
        self._stopping = True
        self._wanted.set()  # a thread waiting for work wakes to end
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    def _loop(self) -> None:
        failures = 0
        while True:
            self._wanted.wait()
            if self._stopping:
                self.ready.clear()
                self.cursor = None
                return
            try:
                if connection.vendor == "postgresql":
                    self._listen()
                else:
                    self._poll()
                failures = 0
            except Exception as exc:  # noqa: BLE001 - the database is away: renewal covers until the watch is back
                failures += 1
                logger.warning("the claim watch lost its database (%s); reconnecting", exc)
                time.sleep(min(0.1 * 2 ** (failures - 1), MAX_BACKOFF_S))
            finally:
                connection.close()

    def _idle(self) -> bool:
        """Tell whether to stop watching: no claim held or expected for ``IDLE_CLOSE_S`` (until the next ``want``)."""
        if self._stopping:
            return True
        if time.monotonic() - self._wanted_at < IDLE_CLOSE_S or self._holder.holding():
            return False
        self._wanted.clear()
        if time.monotonic() - self._wanted_at < IDLE_CLOSE_S:  # a ``want`` came meanwhile
            self._wanted.set()
            return False
        self.ready.clear()
        self.cursor = None  # the next watch starts afresh, and renews what it finds held
        return True

    def _start(self) -> None:
        if self.cursor is None:
            self.cursor = held_event_start()
            self.ready.set()
            self._holder.watching()

    def _listen(self) -> None:
        with listening() as listener:
            self._start()  # after LISTEN: a commit from now on wakes a read that sees it
            chase_until = 0.0
            woken = False
            while not self._idle():
                # Chasing: whether the events a notification announced are readable yet, whoever's.
                if self._read(chasing=woken or time.monotonic() < chase_until):
                    chase_until = 0.0
                elif woken:
                    chase_until = max(chase_until, time.monotonic() + CHASE_FOR_S)
                chasing = time.monotonic() < chase_until
                woken = self._notified(listener, CHASE_EVERY_S if chasing else RECHECK_S)

    @staticmethod
    def _notified(listener, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a notification of an event naming a held claim; tell whether one came.

        The others (a drain's claims and completions notify too) are passed over without a
        read; once one comes, every notification already arrived is taken too, so one read
        answers a burst of them.
        """
        deadline = time.monotonic() + timeout_s
        woken = False
        # Each ``notifies()`` runs to its end: it holds the connection's lock while suspended,
        # and drops the rest of a packet when closed early.
        while not woken and (remaining := deadline - time.monotonic()) > 0:
            for notification in listener.notifies(timeout=remaining, stop_after=1):
                woken = woken or HELD_TOPIC in notification.payload.split()
        if woken:
            for _ in listener.notifies(timeout=0):
                pass  # the rest of a burst: the read to come answers it too
        return woken

    def _poll(self) -> None:
        self._start()
        while not self._idle():
            self._read()
            time.sleep(SQLITE_POLL_S)

    def _read(self, *, chasing: bool = False) -> bool:
        """Read every event after the cursor naming this process's workers and hand them over.

        Return whether any came; ``chasing``: whether any event naming a held claim came,
        whoever held it (what a notification announced is readable: no need to chase it).
        The cursor then moves up to the position read first (the horizon, on SQLite the last
        event), not only to the last event read: the next read skips the events of other
        workers that this one passed over.
        """
        found = False
        while True:
            projects, prefixes = self._holder.watched()
            if not projects or self.cursor is None:
                return found
            horizon = event_horizon()
            read_to = held_event_start(horizon)  # every event up to here is final before the read
            if chasing and not found:
                found = held_event_after(self.cursor, projects, horizon)
            events = held_event_feed(self.cursor, BATCH, projects, held_by_prefixes=prefixes, horizon=horizon)
            self.reads += 1
            if events:
                found = True
                self._holder.pushed(events)  # before the cursor moves: a cursor past an event means it was handed over
                self.cursor = (events[-1].txid, events[-1].id)
            if len(events) < BATCH:
                self.cursor = max(self.cursor, read_to)
                return found
