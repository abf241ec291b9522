"""``with claim.hold() as ctx``: work on a claim by hand, renewed in the background.

Written by hand (not generated). The holder of the async client (``runstate._worker.Holder``:
the consume engine's renewer and record methods) runs on an event loop in a daemon thread of
its own, on async twins of what ``claim.hold()`` hands in: a connection pool of the tasks
namespace's configuration and the claim as last seen. The block runs in the calling thread
and ``ctx.signal`` is a ``threading.Event``.
"""

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, Protocol

from runstate._async.http import AsyncHttp
from runstate._async.work import AsyncClaim, AsyncTasks
from runstate._config import JsonDict
from runstate._sync.http import Http
from runstate._tracing import in_span, leave
from runstate._worker import HoldContext, Holder

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


class Hold:
    """The context manager ``claim.hold()`` returns; the sync twin of ``AsyncHold`` (same rules).

    The block cannot be cancelled (it runs in the calling thread): it learns of a cancel
    request or a lost lease through ``ctx.signal`` / ``ctx.wait_cancelled(timeout)``.
    """

    def __init__(
        self, claim: HeldClaim, tasks: HoldingTasks, *, lease_ttl_ms: int | None = None, renew_fraction: float = 1 / 3
    ) -> None:
        self.claim = claim
        self._config = tasks._http.config
        self._lease_ttl_ms = lease_ttl_ms
        self._renew_fraction = renew_fraction
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._http: AsyncHttp | None = None
        self._holder: Holder | None = None
        self._token = None
        self.ctx: HoldContext | None = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.claim.id}>"

    def _call(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def __enter__(self) -> HoldContext:
        if self._loop is not None:
            raise RuntimeError("a hold is entered once")
        loop = self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=loop.run_forever, name=f"runstate-hold-{self.claim.task_id}", daemon=True
        )
        self._thread.start()

        async def start() -> HoldContext:
            self._http = AsyncHttp(self._config)
            claim = AsyncClaim(self._http, self.claim.data)
            ctx = HoldContext(claim)
            tasks = AsyncTasks(self._http, None)
            self._holder = Holder(
                self._http, claim, ctx, tasks, lease_ttl_ms=self._lease_ttl_ms, renew_fraction=self._renew_fraction
            )
            await self._holder.enter()
            return ctx

        try:
            self.ctx = self._call(start())
        except BaseException:
            self._close()
            raise
        assert self._holder is not None
        self._token = in_span(self._holder.held.trace.context)  # the block runs in its process span
        return self.ctx

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        assert self._holder is not None
        leave(self._token)
        try:
            refusal = self._call(self._holder.exit(exc))
        finally:
            self._close()
        if exc is None and refusal is not None:
            raise refusal

    def _close(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        if self._http is not None:
            self._call(self._http.aclose())
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()
