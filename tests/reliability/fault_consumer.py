"""An SDK consumer in a process of its own, for the fault tests (not a test module).

    python -m tests.reliability.fault_consumer MAILBOX LEDGER_DIR CONCURRENCY LEASE_TTL_MS
    RUNSTATE_FAULT_LEDGER_DIR=LEDGER_DIR runstate worker tests.reliability.fault_consumer:work ...

Uses the sync client configured from RUNSTATE_URL / RUNSTATE_API_KEY / RUNSTATE_SCOPE_ID.
Every claim, renew, complete, fail and release the worker loop sends (each item of its
buffered ``complete_many`` / ``renew_many`` batches on its own), and each handler's side
effect, is recorded in ``LEDGER_DIR/consumer-<pid>.jsonl``. Run as a module, the client
makes no retries of its own, so each recorded call is one request and a refusal is never
the answer to a retry of a request that had already committed. Loaded as the handler of
``runstate worker`` (with ``RUNSTATE_FAULT_LEDGER_DIR`` set), the command's client retries
as it always does: a call that took more than one request is recorded with
``http_requests`` (``tests/reliability/ledger.py``, ``watch_sdk``).

A task's input says what its handler does: ``{"i", "seconds"}`` sleeps, then returns;
``{"hold_log": path}`` on attempt 1 writes ``holding <task id> <pid>`` to that file and
waits for its signal (a lost claim), returning nothing the loop would record.
"""

import os
import sys
import time

from runstate import Runstate
from runstate._async.http import AsyncHttp
from runstate._async.work import AsyncClaim, AsyncTasks, claim_id_of
from tests.reliability.ledger import LEDGER_DIR_ENV, Ledger, counting_requests, error_code, process_ledger, watch_http


def ledger() -> Ledger:
    """Return this process's ledger (``consumer-<pid>.jsonl`` when ``RUNSTATE_FAULT_LEDGER_DIR`` is set)."""
    return process_ledger("consumer")


def instrument(ledger: Ledger) -> None:
    """Record the worker loop's claim operations (the async engine behind ``consume``)."""
    init = AsyncHttp.__init__

    def watched_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        watch_http(self._client)  # each call's retries are counted

    AsyncHttp.__init__ = watched_init
    claim = AsyncTasks.claim

    async def recorded_claim(self, mailbox, **kwargs):
        with ledger.op("claim", run_id=self._run_id) as call:
            claims = await claim(self, mailbox, **kwargs)
            call.done(claim_ids=[c.id for c in claims])
        return claims

    def recorded(op: str, method):
        async def wrapper(self, *args, **kwargs):
            fields = {}
            if op == "complete":
                fields["outcome"] = args[0] if args else kwargs.get("outcome")
            elif op == "fail":
                fields["error"] = args[0] if args else kwargs.get("error")
                fields["retry"] = kwargs.get("retry", False)
            with ledger.op(op, claim_id=self.id, **fields) as call:
                answer = await method(self, *args, **kwargs)
                if op != "renew" and isinstance(answer, dict):
                    call.done(state=answer.get("state"))
            return answer

        return wrapper

    def recorded_batch(op: str, method):
        """Record each item of a ``complete_many`` / ``renew_many`` (the loop's buffered calls) on its own."""

        async def wrapper(self, items, **kwargs):
            items = list(items)
            pairs = items if op == "complete" else [(claim, None) for claim in items]
            fields = [
                {"claim_id": claim_id_of(claim)} | ({"outcome": o} if op == "complete" else {}) for claim, o in pairs
            ]
            started = time.monotonic_ns()
            try:
                with counting_requests() as requests:
                    results = await method(self, items, **kwargs)
            except BaseException as error:
                code = error_code(error) if isinstance(error, Exception) else None
                for item in fields:
                    if requests[0] > 1:
                        item["http_requests"] = requests[0]
                    if code is not None:
                        ledger.record(op, code=code, started_ns=started, **item)
                    else:
                        ledger.record(op, unknown=True, started_ns=started, error_type=type(error).__name__, **item)
                raise
            for item, result in zip(fields, results, strict=True):
                if requests[0] > 1:
                    item["http_requests"] = requests[0]
                if not result.ok:  # the server answered this item: a refusal
                    ledger.record(op, code=result.error.code, started_ns=started, **item)
                elif op == "complete":
                    ledger.record(op, ok=True, started_ns=started, state=result.task.get("state"), **item)
                else:
                    ledger.record(op, ok=True, started_ns=started, **item)
            return results

        return wrapper

    AsyncTasks.claim = recorded_claim
    for op in ("renew", "complete", "fail", "release"):
        setattr(AsyncClaim, op, recorded(op, getattr(AsyncClaim, op)))
    AsyncTasks.complete_many = recorded_batch("complete", AsyncTasks.complete_many)
    AsyncTasks.renew_many = recorded_batch("renew", AsyncTasks.renew_many)


def work(ctx):
    """The handler: ``{"i", "seconds"}`` sleeps, records its effect, returns; ``{"hold_log"}`` holds attempt 1."""
    task_input = ctx.input
    if task_input.get("hold_log") and ctx.attempt == 1:
        with open(task_input["hold_log"], "a") as log:
            log.write(f"holding {ctx.task_id} {os.getpid()}\n")
        ctx.signal.wait(60)
        return {"held": True, "pid": os.getpid()}
    time.sleep(task_input.get("seconds", 0))
    ledger().record("effect", ok=True, task_id=ctx.task_id, attempt=ctx.attempt)
    return {"i": task_input.get("i"), "attempt": ctx.attempt, "pid": os.getpid()}


def main(mailbox: str, ledger_dir: str, concurrency: int, lease_ttl_ms: int) -> None:
    os.environ[LEDGER_DIR_ENV] = ledger_dir
    instrument(ledger())
    with Runstate(max_retries=0) as rs:
        summary = rs.scope().consume(
            mailbox, work, concurrency=concurrency, lease_ttl_ms=lease_ttl_ms, claim_wait_ms=2000, drain_timeout=5
        )
    print(f"summary completed={summary.completed} lost={summary.lost} stop_reason={summary.stop_reason}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
elif os.environ.get(LEDGER_DIR_ENV):
    # Imported by ``runstate worker`` for its handler: record that worker's calls.
    instrument(ledger())
