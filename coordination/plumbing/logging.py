"""Structured JSON logs and the request id that ties a request's lines together.

``RequestContextMiddleware`` takes the caller's ``X-Request-ID`` (or makes one), keeps it
in a context variable for the request's duration, answers it in the ``X-Request-ID``
response header, counts the request for ``/v1/metrics`` and logs one line per request.
``JsonFormatter`` writes every log record as one JSON object with that ``requestId`` and, when a
span is active (``coordination.plumbing.tracing``), its ``trace_id`` and ``span_id``.

No API key reaches a log in plaintext, wherever a caller put it (a query string, the path,
an odd header): ``redact`` masks the secret of anything shaped like a key and the value of
every credential-named query parameter. ``JsonFormatter`` redacts each line it writes, and
``RedactFilter`` (installed on every handler, uvicorn's access log included, by
``redact_every_handler``) redacts a record's message before any other formatter sees it.

Redaction runs on the event loop (uvicorn writes its access line there), so it must cost
what the text's length does and no more: the patterns below cannot backtrack (possessive
quantifiers, one pass), and what a caller controls is cut to ``MAX_LOGGED_CHARS`` before it
is redacted (``[cut: N characters]`` marks the cut). A cut through a key keeps none of its
secret: the cut comes first, and the redaction masks whatever part of a key or credential
value is left.
"""

import contextvars
import json
import logging
import re
import time
import traceback
import uuid
from datetime import UTC, datetime

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from opentelemetry import trace

REQUEST_ID_HEADER = "X-Request-ID"
_REQUEST_ID_META = "HTTP_" + REQUEST_ID_HEADER.upper().replace("-", "_")  # where Django's request keeps it
# An API key is ``rs_<12 hex prefix>_<secret>``; the prefix names the key, the rest is secret.
_API_KEY = re.compile(r"\brs_([0-9a-f]{12})_[A-Za-z0-9_-]++")
# A query parameter's name (up to its ``=``) and value. The quantifiers are possessive: a
# name not followed by ``=`` fails at once instead of being re-scanned from every position
# inside it (``?keykeykey...`` made the former single pattern quadratic: 48 KB held the
# event loop for 8.5 s).
_PARAMETER_NAME = re.compile(r"[?&;]([A-Za-z0-9_.-]*+)=")
_PARAMETER_VALUE = re.compile(r"[^&;#\s'\"]*+")
# A name that says its parameter carries a credential (``api_key``, ``access_token``...).
_CREDENTIAL_NAME = re.compile(r"key|token|secret|password|auth", re.IGNORECASE)
REDACTED = "[redacted]"
# The longest message or argument a log line keeps (a 64 KB query string is cut to this).
MAX_LOGGED_CHARS = 8192
# An id from the caller is kept when it is a plain token; anything else is replaced.
_ACCEPTABLE_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")
# Attributes every LogRecord has; anything else on a record was passed as ``extra``.
_RECORD_FIELDS = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "request_id"}

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("runstate_request_id", default=None)
request_logger = logging.getLogger("runstate.request")


def redact(text: str) -> str:
    """Return ``text`` with the secret of every API key and every credential in a query string masked.

    Linear in ``text``'s length whatever it holds. Text with neither ``rs_`` (every key holds
    it) nor ``=`` (every parameter the patterns mask holds it) has nothing to mask and is
    returned as it is, without the passes: most of what a request logs.
    """
    if "rs_" not in text and "=" not in text:
        return text
    text = _API_KEY.sub(rf"rs_\1_{REDACTED}", text)
    kept: list[str] = []
    position = 0  # everything before it is in ``kept``
    for name in _PARAMETER_NAME.finditer(text):
        # A match inside a value masked already (``?key=a?token=b``) is masked with it.
        if name.start() < position or _CREDENTIAL_NAME.search(name[1]) is None:
            continue
        kept += (text[position : name.end()], REDACTED)
        position = _PARAMETER_VALUE.match(text, name.end()).end()
    if not kept:
        return text
    kept.append(text[position:])
    return "".join(kept)


def cut(text: str) -> str:
    """Return ``text``, or its first ``MAX_LOGGED_CHARS`` characters and a marker if it is longer."""
    if len(text) <= MAX_LOGGED_CHARS:
        return text
    return f"{text[:MAX_LOGGED_CHARS]} ...[cut: {len(text)} characters]"


def _redact_value(value):
    return redact(cut(value)) if isinstance(value, str) else value


class RedactFilter(logging.Filter):
    """Mask keys in a record's message, arguments and traceback, keeping their shapes.

    Arguments stay a tuple (or mapping) of the same length: a formatter may unpack them, as
    uvicorn's access log formatter does.
    """

    def filter(self, record: logging.LogRecord) -> bool:  # noqa: D102
        if isinstance(record.msg, str):
            # A format string is the code's, not a caller's: cutting it could orphan a ``%s``.
            record.msg = redact(record.msg if record.args else cut(record.msg))
        if isinstance(record.args, tuple):
            record.args = tuple(_redact_value(arg) for arg in record.args)
        elif isinstance(record.args, dict):
            record.args = {name: _redact_value(arg) for name, arg in record.args.items()}
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True


def redact_every_handler() -> None:
    """Put a ``RedactFilter`` on every handler configured so far (Django's, uvicorn's, ours)."""
    loggers = [logging.getLogger()]
    loggers += [item for item in logging.Logger.manager.loggerDict.values() if isinstance(item, logging.Logger)]
    for logger in loggers:
        for handler in logger.handlers:
            if not any(isinstance(existing, RedactFilter) for existing in handler.filters):
                handler.addFilter(RedactFilter())


def current_request_id() -> str | None:
    """Return the id of the request being handled, if any."""
    return request_id_var.get()


class RequestIdFilter(logging.Filter):
    """Put the current request id on every record as ``request_id``."""

    def filter(self, record: logging.LogRecord) -> bool:  # noqa: D102
        if not hasattr(record, "request_id"):
            record.request_id = request_id_var.get()
        return True


class JsonFormatter(logging.Formatter):
    """Format a record as one line of JSON: time, level, logger, message, requestId, extras."""

    def format(self, record: logging.LogRecord) -> str:  # noqa: D102
        written = datetime.fromtimestamp(record.created, UTC)
        body = {
            "time": written.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": cut(record.getMessage()),
        }
        request_id = getattr(record, "request_id", None) or request_id_var.get()
        if request_id:
            body["requestId"] = request_id
        span_context = trace.get_current_span().get_span_context()
        if span_context.is_valid:
            body["trace_id"] = format(span_context.trace_id, "032x")
            body["span_id"] = format(span_context.span_id, "016x")
        for key, value in vars(record).items():
            if key not in _RECORD_FIELDS and not key.startswith("_"):
                body[key] = cut(value) if isinstance(value, str) else value
        if record.exc_info:
            body["exception"] = "".join(traceback.format_exception(*record.exc_info)).rstrip()
        # Extras such as Django's ``request`` render with their query string: redact the whole line.
        return redact(_ENCODER.encode(body))


def _rendered(value) -> str:
    """Render an extra JSON cannot hold (Django's ``request``, with its query string) as cut text."""
    return cut(str(value))


# ``json.dumps(body, default=_rendered)``'s encoder, made once (``dumps`` makes one per call when
# given ``default``; ``encode`` keeps no state between calls, so threads may share it).
_ENCODER = json.JSONEncoder(default=_rendered)


def _route_of(request) -> str:
    match = getattr(request, "resolver_match", None)
    return match.route if match is not None and match.route else "unmatched"


class RequestContextMiddleware:
    """Request id in and out, one log line and the request metrics for every request."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request):  # noqa: D102
        if self.is_async:
            return self.__acall__(request)
        token, started = self._begin(request)
        try:
            response = self.get_response(request)
            return self._end(request, response, started)
        finally:
            request_id_var.reset(token)

    async def __acall__(self, request):  # noqa: D102
        token, started = self._begin(request)
        try:
            response = await self.get_response(request)
            return self._end(request, response, started)
        finally:
            request_id_var.reset(token)

    @staticmethod
    def _begin(request):
        given = request.META.get(_REQUEST_ID_META, "")  # ``request.headers`` would parse every header
        # A key sent as the request id would be echoed into every log line of the request.
        acceptable = _ACCEPTABLE_ID.fullmatch(given) and redact(given) == given
        request.request_id = given if acceptable else uuid.uuid4().hex
        return request_id_var.set(request.request_id), time.perf_counter()

    @staticmethod
    def _end(request, response, started: float):
        from coordination.plumbing.metrics import observe_request

        seconds = time.perf_counter() - started
        response[REQUEST_ID_HEADER] = request.request_id
        route = _route_of(request)
        observe_request(method=request.method, route=route, status=response.status_code, seconds=seconds)
        request_logger.info(
            "%s %s %s",
            request.method,
            request.path,
            response.status_code,
            extra={
                "method": request.method,
                "path": request.path,
                "route": route,
                "status": response.status_code,
                "durationMs": round(seconds * 1000, 1),
            },
        )
        return response
