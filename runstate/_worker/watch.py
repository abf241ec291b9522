"""The claim watch: what stops this worker's claims, pushed by the server (``GET /v1/claims/watch``).

One connection per worker loop, whatever its number of claims: the server sends the events
that stop a claim taken with this loop's ``worker_id`` (a task cancel, a run or group end, a
deadline, a lease that ran out), and ``on_event`` trips the handler at once instead of at the
next renewal. The watch keeps the cursor of the last frame it received (the opening
``watch.ready`` frame's included) and reconnects with it, so a dropped connection or a
restarted API process costs no cancel. Renewal still reports a cancel: it is the fallback
while the watch is down, and the only channel against a server that has no watch (404) or
refuses this key one (401/403), where the watch gives up.
"""

import asyncio
import logging
from collections.abc import Callable

import httpx

from runstate._async.http import AsyncHttp
from runstate._config import JsonDict
from runstate._errors import RateLimitedError, RunstateError
from runstate._loop import TRANSIENT

logger = logging.getLogger("runstate.worker")

PATH = "/claims/watch"
# How long a worker loop waits for its watch to open before it claims anyway (renewal covers
# the claims taken before it opens).
READY_TIMEOUT_S = 5.0
# Reconnection backoff: 0.05 s doubling up to this.
MAX_BACKOFF_S = 2.0


class ClaimWatch:
    """Follow ``GET /v1/claims/watch`` for ``worker_id`` until cancelled; call ``on_event(type, claim_id, data)``."""

    def __init__(self, http: AsyncHttp, worker_id: str, on_event: Callable[[str, str, JsonDict], None]) -> None:
        self._http = http
        self.worker_id = worker_id
        self._on_event = on_event
        self.cursor: str | None = None  # the last frame's id: where a reconnection resumes
        self.ready = asyncio.Event()  # set once the first connection is open
        self.connections = 0

    async def run(self) -> None:
        """Watch, reconnecting with the cursor, until cancelled or the server refuses the watch for good."""
        failures = 0
        while True:
            try:
                async for frame in self._http.event_stream(
                    PATH, params={"workerId": self.worker_id}, last_event_id=self.cursor
                ):
                    failures = 0
                    self._received(frame)
                failures += 1  # the server ended the stream (a restart): reconnect, not in a tight loop
            except RateLimitedError as exc:
                failures += 1
                delay = exc.retry_after if exc.retry_after is not None else self._backoff(failures)
                logger.warning("claim watch refused (%s); renewal reports cancels until it opens", exc.code)
                await asyncio.sleep(max(delay, self._backoff(failures)))
                continue
            except (httpx.TransportError, *TRANSIENT) as exc:
                failures += 1
                logger.info("claim watch dropped (%r); reconnecting", exc)
            except RunstateError as exc:
                # No watch on this server, or not for this key: renewal stays the only channel.
                logger.warning("claim watch unavailable (%s); cancels reach handlers at renewal", exc)
                self.ready.set()
                return
            await asyncio.sleep(self._backoff(failures))

    @staticmethod
    def _backoff(failures: int) -> float:
        return min(0.05 * 2 ** max(failures - 1, 0), MAX_BACKOFF_S) if failures else 0.0

    def _received(self, frame: JsonDict) -> None:
        if "type" not in frame:
            # ``watch.ready`` (its cursor is ``after``) or ``stream.dropped`` (no cursor: resume as before).
            after = frame.get("after")
            if isinstance(after, str):
                self.cursor = after
                self.connections += 1
                self.ready.set()
            return
        self.cursor = frame["id"]
        data = frame.get("data") or {}
        claim_id = data.get("claimId")
        if isinstance(claim_id, str):
            self._on_event(frame["type"], claim_id, data)
