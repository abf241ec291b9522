"""Tracing is off unless the OTEL_* variables configure it; then one provider, set up once."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runstate._tracing import tracing_requested

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys
import {module}
from opentelemetry import trace
from runstate._tracing import configured_provider
provider = configured_provider()
processors = provider._active_span_processor._span_processors if provider is not None else ()
print(json.dumps({{
    "global": type(trace.get_tracer_provider()).__name__,
    "processors": [type(p).__name__ for p in processors],
    "exporters": [type(p.span_exporter).__name__ for p in processors],
    "service": provider.resource.attributes.get("service.name") if provider is not None else None,
    "instrumented": [name for name in ("django", "psycopg", "celery")
                     if getattr(sys.modules.get("opentelemetry.instrumentation." + name), "__name__", None)],
}}))
"""


def probe(module: str, **variables: str) -> dict:
    """Import ``module`` in a fresh process with only ``variables`` of the OTEL_* kind set; report its tracing."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("OTEL_")}
    env.update(variables, DJANGO_SETTINGS_MODULE="runstate_project.settings", PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(module=module)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("variables", "requested"),
    [
        ({}, False),
        ({"OTEL_SERVICE_NAME": "x"}, False),
        ({"OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_SDK_DISABLED": "true"}, False),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "TRUE"}, False),
    ],
)
def test_tracing_is_requested_only_by_an_exporter_or_an_endpoint(variables, requested):
    assert tracing_requested(variables) is requested


def test_with_tracing_off_the_api_process_creates_no_provider_and_no_span_processor():
    seen = probe("runstate_project.asgi")
    assert seen == {
        "global": "ProxyTracerProvider",
        "processors": [],
        "exporters": [],
        "service": None,
        "instrumented": [],
    }


def test_with_an_otlp_endpoint_the_api_process_exports_through_one_batch_processor():
    seen = probe("runstate_project.asgi", OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9")
    assert seen["global"] == "TracerProvider"
    assert seen["processors"] == ["BatchSpanProcessor"]
    assert seen["exporters"] == ["OTLPSpanExporter"]
    assert seen["service"] == "runstate-api"
    assert seen["instrumented"] == ["django", "psycopg"]


def test_the_service_name_and_the_disabled_instrumentations_come_from_the_standard_variables():
    seen = probe(
        "runstate_project.asgi",
        OTEL_TRACES_EXPORTER="console",
        OTEL_SERVICE_NAME="my-coordinator",
        OTEL_PYTHON_DISABLED_INSTRUMENTATIONS="psycopg",
    )
    assert seen["exporters"] == ["ConsoleSpanExporter"]
    assert seen["service"] == "my-coordinator"
    assert seen["instrumented"] == ["django"]


def test_the_sdk_works_without_opentelemetry_installed():
    """With ``opentelemetry`` absent, the SDK imports and its spans are no-ops."""
    script = """
import sys
sys.modules["opentelemetry"] = None  # as if not installed: every import of it fails
import runstate
from runstate import _tracing
assert _tracing.trace is None
assert _tracing.configure("x", {"OTEL_TRACES_EXPORTER": "otlp"}) is None
with _tracing.send_span("m", run_id="r") as headers:
    assert headers == {}
span = _tracing.process_span("m", traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
with span.settle("m", outcome="complete"):
    pass
span.end()
print("ok")
"""
    env = {name: value for name, value in os.environ.items() if not name.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
