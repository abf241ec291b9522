"""Quotas (rate limits as token buckets): ``rs.quotas.put`` / ``get`` / ``take``."""

from time import monotonic

from runstate._async.http import AsyncHttp
from runstate._config import MAX_SERVER_WAIT_MS, JsonDict, compact, default_scope_id, segment
from runstate._errors import ConflictError


class AsyncQuotas:
    """``rs.quotas``: configure a project's quotas and take tokens from them."""

    def __init__(self, http: AsyncHttp) -> None:
        self._http = http

    async def put(self, name: str, *, limit: int, period_ms: int) -> JsonDict:
        """Create the quota full or change it (``limit`` tokens per ``period_ms``; needs ``resource_config``).

        A key bound to a run is refused (``PERMISSION_DENIED``): quotas belong to the project.
        """
        quota: JsonDict = await self._http.request(
            "PUT", f"/quotas/{segment(name)}", idempotent=True, json={"limit": limit, "periodMs": period_ms}
        )
        return quota

    async def get(self, name: str) -> JsonDict:
        """Return the quota with ``available``, the whole tokens it holds now.

        A key bound to a run is refused (``PERMISSION_DENIED``): the level is the whole project's use.
        """
        quota: JsonDict = await self._http.request("GET", f"/quotas/{segment(name)}", idempotent=True)
        return quota

    async def take(self, name: str, *, run_id: str | None = None, amount: int = 1, wait_ms: int = 0) -> JsonDict:
        """Take ``amount`` tokens for work under ``run_id``; wait up to ``wait_ms`` for them.

        Return ``{"granted": True, "remaining": n}``. Raise ``ConflictError`` with code
        ``QUOTA_EXHAUSTED`` (``details["retryAfterMs"]``) when the tokens are not there in
        time, and the run's error (``ScopeCancelledError``...) when it is inactive. Waits
        longer than the server's cap (30 s) are split into several calls. Never retried
        after a lost answer: a repeat could take twice.
        """
        if wait_ms < 0:
            raise ValueError("wait_ms must be >= 0")
        body = compact(runId=default_scope_id(run_id), amount=amount)
        deadline = monotonic() + wait_ms / 1000
        while True:
            chunk_ms = min(max(0, int((deadline - monotonic()) * 1000)), MAX_SERVER_WAIT_MS)
            try:
                granted: JsonDict = await self._http.request(
                    "POST",
                    f"/quotas/{segment(name)}/take",
                    idempotent=False,
                    json={**body, "waitMs": chunk_ms},
                    wait_ms=chunk_ms,
                )
                return granted
            except ConflictError as error:
                retry_ms = (error.details or {}).get("retryAfterMs")
                left_ms = (deadline - monotonic()) * 1000
                if error.code != "QUOTA_EXHAUSTED" or retry_ms is None or left_ms <= 0 or retry_ms > left_ms:
                    raise
