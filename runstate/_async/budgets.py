"""Budgets (amounts under a run): ``run.budgets.create``, ``rs.budgets.reserve`` and reservations."""

from types import TracebackType
from typing import Self

from runstate._async.http import AsyncHttp
from runstate._config import JsonDict, compact, default_scope_id, segment


class AsyncBudget:
    """A handle on a budget; ``data`` is the budget as last seen (``limit``, ``spent``, ``reserved``, ``remaining``)."""

    def __init__(self, http: AsyncHttp, budget_id: str, data: JsonDict | None = None) -> None:
        self._http = http
        self.id = budget_id
        self.data = data

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id}>"

    async def status(self) -> JsonDict:
        """Return the budget."""
        self.data = await self._http.request("GET", f"/budgets/{segment(self.id)}", idempotent=True)
        return self.data

    async def set_limit(self, limit: int) -> JsonDict:
        """Change the limit (``resource_config``); never below what is spent and reserved (``ValidationError``)."""
        self.data = await self._http.request(
            "PATCH", f"/budgets/{segment(self.id)}", json={"limit": limit}, idempotent=True
        )
        return self.data


class AsyncReservation:
    """A reservation on the budgets of a run's chain; also a context manager.

    ``async with rs.budgets.reserve("usd", run_id=..., amount=500) as r:`` reserves on entry.
    Report what the body actually spent with ``r.spend(n)`` (adds up); on exit the reported
    total is committed and the rest handed back. Nothing reported: everything is released.
    An exception in the body still commits what was reported before it (that spend
    happened), else releases everything, and propagates. Calling ``commit`` or ``release``
    inside the body settles it then, and the exit does nothing more.
    """

    def __init__(self, http: AsyncHttp, request: JsonDict) -> None:
        self._http = http
        self._request = request
        self.id: str | None = None
        self.data: JsonDict | None = None
        self.spent: int | None = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id}>"

    @property
    def amount(self) -> int:
        """Return the amount reserved."""
        return int(self._request["amount"])

    @property
    def settled(self) -> bool:
        """Tell whether the reservation is committed, released or expired (as last seen)."""
        return self.data is not None and self.data.get("state") != "RESERVED"

    async def open(self) -> Self:
        """Make the reservation (``ConflictError`` ``BUDGET_EXHAUSTED`` when a budget lacks room)."""
        # Retried only with a key: the server then answers the same reservation again.
        idempotent = self._request.get("key") is not None
        self.data = await self._http.request("POST", "/budget-reservations", idempotent=idempotent, json=self._request)
        self.id = self.data["reservationId"]
        return self

    def spend(self, amount: int) -> None:
        """Report ``amount`` as spent (adds to what was reported); committed on exit."""
        if amount < 0:
            raise ValueError("amount must be >= 0")
        self.spent = (self.spent or 0) + amount

    def _path(self, action: str) -> str:
        if self.id is None:
            raise RuntimeError("The reservation is not made yet: await open() or use it as a context manager.")
        return f"/budget-reservations/{segment(self.id)}/{action}"

    async def commit(self, amount: int | None = None) -> JsonDict:
        """Record ``amount`` (default: what ``spend`` reported, else 0) as spent and hand the rest back."""
        amount = amount if amount is not None else (self.spent or 0)
        self.data = await self._http.request("POST", self._path("commit"), idempotent=False, json={"amount": amount})
        return self.data

    async def release(self) -> JsonDict:
        """Hand the whole reservation back (idempotent)."""
        self.data = await self._http.request("POST", self._path("release"), idempotent=True)
        return self.data

    async def status(self) -> JsonDict:
        """Return the reservation."""
        if self.id is None:
            raise RuntimeError("The reservation is not made yet.")
        self.data = await self._http.request("GET", f"/budget-reservations/{segment(self.id)}", idempotent=True)
        return self.data

    async def __aenter__(self) -> Self:
        return await self.open()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.id is None or self.settled:
            return
        if self.spent is not None:
            await self.commit(self.spent)
        else:
            await self.release()


class AsyncBudgets:
    """``run.budgets`` (create under the run, reserve for it) and ``rs.budgets`` (look-ups, reserve with ``run_id``)."""

    def __init__(self, http: AsyncHttp, run_id: str | None) -> None:
        self._http = http
        self._run_id = run_id

    def get(self, budget_id: str) -> AsyncBudget:
        """Return a handle on the budget (no request)."""
        return AsyncBudget(self._http, budget_id)

    async def create(self, name: str, limit: int) -> AsyncBudget:
        """Create the budget ``name`` capping everything under the run (needs ``resource_config``)."""
        if self._run_id is None:
            raise ValueError("budgets.create needs a run: use rs.scope(run_id).budgets.create(...).")
        budget: JsonDict = await self._http.request(
            "POST", f"/runs/{segment(self._run_id)}/budgets", idempotent=False, json={"name": name, "limit": limit}
        )
        return AsyncBudget(self._http, budget["id"], budget)

    def reserve(
        self,
        budget: str,
        *,
        amount: int,
        run_id: str | None = None,
        ttl_ms: int | None = None,
        key: str | None = None,
    ) -> AsyncReservation:
        """Return a reservation of ``amount`` on every budget named ``budget`` on the run's chain.

        Nothing is sent until it is entered (``async with``) or opened (``await r.open()``).
        """
        run = run_id or self._run_id or default_scope_id(None)
        return AsyncReservation(self._http, compact(runId=run, budget=budget, amount=amount, ttlMs=ttl_ms, key=key))
