"""Per-process caches of rows a request reads on every call: API keys and mailboxes.

Each API request authenticates its key and most name a mailbox; reading both again on
every request costs two statements and, under load, a fifth of a process's CPU. An API
process keeps what it read for ``RUNSTATE_PROCESS_CACHE_S`` seconds (5 by default; 0
turns the caches off), and forgets an entry as soon as its row changes anywhere:

- on PostgreSQL, triggers (migration 0009) send ``NOTIFY runstate_cache, '<row id>'`` when
  a key or mailbox row is updated or deleted (``'*'`` on TRUNCATE). The process's LISTEN
  connection (``coordination.plumbing.notify.hub``) drops the entry, so a revoked key is refused by
  every process within the notification's delivery, milliseconds after the revoke commits;
- in the process that writes the row, at once (``post_save`` / ``post_delete``), before it
  commits.

The caches serve only while the LISTEN connection is up, and only entries read since it
last connected: a notification sent while it was down is lost, so everything read before a
reconnect is dropped. A read that overlaps an invalidation is not kept (``generation``):
it may have seen the row as it was before the change. Without PostgreSQL (SQLite) there
is no NOTIFY and the caches stay off.

Every caller gets an object of its own: an entry keeps a snapshot of the row (the model
instance pickled, with the related rows it carries and its mutable field values such as a
list of permissions), and each hit is a fresh copy of it. A caller may change or save what
it got (a request's thread sets an attribute, a service saves the mailbox) without another
thread, or the next request, seeing the change. A copy costs about 20 µs, no query.
``RowCache.get_shared`` hands out instead one immutable value derived from the entry once
(the hot path's ``services.keys.CachedKey``): nobody can change it, so one serves every caller.

Caching is turned on by the API's ASGI application (``runstate_project.asgi``), the one
place that serves keys and mailboxes at request rates, and by a Celery worker's process at
its first ``@runstate_task`` submit (``workers.decorators``); management commands and the
in-process test client read the database as before.
"""

import pickle
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from coordination.plumbing.notify import CacheFeed, hub

ALL = "*"
MAX_ENTRIES = 10_000  # per cache; a full cache starts again rather than evicting one by one


@dataclass
class _Entry:
    snapshot: bytes  # the model instance, pickled: each hit unpickles a copy of its own
    row_id: str
    expires_at: float
    epoch: int
    shared: Any = None  # ``get_shared``'s value, made at its first call


class RowCache:
    """A dict of rows by lookup key, forgotten by row id; thread-safe."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._entries: dict[Hashable, _Entry] = {}
        self._keys_by_row: dict[str, set[Hashable]] = {}
        self.generation = 0  # bumped by every invalidation

    def get(self, key: Hashable) -> Any | None:
        """Return a copy of the cached value of ``key``, or None (absent, expired, or read before a reconnect)."""
        entry = self._live(key)
        return None if entry is None else pickle.loads(entry.snapshot)

    def get_shared(self, key: Hashable, share: Callable[[Any], Any]) -> Any | None:
        """Return ``share(a copy)`` of ``key``'s cached value, made once per entry and then handed to every caller.

        ``share`` (the same function for every caller of this cache) must return an immutable
        value: it is not copied. None when ``get`` would answer None.
        """
        entry = self._live(key)
        if entry is None:
            return None
        if entry.shared is None:  # two threads at once each make it once: equal values, the last kept
            entry.shared = share(pickle.loads(entry.snapshot))
        return entry.shared

    def _live(self, key: Hashable) -> _Entry | None:
        """Return ``key``'s entry if it may be answered from: present, unexpired, read since the last reconnect."""
        epoch = _state.epoch
        if epoch is None:
            return None
        entry = self._entries.get(key)
        if entry is None or entry.epoch != epoch or entry.expires_at < time.monotonic():
            return None
        return entry

    def load(self, key: Hashable, read: Callable[[], Any]) -> Any:
        """Return ``key``'s row from the cache, or ``read()`` it and keep it unless it was invalidated meanwhile.

        ``read`` returns a model instance, or None for "no such row" (never cached); a change
        to the instance's row (its ``pk``) forgets the entry. The instance returned is the
        caller's own: the entry keeps a snapshot taken before it is returned.
        """
        cached = self.get(key)
        if cached is not None:
            return cached
        epoch, generation = _state.epoch, self.generation
        value = read()
        if value is None or epoch is None or _state.ttl_s <= 0:
            return value
        snapshot = pickle.dumps(value)  # before the caller can change ``value``
        with self._lock:
            if self.generation != generation or _state.epoch != epoch:
                return value  # a change arrived while we read: what we read may predate it
            if len(self._entries) >= MAX_ENTRIES:
                self._entries.clear()
                self._keys_by_row.clear()
            rid = str(value.pk)
            self._entries[key] = _Entry(snapshot, rid, time.monotonic() + _state.ttl_s, epoch)
            self._keys_by_row.setdefault(rid, set()).add(key)
        return value

    def forget_row(self, row_id: object) -> None:
        """Drop every entry of row ``row_id``."""
        rid = str(row_id)
        with self._lock:
            self.generation += 1
            for key in self._keys_by_row.pop(rid, ()):
                self._entries.pop(key, None)

    def clear(self) -> None:
        """Drop everything."""
        with self._lock:
            self.generation += 1
            self._entries.clear()
            self._keys_by_row.clear()

    def __len__(self) -> int:
        return len(self._entries)


class _State:
    """Whether the caches serve, and the LISTEN connection's epoch they trust."""

    def __init__(self) -> None:
        self.enabled = False
        self.ttl_s = 0.0
        self.listening_epoch: int | None = None  # set by the hub while its LISTEN is up

    @property
    def epoch(self) -> int | None:
        return self.listening_epoch if self.enabled else None


_state = _State()
api_keys = RowCache("api_keys")
mailboxes = RowCache("mailboxes")
CACHES = (api_keys, mailboxes)


def enable() -> bool:
    """Turn the caches on in this process (PostgreSQL, ``RUNSTATE_PROCESS_CACHE_S`` > 0); return whether they are.

    Starts the LISTEN connection; the caches serve once it is up.
    """
    _state.ttl_s = float(settings.RUNSTATE_PROCESS_CACHE_S)
    _state.enabled = _state.ttl_s > 0 and hub.enabled()
    if _state.enabled:
        hub.start_cache_listener(CacheFeed(on_listening, on_notification))
    return _state.enabled


def disable() -> None:
    """Turn the caches off and empty them (tests); ``enable`` trusts only the listener it starts."""
    _state.enabled = False
    _state.listening_epoch = None
    clear_all()


def clear_all() -> None:
    """Empty every cache."""
    for cache in CACHES:
        cache.clear()


def on_listening(epoch: int | None) -> None:
    """Trust only what is read from now on: the LISTEN connection came up as ``epoch`` (None: it went down)."""
    clear_all()
    _state.listening_epoch = epoch


def on_notification(payload: str) -> None:
    """Forget what a ``runstate_cache`` notification names: a row id, or ``*`` for everything."""
    if payload == ALL:
        clear_all()
        return
    for cache in CACHES:
        cache.forget_row(payload)


def forget_row(sender, instance, **kwargs) -> None:
    """``post_save`` / ``post_delete`` receiver: this process changed a cached row."""
    for cache in CACHES:
        cache.forget_row(instance.pk)
