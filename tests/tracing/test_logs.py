"""JSON log lines carry the active span's ``trace_id`` and ``span_id``, and nothing when no span is active."""

import json
import logging

from opentelemetry import trace

from coordination.plumbing.logging import JsonFormatter


def formatted(message: str) -> dict:
    record = logging.LogRecord("runstate.test", logging.INFO, __file__, 1, message, (), None)
    return json.loads(JsonFormatter().format(record))


def test_a_line_written_in_a_span_names_its_trace_and_span(spans):
    with trace.get_tracer("test").start_as_current_span("work") as span:
        line = formatted("inside")
    context = span.get_span_context()
    assert line["trace_id"] == format(context.trace_id, "032x")
    assert line["span_id"] == format(context.span_id, "016x")


def test_a_line_written_outside_any_span_has_no_trace_fields(spans):
    line = formatted("outside")
    assert "trace_id" not in line and "span_id" not in line


def test_with_tracing_off_lines_have_no_trace_fields():
    line = formatted("untraced")
    assert "trace_id" not in line and "span_id" not in line
