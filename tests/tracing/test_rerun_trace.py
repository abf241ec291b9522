"""A rerun is the same work: it continues the old task's trace, and links a caller in another trace.

The service-level cases run with tracing off (what is stored on the new task); the last one
runs the API and the SDK in this process with the ``spans`` fixture, as test_work_trace does.
"""

import asyncio

import pytest
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from coordination.domain.states import MailboxMode
from coordination.models import Task
from coordination.plumbing.tracing import NO_TRACE, TraceContext, work_trace
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.reruns import task_rerun
from coordination.services.runs import run_create
from coordination.services.tasks import task_cancel, task_submit
from tests.tracing.conftest import by_name, request_of
from tests.tracing.test_work_trace import (
    CALLER_SPAN_ID,
    CALLER_TRACE_ID,
    TRACEPARENT,
    client,
    consume_one,
    submit_with_traceparent,
)

# A caller in another trace than the work's (an operator's tool, a later agent step).
OTHER_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
OTHER = TraceContext(f"00-{OTHER_TRACE_ID}-00f067aa0ba902b7-01", "other=1")
WORK = TraceContext(TRACEPARENT, "vendor=abc")


def test_the_work_trace_continues_and_a_caller_in_another_trace_is_a_link():
    same_trace = TraceContext(f"00-{CALLER_TRACE_ID}-1111111111111111-01")
    assert work_trace(WORK, NO_TRACE) == (WORK, ())
    assert work_trace(WORK, OTHER) == (WORK, (OTHER,))
    assert work_trace(WORK, same_trace) == (same_trace, ())  # already in the work's trace: the cause is the parent
    assert work_trace(NO_TRACE, OTHER) == (OTHER, ())  # untraced work continues the caller's
    assert work_trace(NO_TRACE, NO_TRACE) == (NO_TRACE, ())


@pytest.fixture
def ended_task(project):
    """Return ``make(trace)``: a finished (cancelled while queued) task that stored ``trace``."""
    run = run_create(project_id=project.id, name="reruns")
    mailbox, _ = mailbox_ensure(project_id=project.id, name="work", mode=MailboxMode.WORK)

    def make(stored: TraceContext) -> Task:
        task, _ = task_submit(project_id=project.id, mailbox=mailbox, run_id=run.id, input={}, trace=stored)
        return task_cancel(project_id=project.id, task_id=task.id)

    return make


@pytest.mark.django_db
@pytest.mark.parametrize("caller", [NO_TRACE, OTHER], ids=["no-caller-context", "caller-in-another-trace"])
def test_with_tracing_off_a_rerun_stores_the_old_tasks_context(project, ended_task, caller):
    old = ended_task(WORK)
    assert old.state == "CANCELLED"
    new, created = task_rerun(project_id=project.id, task_id=old.id, trace=caller)
    assert created
    stored = Task.objects.get(id=new.id)
    assert (stored.traceparent, stored.tracestate) == (TRACEPARENT, "vendor=abc")


@pytest.mark.django_db
def test_a_rerun_of_untraced_work_stores_the_callers_context(project, ended_task):
    old = ended_task(NO_TRACE)
    new, _ = task_rerun(project_id=project.id, task_id=old.id, trace=OTHER)
    stored = Task.objects.get(id=new.id)
    assert (stored.traceparent, stored.tracestate) == (OTHER.traceparent, "other=1")
    untraced, _ = task_rerun(project_id=project.id, task_id=old.id)
    assert Task.objects.get(id=untraced.id).traceparent == ""


@pytest.mark.django_db(transaction=True)
def test_a_rerun_over_http_is_processed_in_the_old_tasks_trace_linked_to_its_caller(spans, api_key):
    async def scenario():
        async with client(api_key) as rs:
            await rs.mailboxes.ensure("rerun-traced", mode="WORK")
            run = await rs.scopes.create(name="reruns")
            answer = await submit_with_traceparent(rs, run.id, "rerun-traced")

            async def handler(ctx):
                return {"attempt": ctx.attempt}

            await consume_one(rs, run.id, "rerun-traced", handler)
            old = rs.tasks.get(answer["id"])
            # An operator's step in a trace of its own reruns it (the SDK sends its span's context).
            with trace.get_tracer("test").start_as_current_span("operator") as operator:
                new = await old.rerun()
            await consume_one(rs, run.id, "rerun-traced", handler)
            return run.id, old.id, new.id, operator.get_span_context()

    run_id, old_id, new_id, operator = asyncio.run(scenario())
    finished = spans.get_finished_spans()
    first_send, rerun_send = sorted(by_name(finished, "send rerun-traced"), key=lambda span: span.start_time)
    processes = {span.attributes["runstate.task_id"]: span for span in by_name(finished, "process rerun-traced")}
    assert set(processes) == {old_id, new_id}

    # The rerun's send span is in the work's trace, under the first submit's, and links the operator's span.
    assert format(request_of(finished, first_send).parent.span_id, "016x") == CALLER_SPAN_ID
    assert format(rerun_send.context.trace_id, "032x") == CALLER_TRACE_ID
    assert rerun_send.parent.span_id == first_send.context.span_id
    assert rerun_send.kind == SpanKind.PRODUCER
    # The link names the rerun request's server span, in the operator's trace under its span.
    (link,) = rerun_send.links
    rerun_request = {span.context.span_id: span for span in finished}[link.context.span_id]
    assert rerun_request.name == "POST v1/tasks/<str:task_id>/rerun"
    assert (rerun_request.context.trace_id, rerun_request.parent.span_id) == (operator.trace_id, operator.span_id)
    assert rerun_send.attributes["messaging.operation.type"] == "send"
    assert rerun_send.attributes["runstate.task_id"] == new_id
    assert rerun_send.attributes["runstate.rerun_of"] == old_id
    assert rerun_send.attributes["runstate.run_id"] == run_id

    # The new task stores the rerun send span's context (the work's tracestate kept); its process span is its child.
    stored = Task.objects.get(id=new_id)
    assert stored.traceparent == f"00-{CALLER_TRACE_ID}-{rerun_send.context.span_id:016x}-01"
    assert stored.tracestate == "vendor=abc"
    again = processes[new_id]
    assert format(again.context.trace_id, "032x") == CALLER_TRACE_ID
    assert again.parent.span_id == rerun_send.context.span_id
    assert again.attributes["runstate.attempt"] == 1
    assert processes[old_id].parent.span_id == first_send.context.span_id
    settles = by_name(finished, "settle rerun-traced")
    under = [span.attributes["runstate.outcome"] for span in settles if span.parent.span_id == again.context.span_id]
    assert under == ["complete"]
    # Nothing of the work landed in the operator's trace: only the rerun request's own server span.
    in_operators = [span for span in finished if span.context.trace_id == operator.trace_id and span.name != "operator"]
    assert [span.name for span in in_operators if span.instrumentation_scope.name == "runstate"] == []
    assert [span.name for span in in_operators] == ["POST v1/tasks/<str:task_id>/rerun"]
