"""``with claim.hold() as ctx``: work on a claim by hand, renewed in the background.

Written by hand (not generated). The holder of the async client (``runstate._worker.Holder``:
the consume engine's renewer and record methods, and the client's shared claim watch) runs on
async twins of what ``claim.hold()`` hands in: the claim as last seen, and a connection pool of
the client's configuration on an event loop in a daemon thread (``_Background``), one per sync
client, shared by its holds (so they share one claim watch too) and stopped ``LINGER_S`` after
the last one ended. The block runs in the calling thread and ``ctx.signal`` is a
``threading.Event``.
"""

import asyncio
import os
import threading
import weakref
from collections.abc import Coroutine
from typing import Any, Protocol

from runstate._async.http import AsyncHttp
from runstate._async.work import AsyncClaim, AsyncTasks
from runstate._config import JsonDict
from runstate._sync.http import Http
from runstate._tracing import in_span, leave
from runstate._worker import HoldContext, Holder
from runstate._worker.watch import LINGER_S

__all__ = ["Hold", "HoldContext"]


class HeldClaim(Protocol):
    """The claim a hold renews (``Claim``, whose ``hold()`` makes one): what its twin is made of."""

    @property
    def id(self) -> str:
        """Return the claim's id."""

    @property
    def task_id(self) -> str:
        """Return the claimed task's id."""

    @property
    def data(self) -> JsonDict:
        """Return the claim as last seen."""


class HoldingTasks(Protocol):
    """The tasks namespace ``claim.hold()`` hands in (``Tasks``): its client's configuration."""

    _http: Http


class _Background:
    """An event loop in a daemon thread and an async twin of one sync client's HTTP plumbing.

    Shared by the client's holds (``of`` counts one more, ``leave`` one less); ``LINGER_S``
    after the last one left, it cancels what runs on it (the claim watch), closes its
    connections and stops.
    """

    _lock = threading.Lock()
    _of: "weakref.WeakKeyDictionary[Http, _Background]" = weakref.WeakKeyDictionary()

    def __init__(self, http: Http) -> None:
        self.pid = os.getpid()  # a child process made by fork has no thread: it starts its own
        self.holds = 0
        self.closing = False
        self.loop = asyncio.new_event_loop()
        self._linger: asyncio.TimerHandle | None = None
        self._thread = threading.Thread(target=self._run, name="runstate-holds", daemon=True)
        self._thread.start()
        self.http: AsyncHttp = self.call(self._open(http))

    @classmethod
    def of(cls, http: Http) -> "_Background":
        """Return the running background of ``http``'s holds, counting one more hold on it."""
        with cls._lock:
            background = cls._of.get(http)
            if background is None or background.closing or background.pid != os.getpid():
                background = cls._of[http] = cls(http)
            background.holds += 1
            if background._linger is not None:
                background.loop.call_soon_threadsafe(background._linger.cancel)
                background._linger = None
            return background

    def leave(self) -> None:
        """Count one hold less; the last one out starts the linger before the background stops."""
        with self._lock:
            self.holds -= 1
            if self.holds == 0:
                self.loop.call_soon_threadsafe(self._linger_then_close)

    @staticmethod
    async def _open(http: Http) -> AsyncHttp:
        return AsyncHttp(http.config)

    def _run(self) -> None:
        self.loop.run_forever()
        self.loop.close()

    def call(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        """Run ``coroutine`` on the background's loop and return its result, from another thread."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def _linger_then_close(self) -> None:
        with self._lock:
            if self.holds == 0 and self._linger is None and not self.closing:
                self._linger = self.loop.call_later(LINGER_S, lambda: self.loop.create_task(self._close()))

    async def _close(self) -> None:
        with self._lock:
            if self.holds or self.closing:
                return
            self.closing = True
        current = asyncio.current_task()
        others = [task for task in asyncio.all_tasks(self.loop) if task is not current]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        await self.http.aclose()
        self.loop.stop()


class Hold:
    """The context manager ``claim.hold()`` returns; the sync twin of ``AsyncHold`` (same rules).

    The block cannot be cancelled (it runs in the calling thread): it learns of a cancel
    request or a lost lease through ``ctx.signal`` / ``ctx.wait_cancelled(timeout)``.
    """

    def __init__(
        self, claim: HeldClaim, tasks: HoldingTasks, *, lease_ttl_ms: int | None = None, renew_fraction: float = 1 / 3
    ) -> None:
        self.claim = claim
        self._client_http = tasks._http
        self._lease_ttl_ms = lease_ttl_ms
        self._renew_fraction = renew_fraction
        self._background: _Background | None = None
        self._holder: Holder | None = None
        self._token = None
        self.ctx: HoldContext | None = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.claim.id}>"

    def __enter__(self) -> HoldContext:
        if self._background is not None:
            raise RuntimeError("a hold is entered once")
        background = self._background = _Background.of(self._client_http)

        async def start() -> HoldContext:
            claim = AsyncClaim(background.http, self.claim.data)
            ctx = HoldContext(claim)
            tasks = AsyncTasks(background.http, None)
            self._holder = Holder(
                background.http,
                claim,
                ctx,
                tasks,
                lease_ttl_ms=self._lease_ttl_ms,
                renew_fraction=self._renew_fraction,
            )
            await self._holder.enter()
            return ctx

        try:
            self.ctx = background.call(start())
        except BaseException:
            background.leave()
            raise
        assert self._holder is not None
        self._token = in_span(self._holder.held.trace.context)  # the block runs in its process span
        return self.ctx

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        assert self._holder is not None and self._background is not None
        leave(self._token)
        try:
            refusal = self._background.call(self._holder.exit(exc))
        finally:
            self._background.leave()
        if exc is None and refusal is not None:
            raise refusal
