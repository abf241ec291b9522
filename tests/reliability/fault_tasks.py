"""The decorated task the fault tests run in real Celery workers (loaded with ``--include``).

With ``RUNSTATE_FAULT_LEDGER_DIR`` set, a worker process records every claim, renew,
complete, fail and release its runtime makes (and each handler's side effect) in a ledger
file of its own, ``celery-<pid>.jsonl``, which the test merges into its ledger. The
recording wraps the functions ``workers.runtime`` calls (the claims package's narrow claim by
id and completion, and the services for the rest); it changes nothing they do.
"""

import os
import time

from coordination.domain.exceptions import CoordinationError
from tests.reliability.ledger import LEDGER_DIR_ENV, Ledger, process_ledger
from workers import runstate_task

PROJECT = "faults"


def ledger() -> Ledger:
    """Return this process's ledger (``celery-<pid>.jsonl`` when ``RUNSTATE_FAULT_LEDGER_DIR`` is set)."""
    return process_ledger("celery")


# A lease of 2 s (renewed every 0.67 s): a killed worker's tasks come back within ~3 s.
@runstate_task(mailbox="faults-bulk", project=PROJECT, lease_ttl=2, max_attempts=10)
def bulk(ctx, i: int, seconds: float):
    time.sleep(seconds)
    ledger().record("effect", ok=True, task_id=ctx.task_id, attempt=ctx.attempt)
    return {"i": i, "attempt": ctx.attempt, "pid": os.getpid()}


@runstate_task(mailbox="faults-hold", project=PROJECT, lease_ttl=2, max_attempts=3)
def hold(ctx, hold_log: str):
    """On attempt 1, say so in ``hold_log`` and wait for the signal (a lost claim); later attempts return."""
    if ctx.attempt == 1:
        with open(hold_log, "a") as log:
            log.write(f"holding {ctx.task_id} {os.getpid()}\n")
        ctx.signal.wait(60)
        return {"held": True, "pid": os.getpid()}
    ledger().record("effect", ok=True, task_id=ctx.task_id, attempt=ctx.attempt)
    return {"attempt": ctx.attempt, "pid": os.getpid()}


def _instrument_runtime() -> None:
    """Record each service call of ``workers.runtime`` in this process's ledger."""
    from workers import runtime

    book = ledger()
    claim_by_id = runtime.task_claim_by_id_narrow

    def claim_by_id_recorded(**kwargs):
        with book.op("claim", task_id=kwargs["task_id"]) as call:
            claim = claim_by_id(**kwargs)
            call.done(claim_ids=[claim.claim_id] if claim is not None else [])
        return claim

    def recorded(op: str, service, keep: tuple[str, ...]):
        def wrapper(**kwargs):
            fields = {name: kwargs[name] for name in keep if name in kwargs}
            with book.op(op, claim_id=kwargs["claim_id"], **fields) as call:
                result = service(**kwargs)
                # A Task, a Claim (its task) or, from ``claim_complete_narrow``, the new state.
                task = getattr(result, "task", result)
                call.done(state=getattr(task, "state", task))
            return result

        return wrapper

    renew_many = runtime.claims_renew_many

    def claims_renew_many(*, project_id, items):
        # The renewer renews every claim of the process in one call: one entry per claim.
        started = time.monotonic_ns()
        try:
            answers = renew_many(project_id=project_id, items=items)
        except Exception as error:
            for claim_id, _ in items:
                failed = type(error).__name__
                book.record("renew", unknown=True, started_ns=started, claim_id=claim_id, error_type=failed)
            raise
        for (claim_id, _), answer in zip(items, answers, strict=True):
            if isinstance(answer, CoordinationError):
                book.record("renew", code=answer.code, started_ns=started, claim_id=claim_id)
            else:
                book.record("renew", ok=True, started_ns=started, claim_id=claim_id, state=answer.task.state)
        return answers

    runtime.task_claim_by_id_narrow = claim_by_id_recorded
    runtime.claim_complete_narrow = recorded("complete", runtime.claim_complete_narrow, ("outcome",))
    runtime.claims_renew_many = claims_renew_many
    runtime.claim_fail = recorded("fail", runtime.claim_fail, ("error", "retry"))
    runtime.claim_release = recorded("release", runtime.claim_release, ())


if os.environ.get(LEDGER_DIR_ENV):
    _instrument_runtime()
