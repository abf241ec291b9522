"""Decorated tasks the live tracing tests run in a real Celery worker (``--include``).

Each handler notes the span it runs in (trace id, span id) to the log file in its input.
"""

import time

from opentelemetry import trace

from tests.workers.celery_tasks import note
from workers import runstate_task

PROJECT = "celery-traced"


def note_span(log: str, ctx) -> None:
    current = trace.get_current_span().get_span_context()
    note(log, "run", ctx.task_id, ctx.attempt, format(current.trace_id, "032x"), format(current.span_id, "016x"))


@runstate_task(mailbox="celery-traced", project=PROJECT, lease_ttl=10)
def traced(ctx, log: str):
    note_span(log, ctx)
    return {"attempt": ctx.attempt}


@runstate_task(mailbox="celery-traced-takeover", project=PROJECT, lease_ttl=2)
def hangs_first(ctx, log: str):
    """Hang on the first attempt (the test kills the worker), return on the next."""
    note_span(log, ctx)
    if ctx.attempt == 1:
        time.sleep(600)
    return {"attempt": ctx.attempt}
