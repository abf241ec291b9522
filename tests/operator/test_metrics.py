"""``/v1/metrics``: the named ``runstate_*`` series, with values that move when work is done."""

import datetime as dt

import pytest
from django.test import override_settings
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from coordination.services.claims import claim_complete, task_claim
from coordination.services.groups import group_close, group_create
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.runs import run_cancel, run_create
from coordination.services.sweeps import tasks_settle_expired_leases
from coordination.services.tasks import task_submit
from coordination.services.timers import timer_create, timers_fire_due

# The event fold reads committed events through the metrics view's own queries.
pytestmark = pytest.mark.django_db(transaction=True)

NAMED = [
    "runstate_http_requests_total",
    "runstate_http_request_duration_seconds",
    "runstate_runs",
    "runstate_tasks",
    "runstate_messages",
    "runstate_groups",
    "runstate_barriers",
    "runstate_timers",
    "runstate_leases_active",
    "runstate_mailbox_queue_depth",
    "runstate_mailbox_oldest_queued_age_seconds",
    "runstate_group_decisions_total",
    "runstate_sweep_lag_seconds",
    "runstate_tasks_finished_total",
    "runstate_lease_expiries_total",
    "runstate_claim_latency_seconds",
    "runstate_timer_lateness_seconds",
]


# The scrape token (RUNSTATE_METRICS_TOKEN) that Prometheus presents: it sees every series.
SCRAPE_TOKEN = "test-scrape-token-0123456789abcdef"


def scrape(client) -> dict[tuple[str, tuple], float]:
    """Return every sample, as Prometheus scrapes them with the token, as {(name, sorted labels): value}."""
    with override_settings(RUNSTATE_METRICS_TOKEN=SCRAPE_TOKEN):
        response = client.get(
            "/v1/metrics",
            HTTP_ACCEPT="application/openmetrics-text;version=1.0.0,*/*;q=0.1",
            HTTP_AUTHORIZATION=f"Bearer {SCRAPE_TOKEN}",
        )
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(samples, name: str, **labels) -> float:
    """Sum the samples of ``name`` whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(v for (n, lbls), v in samples.items() if n == name and wanted <= set(lbls))


def test_the_scrape_token_gets_every_named_series(anon, api, project):
    mailbox_ensure(project_id=project.id, name="jobs", mode="WORK")
    # Labelled series appear once something is counted: a request, a decided group.
    assert api.get("/v1/runs").status_code == 200
    group = group_create(project_id=project.id, mailbox_name="jobs", condition="ALL_TERMINAL")
    group_close(project_id=project.id, group_id=group.id)
    samples = scrape(anon)
    names = {name for name, _ in samples}
    for name in NAMED:
        present = {n for n in names if n == name or n.startswith(name + "_") or n == name.removesuffix("_total")}
        assert present, name


def test_state_gauges_and_counters_move_when_work_is_done(anon, project):
    mailbox, _ = mailbox_ensure(project_id=project.id, name="jobs", mode="WORK")
    run = run_create(project_id=project.id)
    before = scrape(anon)

    for n in range(3):
        task_submit(project_id=project.id, mailbox=mailbox, run_id=run.id, input={"n": n})
    queued = scrape(anon)
    assert value(queued, "runstate_tasks", state="QUEUED") == value(before, "runstate_tasks", state="QUEUED") + 3
    assert value(queued, "runstate_mailbox_queue_depth", project="acme", mailbox="jobs") == 3

    (claim,) = task_claim(project_id=project.id, mailbox=mailbox, run_id=run.id, worker_id="w1")
    claim_complete(project_id=project.id, claim_id=claim.claim_id, outcome={})
    worked = scrape(anon)
    assert value(worked, "runstate_tasks", state="SUCCEEDED") == value(before, "runstate_tasks", state="SUCCEEDED") + 1
    assert value(worked, "runstate_tasks_finished_total", state="SUCCEEDED") == (
        value(before, "runstate_tasks_finished_total", state="SUCCEEDED") + 1
    )
    assert (
        value(worked, "runstate_claim_latency_seconds_count")
        == value(before, "runstate_claim_latency_seconds_count") + 1
    )
    assert value(worked, "runstate_mailbox_queue_depth", project="acme", mailbox="jobs") == 2

    run_cancel(run_id=run.id, project_id=project.id)
    cancelled = scrape(anon)
    assert value(cancelled, "runstate_tasks_finished_total", state="CANCELLED") == (
        value(before, "runstate_tasks_finished_total", state="CANCELLED") + 2
    )
    assert value(cancelled, "runstate_runs", state="CANCELLED") == value(before, "runstate_runs", state="CANCELLED") + 1


def test_group_decisions_are_counted_by_outcome_and_reason(anon, project):
    mailbox_ensure(project_id=project.id, name="jobs", mode="WORK")
    before = scrape(anon)
    group = group_create(project_id=project.id, mailbox_name="jobs", condition="ALL_TERMINAL")
    group_close(project_id=project.id, group_id=group.id)
    after = scrape(anon)
    labels = {"outcome": "FAILURE", "reason": "all_terminal"}
    assert value(after, "runstate_group_decisions_total", **labels) == (
        value(before, "runstate_group_decisions_total", **labels) + 1
    )


def test_lease_expiries_timer_lateness_and_sweep_lag(anon, project):
    mailbox, _ = mailbox_ensure(project_id=project.id, name="jobs", mode="WORK", lease_ttl_ms=100)
    run = run_create(project_id=project.id)
    task_submit(project_id=project.id, mailbox=mailbox, run_id=run.id, input={})
    task_claim(project_id=project.id, mailbox=mailbox, run_id=run.id, worker_id="w1", lease_ttl_ms=100)
    timer_create(project_id=project.id, run_id=run.id, at=timezone.now() + dt.timedelta(milliseconds=50))
    before = scrape(anon)

    import time

    time.sleep(0.3)  # the lease and the timer are now due, and no sweep has run
    due = scrape(anon)
    assert value(due, "runstate_sweep_lag_seconds", sweep="leases") > 0
    assert value(due, "runstate_sweep_lag_seconds", sweep="timers") > 0

    assert tasks_settle_expired_leases() == 1
    assert timers_fire_due() == 1
    swept = scrape(anon)
    assert value(swept, "runstate_sweep_lag_seconds", sweep="leases") == 0
    assert value(swept, "runstate_sweep_lag_seconds", sweep="timers") == 0
    assert total(swept, "runstate_lease_expiries_total") == total(before, "runstate_lease_expiries_total") + 1
    assert value(swept, "runstate_timer_lateness_seconds_count") == (
        value(before, "runstate_timer_lateness_seconds_count") + 1
    )
    assert value(swept, "runstate_timer_lateness_seconds_sum") > value(before, "runstate_timer_lateness_seconds_sum")


def test_requests_are_counted_by_route_and_status(api, anon):
    before = scrape(anon)
    for _ in range(2):
        assert api.get("/v1/runs").status_code == 200
    assert api.get("/v1/runs/not-a-run").status_code == 404
    after = scrape(anon)
    ok = {"method": "GET", "route": "v1/runs", "status": "200"}
    missing = {"method": "GET", "route": "v1/runs/<str:run_id>", "status": "404"}
    assert value(after, "runstate_http_requests_total", **ok) == value(before, "runstate_http_requests_total", **ok) + 2
    assert value(after, "runstate_http_requests_total", **missing) == (
        value(before, "runstate_http_requests_total", **missing) + 1
    )
    count = {"method": "GET", "route": "v1/runs"}
    assert value(after, "runstate_http_request_duration_seconds_count", **count) == (
        value(before, "runstate_http_request_duration_seconds_count", **count) + 2
    )


def test_the_schema_documents_metrics_as_plain_text(anon):
    schema = anon.get("/v1/schema", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    operation = schema["paths"]["/v1/metrics"]["get"]
    assert "text/plain" in operation["responses"]["200"]["content"]


def test_a_wrong_method_is_405_with_the_json_envelope(api):
    """The text renderer once answered a 405 with the bare word ``error`` (found by the method sweep)."""
    response = api.delete("/v1/metrics")
    assert response.status_code == 405
    assert response["Content-Type"] == "application/json"
    assert response.json()["error"]["code"] == "METHOD_NOT_ALLOWED"
