"""The service's side of tracing: the trace context stored with a piece of work, and its spans.

A submit or send stores its caller's W3C context (``TraceContext``): the request's
``traceparent``/``tracestate`` headers, or in-process (the Celery decorator's ``submit``)
the current span. When this process traces (``runstate_project.tracing`` set a provider up
from the ``OTEL_*`` variables), the submit is a ``send`` span, child of the caller's, and
the task stores that span's context instead. A rerun continues the old task's trace
(``work_trace``). Coordination has spans of its own: a cancel (with the counts its cascade
ended), a group's finalize (its outcome), a barrier's release, a timer's firing, a wait for
a pool or a quota (a budget reservation never waits).

When nothing traces, ``span`` yields None and costs a lookup of the global provider; a
request without a ``traceparent`` header costs the header's read.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind

from runstate._tracing import (
    MAX_TRACESTATE_CHARS,
    TRACER_NAME,
    current_headers,
    parent_context,
    remote_span_context,
    span_headers,
    tracing_on,
    valid_traceparent,
)

__all__ = ["NO_TRACE", "SpanKind", "TraceContext", "annotate", "span", "tracing_on"]

# The longest ``traceparent`` kept: version 00's length (a later version's extra fields are dropped).
TRACEPARENT_CHARS = 55


@dataclass(frozen=True)
class TraceContext:
    """A W3C trace context as stored on a task or message (empty strings: none)."""

    traceparent: str = ""
    tracestate: str = ""

    @classmethod
    def from_headers(cls, traceparent: str | None, tracestate: str | None = None) -> "TraceContext":
        """Return the context the headers carry; an invalid ``traceparent`` carries none (W3C: ignore it)."""
        if not valid_traceparent(traceparent):
            return NO_TRACE
        assert traceparent is not None
        state = tracestate or ""
        if len(state) > MAX_TRACESTATE_CHARS:
            state = ""  # W3C: a list too long may be dropped; cutting it could split an entry
        return cls(traceparent[:TRACEPARENT_CHARS], state)

    @classmethod
    def current(cls) -> "TraceContext":
        """Return the current span's context in this process (none when no span is active)."""
        headers = current_headers()
        return cls(headers["traceparent"], headers.get("tracestate", "")) if headers else NO_TRACE

    def __bool__(self) -> bool:
        return bool(self.traceparent)

    @property
    def trace_id(self) -> str:
        """Return the trace id (32 hex digits), or an empty string when there is no context."""
        return self.traceparent.split("-")[1] if self.traceparent else ""


NO_TRACE = TraceContext()


# Where the request's SERVER span is kept in its ASGI scope (``runstate_project.tracing.server_spans``).
SERVER_SPAN = "runstate.server_span"


def request_trace(scope: dict | None, traceparent: str | None, tracestate: str | None = None) -> TraceContext:
    """Return the context a request's work continues: the request's server span, else its headers'.

    When this process traces, the ASGI instrumentation has opened the request's SERVER span,
    the child of the caller's ``traceparent``, and kept it in the ASGI ``scope``: the spans the
    request makes, and the context its tasks store, go under it (on the hot path and in a
    view's thread alike, where the event loop's current span is not). Untraced, it is the
    context the headers carry, stored as it came.
    """
    server = scope.get(SERVER_SPAN) if scope is not None else None
    headers = span_headers(server) if server is not None else None
    if headers:
        return TraceContext(headers["traceparent"], headers.get("tracestate", ""))
    return TraceContext.from_headers(traceparent, tracestate)


def _attributes(operation: str | None, mailbox: str | None, values: dict[str, Any]) -> dict[str, Any]:
    attributes: dict[str, Any] = {"messaging.system": "runstate"}
    if operation is not None:
        attributes["messaging.operation.type"] = operation
    if mailbox is not None:
        attributes["messaging.destination.name"] = mailbox
    for name, value in values.items():
        if value is not None:
            attributes[f"runstate.{name}"] = str(value) if not isinstance(value, bool | int | float | str) else value
    return attributes


@contextmanager
def span(
    name: str,
    *,
    operation: str | None = None,
    mailbox: str | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    parent: TraceContext | None = None,
    links: tuple[TraceContext, ...] = (),
    **attributes: Any,
) -> Iterator[Any]:
    """Run the block in a span named ``name`` (a child of ``parent`` when given); yield it, or None when off.

    ``attributes`` become ``runstate.<name>`` (``run_id``, ``task_id``...); ``operation`` and
    ``mailbox`` the messaging conventions' ``messaging.operation.type`` and
    ``messaging.destination.name``. ``links`` are contexts the span relates to without being
    their child (another trace's caller); the empty ones are skipped.
    """
    if not tracing_on():
        yield None
        return
    context = parent_context(parent.traceparent, parent.tracestate) if parent else None
    linked = [remote_span_context(link.traceparent, link.tracestate) for link in links if link]
    with trace.get_tracer(TRACER_NAME).start_as_current_span(
        name,
        context=context,
        kind=kind,
        attributes=_attributes(operation, mailbox, attributes),
        links=[Link(span_context) for span_context in linked if span_context is not None],
    ) as current:
        yield current


def record_span(name: str, *, started_ns: int | None = None, **attributes: Any) -> None:
    """Record a span of something already done (from ``started_ns``, ``time.time_ns()``, to now), when tracing.

    For what is worth a span only once it happened: a sweep that fired timers, an arrival
    that released a barrier.
    """
    if not tracing_on():
        return
    tracer = trace.get_tracer(TRACER_NAME)
    tracer.start_span(name, start_time=started_ns, attributes=_attributes(None, None, attributes)).end()


def annotate(current: Any, **attributes: Any) -> None:
    """Set ``runstate.<name>`` attributes on ``current`` (a span ``span`` yielded, or None)."""
    if current is not None and current.is_recording():
        current.set_attributes(_attributes(None, None, attributes))


# The ``send`` span open in this context: its mailbox, the span and the context its work
# stores. A ``send_span`` to that mailbox inside it joins it: the API's hot path opens a
# submit's span itself and, when its statement touched no row, hands the request to the view
# inside it (coordination/api/hot), so a request is one ``send`` span whichever path answers.
_open_send: ContextVar[tuple[str, Any, TraceContext] | None] = ContextVar("runstate_open_send", default=None)


@contextmanager
def send_span(
    mailbox: str, caller: TraceContext, *, links: tuple[TraceContext, ...] = (), **attributes: Any
) -> Iterator[tuple[Any, TraceContext]]:
    """Trace a submit or send to ``mailbox``; yield the span and the context to store with the work.

    The stored context is the ``send`` span's when this process traces, otherwise the caller's.
    Inside another ``send_span`` to ``mailbox`` (the hot path's, around the view it hands a
    request to) it yields that one's span and context, with ``attributes`` set on it.
    """
    joined = _open_send.get()
    if joined is not None and joined[0] == mailbox:
        _, current, stored = joined
        if current is None:
            yield current, stored
            return
        annotate(current, **attributes)
        with trace.use_span(current, end_on_exit=False):  # an exception is recorded on it, as on its own
            yield current, stored
        return
    with span(
        f"send {mailbox}",
        operation="send",
        mailbox=mailbox,
        kind=SpanKind.PRODUCER,
        parent=caller,
        links=links,
        **attributes,
    ) as current:
        stored = TraceContext.current() if current is not None else caller
        token = _open_send.set((mailbox, current, stored))
        try:
            yield current, stored
        finally:
            _open_send.reset(token)


def work_trace(stored: TraceContext, caller: TraceContext) -> tuple[TraceContext, tuple[TraceContext, ...]]:
    """Return the context a resubmit of work (a rerun) continues, and the contexts it links to.

    ``stored`` is the context the work's first submit stored, ``caller`` the resubmit's. The
    work's own trace continues, as a Celery retry or a Temporal activity's next attempt stays
    in the trace it started in: a caller in another trace becomes a link of the ``send``
    span; a caller already in the work's trace is its parent (it names the cause). Work that
    stored no context continues the caller's.
    """
    if not stored or (caller and caller.trace_id == stored.trace_id):
        return caller or stored, ()
    return stored, (caller,) if caller else ()
