"""The completion buffer: the engine's completions sent in batches by one flusher task.

Completions are sent through ``POST /v1/claims/complete`` when ``FLUSH_SIZE`` are waiting or
the oldest has waited ``FLUSH_DELAY_S`` (pgqueuer's and River's batch completers work the
same way); each waiter gets its own item's answer.
"""

import asyncio
from time import monotonic
from typing import Any

from runstate._batch import ClaimResult
from runstate._config import JsonDict
from runstate._worker.protocols import Claim, Tasks
from runstate._worker.threads import _settle

# Buffered completions are sent when this many wait, or when the oldest has waited this long.
FLUSH_SIZE = 50
FLUSH_DELAY_S = 0.02


class _Completer:
    """Buffered completions, keyed by claim, sent in batches by one flusher task.

    A completion waits until ``FLUSH_SIZE`` are waiting or the oldest has waited
    ``FLUSH_DELAY_S``, then all that wait go in one ``complete_many`` (at once while stopping).
    ``complete`` answers what ``claim.complete`` would have: the task, or the item's own
    error raised (``LeaseLostError``, ``NotFoundError``, ``ScopeCancelledError``...); an error
    of the whole request (transport, 5xx after the retries) is raised to each of its waiters.
    """

    def __init__(self, tasks: Tasks) -> None:
        self._tasks = tasks
        self._pending: dict[str, tuple[Any, asyncio.Future[ClaimResult]]] = {}
        self._oldest = 0.0
        self._wake = asyncio.Event()
        self._hurry = False
        self._closed = False
        self._flusher: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._flusher = asyncio.create_task(self._run(), name="runstate-completer")

    def hurry(self) -> None:
        """Send what waits, and each later completion, at once (the worker is stopping)."""
        self._hurry = True
        self._wake.set()

    async def close(self) -> None:
        """Send what still waits, then end the flusher."""
        self._closed = True
        self.hurry()
        if self._flusher is not None:
            await self._flusher

    async def complete(self, claim: Claim, outcome: Any) -> JsonDict:
        """Buffer the completion of ``claim`` and return the completed task once it is sent."""
        if self._closed or self._flusher is None or self._flusher.done():
            return await claim.complete(outcome)
        if claim.id in self._pending:
            raise RuntimeError(f"claim {claim.id} is already waiting to be completed")
        future: asyncio.Future[ClaimResult] = asyncio.get_running_loop().create_future()
        if not self._pending:
            self._oldest = monotonic()
        self._pending[claim.id] = (outcome, future)
        if len(self._pending) == 1 or len(self._pending) >= FLUSH_SIZE:
            self._wake.set()
        result = await future
        if result.error is not None:
            raise result.error
        assert result.task is not None
        return result.task

    async def _run(self) -> None:
        while True:
            if not self._pending:
                if self._closed:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            left = self._oldest + FLUSH_DELAY_S - monotonic()
            if len(self._pending) < FLUSH_SIZE and not self._hurry and left > 0:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), left)
                except TimeoutError:
                    pass
                continue
            await self._flush()

    async def _flush(self) -> None:
        # A waiter cancelled before the send withdraws its completion.
        batch = [
            (claim_id, outcome, future) for claim_id, (outcome, future) in self._pending.items() if not future.done()
        ]
        self._pending = {}
        if not batch:
            return
        try:
            results = await self._tasks.complete_many([(claim_id, outcome) for claim_id, outcome, _ in batch])
        except Exception as exc:  # noqa: BLE001 - the whole request failed: each waiter hears it
            for _, _, future in batch:
                _settle(future, None, exc)
            return
        except BaseException:
            for _, _, future in batch:
                future.cancel()
            raise
        for (_, _, future), result in zip(batch, results, strict=True):
            _settle(future, result, None)
