"""Barriers and durable timers: ``run.barriers`` / ``run.timers`` and their handles."""

from datetime import datetime

from runstate._async.http import AsyncHttp
from runstate._config import JsonDict, compact, parse_time, segment, wire_time
from runstate._errors import ConflictError


class AsyncBarrier:
    """A handle on a barrier; ``data`` is the barrier as last seen (``None`` until loaded)."""

    def __init__(self, http: AsyncHttp, barrier_id: str, data: JsonDict | None = None) -> None:
        self._http = http
        self.id = barrier_id
        self.data = data

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id}>"

    @property
    def _path(self) -> str:
        return f"/barriers/{segment(self.id)}"

    async def status(self) -> JsonDict:
        """Return the barrier in its current epoch."""
        self.data = await self._http.request("GET", self._path, idempotent=True)
        return self.data

    async def arrive(self, key: str) -> JsonDict:
        """Record ``key``'s arrival in the current epoch (the same key again changes nothing)."""
        self.data = await self._http.request("POST", f"{self._path}/arrive", idempotent=True, json={"key": key})
        return self.data

    async def wait(self, timeout_ms: int | None = 60_000) -> JsonDict:
        """Wait until the barrier is released and return it; ``TimeoutError`` after ``timeout_ms``.

        Raise ``ConflictError`` with code ``BARRIER_CANCELLED`` if the barrier is cancelled
        (for example with its run). A barrier already moved on to a later epoch counts as released.
        """
        first_epoch: list[int] = []

        def released(barrier: JsonDict) -> bool:
            if barrier.get("state") == "CANCELLED":  # the server answers 409; a defensive check
                raise ConflictError(
                    "The barrier is cancelled.", code="BARRIER_CANCELLED", status_code=409, details=barrier
                )
            if not first_epoch:
                first_epoch.append(int(barrier["epoch"]))
            return barrier.get("state") == "RELEASED" or int(barrier["epoch"]) > first_epoch[0]

        self.data = await self._http.wait(
            "GET", f"{self._path}/wait", done=released, timeout_ms=timeout_ms, what=f"Barrier {self.id}"
        )
        return self.data

    async def next_epoch(self) -> JsonDict:
        """Move a released barrier to the next epoch with no arrivals (``BARRIER_NOT_RELEASED`` otherwise).

        Never retried: a repeat could skip an epoch.
        """
        self.data = await self._http.request("POST", f"{self._path}/nextEpoch", idempotent=False)
        return self.data


class AsyncBarriers:
    """``run.barriers``: create barriers under the run and re-attach to them."""

    def __init__(self, http: AsyncHttp, run_id: str | None) -> None:
        self._http = http
        self._run_id = run_id

    def get(self, barrier_id: str) -> AsyncBarrier:
        """Return a handle on the barrier (no request)."""
        return AsyncBarrier(self._http, barrier_id)

    async def create(self, *, target: int, name: str | None = None) -> AsyncBarrier:
        """Create a barrier that releases once ``target`` distinct keys arrived (needs ``resource_config``)."""
        if self._run_id is None:
            raise ValueError("barriers.create needs a run: use rs.scope(run_id).barriers.create(...).")
        barrier: JsonDict = await self._http.request(
            "POST", "/barriers", idempotent=False, json=compact(runId=self._run_id, target=target, name=name)
        )
        return AsyncBarrier(self._http, barrier["id"], barrier)


class AsyncTimer:
    """A handle on a durable timer.

    ``fire_at`` (a datetime) is known from the create answer; a handle from ``get(id)`` has
    it once ``status()`` (or ``wait()``) has loaded the timer.
    """

    def __init__(self, http: AsyncHttp, timer_id: str, data: JsonDict | None = None) -> None:
        self._http = http
        self.id = timer_id
        self.data: JsonDict | None = None
        self.fire_at: datetime | None = None
        if data is not None:
            self._update(data)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id}>"

    @property
    def _path(self) -> str:
        return f"/timers/{segment(self.id)}"

    def _update(self, data: JsonDict) -> JsonDict:
        self.data = data
        self.fire_at = parse_time(data.get("fireAt"))
        return data

    async def status(self) -> JsonDict:
        """Return the timer (and load ``fire_at``)."""
        return self._update(await self._http.request("GET", self._path, idempotent=True))

    async def wait(self, timeout_ms: int | None = 60_000) -> JsonDict:
        """Wait until the timer fires, acknowledge it, and return it with ``fired_at`` as a datetime.

        Idempotent (a second wait answers the same). ``TimeoutError`` after ``timeout_ms``;
        ``ConflictError`` (``INVALID_STATE``) if the timer was cancelled.
        """
        timer = await self._http.wait(
            "POST",
            f"{self._path}/wait",
            done=lambda t: t.get("state") == "ACKNOWLEDGED",
            timeout_ms=timeout_ms,
            what=f"Timer {self.id}",
        )
        self._update(timer)
        return timer | {"fired_at": parse_time(timer.get("firedAt"))}

    async def cancel(self) -> JsonDict:
        """Disarm the timer (``ConflictError`` ``TIMER_FIRED`` once it fired; a cancelled one is unchanged)."""
        return self._update(await self._http.request("POST", f"{self._path}/cancel", idempotent=True))


class AsyncTimers:
    """``run.timers``: arm timers under the run and re-attach to them."""

    def __init__(self, http: AsyncHttp, run_id: str | None) -> None:
        self._http = http
        self._run_id = run_id

    def get(self, timer_id: str) -> AsyncTimer:
        """Return a handle on the timer (no request; ``fire_at`` is set by ``status()``)."""
        return AsyncTimer(self._http, timer_id)

    async def create(self, *, at: datetime | str | None = None, after_seconds: float | None = None) -> AsyncTimer:
        """Arm a timer at ``at`` or after ``after_seconds`` (exactly one); a past ``at`` fires at once."""
        if self._run_id is None:
            raise ValueError("timers.create needs a run: use rs.scope(run_id).timers.create(...).")
        if (at is None) == (after_seconds is None):
            raise ValueError("Pass exactly one of at and after_seconds.")
        timer: JsonDict = await self._http.request(
            "POST",
            "/timers",
            idempotent=False,
            json=compact(runId=self._run_id, at=wire_time(at), afterSeconds=after_seconds),
        )
        return AsyncTimer(self._http, timer["id"], timer)
