"""The MCP server's claims and deliveries continue their submitter's trace.

A ``runstate mcp`` process (stdio, as an agent's client starts it) exports over OTLP/HTTP to
the receiver this test runs; the submitter is this process, whose spans are recorded in
memory. Each claim the agent takes is a ``process`` span, child of the submitter's ``send``
span, from ``task_claim`` to ``task_complete`` / ``task_fail``, whose record is a ``settle``
span under it; a failed attempt's retry is a second one with ``attempt`` 2. A message
received and completed the same way.
"""

import asyncio
import time

import pytest
from opentelemetry import trace

from runstate import Runstate
from tests.mcp.conftest import call, stdio_session
from tests.sdk.conftest import sdk, sdk_server  # noqa: F401 - fixtures
from tests.tracing.conftest import attributes, one
from tests.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def named(receiver, name: str) -> list:
    return [span for span in list(receiver.spans) if span.name == name]


def test_an_agents_claims_and_messages_are_process_spans_in_the_submitters_trace(spans, sdk, receiver):  # noqa: F811
    suffix = time.monotonic_ns()
    mailbox, queue = f"mcp-traced-{suffix}", f"mcp-traced-inbox-{suffix}"
    with Runstate() as rs:
        rs.mailboxes.ensure(mailbox, mode="WORK", max_attempts=3)
        rs.mailboxes.ensure(queue, mode="QUEUE")
        run = rs.scopes.create(name="mcp traced")
        with trace.get_tracer("test").start_as_current_span("the caller") as caller:
            ticket = run.tasks.submit(mailbox, {"n": 1})
            message = run.messages.send(queue, {"hello": 1})
    finished = spans.get_finished_spans()
    send = one(finished, f"send {mailbox}")
    sent = one(finished, f"send {queue}")
    otel = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint.removesuffix("/v1/traces"),
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_SERVICE_NAME": "runstate-mcp-test",
    }

    async def agent():
        async with stdio_session(sdk.url, sdk.api_key, env=otel) as session:
            error, body = await call(session, "task_claim", mailbox=mailbox, runId=run.id, waitMs=5000)
            assert not error and len(body["claims"]) == 1, body
            first = body["claims"][0]
            error, body = await call(session, "task_fail", claimId=first["claimId"], error={"why": "x"}, retry=True)
            assert not error and body["task"]["state"] == "QUEUED", body
            error, body = await call(session, "task_claim", mailbox=mailbox, runId=run.id, waitMs=5000)
            assert not error and body["claims"][0]["attempt"] == 2, body
            error, body = await call(session, "task_complete", claimId=body["claims"][0]["claimId"], outcome=1)
            assert not error and body["task"]["state"] == "SUCCEEDED", body
            error, body = await call(session, "message_receive", mailbox=queue, runId=run.id, waitMs=5000)
            assert not error and len(body["deliveries"]) == 1, body
            error, body = await call(session, "message_complete", deliveryId=body["deliveries"][0]["deliveryId"])
            assert not error, body

    asyncio.run(agent())
    trace_id = format(caller.get_span_context().trace_id, "032x")

    processes = wait_until(
        lambda: len(found := named(receiver, f"process {mailbox}")) == 2 and found, what="two process spans"
    )
    settles = wait_until(lambda: len(found := named(receiver, f"settle {mailbox}")) == 2 and found, what="two settles")
    by_attempt = {attributes(span)["runstate.attempt"]: span for span in processes}
    assert set(by_attempt) == {1, 2}
    for span in processes:
        seen = attributes(span)
        assert span.trace_id.hex() == trace_id
        assert span.parent_span_id.hex() == format(send.context.span_id, "016x")
        assert seen["runstate.task_id"] == ticket.id
        assert seen["runstate.run_id"] == run.id
        assert seen["messaging.operation.type"] == "process"
    # The failed attempt's process span is marked failed (status code 2: error); the second is not.
    assert by_attempt[1].status.code == 2 and "task_fail" in by_attempt[1].status.message
    assert by_attempt[2].status.code != 2
    outcomes = {
        attributes(span)["runstate.outcome"]: span.parent_span_id for span in settles if span.trace_id.hex() == trace_id
    }
    assert outcomes == {"fail": by_attempt[1].span_id, "complete": by_attempt[2].span_id}

    [processed] = wait_until(lambda: named(receiver, f"process {queue}"), what="the message's process span")
    [settled] = wait_until(lambda: named(receiver, f"settle {queue}"), what="the message's settle span")
    assert processed.trace_id.hex() == trace_id
    assert processed.parent_span_id.hex() == format(sent.context.span_id, "016x")
    assert attributes(processed)["runstate.message_id"] == message["id"]
    assert attributes(processed)["runstate.attempt"] == 1
    assert settled.parent_span_id == processed.span_id
    assert attributes(settled)["runstate.outcome"] == "completed"
