"""The service's ``send`` span: a send inside another to the same mailbox joins it.

The API's hot path opens a submit's span and hands a request its statement could not decide
to the view inside it: the view's send is that span, so a request is one ``send`` span.
"""

import pytest
from opentelemetry.trace import SpanKind, StatusCode

from coordination.domain.exceptions import KeyConflict
from coordination.plumbing.tracing import TraceContext, send_span
from tests.tracing.conftest import one

CALLER = TraceContext.from_headers("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "vendor=1")


def test_a_send_inside_a_send_to_the_same_mailbox_joins_it_and_records_its_error_there(spans):
    with send_span("work", CALLER, run_id="r1") as (outer, stored):
        with pytest.raises(KeyConflict), send_span("work", TraceContext(), run_id="r1") as (inner, inner_stored):
            assert (inner, inner_stored) == (outer, stored)
            raise KeyConflict("The idempotency key is already used with another input.")
    send = one(spans.get_finished_spans(), "send work")
    assert send.kind == SpanKind.PRODUCER
    assert f"{send.parent.span_id:016x}" == "b7ad6b7169203331"
    assert stored.traceparent == f"00-{send.context.trace_id:032x}-{send.context.span_id:016x}-01"
    assert stored.tracestate == "vendor=1"
    assert send.status.status_code == StatusCode.ERROR
    assert [event.name for event in send.events] == ["exception"]


def test_a_send_inside_a_send_to_another_mailbox_is_a_span_of_its_own(spans):
    with send_span("work", CALLER, run_id="r1") as (outer, _), send_span("other", TraceContext()) as (inner, _):
        assert inner is not outer
    finished = spans.get_finished_spans()
    assert one(finished, "send other").parent.span_id == one(finished, "send work").context.span_id


def test_with_tracing_off_a_joined_send_stores_the_callers_context():
    with send_span("work", CALLER) as (outer, stored), send_span("work", TraceContext()) as (inner, inner_stored):
        assert (outer, stored) == (None, CALLER)
        assert (inner, inner_stored) == (None, CALLER)
