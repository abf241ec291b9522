"""Tasks, claims and queue messages: tickets, claim and delivery handles, run-bound namespaces."""

from datetime import datetime
from typing import Any

from runstate._async.http import AsyncHttp
from runstate._config import JsonDict, compact, parse_time, segment, wire_time

# Task states after which nothing changes (DESIGN.md "Tasks and claims").
TASK_TERMINAL = frozenset({"SUCCEEDED", "FAILED", "CANCELLED", "EXPIRED"})


class AsyncTicket:
    """A handle on one task: the answer of a submit, or ``rs.tasks.get(id)`` (no request).

    ``data`` is the task as last seen (``None`` until something loaded it).
    """

    def __init__(self, http: AsyncHttp, task_id: str, data: JsonDict | None = None) -> None:
        self._http = http
        self.id = task_id
        self.data = data

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id}>"

    async def status(self) -> JsonDict:
        """Return the task."""
        self.data = await self._http.request("GET", f"/tasks/{segment(self.id)}", idempotent=True)
        return self.data

    async def result(self, timeout_ms: int | None = 60_000) -> JsonDict:
        """Wait until the task is terminal and return it (whatever its state); ``TimeoutError`` after ``timeout_ms``."""
        self.data = await self._http.wait(
            "GET",
            f"/tasks/{segment(self.id)}/result",
            done=lambda task: task.get("state") in TASK_TERMINAL,
            timeout_ms=timeout_ms,
            what=f"Task {self.id}",
        )
        return self.data

    async def cancel(self, reason: str | None = None, grace_ms: int | None = None) -> JsonDict:
        """Cancel the task: a queued one at once, a running one cooperatively (idempotent).

        With ``grace_ms``, the server records ``CANCELLED`` if the handler has not returned by then.
        """
        self.data = await self._http.request(
            "POST",
            f"/tasks/{segment(self.id)}/cancel",
            idempotent=True,
            json=compact(reason=reason, graceMs=grace_ms),
        )
        return self.data


class AsyncClaim:
    """A claimed task under a lease; every operation is fenced by the claim's ``attempt``."""

    def __init__(self, http: AsyncHttp, data: JsonDict) -> None:
        self._http = http
        self.id: str = data["claimId"]
        self.attempt: int = data["attempt"]
        self.task: JsonDict = data["task"]
        self._update(data)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id}>"

    def _update(self, data: JsonDict) -> None:
        self.data = data
        self.lease_expires_at: datetime | None = parse_time(data.get("leaseExpiresAt"))
        self.cancellation_requested: bool = bool(data.get("cancellationRequested"))

    @property
    def task_id(self) -> str:
        """Return the claimed task's id."""
        return str(self.task["id"])

    async def renew(self, lease_ttl_ms: int | None = None) -> JsonDict:
        """Extend the lease; the answer's ``cancellationRequested`` says whether to stop."""
        data: JsonDict = await self._http.request(
            "POST", f"/claims/{segment(self.id)}/renew", idempotent=True, json=compact(leaseTtlMs=lease_ttl_ms)
        )
        self._update(data)
        return data

    async def complete(self, outcome: Any = None) -> JsonDict:
        """Record the outcome; the task ends ``SUCCEEDED`` (``CANCELLED`` if cancellation was requested)."""
        task: JsonDict = await self._http.request(
            "POST", f"/claims/{segment(self.id)}/complete", idempotent=True, json={"outcome": outcome}
        )
        return task

    async def fail(self, error: Any = None, *, retry: bool = False, retry_delay_ms: int = 0) -> JsonDict:
        """Record a failure; with ``retry`` the task is queued again while attempts remain."""
        task: JsonDict = await self._http.request(
            "POST",
            f"/claims/{segment(self.id)}/fail",
            idempotent=True,
            json={"error": error, "retry": retry, "retryDelayMs": retry_delay_ms},
        )
        return task

    async def release(self) -> JsonDict:
        """Hand the task back to the queue (allowed after the run was cancelled too)."""
        task: JsonDict = await self._http.request("POST", f"/claims/{segment(self.id)}/release", idempotent=True)
        return task


class AsyncDelivery:
    """A queue message handed out under a visibility lease."""

    def __init__(self, http: AsyncHttp, data: JsonDict) -> None:
        self._http = http
        self.data = data
        self.id: str = data["deliveryId"]
        self.message_id: str = data["messageId"]
        self.body: Any = data["body"]
        self.attempt: int = data["attempt"]
        self.visible_until: datetime | None = parse_time(data.get("visibleUntil"))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id}>"

    async def complete(self) -> JsonDict:
        """Acknowledge the message (refused once the run is inactive)."""
        message: JsonDict = await self._http.request(
            "POST", f"/deliveries/{segment(self.id)}/complete", idempotent=True
        )
        return message

    async def retry(self, delay_ms: int | None = None) -> JsonDict:
        """Put the message back in the queue, visible again after ``delay_ms``."""
        message: JsonDict = await self._http.request(
            "POST", f"/deliveries/{segment(self.id)}/retry", idempotent=True, json=compact(delayMs=delay_ms)
        )
        return message

    async def reject(self, reason: str | None = None) -> JsonDict:
        """Dead-letter the message with ``reason``."""
        message: JsonDict = await self._http.request(
            "POST", f"/deliveries/{segment(self.id)}/reject", idempotent=True, json=compact(reason=reason)
        )
        return message


class AsyncTasks:
    """Tasks of a WORK mailbox: ``run.tasks`` (submit and claim under the run) or ``rs.tasks``."""

    def __init__(self, http: AsyncHttp, run_id: str | None) -> None:
        self._http = http
        self._run_id = run_id

    def _run(self, operation: str) -> str:
        if self._run_id is None:
            raise ValueError(f"tasks.{operation} needs a run: use rs.scope(run_id).tasks.{operation}(...).")
        return self._run_id

    def get(self, task_id: str) -> AsyncTicket:
        """Return a handle on the task (no request)."""
        return AsyncTicket(self._http, task_id)

    async def submit(
        self,
        mailbox: str,
        input: Any = None,
        *,
        key: str | None = None,
        priority: int | None = None,
        max_attempts: int | None = None,
        expires_at: datetime | str | None = None,
    ) -> AsyncTicket:
        """Submit a task to ``mailbox`` under the run and return its ticket.

        With ``key`` the submit is idempotent (the same key and input answer the existing
        task) and is retried on transport errors; without one it is sent once.
        """
        body = compact(
            runId=self._run("submit"),
            key=key,
            priority=priority,
            maxAttempts=max_attempts,
            expiresAt=wire_time(expires_at),
        )
        body["input"] = {} if input is None else input
        task: JsonDict = await self._http.request(
            "POST", f"/mailboxes/{segment(mailbox)}/tasks", idempotent=key is not None, json=body
        )
        return AsyncTicket(self._http, task["id"], task)

    async def claim(
        self,
        mailbox: str,
        *,
        max: int = 1,
        wait_ms: int = 0,
        lease_ttl_ms: int | None = None,
        worker_id: str | None = None,
    ) -> list[AsyncClaim]:
        """Claim up to ``max`` tasks of exactly this run, waiting up to ``wait_ms`` (30 s at most) for one.

        Never retried: a lost answer's claims are taken over once their lease expires.
        """
        wait = min(wait_ms, 30_000)
        answer: JsonDict = await self._http.request(
            "POST",
            f"/mailboxes/{segment(mailbox)}/claims",
            idempotent=False,
            json=compact(runId=self._run("claim"), max=max, waitMs=wait, leaseTtlMs=lease_ttl_ms, workerId=worker_id),
            wait_ms=wait,
        )
        return [AsyncClaim(self._http, claim) for claim in answer["claims"]]


class AsyncMessages:
    """Messages of a QUEUE mailbox: ``run.messages`` (send and receive under the run) or ``rs.messages``."""

    def __init__(self, http: AsyncHttp, run_id: str | None) -> None:
        self._http = http
        self._run_id = run_id

    def _run(self, operation: str) -> str:
        if self._run_id is None:
            raise ValueError(f"messages.{operation} needs a run: use rs.scope(run_id).messages.{operation}(...).")
        return self._run_id

    async def send(self, mailbox: str, body: Any, *, key: str | None = None) -> JsonDict:
        """Enqueue a message; with ``key`` it is idempotent (and retried), without one it is sent once."""
        message: JsonDict = await self._http.request(
            "POST",
            f"/mailboxes/{segment(mailbox)}/messages",
            idempotent=key is not None,
            json=compact(runId=self._run("send"), key=key) | {"body": body},
        )
        return message

    async def receive(
        self, mailbox: str, *, max: int = 1, visibility_ms: int | None = None, wait_ms: int = 0
    ) -> list[AsyncDelivery]:
        """Receive up to ``max`` messages of exactly this run, waiting up to ``wait_ms`` (30 s at most).

        Never retried: a lost answer's messages are delivered again once their visibility runs out.
        """
        wait = min(wait_ms, 30_000)
        answer: JsonDict = await self._http.request(
            "POST",
            f"/mailboxes/{segment(mailbox)}/deliveries",
            idempotent=False,
            json=compact(runId=self._run("receive"), max=max, visibilityMs=visibility_ms, waitMs=wait),
            wait_ms=wait,
        )
        return [AsyncDelivery(self._http, delivery) for delivery in answer["deliveries"]]

    async def retrieve(self, message_id: str) -> JsonDict:
        """Return a message (dead-lettered ones included)."""
        message: JsonDict = await self._http.request("GET", f"/messages/{segment(message_id)}", idempotent=True)
        return message
