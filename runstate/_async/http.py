"""HTTP plumbing of the async client: one pooled connection set, timeouts, retries, errors.

Whether a call may be retried is decided by each caller and passed as ``idempotent``: a
retry must never repeat an effect. Reads, ensures and state transitions that answer the
same on repetition (cancel, complete, close, verdicts, arrivals, renewals...) retry on
transport errors and 429/502/503/504; creates, claims, receives and submits or sends
without an idempotency key never do.
"""

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Mapping
from time import monotonic
from typing import Any

import httpx

from runstate._config import MAX_SERVER_WAIT_MS, RETRYABLE_STATUS, ClientConfig, JsonDict, new_worker_id
from runstate._errors import TransportError, error_from_response, retry_after_seconds
from runstate._tracing import current_headers

Params = Mapping[str, str | int]


class AsyncHttp:
    """Send requests to ``{base_url}/v1`` and turn error answers into exceptions."""

    def __init__(self, config: ClientConfig, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config = config
        # The workerId of the claims taken through this client without one: what its holds watch.
        self.worker_id = new_worker_id()
        self._client = httpx.AsyncClient(
            base_url=f"{config.base_url}/v1",
            headers=config.request_headers(),
            timeout=httpx.Timeout(config.timeout, connect=config.connect_timeout),
            limits=httpx.Limits(
                max_connections=config.max_connections, max_keepalive_connections=config.max_connections
            ),
            transport=transport,
        )

    async def aclose(self) -> None:
        """Close the pooled connections."""
        await self._client.aclose()

    @property
    def closed(self) -> bool:
        """Whether ``aclose`` was called: nothing can be sent any more."""
        return self._client.is_closed

    async def request(
        self,
        method: str,
        path: str,
        *,
        idempotent: bool,
        json: JsonDict | None = None,
        params: Params | None = None,
        wait_ms: int = 0,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """Send one call and return its decoded JSON answer; raise the mapped error otherwise.

        ``wait_ms`` is how long the server may hold the answer (a long-poll): the read
        timeout is extended by that much.
        """
        timeout = httpx.Timeout(self.config.timeout + wait_ms / 1000, connect=self.config.connect_timeout)
        if headers is None:
            headers = current_headers()  # the caller's span, if any: a cancel's span is its child
        retries = 0
        while True:
            try:
                response = await self._client.request(
                    method, path, json=json, params=params, timeout=timeout, headers=headers
                )
            except httpx.TransportError as exc:
                if not idempotent or retries >= self.config.max_retries:
                    raise TransportError(f"{method} /v1{path}: {type(exc).__name__}: {exc}") from exc
                delay = self.config.backoff_delay(retries)
            else:
                if response.status_code < 400:
                    return response.json() if response.content else None
                retryable = idempotent and response.status_code in RETRYABLE_STATUS
                if not retryable or retries >= self.config.max_retries:
                    raise error_from_response(response)
                delay = max(self.config.backoff_delay(retries), retry_after_seconds(response) or 0.0)
            retries += 1
            await asyncio.sleep(delay)

    async def wait(
        self,
        method: str,
        path: str,
        *,
        done: Callable[[JsonDict], bool],
        timeout_ms: int | None,
        what: str,
    ) -> JsonDict:
        """Long-poll ``path`` (``?timeoutMs=``) until ``done(answer)``, looping over the server's cap.

        Raise the builtin ``TimeoutError`` once ``timeout_ms`` (``None``: no limit) has passed.
        """
        if timeout_ms is not None and timeout_ms < 0:
            raise ValueError("timeout_ms must be >= 0")
        deadline = None if timeout_ms is None else monotonic() + timeout_ms / 1000
        while True:
            remaining_ms = MAX_SERVER_WAIT_MS if deadline is None else max(0, int((deadline - monotonic()) * 1000))
            chunk_ms = min(remaining_ms, MAX_SERVER_WAIT_MS)
            answer: JsonDict = await self.request(
                method, path, idempotent=True, params={"timeoutMs": chunk_ms}, wait_ms=chunk_ms
            )
            if done(answer):
                return answer
            if deadline is not None and monotonic() >= deadline:
                state = answer.get("state")
                raise TimeoutError(f"{what} did not finish within {timeout_ms} ms (state {state}).")

    async def event_stream(self, path: str, *, params: Params, last_event_id: str | None) -> AsyncIterator[JsonDict]:
        """Yield the events of one Server-Sent Events connection until the server closes it.

        Error answers raise the mapped error; comments (heartbeats) are skipped. The read
        timeout is off: the server sends a heartbeat comment every 15 s.
        """
        # JSON too: an error answered before the stream starts comes as the usual envelope.
        headers = {"Accept": "text/event-stream, application/json"}
        if last_event_id is not None:
            headers["Last-Event-ID"] = last_event_id
        timeout = httpx.Timeout(self.config.timeout, connect=self.config.connect_timeout, read=None)
        async with self._client.stream("GET", path, params=params, headers=headers, timeout=timeout) as response:
            if response.status_code >= 400:
                await response.aread()
                raise error_from_response(response)
            data: list[str] = []
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    data.append(line[5:].lstrip(" "))
                elif not line and data:
                    event: JsonDict = json.loads("\n".join(data))
                    data = []
                    yield event
