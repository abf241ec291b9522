"""One trace per piece of work: submit over HTTP, claim and process in the SDK, settle.

The API (``runstate_project.asgi.application``) and the SDK run in this process, the SDK
talking to the API through httpx's ASGI transport, so both sides' spans reach the one
in-memory exporter of the ``spans`` fixture. The database is the real one.
"""

import asyncio

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from coordination.models import Task
from runstate import AsyncRunstate
from tests.tracing.conftest import by_name, one, request_of

pytestmark = pytest.mark.django_db(transaction=True)

CALLER_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{CALLER_TRACE_ID}-{CALLER_SPAN_ID}-01"


def client(api_key: str) -> AsyncRunstate:
    from runstate_project.asgi import application

    transport = httpx.ASGITransport(app=application)
    return AsyncRunstate(base_url="http://testserver", api_key=api_key, transport=transport)


async def consume_one(rs: AsyncRunstate, run_id: str, mailbox: str, handler) -> None:
    """Run a worker until it has handled one task, then stop it."""
    done = asyncio.Event()
    worker = None

    async def handle(ctx):
        try:
            return await handler(ctx)
        finally:
            done.set()

    worker = rs.scope(run_id).worker(mailbox, handle, handle_signals=False, claim_wait_ms=1000)
    running = asyncio.create_task(worker.run())
    await asyncio.wait_for(done.wait(), 30)
    worker.stop()
    await asyncio.wait_for(running, 30)


async def consume_messages_until(run, mailbox: str, handler) -> None:
    """Run a message worker on ``mailbox`` until ``handler`` returns True for a message, then stop it."""
    done = asyncio.Event()

    async def handle(ctx):
        if await handler(ctx):
            done.set()

    worker = run.message_worker(mailbox, handle, handle_signals=False, receive_wait_ms=1000)
    running = asyncio.create_task(worker.run())
    await asyncio.wait_for(done.wait(), 30)
    worker.stop()
    await asyncio.wait_for(running, 30)


async def submit_with_traceparent(rs: AsyncRunstate, run_id: str, mailbox: str) -> dict:
    """Submit a task over HTTP as another process would: ``TRACEPARENT`` and a ``tracestate`` in the headers."""
    return await rs._http.request(
        "POST",
        f"/mailboxes/{mailbox}/tasks",
        idempotent=False,
        json={"runId": run_id, "input": {"n": 1}},
        headers={"traceparent": TRACEPARENT, "tracestate": "vendor=abc"},
    )


def test_an_http_submit_with_a_traceparent_is_one_trace_through_consume(spans, api_key):
    inside: list = []

    async def scenario():
        async with client(api_key) as rs:
            await rs.mailboxes.ensure("traced", mode="WORK")
            run = await rs.scopes.create(name="traced")
            answer = await submit_with_traceparent(rs, run.id, "traced")

            async def handler(ctx):
                inside.append(trace.get_current_span().get_span_context())
                return {"ok": True}

            await consume_one(rs, run.id, "traced", handler)
            return run.id, answer["id"]

    run_id, task_id = asyncio.run(scenario())
    finished = spans.get_finished_spans()
    send = one(finished, "send traced")
    process = one(finished, "process traced")
    settle = one(finished, "settle traced")

    # The service's send span continues the caller's trace, under the request's server span,
    # itself under the caller's span.
    assert format(send.context.trace_id, "032x") == CALLER_TRACE_ID
    assert format(request_of(finished, send).parent.span_id, "016x") == CALLER_SPAN_ID
    assert send.kind == SpanKind.PRODUCER
    assert send.attributes["messaging.system"] == "runstate"
    assert send.attributes["messaging.operation.type"] == "send"
    assert send.attributes["messaging.destination.name"] == "traced"
    assert send.attributes["runstate.task_id"] == task_id
    assert send.attributes["runstate.run_id"] == run_id

    # The task stores the send span's context (the caller's tracestate kept).
    task = Task.objects.get(id=task_id)
    assert task.traceparent == f"00-{CALLER_TRACE_ID}-{send.context.span_id:016x}-01"
    assert task.tracestate == "vendor=abc"

    # The worker's process span is the send span's child, in the same trace; the handler runs in it.
    assert process.context.trace_id == send.context.trace_id
    assert process.parent.span_id == send.context.span_id
    assert process.kind == SpanKind.CONSUMER
    assert process.attributes["messaging.operation.type"] == "process"
    assert process.attributes["messaging.destination.name"] == "traced"
    assert process.attributes["runstate.task_id"] == task_id
    assert process.attributes["runstate.run_id"] == run_id
    assert process.attributes["runstate.attempt"] == 1
    assert inside and inside[0].span_id == process.context.span_id

    # Recording the result is the settle span, under the process span.
    assert settle.context.trace_id == send.context.trace_id
    assert settle.parent.span_id == process.context.span_id
    assert settle.attributes["messaging.operation.type"] == "settle"
    assert settle.attributes["runstate.outcome"] == "complete"
    assert settle.end_time <= process.end_time


def test_the_sdk_submit_is_the_root_of_the_trace_and_a_claim_answers_its_context(spans, api_key):
    async def scenario():
        async with client(api_key) as rs:
            await rs.mailboxes.ensure("sdk-traced", mode="WORK")
            run = await rs.scopes.create(name="sdk")
            with trace.get_tracer("test").start_as_current_span("the caller") as caller:
                ticket = await run.tasks.submit("sdk-traced", {"n": 1})
            claims = await run.tasks.claim("sdk-traced")
            await claims[0].complete({"ok": True})
            return caller, ticket, claims[0]

    caller, ticket, claim = asyncio.run(scenario())
    finished = spans.get_finished_spans()
    sdk_send, server_send = sorted(by_name(finished, "send sdk-traced"), key=lambda span: span.start_time)
    assert sdk_send.parent.span_id == caller.get_span_context().span_id
    assert sdk_send.attributes["runstate.task_id"] == ticket.id
    assert request_of(finished, server_send).parent.span_id == sdk_send.context.span_id
    assert server_send.context.trace_id == caller.get_span_context().trace_id
    trace_id = format(caller.get_span_context().trace_id, "032x")
    receive = one(finished, "receive sdk-traced")
    assert receive.attributes["messaging.operation.type"] == "receive"
    assert receive.attributes["messaging.batch.message_count"] == 1
    assert [link.context.span_id for link in receive.links] == [server_send.context.span_id]
    flags = int(server_send.context.trace_flags)
    assert claim.data["traceparent"] == f"00-{trace_id}-{server_send.context.span_id:016x}-{flags:02x}"
    assert claim.data["tracestate"] is None


def test_a_message_sent_in_a_span_is_processed_and_settled_in_the_same_trace(spans, api_key):
    inside: list = []

    async def scenario():
        async with client(api_key) as rs:
            await rs.mailboxes.ensure("traced-queue", mode="QUEUE")
            run = await rs.scopes.create(name="messages")
            with trace.get_tracer("test").start_as_current_span("the sender") as sender:
                message = await run.messages.send("traced-queue", {"hello": 1})

            async def handler(ctx):
                inside.append(trace.get_current_span().get_span_context())
                return True

            await consume_messages_until(run, "traced-queue", handler)
            return sender, message

    sender, message = asyncio.run(scenario())
    finished = spans.get_finished_spans()
    sdk_send, server_send = sorted(by_name(finished, "send traced-queue"), key=lambda span: span.start_time)
    process = one(finished, "process traced-queue")
    settle = one(finished, "settle traced-queue")
    assert sdk_send.parent.span_id == sender.get_span_context().span_id
    assert request_of(finished, server_send).parent.span_id == sdk_send.context.span_id
    assert server_send.attributes["runstate.message_id"] == message["id"]
    assert process.parent.span_id == server_send.context.span_id
    assert process.context.trace_id == sender.get_span_context().trace_id
    assert process.attributes["runstate.message_id"] == message["id"]
    assert process.attributes["runstate.attempt"] == 1
    assert inside[0].span_id == process.context.span_id
    assert settle.parent.span_id == process.context.span_id
    assert settle.attributes["runstate.outcome"] == "completed"


def test_a_message_whose_handler_fails_is_redelivered_as_a_second_process_span_with_attempt_2(spans, api_key):
    attempts: list = []

    async def scenario():
        async with client(api_key) as rs:
            await rs.mailboxes.ensure("traced-retry-queue", mode="QUEUE")
            run = await rs.scopes.create(name="message retry")
            with trace.get_tracer("test").start_as_current_span("the sender") as sender:
                message = await run.messages.send("traced-retry-queue", {"hello": 2})

            async def handler(ctx):
                attempts.append((ctx.attempt, trace.get_current_span().get_span_context().span_id))
                if ctx.attempt == 1:
                    raise RuntimeError("first delivery fails")
                return True

            await consume_messages_until(run, "traced-retry-queue", handler)
            return sender, message

    sender, message = asyncio.run(scenario())
    finished = spans.get_finished_spans()
    server_send = [span for span in by_name(finished, "send traced-retry-queue") if span.parent.is_remote][0]
    processes = sorted(by_name(finished, "process traced-retry-queue"), key=lambda span: span.start_time)
    assert [span.attributes["runstate.attempt"] for span in processes] == [1, 2]
    for span in processes:
        assert span.context.trace_id == sender.get_span_context().trace_id
        assert span.parent.span_id == server_send.context.span_id
        assert span.attributes["runstate.message_id"] == message["id"]
    assert [span_id for _, span_id in attempts] == [span.context.span_id for span in processes]
    assert not processes[0].status.is_ok and processes[1].status.is_ok
    settles = {
        span.parent.span_id: span.attributes["runstate.outcome"]
        for span in by_name(finished, "settle traced-retry-queue")
    }
    assert settles == {processes[0].context.span_id: "retried", processes[1].context.span_id: "completed"}
