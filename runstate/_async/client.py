"""``AsyncRunstate``: the async client and its top-level namespaces."""

import asyncio
from collections.abc import AsyncIterator, Iterable, Mapping
from types import TracebackType
from typing import Any, Self

import httpx

from runstate._async.budgets import AsyncBudgets
from runstate._async.clock import AsyncBarriers, AsyncTimers
from runstate._async.groups import AsyncGroups
from runstate._async.http import AsyncHttp
from runstate._async.pools import AsyncPools
from runstate._async.quotas import AsyncQuotas
from runstate._async.runs import AsyncScope, AsyncScopes
from runstate._async.work import AsyncMessages, AsyncTasks
from runstate._config import ClientConfig, JsonDict, compact, csv, default_scope_id, segment


class AsyncMailboxes:
    """``rs.mailboxes``: ensure and read mailboxes."""

    def __init__(self, http: AsyncHttp) -> None:
        self._http = http

    async def ensure(
        self, name: str, *, mode: str, lease_ttl_ms: int | None = None, max_attempts: int | None = None
    ) -> JsonDict:
        """Ensure the mailbox exists with ``mode`` (``WORK`` or ``QUEUE``); idempotent, needs ``resource_config``.

        A key bound to a run is refused (``PERMISSION_DENIED``): mailboxes belong to the project.
        """
        mailbox: JsonDict = await self._http.request(
            "PUT",
            f"/mailboxes/{segment(name)}",
            idempotent=True,
            json=compact(mode=mode, leaseTtlMs=lease_ttl_ms, maxAttempts=max_attempts),
        )
        return mailbox

    async def retrieve(self, name: str) -> JsonDict:
        """Return the mailbox: ``name, mode, leaseTtlMs, maxAttempts, createdAt``."""
        mailbox: JsonDict = await self._http.request("GET", f"/mailboxes/{segment(name)}", idempotent=True)
        return mailbox


class AsyncEvents:
    """``rs.events``: the cursor-paged event log."""

    def __init__(self, http: AsyncHttp) -> None:
        self._http = http

    async def follow(
        self,
        *,
        after: str | None = None,
        types: str | Iterable[str] | None = None,
        run_id: str | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[JsonDict]:
        """Yield every event after ``after`` (from the start when ``None``), then wait for new ones, forever."""
        cursor = after
        while True:
            page = await self.list(after=cursor, types=types, run_id=run_id, limit=limit, wait_ms=30_000)
            for event in page["events"]:  # noqa: UP028 - an async generator cannot "yield from"
                yield event
            cursor = page["nextCursor"]

    async def stream(
        self,
        *,
        after: str | None = None,
        types: str | Iterable[str] | None = None,
        run_id: str | None = None,
    ) -> AsyncIterator[JsonDict]:
        """Yield events from the Server-Sent Events stream (``GET /v1/events/stream``), forever.

        Starts after the cursor ``after``, or with new events only when ``None``. A dropped
        connection is resumed from the last event received (``Last-Event-ID``), so nothing is
        skipped or repeated; errors answered by the server (401, 403, 404...) are raised.
        """
        params: dict[str, Any] = compact(types=csv(types), runId=run_id)
        last_id = after
        failures = 0
        while True:
            try:
                async for event in self._http.event_stream("/events/stream", params=params, last_event_id=last_id):
                    last_id = event["id"]
                    failures = 0
                    yield event
            except httpx.TransportError:
                failures += 1
                await asyncio.sleep(min(0.1 * 2**failures, 5.0))

    async def list(
        self,
        *,
        after: str | None = None,
        types: str | Iterable[str] | None = None,
        run_id: str | None = None,
        limit: int | None = None,
        wait_ms: int | None = None,
    ) -> JsonDict:
        """Return the events after the cursor ``after``, oldest first: ``{events, nextCursor}``.

        ``types`` filters by type, ``run_id`` by run (and every run below it). With
        ``wait_ms`` (30 s at most), an empty page waits that long for the next event.
        ``nextCursor`` is never null: pass it as ``after`` to continue.
        """
        wait = min(wait_ms, 30_000) if wait_ms else 0
        params: dict[str, Any] = compact(after=after, types=csv(types), runId=run_id, limit=limit)
        if wait:
            params["waitMs"] = wait
        page: JsonDict = await self._http.request("GET", "/events", idempotent=True, params=params, wait_ms=wait)
        return page


class AsyncRunstate:
    """The async client.

    Configured by arguments or the environment: ``base_url`` (``RUNSTATE_URL``, the service's
    URL without ``/v1``; default ``http://127.0.0.1:8000``) and ``api_key``
    (``RUNSTATE_API_KEY``). One pool of connections serves every call; close it with
    ``await rs.aclose()`` or use the client as an async context manager.
    """

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = 30.0,
        connect_timeout: float = 10.0,
        max_retries: int = 3,
        backoff_base: float = 0.2,
        backoff_max: float = 10.0,
        max_connections: int = 100,
        headers: Mapping[str, str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.config = ClientConfig.build(
            base_url=base_url,
            api_key=api_key,
            timeout=timeout,
            connect_timeout=connect_timeout,
            max_retries=max_retries,
            backoff_base=backoff_base,
            backoff_max=backoff_max,
            max_connections=max_connections,
            headers=headers,
        )
        self._http = AsyncHttp(self.config, transport)
        self.mailboxes = AsyncMailboxes(self._http)
        self.scopes = AsyncScopes(self._http)
        self.events = AsyncEvents(self._http)
        # Look-ups that need no run; creating barriers, timers, tasks and messages goes through a run.
        self.groups = AsyncGroups(self._http)
        self.tasks = AsyncTasks(self._http, None)
        self.messages = AsyncMessages(self._http, None)
        self.barriers = AsyncBarriers(self._http, None)
        self.timers = AsyncTimers(self._http, None)
        self.pools = AsyncPools(self._http)
        self.quotas = AsyncQuotas(self._http)
        self.budgets = AsyncBudgets(self._http, None)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.config.base_url}>"

    def scope(self, scope_id: str | None = None) -> AsyncScope:
        """Return a handle on the run ``scope_id`` (default ``RUNSTATE_SCOPE_ID``); no request is sent."""
        return AsyncScope(self._http, default_scope_id(scope_id))

    async def health(self) -> JsonDict:
        """Return ``/v1/healthz`` (needs no key)."""
        answer: JsonDict = await self._http.request("GET", "/healthz", idempotent=True)
        return answer

    async def aclose(self) -> None:
        """Close the client's connections."""
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
