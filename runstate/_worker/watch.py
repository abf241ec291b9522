"""The claim watch: what stops this worker's claims, pushed by the server (``GET /v1/claims/watch``).

One connection per worker loop, whatever its number of claims: the server sends the events
that stop a claim taken with this loop's ``worker_id`` (a task cancel, a run or group end, a
deadline, a lease that ran out), and ``on_event`` trips the handler at once instead of at the
next renewal. The watch keeps the cursor of the last frame it received (the opening
``watch.ready`` frame's included) and reconnects with it, so a dropped connection or a
restarted API process costs no cancel. Renewal still reports a cancel: it is the fallback
while the watch is down, and the only channel against a server that has no watch (404) or
refuses this key one (401/403), where the watch gives up.

Claims held by hand (``claim.hold()``) share one watch per client and worker id
(``SharedWatch``, from ``shared_watch``): each hold subscribes its claim while it lasts, and
the watch closes ``LINGER_S`` after the last hold of that client and worker id ended.
"""

import asyncio
import logging
import weakref
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
# How long a shared watch stays open after its last hold ended, for the next one (as the
# Celery workers' watch keeps its connections for 30 s after their last claim).
LINGER_S = 30.0

OnEvent = Callable[[str, str, JsonDict], None]


class ClaimWatch:
    """Follow ``GET /v1/claims/watch`` for ``worker_id`` until cancelled; call ``on_event(type, claim_id, data)``."""

    def __init__(self, http: AsyncHttp, worker_id: str, on_event: OnEvent) -> None:
        self._http = http
        self.worker_id = worker_id
        self._on_event = on_event
        self.cursor: str | None = None  # the last frame's id: where a reconnection resumes
        self.ready = asyncio.Event()  # set once the first connection is open
        self.connections = 0

    async def run(self) -> None:
        """Watch, reconnecting with the cursor, until cancelled or the server refuses the watch for good."""
        failures = 0
        while not self._http.closed:  # a closed client ends its watch
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
        self.ready.set()

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


class SharedWatch:
    """One claim watch for the claims held by hand through one client under one worker id.

    A hold subscribes its claim for as long as it lasts (``subscribe``, ``unsubscribe``); what
    the server pushes for a subscribed claim goes to that hold's ``on_event``, the rest (a claim
    already ended) is dropped. The watch closes ``LINGER_S`` after its last hold ended, unless
    another starts meanwhile.
    """

    def __init__(self, http: AsyncHttp, worker_id: str) -> None:
        self.watch = ClaimWatch(http, worker_id, self._received)
        self.loop = asyncio.get_running_loop()
        self.closed = False
        self._subscribers: dict[str, OnEvent] = {}
        self._task = self.loop.create_task(self.watch.run(), name=f"runstate-claim-watch-{worker_id}")
        self._linger: asyncio.TimerHandle | None = None

    def _received(self, event_type: str, claim_id: str, data: JsonDict) -> None:
        on_event = self._subscribers.get(claim_id)
        if on_event is not None:
            on_event(event_type, claim_id, data)

    async def subscribe(self, claim_id: str, on_event: OnEvent) -> None:
        """Push what stops ``claim_id`` to ``on_event`` from now on; return once the watch is open.

        Waits at most ``READY_TIMEOUT_S`` for the watch to open: a claim stopped before it opens
        is told by renewal (``Holder`` renews once right after this returns).
        """
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        self._subscribers[claim_id] = on_event
        if self.watch.ready.is_set() or self._task.done():
            return
        ready = asyncio.ensure_future(self.watch.ready.wait())
        try:
            await asyncio.wait({ready, self._task}, timeout=READY_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()

    def unsubscribe(self, claim_id: str) -> None:
        """Stop pushing ``claim_id``'s events; the last one out starts the linger before the watch closes."""
        self._subscribers.pop(claim_id, None)
        if not self._subscribers and self._linger is None and not self.closed:
            self._linger = self.loop.call_later(LINGER_S, self.close)

    def close(self) -> None:
        """End the watch now (a hold that comes later opens another)."""
        self.closed = True
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        self._task.cancel()


# The shared watches of each client, by worker id (a client that is gone takes its own along).
_shared: "weakref.WeakKeyDictionary[AsyncHttp, dict[str, SharedWatch]]" = weakref.WeakKeyDictionary()


def shared_watch(http: AsyncHttp, worker_id: str) -> SharedWatch:
    """Return the open watch of ``http``'s holds under ``worker_id``, opening one if there is none."""
    watches = _shared.setdefault(http, {})
    watch = watches.get(worker_id)
    if watch is None or watch.closed or watch.loop is not asyncio.get_running_loop():
        watch = watches[worker_id] = SharedWatch(http, worker_id)
    return watch
