"""The Celery decorator continues the submitter's trace in a real worker, and a takeover adds an attempt.

This process submits through ``@runstate_task`` inside a span of its own (spans recorded in
memory); a real ``celery worker`` (and beat, for the lease sweep) exports its spans over
OTLP/HTTP to the receiver this test runs. The worker's ``process`` span must be the child
of this process's ``send`` span, in the same trace.
"""

import pytest
import redis
from opentelemetry import trace

from coordination.models import Task
from coordination.services.runs import run_create
from tests.tracing import celery_tasks as ct
from tests.tracing.conftest import attributes, one
from tests.waiting import wait_until
from tests.workers.celery_tasks import read_notes
from tests.workers.test_decorator_live import BROKER_URL, Cluster, worker_command
from workers.registry import registry

pytestmark = [
    pytest.mark.postgres_only,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not BROKER_URL.startswith("redis://"), reason="needs CELERY_BROKER_URL on Redis"),
]


@pytest.fixture
def cluster(tmp_path, receiver):
    redis.Redis.from_url(BROKER_URL).flushdb()
    for task in registry:
        task.forget_ids()
    started = Cluster(tmp_path)
    endpoint = receiver.endpoint.removesuffix("/v1/traces")
    started.tracing_env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_SERVICE_NAME": "runstate-celery-test",
    }
    try:
        yield started
    finally:
        started.stop()


def start_worker(cluster) -> object:
    command = worker_command(2, "threads")
    command[command.index("--include=tests.workers.celery_tasks")] = "--include=tests.tracing.celery_tasks"
    return cluster.start(command, **cluster.tracing_env)


def process_spans(receiver, task_id: str) -> list:
    return [
        span
        for span in list(receiver.spans)
        if span.name == "process celery-traced" or span.name == "process celery-traced-takeover"
        if attributes(span).get("runstate.task_id") == task_id
    ]


def test_a_decorated_task_runs_in_a_process_span_child_of_the_submitters_send_span(spans, cluster, receiver, tmp_path):
    log = str(tmp_path / "effects.log")
    run = run_create(project_id=ct.traced.project_id, name="traced")
    start_worker(cluster)
    with trace.get_tracer("test").start_as_current_span("the caller") as caller:
        task = ct.traced.submit(run.id, {"log": log})
    send = one(spans.get_finished_spans(), "send celery-traced")
    assert send.parent.span_id == caller.get_span_context().span_id
    assert send.attributes["runstate.task_id"] == str(task.id)

    wait_until(lambda: Task.objects.get(id=task.id).state == "SUCCEEDED", what="the task")
    [process] = wait_until(lambda: process_spans(receiver, str(task.id)), what="the process span")
    assert process.trace_id.hex() == format(caller.get_span_context().trace_id, "032x")
    assert process.parent_span_id.hex() == format(send.context.span_id, "016x")
    seen = attributes(process)
    assert seen["messaging.system"] == "runstate"
    assert seen["messaging.operation.type"] == "process"
    assert seen["messaging.destination.name"] == "celery-traced"
    assert seen["runstate.attempt"] == 1
    assert seen["runstate.run_id"] == str(run.id)
    # The handler ran in that span.
    [(_, task_id, attempt, trace_id, span_id)] = read_notes(log)
    assert (task_id, attempt, trace_id, span_id) == (str(task.id), "1", process.trace_id.hex(), process.span_id.hex())
    settle = wait_until(
        lambda: [span for span in list(receiver.spans) if span.name == "settle celery-traced"], what="the settle span"
    )[0]
    assert settle.parent_span_id == process.span_id
    assert attributes(settle)["runstate.outcome"] == "complete"


def test_a_takeover_after_sigkill_adds_a_second_process_span_with_attempt_2_to_the_same_trace(
    spans, cluster, receiver, tmp_path
):
    log = str(tmp_path / "effects.log")
    run = run_create(project_id=ct.hangs_first.project_id, name="takeover")
    first = start_worker(cluster)
    cluster.beat()
    with trace.get_tracer("test").start_as_current_span("the caller") as caller:
        task = ct.hangs_first.submit(run.id, {"log": log})
    send = one(spans.get_finished_spans(), "send celery-traced-takeover")
    wait_until(lambda: len(read_notes(log)) == 1, what="the first attempt to start")
    cluster.kill(first)  # SIGKILL: the first attempt's span never ends, its lease runs out
    start_worker(cluster)

    wait_until(lambda: Task.objects.get(id=task.id).state == "SUCCEEDED", waits=2, what="the takeover")
    [second] = wait_until(lambda: process_spans(receiver, str(task.id)), what="the second span")
    assert attributes(second)["runstate.attempt"] == 2
    assert second.trace_id.hex() == format(caller.get_span_context().trace_id, "032x")
    assert second.parent_span_id.hex() == format(send.context.span_id, "016x")
    notes = read_notes(log)
    assert [(parts[2], parts[3]) for parts in notes] == [("1", second.trace_id.hex()), ("2", second.trace_id.hex())]
    assert notes[1][4] == second.span_id.hex()
    assert notes[0][4] != notes[1][4], "each attempt has a span of its own"
