"""Tasks, claims and queue messages: tickets, claim and delivery handles, run-bound namespaces."""

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from runstate._async.hold import AsyncHold
from runstate._async.http import AsyncHttp
from runstate._batch import (
    MAX_CLAIM_BATCH,
    MAX_SUBMIT_BATCH,
    ClaimResult,
    TaskItem,
    check_unique_claims,
    chunks,
    rebase_index,
    task_body,
)
from runstate._config import JsonDict, compact, parse_time, segment
from runstate._errors import RunstateError
from runstate._tracing import annotate_task, receive_started, record_receive, send_span

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

    async def rerun(self, *, key: str | None = None, input: Any = None) -> "AsyncTicket":
        """Submit this finished task again, as a new task in its mailbox and run; return the new ticket.

        The new task has this one's input unless another ``input`` is given (not ``None``), and
        its ``rerunOf`` is this task. With ``key`` the rerun is idempotent (the same key and input answer the
        same rerun) and is retried on transport errors; without one it is sent once.
        """
        body = compact(key=key, input=input)
        task: JsonDict = await self._http.request(
            "POST", f"/tasks/{segment(self.id)}/rerun", idempotent=key is not None, json=body
        )
        return AsyncTicket(self._http, task["id"], task)


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

    def hold(self, *, lease_ttl_ms: int | None = None, renew_fraction: float = 1 / 3) -> AsyncHold:
        """Work on this claim by hand: ``async with claim.hold() as ctx:`` renews it in the background.

        ``ctx`` is a handler's context (``signal``, ``is_cancellation_requested()``,
        ``wait_cancelled()``; ``cancel_on_request()`` in async contexts only) plus ``complete(value)`` and
        ``release()``. The block's end is recorded as ``consume`` records a handler's: see
        ``AsyncHold`` for the rules (a normal end completes with ``None`` unless
        ``ctx.complete`` gave a value; an exception is recorded as a failure and re-raised).
        """
        tasks = AsyncTasks(self._http, None)  # renews and completes it: no run needed
        return AsyncHold(self, tasks, lease_ttl_ms=lease_ttl_ms, renew_fraction=renew_fraction)


def claim_id_of(claim: AsyncClaim | str) -> str:
    """Return the id of a claim handle, or the id itself."""
    return claim.id if isinstance(claim, AsyncClaim) else claim


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

    async def extend(self, visibility_ms: int) -> JsonDict:
        """Hide the message ``visibility_ms`` more from now; ``LeaseLostError`` once this delivery is stale.

        Refused with the run's code (``ScopeCancelledError``...) once the run is inactive.
        """
        data: JsonDict = await self._http.request(
            "POST", f"/deliveries/{segment(self.id)}/extend", idempotent=True, json={"visibilityMs": visibility_ms}
        )
        self.data = data
        self.visible_until = parse_time(data.get("visibleUntil"))
        return data


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
        body = {"runId": self._run("submit")} | task_body(
            input, key=key, priority=priority, max_attempts=max_attempts, expires_at=expires_at
        )
        with send_span(mailbox, run_id=body["runId"]) as headers:
            task: JsonDict = await self._http.request(
                "POST", f"/mailboxes/{segment(mailbox)}/tasks", idempotent=key is not None, json=body, headers=headers
            )
            annotate_task(task)
        return AsyncTicket(self._http, task["id"], task)

    async def submit_many(self, mailbox: str, items: Iterable[TaskItem]) -> list[AsyncTicket]:
        """Submit many tasks to ``mailbox`` under the run; return their tickets in the order of ``items``.

        Each item is a ``TaskItem`` dict: ``input`` and, optionally, ``key``, ``priority``,
        ``max_attempts``, ``expires_at`` (as ``submit`` takes them). The list is sent 1,000
        tasks a request, and each request is all or nothing: an invalid item
        (``ValidationError``), a ``key`` reused with other input (``KEY_CONFLICT``) or a run
        that refuses work refuses that request and writes none of its tasks. A longer list is
        NOT atomic as a whole: the requests before a refused one stay written (the error's
        ``details["index"]`` counts from the start of ``items``). Give every item a ``key`` to
        make resubmitting the whole list safe; a request whose items all have one is retried
        on transport errors, like ``submit`` with a key.
        """
        run_id = self._run("submit_many")
        path = f"/mailboxes/{segment(mailbox)}/tasks/batch"
        tickets: list[AsyncTicket] = []
        for offset, chunk in chunks([task_body(**item) for item in items], MAX_SUBMIT_BATCH):
            try:
                with send_span(mailbox, run_id=run_id) as headers:
                    answer: JsonDict = await self._http.request(
                        "POST",
                        path,
                        idempotent=all("key" in task for task in chunk),
                        json={"runId": run_id, "tasks": list(chunk)},
                        headers=headers,
                    )
            except RunstateError as error:
                rebase_index(error, offset)
                raise
            tickets.extend(AsyncTicket(self._http, task["id"], task) for task in answer["tasks"])
        return tickets

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

        Never retried: a lost answer's claims are taken over once their lease expires. Without
        ``worker_id`` the claims carry the client's own (``hostname:pid:random``), which its
        ``claim.hold()`` watches.
        """
        wait = min(wait_ms, 30_000)
        run_id, started_ns = self._run("claim"), receive_started()
        answer: JsonDict = await self._http.request(
            "POST",
            f"/mailboxes/{segment(mailbox)}/claims",
            idempotent=False,
            json=compact(
                runId=run_id, max=max, waitMs=wait, leaseTtlMs=lease_ttl_ms, workerId=worker_id or self._http.worker_id
            ),
            wait_ms=wait,
        )
        record_receive(mailbox, run_id=run_id, started_ns=started_ns, items=answer["claims"])
        return [AsyncClaim(self._http, claim) for claim in answer["claims"]]

    async def complete_many(self, items: Iterable[tuple[AsyncClaim | str, Any]]) -> list[ClaimResult]:
        """Complete many claims: ``(claim or claim id, outcome)`` pairs; one result per item, in order.

        Sent 500 items a request (``POST /v1/claims/complete``). Each item is fenced and decided
        on its own, as ``claim.complete`` would be: a stale claim answers a result whose
        ``error`` is a ``LeaseLostError`` (not raised) while the others complete. Retried like
        ``claim.complete``; needs no run (``rs.tasks`` works too). A claim listed twice is a
        ``ValueError``.
        """
        body = [{"claimId": claim_id_of(claim), "outcome": outcome} for claim, outcome in items]
        return await self._claim_batch("/claims/complete", body)

    async def renew_many(
        self, claims: Iterable[AsyncClaim | str], *, lease_ttl_ms: int | None = None
    ) -> list[ClaimResult]:
        """Renew many claims (or claim ids); one result per item, in order, as ``complete_many``.

        Sent 500 items a request (``POST /v1/claims/renew``). An ``ok`` result's ``claim`` has
        ``cancellationRequested``; a claim handle passed in is updated as by ``claim.renew``.
        """
        held = list(claims)
        body = [compact(claimId=claim_id_of(claim), leaseTtlMs=lease_ttl_ms) for claim in held]
        results = await self._claim_batch("/claims/renew", body)
        for claim, result in zip(held, results, strict=True):
            if isinstance(claim, AsyncClaim) and result.claim is not None:
                claim._update(result.claim)
        return results

    async def _claim_batch(self, path: str, items: list[JsonDict]) -> list[ClaimResult]:
        check_unique_claims([item["claimId"] for item in items])
        results: list[ClaimResult] = []
        for _, chunk in chunks(items, MAX_CLAIM_BATCH):
            answer: JsonDict = await self._http.request("POST", path, idempotent=True, json={"items": list(chunk)})
            results.extend(ClaimResult.from_answer(item) for item in answer["results"])
        return results


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
        run_id = self._run("send")
        with send_span(mailbox, run_id=run_id) as headers:
            message: JsonDict = await self._http.request(
                "POST",
                f"/mailboxes/{segment(mailbox)}/messages",
                idempotent=key is not None,
                json=compact(runId=run_id, key=key) | {"body": body},
                headers=headers,
            )
        return message

    async def receive(
        self, mailbox: str, *, max: int = 1, visibility_ms: int | None = None, wait_ms: int = 0
    ) -> list[AsyncDelivery]:
        """Receive up to ``max`` messages of exactly this run, waiting up to ``wait_ms`` (30 s at most).

        Never retried: a lost answer's messages are delivered again once their visibility runs out.
        """
        wait = min(wait_ms, 30_000)
        run_id, started_ns = self._run("receive"), receive_started()
        answer: JsonDict = await self._http.request(
            "POST",
            f"/mailboxes/{segment(mailbox)}/deliveries",
            idempotent=False,
            json=compact(runId=run_id, max=max, visibilityMs=visibility_ms, waitMs=wait),
            wait_ms=wait,
        )
        record_receive(mailbox, run_id=run_id, started_ns=started_ns, items=answer["deliveries"])
        return [AsyncDelivery(self._http, delivery) for delivery in answer["deliveries"]]

    async def retrieve(self, message_id: str) -> JsonDict:
        """Return a message (dead-lettered ones included)."""
        message: JsonDict = await self._http.request("GET", f"/messages/{segment(message_id)}", idempotent=True)
        return message
