"""Tracing on for one test (a tracer provider with an in-memory exporter), an OTLP receiver, an API key.

OpenTelemetry lets a process set its global provider once; the fixture sets it for the test
and puts the API's globals back as they were (no provider: tracing off) when it ends, so the
rest of the suite runs untraced. The same reset opentelemetry-test-utils does.
"""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util._once import Once

from coordination.services.keys import ALL_PERMISSIONS, api_key_create, project_ensure


def reset_tracing_globals() -> None:
    """Forget the global tracer provider (the API's own state: tracing is off again)."""
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = None


@pytest.fixture
def spans():
    """Record every span of the test in memory; yield the exporter (``get_finished_spans()``)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    reset_tracing_globals()
    trace.set_tracer_provider(provider)
    try:
        yield exporter
    finally:
        provider.shutdown()
        reset_tracing_globals()


@pytest.fixture
def api_key():
    """A key of a project of its own, allowed everything."""
    project = project_ensure(name="traced")
    return api_key_create(project_id=project.id, permissions=list(ALL_PERMISSIONS), name="tracing").plaintext


def by_name(finished, name: str) -> list:
    """Return the finished spans named ``name``."""
    return [span for span in finished if span.name == name]


def request_of(finished, span):
    """Return the span of the request that made ``span`` (its parent, the ASGI instrumentation's).

    It is a SERVER span in the API's process; here, where the client runs in the same context,
    the instrumentation makes it INTERNAL under the client's current span.
    """
    requests = {
        each.context.span_id: each
        for each in finished
        if each.instrumentation_scope.name == "opentelemetry.instrumentation.asgi"
    }
    assert span.parent is not None and span.parent.span_id in requests, (span.name, [s.name for s in finished])
    return requests[span.parent.span_id]


def one(finished, name: str):
    """Return the one finished span named ``name``."""
    found = by_name(finished, name)
    assert len(found) == 1, (name, [span.name for span in finished])
    return found[0]


class Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP receiver: keeps every span of every export request it is sent."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.spans: list = []
        self.resources: list = []
        self.paths: list[str] = []

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1/traces"


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - the http.server convention
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        self.server.paths.append((self.path, self.headers["Content-Type"]))
        for resource_spans in request.resource_spans:
            self.server.resources.append(resource_spans.resource)
            for scope_spans in resource_spans.scope_spans:
                self.server.spans.extend(scope_spans.spans)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def receiver():
    server = Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def attributes(span) -> dict:
    """Decode a protobuf span's attributes to a dict of plain values."""
    decoded = {}
    for item in span.attributes:
        value = item.value
        decoded[item.key] = getattr(value, value.WhichOneof("value"))
    return decoded
