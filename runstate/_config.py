"""Client settings from arguments or the environment, and the helpers both clients share."""

from __future__ import annotations

import os
import random
import secrets
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from urllib.parse import quote

DEFAULT_URL = "http://127.0.0.1:8000"
# The server caps every long-poll at 30 s (DESIGN.md "HTTP API"); waits loop over it.
MAX_SERVER_WAIT_MS = 30_000
# Answers worth retrying for an idempotent call: rate limited, or the service (or a proxy
# in front of it) unavailable. Nothing was changed by the failed attempt.
RETRYABLE_STATUS = frozenset({429, 502, 503, 504})
SDK_VERSION = "0.1.0"

JsonDict = dict[str, Any]


@dataclass(frozen=True)
class ClientConfig:
    """Everything a client needs to talk to the service.

    ``timeout`` bounds an ordinary request (a long-poll gets its wait on top);
    ``max_retries`` bounds the retries of idempotent calls, spaced by exponential
    backoff from ``backoff_base`` seconds up to ``backoff_max`` with full jitter.
    """

    base_url: str
    api_key: str | None
    timeout: float = 30.0
    connect_timeout: float = 10.0
    max_retries: int = 3
    backoff_base: float = 0.2
    backoff_max: float = 10.0
    max_connections: int = 100
    headers: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        *,
        base_url: str | None,
        api_key: str | None,
        timeout: float,
        connect_timeout: float,
        max_retries: int,
        backoff_base: float,
        backoff_max: float,
        max_connections: int,
        headers: Mapping[str, str] | None,
    ) -> ClientConfig:
        """Fill what the arguments leave out from ``RUNSTATE_URL`` and ``RUNSTATE_API_KEY``."""
        url = base_url or os.environ.get("RUNSTATE_URL") or DEFAULT_URL
        url = url.rstrip("/")
        if url.endswith("/v1"):
            url = url[: -len("/v1")]
        if max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        return cls(
            base_url=url,
            api_key=api_key if api_key is not None else os.environ.get("RUNSTATE_API_KEY") or None,
            timeout=timeout,
            connect_timeout=connect_timeout,
            max_retries=max_retries,
            backoff_base=backoff_base,
            backoff_max=backoff_max,
            max_connections=max_connections,
            headers=dict(headers or {}),
        )

    def request_headers(self) -> dict[str, str]:
        """Return the headers sent with every request."""
        headers = {"User-Agent": f"runstate-python/{SDK_VERSION}", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        headers.update(self.headers)
        return headers

    def backoff_delay(self, retry: int) -> float:
        """Return the pause before retry number ``retry`` (0-based): full jitter, capped."""
        return random.uniform(0, min(self.backoff_max, self.backoff_base * 2**retry))


def new_worker_id() -> str:
    """Return a worker id naming this process (host and pid) and, within it, one worker or client."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def default_scope_id(scope_id: str | None) -> str:
    """Return ``scope_id``, else ``RUNSTATE_SCOPE_ID``; refuse when neither is set."""
    resolved = scope_id or os.environ.get("RUNSTATE_SCOPE_ID")
    if not resolved:
        raise ValueError("No run id: pass one, or set RUNSTATE_SCOPE_ID.")
    return resolved


def segment(value: str) -> str:
    """Quote one path segment (an id or a mailbox name)."""
    return quote(str(value), safe="")


def wire_time(value: datetime | str | None) -> str | None:
    """Return a time as RFC 3339 text; naive datetimes are refused (they name no instant)."""
    if value is None or isinstance(value, str):
        return value
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError("Pass an aware datetime (with a timezone), e.g. datetime.now(timezone.utc).")
    return value.isoformat()


def parse_time(value: object) -> datetime | None:
    """Parse an RFC 3339 time of an answer (``None`` stays ``None``)."""
    if value is None:
        return None
    return datetime.fromisoformat(str(value))


def compact(**fields: Any) -> JsonDict:
    """Return the fields that are not ``None`` (an omitted field takes the server's default)."""
    return {name: value for name, value in fields.items() if value is not None}


def csv(values: str | Iterable[str] | None) -> str | None:
    """Join a list of event types (or pass a comma-separated string through)."""
    if values is None or isinstance(values, str):
        return values
    return ",".join(values)
