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

- ``claims.held`` (``HELD_TOPIC``), for the events that name a held claim (``heldBy``: a
  cancel, a run or group end, a deadline, a lease that ran out; migration 0020): the claim
  watches' feed wakes on it alone.

Waiters on ``ANY_TOPIC`` (event-log readers, the SSE feed) wake on every notification.

Each event loop (one per API process) holds one ``LISTEN`` connection, an asyncio task
reading psycopg's async ``notifies()``: a notification sets the flags of the waiters
registered for its topics right there on the loop, with no thread and no hop per waiter.
Waiters subscribe *before* they read the database, so a notification can never fall
between their read and their wait; after a reconnect every waiter is woken once to re-read,
since notifications sent while disconnected are lost. On SQLite there is no NOTIFY and
waiters poll on a short interval instead.

That connection is a session of its own, outside the request pool: behind a pooler in
transaction mode (``RUNSTATE_DB_POOLER=transaction``) a LISTEN through the pool would hold
on to no server session, so ``RUNSTATE_LISTEN_DATABASE_URL`` then routes it to PostgreSQL
directly (``listen_params``; docs/deploy.md, "Behind PgBouncer").

The same connection listens on ``CACHE_CHANNEL`` for changed cached rows (API keys and
mailboxes): the listener that ``start_cache_listener`` picks (the API's loop, or a loop of its
own in a process without one) hands them to the ``CacheFeed`` it was given
(``coordination/plumbing/process_cache.py`` gives its own): the caches sit above their
notifications, and this module knows them only by that feed.
"""

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from django.conf import settings
from django.db import connections

logger = logging.getLogger(__name__)

CHANNEL = "runstate"
CACHE_CHANNEL = "runstate_cache"  # changed cached rows (migration 0009's triggers)
ANY_TOPIC = "*"  # woken by every event (event-log readers)
HELD_TOPIC = "claims.held"  # woken by the events that name a held claim (the claim watches' feed)
SQLITE_POLL_S = 0.05
# Even with NOTIFY, a reader re-reads at least this often: a safety net for time-based changes
# (retry delays, deadlines) that no event announces, and for events held behind the horizon.
RECHECK_S = 1.0
# A reader woken by a topic of its own (``HELD_TOPIC``) chases what the notification announced
# for this long, re-reading this often, when its first read finds nothing yet: a transaction
# older than the notifying one, still running, holds the events behind the horizon a moment.
CHASE_FOR_S = 1.0
CHASE_EVERY_S = 0.025
_connections_made = itertools.count(1)  # the epoch of each LISTEN connection, for the cache feed


@dataclass(frozen=True)
class CacheFeed:
    """Where ``start_cache_listener`` sends the LISTEN connection's news, on its loop.

    ``on_listening(epoch)``: the connection came up as ``epoch`` (None: it went down, and
    notifications sent meanwhile are lost). ``on_notification(payload)``: a ``CACHE_CHANNEL``
    notification arrived.
    """

    on_listening: Callable[[int | None], None]
    on_notification: Callable[[str], None]


class Waiter:
    """One wait's wake-up flag, set on its event loop by that loop's listener."""

    def __init__(self, topics: frozenset[str]) -> None:
        self.topics = topics
        self.event = asyncio.Event()

    def wake(self) -> None:
        """Set the flag (on the waiter's loop)."""
        self.event.set()

    async def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a wake-up; return whether one came. Clears the flag."""
        try:
            await asyncio.wait_for(self.event.wait(), timeout=max(timeout_s, 0))
            return True
        except TimeoutError:
            return False
        finally:
            self.event.clear()


class _LoopListener:
    """The LISTEN connection of one event loop and the waiters registered on that loop."""

    def __init__(self) -> None:
        self.by_topic: dict[str, set[Waiter]] = defaultdict(set)
        self.listening = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.conn = None
        self.epoch: int | None = None  # while connected
        self.cache_feed: CacheFeed | None = None  # start_cache_listener's

    def ensure_task(self) -> None:
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._listen_forever(), name="runstate-listen")

    def dispatch(self, payload: str) -> None:
        by_topic = self.by_topic
        woken: set[Waiter] = set()
        for topic in (*payload.split(), ANY_TOPIC):
            waiters = by_topic.get(topic)
            if waiters:
                woken.update(waiters)
        for waiter in woken:
            waiter.wake()

    def wake_all(self) -> None:
        for waiter in {w for ws in self.by_topic.values() for w in ws}:
            waiter.wake()

    async def _listen_forever(self) -> None:
        import psycopg

        backoff = 0.1
        while True:
            try:
                conn = await psycopg.AsyncConnection.connect(**listen_params(), autocommit=True)
                await conn.execute(f"LISTEN {CACHE_CHANNEL}")
                await conn.execute(f"LISTEN {CHANNEL}")  # last: pg_stat_activity shows it (tests look)
            except Exception:  # noqa: BLE001 - keep trying; waiters fall back to rechecks
                logger.warning("LISTEN connection failed; retrying in %.1fs", backoff, exc_info=True)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.1
            self.conn = conn
            self.epoch = next(_connections_made)
            if self.cache_feed is not None:
                self.cache_feed.on_listening(self.epoch)
            # Wake first, then announce: a waiter resuming from ready() already has its wake-up.
            self.wake_all()
            self.listening.set()
            try:
                async for notify in conn.notifies():
                    if notify.channel == CHANNEL:
                        self.dispatch(notify.payload)
                    elif self.cache_feed is not None:
                        self.cache_feed.on_notification(notify.payload)
            except Exception:  # noqa: BLE001 - reconnect below
                logger.warning("LISTEN connection lost; reconnecting", exc_info=True)
            finally:
                if self.cache_feed is not None:
                    self.cache_feed.on_listening(None)
                self.epoch = None
                self.listening.clear()
                self.conn = None
                try:
                    await asyncio.shield(conn.close())
                except BaseException:  # noqa: BLE001, S110 - already broken, or the loop is ending
                    pass


def listen_params() -> dict:
    """Return psycopg connection keywords for a LISTEN connection.

    To ``RUNSTATE_LISTEN_DATABASE_URL`` when it names another route than ``DATABASE_URL``
    (behind a pooler in transaction mode: PostgreSQL itself, docs/deploy.md), else to the
    default database as its connections reach it (the test database under the tests).
    """
    params = connections["default"].get_connection_params()
    for key in ("cursor_factory", "context", "prepare_threshold", "server_side_binding", "pool"):
        params.pop(key, None)
    listen_url = getattr(settings, "RUNSTATE_LISTEN_DATABASE_URL", "")
    if listen_url and listen_url != getattr(settings, "DATABASE_URL", ""):
        listen = settings.RUNSTATE_LISTEN_DATABASE
        params = {"client_encoding": params.get("client_encoding", "UTF8"), **listen.get("OPTIONS", {})}
        for key, setting in (("dbname", "NAME"), ("user", "USER"), ("password", "PASSWORD"), ("host", "HOST")):
            if listen.get(setting):
                params[key] = listen[setting]
        if listen.get("PORT"):
            params["port"] = listen["PORT"]
    return params


@contextmanager
def listening() -> Iterator:
    """Yield a psycopg connection of its own (``listen_params``) LISTENing on ``CHANNEL``, closed on exit.

    For a thread outside any event loop that reads the notifications itself, with
    ``notifies()``: a Celery worker process's claim watch (``workers/watch.py``).
    """
    import psycopg

    with psycopg.connect(**listen_params(), autocommit=True) as conn:
        conn.execute(f"LISTEN {CHANNEL}")
        yield conn


class NotificationHub:
    """Per event loop, a LISTEN connection fanning notifications out to that loop's waiters."""

    def __init__(self) -> None:
        self._loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopListener] = weakref.WeakKeyDictionary()
        self._own_loop: asyncio.AbstractEventLoop | None = None  # start_cache_listener's, without a running loop
        self._own_loop_lock = threading.Lock()

    @staticmethod
    def enabled() -> bool:
        """Tell whether the database can notify (PostgreSQL)."""
        return connections["default"].vendor == "postgresql"

    def _listener(self) -> _LoopListener:
        loop = asyncio.get_running_loop()
        listener = self._loops.get(loop)
        if listener is None:
            for old in [other for other in self._loops if other.is_closed()]:
                del self._loops[old]  # ended loops (tests): their tasks were cancelled
            listener = self._loops[loop] = _LoopListener()
        return listener

    def subscribe(self, topics: Iterable[object]) -> Waiter:
        """Register a waiter for ``topics`` (ids) on the running loop; call ``unsubscribe`` when done."""
        waiter = Waiter(frozenset(str(t) for t in topics))
        by_topic = self._listener().by_topic
        for topic in waiter.topics:
            by_topic[topic].add(waiter)
        return waiter

    def unsubscribe(self, waiter: Waiter) -> None:
        """Forget a waiter (on the loop it was subscribed on)."""
        by_topic = self._listener().by_topic
        for topic in waiter.topics:
            waiters = by_topic.get(topic)
            if waiters is not None:
                waiters.discard(waiter)
                if not waiters:
                    del by_topic[topic]

    def wake_all(self) -> None:
        """Wake every waiter of the running loop (the process is stopping: they look again now)."""
        self._listener().wake_all()

    def start_cache_listener(self, feed: CacheFeed) -> None:
        """Feed ``feed`` from a LISTEN connection: the running loop's, or one on a loop of its own."""
        if not self.enabled():
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            self._background_loop().call_soon_threadsafe(self._serve_cache, feed)
        else:
            self._serve_cache(feed)

    def _serve_cache(self, feed: CacheFeed) -> None:
        listener = self._listener()
        listener.cache_feed = feed
        if listener.epoch is not None:
            feed.on_listening(listener.epoch)
        listener.ensure_task()

    def _background_loop(self) -> asyncio.AbstractEventLoop:
        with self._own_loop_lock:
            if self._own_loop is None or self._own_loop.is_closed():
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="runstate-listen", daemon=True).start()
                self._own_loop = loop
            return self._own_loop

    def waiting_on(self, topic: object) -> int:
        """Return how many waiters of the running loop are subscribed to ``topic``."""
        return len(self._listener().by_topic.get(str(topic), ()))

    async def ready(self, timeout_s: float = 2.0) -> None:
        """Wait until this loop's LISTEN is in place, at most ``timeout_s``.

        Until then a notification could be missed; waiters still re-read on their recheck
        interval, so a slow start costs latency, never correctness.
        """
        if not self.enabled():
            return
        listener = self._listener()
        listener.ensure_task()
        if not listener.listening.is_set():
            try:
                await asyncio.wait_for(listener.listening.wait(), timeout_s)
            except TimeoutError:
                pass

    def stop(self, timeout_s: float = 10.0) -> None:
        """Close every loop's LISTEN connection (tests, before dropping the database).

        Call it from outside the loops (a loop that has ended already closed its own).
        """
        for loop, listener in list(self._loops.items()):
            task = listener.task
            if task is None or task.done():
                continue
            if loop.is_running():
                future = asyncio.run_coroutine_threadsafe(_cancel(task), loop)
                try:
                    future.result(timeout_s)
                except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
                    pass
            elif listener.conn is not None and not loop.is_closed():
                loop.run_until_complete(_cancel(task))
            elif listener.conn is not None:
                listener.conn.pgconn.finish()  # the loop is gone: drop the socket
        self._loops.clear()

    @staticmethod
    def _connect():
        """Return a blocking autocommit connection listening on the channel (tests)."""
        import psycopg

        conn = psycopg.connect(**listen_params(), autocommit=True)
        conn.execute(f"LISTEN {CHANNEL}")
        return conn


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    try:
        await task
    except BaseException:  # noqa: BLE001, S110 - it was cancelled
        pass


hub = NotificationHub()
