"""What the engine asks of a claim and of the tasks namespace, as protocols it defines.

``runstate._async.work`` implements them (``AsyncClaim``, ``AsyncTasks``) and is above this
package: a claim handle offers ``claim.hold()``, which runs on the engine, so the engine may
know a claim only by what it does with one. Whoever starts an engine hands it its ``Tasks``
(``consume``: the run's; a hold: the claim's).
"""

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from runstate._batch import ClaimResult
from runstate._config import JsonDict


class Claim(Protocol):
    """A claimed task under a lease (``AsyncClaim``)."""

    @property
    def id(self) -> str:
        """Return the claim's id."""

    @property
    def data(self) -> JsonDict:
        """Return the claim as last seen."""

    @property
    def task(self) -> JsonDict:
        """Return the claimed task."""

    @property
    def task_id(self) -> str:
        """Return the claimed task's id."""

    @property
    def attempt(self) -> int:
        """Return the attempt this claim fences."""

    @property
    def cancellation_requested(self) -> bool:
        """Return whether a cancel was requested, as last seen."""

    async def complete(self, outcome: Any = None) -> JsonDict:
        """Record the outcome."""

    async def fail(self, error: Any = None, *, retry: bool = False, retry_delay_ms: int = 0) -> JsonDict:
        """Record a failure."""

    async def release(self) -> JsonDict:
        """Hand the task back to the queue."""


class Tasks(Protocol):
    """The tasks namespace of a run (``AsyncTasks``): claim, and renew and complete in batches."""

    async def claim(
        self,
        mailbox: str,
        *,
        max: int = 1,
        wait_ms: int = 0,
        lease_ttl_ms: int | None = None,
        worker_id: str | None = None,
    ) -> Sequence[Claim]:
        """Claim up to ``max`` tasks of ``mailbox``."""

    async def complete_many(self, items: Iterable[tuple[Any, Any]]) -> list[ClaimResult]:
        """Complete ``(claim, outcome)`` pairs."""

    async def renew_many(self, claims: Iterable[Any], *, lease_ttl_ms: int | None = None) -> list[ClaimResult]:
        """Renew claims, updating the handles passed in."""
