"""OpenTelemetry for the SDK and every runstate process: setup, and the spans of a piece of work.

Optional: with no ``opentelemetry`` installed (``pip install "runstate[otel]"`` brings it)
everything here is a no-op. With it installed, the spans go to whatever tracer provider
the process has, the application's own or the one ``configure`` sets up from the standard
``OTEL_*`` variables (``runstate worker``, ``runstate mcp`` and the service's processes
call it).

Tracing is off unless configured: ``configure`` creates a tracer provider only when
``OTEL_TRACES_EXPORTER`` names an exporter (``otlp`` or ``console``; ``none`` turns it off)
or, with that unset, ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set; ``OTEL_SDK_DISABLED=true`` turns it off
whatever else is set. The rest (``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_TRACES_SAMPLER``, ``OTEL_BSP_*``, the exporter's endpoint and headers) is read by
the OpenTelemetry SDK itself.

The context travels with the work: a submit (and a message send) carries the caller's W3C
``traceparent``/``tracestate`` (the ``send`` span's when the SDK traces, otherwise the
current span's), the service stores it on the task, a claim answers it, and the worker
starts the handler's ``process`` span as its child; recording the result is a ``settle``
span under it. Names and attributes follow OpenTelemetry's messaging conventions.
"""

import os
import re
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

try:
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.trace import (
        Link,
        NonRecordingSpan,
        SpanContext,
        SpanKind,
        Status,
        StatusCode,
        TraceFlags,
        TraceState,
    )
except ImportError:  # pragma: no cover - exercised by the SDK's no-otel test in a venv of its own
    trace = None  # type: ignore[assignment]

__all__ = ["configure", "configured_provider", "tracing_requested"]

MESSAGING_SYSTEM = "runstate"
TRACER_NAME = "runstate"
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")
MAX_TRACESTATE_CHARS = 512

_provider: Any = None  # the provider ``configure`` made, if it made one


# Setup ---------------------------------------------------------------------------------


def tracing_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Return whether the ``OTEL_*`` variables ask for traces to be exported (see the module's doc)."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = [name.strip().lower() for name in env.get("OTEL_TRACES_EXPORTER", "").split(",") if name.strip()]
    if exporters:
        return any(name != "none" for name in exporters)
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def configure(default_service_name: str, environ: Mapping[str, str] | None = None) -> Any:
    """Set up a tracer provider from the ``OTEL_*`` variables, once per process; return it (None when off).

    Nothing is created when tracing is not requested, or when ``opentelemetry-sdk`` is not
    installed. ``default_service_name`` names the process when ``OTEL_SERVICE_NAME`` does not.
    """
    global _provider
    env = os.environ if environ is None else environ
    if _provider is not None or not tracing_requested(env):
        return _provider
    try:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError:
        return None
    attributes = {} if env.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: default_service_name}
    provider = TracerProvider(resource=Resource.create(attributes))
    exporters = [name.strip().lower() for name in env.get("OTEL_TRACES_EXPORTER", "otlp").split(",")]
    for name in exporters:
        if name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        elif name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _provider = provider
    return provider


def configured_provider() -> Any:
    """Return the provider ``configure`` created in this process, or None."""
    return _provider


# The W3C context a piece of work carries --------------------------------------------


def valid_traceparent(value: str | None) -> bool:
    """Return whether ``value`` is a W3C ``traceparent`` a context can be taken from."""
    if not value or len(value) > 512:
        return False
    match = _TRACEPARENT.fullmatch(value)
    if match is None:
        return False
    version, trace_id, span_id, _, rest = match.groups()
    if version == "ff" or trace_id == "0" * 32 or span_id == "0" * 16:
        return False
    return not (version == "00" and rest)


def _header_of(span_context: Any) -> dict[str, str]:
    ids = f"{span_context.trace_id:032x}-{span_context.span_id:016x}"
    headers = {"traceparent": f"00-{ids}-{int(span_context.trace_flags):02x}"}
    if span_context.trace_state:
        headers["tracestate"] = span_context.trace_state.to_header()
    return headers


def span_headers(span: Any) -> dict[str, str]:
    """Return ``span``'s ``traceparent`` (and ``tracestate``), or nothing when its context is not valid."""
    span_context = span.get_span_context()
    return _header_of(span_context) if span_context.is_valid else {}


def current_headers() -> dict[str, str]:
    """Return the current span's ``traceparent`` (and ``tracestate``), or nothing when there is none."""
    if trace is None:
        return {}
    return span_headers(trace.get_current_span())


def remote_span_context(traceparent: str | None, tracestate: str | None = None) -> Any:
    """Return the remote span context ``traceparent`` names (None if it names none)."""
    if trace is None or not valid_traceparent(traceparent):
        return None
    assert traceparent is not None
    _, trace_id, span_id, flags = traceparent.split("-")[:4]
    state = TraceState.from_header([tracestate]) if tracestate else None
    return SpanContext(
        int(trace_id, 16), int(span_id, 16), is_remote=True, trace_flags=TraceFlags(int(flags, 16)), trace_state=state
    )


def parent_context(traceparent: str | None, tracestate: str | None = None) -> Any:
    """Return an OpenTelemetry context whose span is the remote one ``traceparent`` names (None if it names none)."""
    span_context = remote_span_context(traceparent, tracestate)
    return trace.set_span_in_context(NonRecordingSpan(span_context)) if span_context is not None else None


def _attributes(operation: str, mailbox: str | None, **runstate: Any) -> dict[str, Any]:
    attributes: dict[str, Any] = {"messaging.system": MESSAGING_SYSTEM, "messaging.operation.type": operation}
    if mailbox is not None:
        attributes["messaging.destination.name"] = mailbox
    for name, value in runstate.items():
        if value is not None:
            attributes[f"runstate.{name}"] = value
    return attributes


def _tracer() -> Any:
    return trace.get_tracer(TRACER_NAME)


def tracing_on() -> bool:
    """Return whether this process has a tracer provider (one that may record spans): a global lookup."""
    return trace is not None and not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


# The spans of a piece of work ----------------------------------------------------------


@contextmanager
def send_span(mailbox: str, *, run_id: str | None, operation_name: str = "send") -> Iterator[dict[str, str]]:
    """Trace a submit or send to ``mailbox``; yield the headers that carry its context to the service.

    When nothing records spans, the headers carry the current span's context (an
    application's own), if any.
    """
    if not tracing_on():
        yield current_headers()
        return
    span = _tracer().start_span(
        f"{operation_name} {mailbox}",
        kind=SpanKind.PRODUCER,
        attributes=_attributes("send", mailbox, run_id=run_id),
    )
    if not span.is_recording():
        yield current_headers()
        return
    with trace.use_span(span, end_on_exit=True, record_exception=True, set_status_on_exception=True):
        yield _header_of(span.get_span_context())


def receive_started() -> int:
    """Return the time a claim or receive call starts, for ``record_receive`` (0 when nothing traces)."""
    return time.time_ns() if tracing_on() else 0


def record_receive(mailbox: str, *, run_id: str | None, started_ns: int, items: list[Any]) -> None:
    """Record the ``receive`` span of a claim (or receive) call that handed out ``items``, linked to their senders.

    A call that handed out nothing (a long-poll that ran out) leaves no span.
    """
    if not started_ns or not items or not tracing_on():
        return
    links = []
    for item in items:
        sender = remote_span_context(item.get("traceparent"), item.get("tracestate"))
        if sender is not None:
            links.append(Link(sender))
    attributes = _attributes("receive", mailbox, run_id=run_id)
    attributes["messaging.batch.message_count"] = len(items)
    span = _tracer().start_span(
        f"receive {mailbox}", kind=SpanKind.CLIENT, start_time=started_ns, links=links, attributes=attributes
    )
    span.end()


def annotate_task(task: Any) -> None:
    """Put the submitted task's ids on the current span."""
    if trace is None or not isinstance(task, dict):
        return
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes(_attributes("send", None, task_id=task.get("id"), group_id=task.get("groupId")))


class ProcessSpan:
    """The ``process`` span of one claimed task (or delivery): started at the claim, ended after its result."""

    def __init__(self, span: Any) -> None:
        self.span = span
        self.context = trace.set_span_in_context(span) if span is not None else None

    def fail(self, error: BaseException | str) -> None:
        """Record the handler's exception on the span (or, given a description, mark the span failed)."""
        if self.span is not None and self.span.is_recording():
            if isinstance(error, str):
                self.span.set_status(Status(StatusCode.ERROR, error))
                return
            self.span.record_exception(error)
            self.span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))

    def end(self) -> None:
        """End the span (once)."""
        if self.span is not None:
            self.span.end()
            self.span = None

    @contextmanager
    def settle(self, mailbox: str, *, outcome: str) -> Iterator[None]:
        """Trace recording the result (complete, fail, retry, reject) as a child of the process span."""
        if self.span is None or not self.span.is_recording():
            yield
            return
        attributes = dict(self.span.attributes or {})
        attributes["messaging.operation.type"] = "settle"
        attributes["runstate.outcome"] = outcome
        with _tracer().start_as_current_span(
            f"settle {mailbox}", context=self.context, kind=SpanKind.CLIENT, attributes=attributes
        ):
            yield


def process_span(
    mailbox: str,
    *,
    traceparent: str | None,
    tracestate: str | None = None,
    run_id: str | None = None,
    task_id: str | None = None,
    message_id: str | None = None,
    attempt: int | None = None,
    group_id: str | None = None,
) -> ProcessSpan:
    """Start the ``process`` span of a claimed task: a child of the submitter's span when the claim carries one."""
    if not tracing_on():
        return ProcessSpan(None)
    span = _tracer().start_span(
        f"process {mailbox}",
        context=parent_context(traceparent, tracestate) or otel_context.Context(),
        kind=SpanKind.CONSUMER,
        attributes=_attributes(
            "process",
            mailbox,
            run_id=run_id,
            task_id=task_id,
            message_id=message_id,
            attempt=attempt,
            group_id=group_id,
        ),
    )
    if not span.is_recording():
        return ProcessSpan(None)
    return ProcessSpan(span)


def in_span(context: Any) -> Any:
    """Return a ``contextvars`` token after making ``context`` current (None for no context)."""
    if trace is None or context is None:
        return None
    return otel_context.attach(context)


def leave(token: Any) -> None:
    """Undo ``in_span``."""
    if token is not None:
        otel_context.detach(token)
