"""Structured JSON logs and the request id (X-Request-ID in and out)."""

import json
import logging

from coordination.logging import JsonFormatter, RequestIdFilter, request_id_var


def test_a_request_id_is_made_answered_and_logged(api, caplog):
    with caplog.at_level(logging.INFO, logger="runstate.request"):
        response = api.get("/v1/runs")
    request_id = response["X-Request-ID"]
    assert len(request_id) == 32
    [record] = [r for r in caplog.records if r.name == "runstate.request"]
    line = json.loads(JsonFormatter().format(record))
    assert line["requestId"] == request_id
    assert (line["method"], line["path"], line["route"], line["status"]) == ("GET", "/v1/runs", "v1/runs", 200)
    assert line["level"] == "INFO" and line["logger"] == "runstate.request" and line["time"].endswith("Z")


def test_the_callers_request_id_is_kept(anon):
    response = anon.get("/v1/healthz", HTTP_X_REQUEST_ID="trace-abc.123")
    assert response["X-Request-ID"] == "trace-abc.123"


def test_an_unsafe_request_id_is_replaced(anon):
    response = anon.get("/v1/healthz", HTTP_X_REQUEST_ID="bad id\twith spaces")
    assert response["X-Request-ID"] != "bad id\twith spaces" and len(response["X-Request-ID"]) == 32


def test_every_record_carries_the_current_request_id_and_extras():
    token = request_id_var.set("req-1")
    try:
        record = logging.LogRecord("x", logging.WARNING, __file__, 1, "hello %s", ("world",), None)
        RequestIdFilter().filter(record)
        record.taskId = "t1"
        line = json.loads(JsonFormatter().format(record))
    finally:
        request_id_var.reset(token)
    assert line["message"] == "hello world"
    assert line["requestId"] == "req-1"
    assert line["taskId"] == "t1"


def test_errors_are_logged_with_their_traceback():
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    line = json.loads(JsonFormatter().format(record))
    assert "ValueError: boom" in line["exception"]
