"""Wake long-polls when something they wait for commits.

On PostgreSQL a trigger (``coordination/migrations/0007_...``) sends one
``NOTIFY runstate, '<topic> <topic> ...'`` per INSERT statement on the event table: the
distinct topics of the statement's rows, split over several notifications only when they
would not fit in one payload (under 8,000 bytes), and one empty payload when no row has a
topic. PostgreSQL delivers them when (and only if) the transaction commits. The topics of
an event row:

- its ``subject_id`` (when not empty): the task, message, group, barrier, timer or run it
  is about. Task-result, group, barrier and timer waits subscribe to their object's id.
- its ``run_id``, only for the events that make work available on the run or change what
  a claimer or receiver of the run is answered: ``task.submitted``, ``task.requeued``
  (released, retried, lease expired), ``message.sent``, ``message.retried`` and every
  ``run.*`` event (a cancel, complete or deadline refuses claims and receives). Claim and
  receive waits subscribe to their run's chain of ids. ``task.claimed``, ``task.succeeded``,
  ``message.received`` and the like take work away or end it, so they never wake a run's
  claimers: a busy run wakes its idle claimers only when there is something to claim.

Waiters on ``ANY_TOPIC`` (event-log readers, SSE streams) wake on every notification.

One thread per process holds a ``LISTEN`` connection and wakes the asyncio waiters
registered for any topic of a payload. (The same connection listens on
``process_cache.CHANNEL`` for changed API keys and mailboxes.) Waiters subscribe *before*
they read the database, so a notification can never fall between their read and their
wait; after a reconnect every waiter is woken once to re-read, since notifications sent
while disconnected are lost. On SQLite there is no NOTIFY and waiters poll on a short interval instead.
"""

import asyncio
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Iterable

from django.db import connections

from coordination import process_cache

logger = logging.getLogger(__name__)

CHANNEL = "runstate"
ANY_TOPIC = "*"  # woken by every event (event-log readers)
SQLITE_POLL_S = 0.05


class Waiter:
    """One long-poll's wake-up flag, set from the listener thread."""

    def __init__(self, topics: frozenset[str]) -> None:
        self.topics = topics
        self.loop = asyncio.get_running_loop()
        self.event = asyncio.Event()

    def wake(self) -> None:
        """Set the flag from any thread."""
        self.loop.call_soon_threadsafe(self.event.set)

    async def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a wake-up; return whether one came. Clears the flag."""
        try:
            await asyncio.wait_for(self.event.wait(), timeout=max(timeout_s, 0))
            return True
        except TimeoutError:
            return False
        finally:
            self.event.clear()


class NotificationHub:
    """A process-wide LISTEN connection fanning notifications out to waiters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_topic: dict[str, set[Waiter]] = defaultdict(set)
        self._listening = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._epoch = 0  # counts the LISTEN connections made, for process_cache

    @staticmethod
    def enabled() -> bool:
        """Tell whether the database can notify (PostgreSQL)."""
        return connections["default"].vendor == "postgresql"

    def subscribe(self, topics: Iterable[object]) -> Waiter:
        """Register a waiter for ``topics`` (ids); call ``unsubscribe`` when done."""
        waiter = Waiter(frozenset(str(t) for t in topics))
        with self._lock:
            for topic in waiter.topics:
                self._by_topic[topic].add(waiter)
        return waiter

    def unsubscribe(self, waiter: Waiter) -> None:
        """Forget a waiter."""
        with self._lock:
            for topic in waiter.topics:
                waiters = self._by_topic.get(topic)
                if waiters is not None:
                    waiters.discard(waiter)
                    if not waiters:
                        del self._by_topic[topic]

    def stop(self, timeout_s: float = 10.0) -> None:
        """Close the LISTEN connection and end the thread (tests, before dropping the database)."""
        thread = self._thread
        if thread is None:
            return
        self._stopping.set()
        thread.join(timeout_s)
        self._thread = None
        self._stopping.clear()

    def start(self) -> None:
        """Start the LISTEN thread if it is not running (it connects in the background)."""
        if self.enabled():
            self._ensure_thread()

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._listen_forever, name="runstate-listen", daemon=True)
                self._thread.start()

    async def ready(self, timeout_s: float = 2.0) -> None:
        """Wait (without blocking the loop) until LISTEN is in place, at most ``timeout_s``.

        Until then a notification could be missed; waiters still re-read on their recheck
        interval, so a slow start costs latency, never correctness.
        """
        if self.enabled() and not self._listening.is_set():
            self._ensure_thread()
            await asyncio.get_running_loop().run_in_executor(None, self._listening.wait, timeout_s)

    def _dispatch(self, payload: str) -> None:
        with self._lock:
            topics = [*payload.split(), ANY_TOPIC]
            waiters = {w for topic in topics for w in self._by_topic.get(topic, ())}
        for waiter in waiters:
            waiter.wake()

    def _wake_all(self) -> None:
        with self._lock:
            waiters = {w for ws in self._by_topic.values() for w in ws}
        for waiter in waiters:
            waiter.wake()

    def _connect(self):
        import psycopg

        params = connections["default"].get_connection_params()
        for key in ("cursor_factory", "context", "prepare_threshold", "server_side_binding"):
            params.pop(key, None)
        conn = psycopg.connect(**params, autocommit=True)
        conn.execute(f"LISTEN {process_cache.CHANNEL}")
        conn.execute(f"LISTEN {CHANNEL}")  # last: pg_stat_activity shows it (the restart tests look for it)
        return conn

    def _listen_forever(self) -> None:
        backoff = 0.1
        while not self._stopping.is_set():
            try:
                conn = self._connect()
            except Exception:  # noqa: BLE001 - keep trying; waiters fall back to rechecks
                logger.warning("LISTEN connection failed; retrying in %.1fs", backoff, exc_info=True)
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.1
            self._epoch += 1
            process_cache.on_listening(self._epoch)
            # Wake first, then announce: a waiter resuming from ready() already has its wake-up.
            self._wake_all()
            self._listening.set()
            try:
                while not self._stopping.is_set():
                    for notify in conn.notifies(timeout=0.5):
                        if notify.channel == CHANNEL:
                            self._dispatch(notify.payload)
                        else:
                            process_cache.on_notification(notify.payload)
            except Exception:  # noqa: BLE001 - reconnect below
                logger.warning("LISTEN connection lost; reconnecting", exc_info=True)
            finally:
                process_cache.on_listening(None)
                self._listening.clear()
                try:
                    conn.close()
                except Exception:  # noqa: BLE001, S110 - already broken
                    pass


hub = NotificationHub()
