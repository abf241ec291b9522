"""Tracing on for one test: a tracer provider with an in-memory exporter, taken down afterwards.

OpenTelemetry lets a process set its global provider once; the fixture sets it for the test
and puts the API's globals back as they were (no provider: tracing off) when it ends, so the
rest of the suite runs untraced. The same reset opentelemetry-test-utils does.
"""

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util._once import Once


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


def by_name(finished, name: str) -> list:
    """Return the finished spans named ``name``."""
    return [span for span in finished if span.name == name]


def one(finished, name: str):
    """Return the one finished span named ``name``."""
    found = by_name(finished, name)
    assert len(found) == 1, (name, [span.name for span in finished])
    return found[0]
