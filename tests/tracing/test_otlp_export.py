"""The OTLP/HTTP exporter over a real socket: a small receiver decodes what a cancel exported.

The receiver (``conftest.Receiver``) is an HTTP server in this process that decodes each
``POST /v1/traces`` with ``opentelemetry-proto``, as a collector would. The cancel runs through the API
(in this process, httpx's ASGI transport) with the caller's ``traceparent``.
"""

import asyncio

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from coordination.services.keys import ALL_PERMISSIONS, api_key_create, project_ensure
from runstate import AsyncRunstate
from tests.tracing.conftest import attributes, reset_tracing_globals
from tests.tracing.test_work_trace import CALLER_SPAN_ID, CALLER_TRACE_ID, TRACEPARENT

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def otlp_provider(receiver):
    provider = TracerProvider(resource=Resource.create({"service.name": "runstate-api"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=receiver.endpoint)))
    reset_tracing_globals()
    trace.set_tracer_provider(provider)
    try:
        yield provider
    finally:
        provider.shutdown()
        reset_tracing_globals()


def test_a_cancel_exports_its_span_with_the_counts_of_its_cascade(otlp_provider, receiver):
    project = project_ensure(name="otlp")
    key = api_key_create(project_id=project.id, permissions=list(ALL_PERMISSIONS), name="otlp").plaintext

    async def scenario():
        from runstate_project.asgi import application

        transport = httpx.ASGITransport(app=application)
        async with AsyncRunstate(base_url="http://testserver", api_key=key, transport=transport) as rs:
            await rs.mailboxes.ensure("otlp-work", mode="WORK")
            await rs.mailboxes.ensure("otlp-queue", mode="QUEUE")
            root = await rs.scopes.create(name="root")
            children = [await root.child(name=f"child-{n}") for n in range(2)]
            for run in [root, *children]:
                await run.tasks.submit_many("otlp-work", [{"input": {"n": n}} for n in range(3)])
            await children[0].messages.send("otlp-queue", {"hello": 1})
            await children[1].timers.create(after_seconds=3600)
            await rs._http.request(
                "POST",
                f"/runs/{root.id}/cancel",
                idempotent=True,
                json={"reason": "stop"},
                headers={"traceparent": TRACEPARENT},
            )
            return root.id

    root_id = asyncio.run(scenario())
    assert otlp_provider.force_flush(10_000)

    assert receiver.paths and all(path == ("/v1/traces", "application/x-protobuf") for path in receiver.paths)
    service_names = {
        attribute.value.string_value
        for resource in receiver.resources
        for attribute in resource.attributes
        if attribute.key == "service.name"
    }
    assert service_names == {"runstate-api"}
    cancels = [span for span in receiver.spans if span.name == "cancel run"]
    assert len(cancels) == 1
    cancel = cancels[0]
    assert cancel.trace_id.hex() == CALLER_TRACE_ID
    # Under the cancel request's server span, itself under the caller's span.
    (request,) = [span for span in receiver.spans if span.span_id == cancel.parent_span_id]
    assert request.kind == request.SPAN_KIND_SERVER
    assert request.parent_span_id.hex() == CALLER_SPAN_ID
    seen = attributes(cancel)
    assert seen["runstate.run_id"] == root_id
    assert seen["runstate.reason"] == "stop"
    assert seen["runstate.cascade.task.cancelled"] == 9
    assert seen["runstate.cascade.message.cancelled"] == 1
    assert seen["runstate.cascade.timer.cancelled"] == 1
    assert seen["runstate.cascade.run.cancelled"] == 1
