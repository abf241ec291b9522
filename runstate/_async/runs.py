"""Runs (scopes): ``rs.scopes.create``, ``rs.scope(id)`` and the run handle."""

from datetime import datetime
from typing import Any

from runstate._async.admissions import AsyncAdmissions
from runstate._async.budgets import AsyncBudgets
from runstate._async.clock import AsyncBarriers, AsyncTimers
from runstate._async.consume import AsyncHandler, AsyncWorker, ConsumeSummary
from runstate._async.consume_messages import AsyncMessageHandler, AsyncMessageWorker, MessageSummary
from runstate._async.groups import AsyncGroups
from runstate._async.http import AsyncHttp
from runstate._async.work import AsyncMessages, AsyncTasks
from runstate._config import JsonDict, compact, segment, wire_time


class AsyncScope:
    """A handle on a run; making one (``rs.scope(id)``) sends no request.

    ``groups``, ``barriers``, ``timers``, ``tasks`` and ``messages`` create and find objects
    under this run; ``consume`` runs a worker loop on it, ``consume_messages`` a message loop.
    ``data`` is the run as last seen.
    """

    def __init__(self, http: AsyncHttp, run_id: str, data: JsonDict | None = None) -> None:
        self._http = http
        self.id = run_id
        self.data = data
        self.groups = AsyncGroups(http)
        self.barriers = AsyncBarriers(http, run_id)
        self.timers = AsyncTimers(http, run_id)
        self.tasks = AsyncTasks(http, run_id)
        self.messages = AsyncMessages(http, run_id)
        self.admissions = AsyncAdmissions(http, run_id, AsyncScope)
        self.budgets = AsyncBudgets(http, run_id)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id}>"

    @property
    def _path(self) -> str:
        return f"/runs/{segment(self.id)}"

    async def status(self) -> JsonDict:
        """Return the run: ``storedState`` (its own) and ``effective`` (``INACTIVE`` if it or an ancestor ended)."""
        self.data = await self._http.request("GET", self._path, idempotent=True)
        return self.data

    async def cancel(self, reason: str | None = None) -> JsonDict:
        """Cancel the run and everything below it (idempotent; ``SCOPE_COMPLETED`` on a completed run)."""
        self.data = await self._http.request(
            "POST", f"{self._path}/cancel", idempotent=True, json=compact(reason=reason)
        )
        return self.data

    async def complete(self) -> JsonDict:
        """Complete the run and everything below it (idempotent; ``SCOPE_CANCELLED`` on a cancelled run)."""
        self.data = await self._http.request("POST", f"{self._path}/complete", idempotent=True)
        return self.data

    async def child(
        self, *, name: str | None = None, deadline: datetime | str | None = None, child_limit: int | None = None
    ) -> "AsyncScope":
        """Create a child run, cancelled along with this one (never retried: two calls make two runs)."""
        run: JsonDict = await self._http.request(
            "POST",
            f"{self._path}/children",
            idempotent=False,
            json=compact(name=name, deadline=wire_time(deadline), childLimit=child_limit),
        )
        return AsyncScope(self._http, run["id"], run)

    def worker(
        self,
        mailbox: str,
        handler: AsyncHandler,
        *,
        concurrency: int = 1,
        lease_ttl_ms: int | None = None,
        worker_id: str | None = None,
        claim_wait_ms: int = 30_000,
        renew_fraction: float = 1 / 3,
        drain_timeout: float = 30.0,
        handle_signals: bool = True,
    ) -> AsyncWorker:
        """Return a worker loop on this run (start it with ``run()``, end it with ``stop()``); see ``consume``."""
        return AsyncWorker(
            self._http,
            self.id,
            mailbox,
            handler,
            concurrency=concurrency,
            lease_ttl_ms=lease_ttl_ms,
            worker_id=worker_id,
            claim_wait_ms=claim_wait_ms,
            renew_fraction=renew_fraction,
            drain_timeout=drain_timeout,
            handle_signals=handle_signals,
        )

    async def consume(
        self,
        mailbox: str,
        handler: AsyncHandler,
        *,
        concurrency: int = 1,
        lease_ttl_ms: int | None = None,
        worker_id: str | None = None,
        claim_wait_ms: int = 30_000,
        renew_fraction: float = 1 / 3,
        drain_timeout: float = 30.0,
        handle_signals: bool = True,
    ) -> ConsumeSummary:
        """Claim this run's tasks of ``mailbox`` and run ``handler(ctx)`` on each, ``concurrency`` at a time.

        Leases are renewed in the background every ``renew_fraction`` of their TTL. The
        handler's return value is recorded as the outcome, its exception as a failure (retried
        while attempts remain). ``ctx.signal`` is set when cancellation is requested, the
        lease is lost or the run is refused; a handler whose claim is lost is cancelled.
        Returns when the run refuses work (cancelled, completed, past its deadline) or on
        ``SIGTERM`` / ``stop()``: running handlers get ``drain_timeout`` seconds to finish,
        then are cancelled and their tasks released.
        """
        return await self.worker(
            mailbox,
            handler,
            concurrency=concurrency,
            lease_ttl_ms=lease_ttl_ms,
            worker_id=worker_id,
            claim_wait_ms=claim_wait_ms,
            renew_fraction=renew_fraction,
            drain_timeout=drain_timeout,
            handle_signals=handle_signals,
        ).run()

    def message_worker(
        self,
        mailbox: str,
        handler: AsyncMessageHandler,
        *,
        concurrency: int = 1,
        visibility_ms: int | None = None,
        retry_delay_ms: int = 0,
        receive_wait_ms: int = 30_000,
        extend_fraction: float = 1 / 3,
        drain_timeout: float = 30.0,
        handle_signals: bool = True,
    ) -> AsyncMessageWorker:
        """Return a message loop on this run (``run()`` starts it, ``stop()`` ends it); see ``consume_messages``."""
        return AsyncMessageWorker(
            self._http,
            self.id,
            mailbox,
            handler,
            concurrency=concurrency,
            visibility_ms=visibility_ms,
            retry_delay_ms=retry_delay_ms,
            receive_wait_ms=receive_wait_ms,
            extend_fraction=extend_fraction,
            drain_timeout=drain_timeout,
            handle_signals=handle_signals,
        )

    async def consume_messages(
        self,
        mailbox: str,
        handler: AsyncMessageHandler,
        *,
        concurrency: int = 1,
        visibility_ms: int | None = None,
        retry_delay_ms: int = 0,
        receive_wait_ms: int = 30_000,
        extend_fraction: float = 1 / 3,
        drain_timeout: float = 30.0,
        handle_signals: bool = True,
    ) -> MessageSummary:
        """Receive this run's messages of ``mailbox`` and run ``handler(ctx)`` on each, ``concurrency`` at a time.

        Each delivery is hidden for ``visibility_ms`` (default: the mailbox's lease TTL) and
        extended in the background every ``extend_fraction`` of it while the handler runs.
        The handler's return acknowledges the message; an exception puts it back after
        ``retry_delay_ms``; ``runstate.Reject(reason)`` dead-letters it. ``ctx.signal`` is set
        and ``ctx.lost`` is true when the delivery is lost (its run refused an extend or the
        answer, or the lease was lost): nothing more is sent for it, and an async handler is
        cancelled. Returns when the run refuses work (cancelled, completed, past its deadline)
        or on ``SIGTERM`` / ``stop()``: running handlers get ``drain_timeout`` seconds to
        finish, then are cancelled and their messages put back.
        """
        return await self.message_worker(
            mailbox,
            handler,
            concurrency=concurrency,
            visibility_ms=visibility_ms,
            retry_delay_ms=retry_delay_ms,
            receive_wait_ms=receive_wait_ms,
            extend_fraction=extend_fraction,
            drain_timeout=drain_timeout,
            handle_signals=handle_signals,
        ).run()


class AsyncScopes:
    """``rs.scopes``: create and list runs."""

    def __init__(self, http: AsyncHttp) -> None:
        self._http = http

    async def create(
        self,
        *,
        name: str | None = None,
        deadline: datetime | str | None = None,
        parent_id: str | None = None,
        child_limit: int | None = None,
    ) -> AsyncScope:
        """Create a run (a root run, or a child of ``parent_id``); never retried: two calls make two runs."""
        run: JsonDict = await self._http.request(
            "POST",
            "/runs",
            idempotent=False,
            json=compact(name=name, deadline=wire_time(deadline), parentId=parent_id, childLimit=child_limit),
        )
        return AsyncScope(self._http, run["id"], run)

    async def list(
        self,
        *,
        parent_id: str | None = None,
        state: str | None = None,
        cursor: str | None = None,
        limit: int | None = None,
    ) -> JsonDict:
        """Return one page of runs, oldest first: ``{results, nextCursor}``."""
        params: dict[str, Any] = compact(parentId=parent_id, state=state, cursor=cursor, limit=limit)
        page: JsonDict = await self._http.request("GET", "/runs", idempotent=True, params=params)
        return page
