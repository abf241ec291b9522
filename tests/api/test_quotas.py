"""Quotas over HTTP: DESIGN.md "Shared limits" (quotas)."""

import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection

from coordination.models import Event, Quota
from coordination.models.limits import MICRO
from coordination.services import quotas as quota_services
from tests.conftest import err, make_client

# Waiting takes read through other connections: the data must be committed.
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def run(api):
    return api.post("/v1/runs", {}, format="json").json()


def ms_since(started: float) -> int:
    """Whole milliseconds since ``started`` (``time.monotonic()``), rounded up: the most a bucket refilled meanwhile."""
    return int((time.monotonic() - started) * 1000) + 1


def put(api, name="openai", limit=10, period_ms=60_000):
    return api.put(f"/v1/quotas/{name}", {"limit": limit, "periodMs": period_ms}, format="json")


def take(api, run, name="openai", **body):
    return api.post(f"/v1/quotas/{name}/take", {"runId": run["id"], **body}, format="json")


def test_put_creates_a_full_bucket_then_changes_it(api):
    created = put(api, limit=10)
    assert created.status_code == 201 and created["Location"] == "/v1/quotas/openai"
    assert created.json() == {"name": "openai", "limit": 10, "periodMs": 60_000, "available": 10}
    changed = put(api, limit=20, period_ms=1000)
    assert changed.status_code == 200
    assert (changed.json()["limit"], changed.json()["periodMs"]) == (20, 1000)
    assert api.get("/v1/quotas/openai").json()["limit"] == 20


def test_takes_spend_the_bucket_then_refuse_with_retry_after(api, run):
    put(api, limit=3, period_ms=3_600_000)  # one token every 1,200,000 ms
    started = time.monotonic()
    assert take(api, run).json() == {"granted": True, "remaining": 2}
    assert take(api, run, amount=2).json() == {"granted": True, "remaining": 0}
    error = err(take(api, run), 409, "QUOTA_EXHAUSTED")
    # One token comes back after a third of the period, less the time since the first take.
    assert 1_200_000 - ms_since(started) <= error["details"]["retryAfterMs"] <= 1_200_000
    quota = Quota.objects.get(name="openai")
    events = Event.objects.filter(type="quota.exhausted")
    assert [(e.subject_id, e.run_id.hex, e.data["amount"]) for e in events] == [
        (str(quota.id), run["id"].replace("-", ""), 1)
    ]


def test_retry_after_is_when_the_amount_is_there(api, run):
    put(api, limit=10, period_ms=10_000)  # one token per second
    started = time.monotonic()
    take(api, run, amount=10)
    retry_ms = err(take(api, run, amount=4), 409, "QUOTA_EXHAUSTED")["details"]["retryAfterMs"]
    # Four seconds, less what refilled between the two takes (however slow the machine).
    assert 4_000 - ms_since(started) <= retry_ms <= 4_000
    quota = Quota.objects.get(name="openai")
    # Exactly: from the stored level, the wait the bucket's arithmetic gives, within a tick.
    level = quota_services.refilled_micro(quota, quota.level_at)
    assert quota_services.retry_after_ms(quota, level, 4) == 4_000
    assert quota_services.retry_after_ms(quota, level + 1, 4) == 4_000  # rounded up
    assert quota_services.retry_after_ms(quota, 4 * MICRO, 4) == 0


def test_a_changed_limit_keeps_the_level_capped(api, run):
    put(api, limit=10, period_ms=3_600_000)
    take(api, run, amount=4)
    assert put(api, limit=100, period_ms=3_600_000).json()["available"] == 6
    assert put(api, limit=5, period_ms=3_600_000).json()["available"] == 5


def test_validation(api, run):
    put(api, limit=5)
    err(take(api, run, amount=6), 400, "VALIDATION_ERROR")
    err(take(api, run, amount=0), 400, "VALIDATION_ERROR")
    err(take(api, run, waitMs=-1), 400, "VALIDATION_ERROR")
    err(put(api, limit=0), 400, "VALIDATION_ERROR")
    err(put(api, period_ms=0), 400, "VALIDATION_ERROR")
    err(take(api, run, name="unknown"), 404, "NOT_FOUND")
    err(api.post("/v1/quotas/openai/take", {"runId": "nope"}, format="json"), 404, "NOT_FOUND")


def test_under_an_inactive_run_takes_are_refused_with_its_code(api, run):
    put(api)
    child = api.post(f"/v1/runs/{run['id']}/children", {}, format="json").json()
    api.post(f"/v1/runs/{run['id']}/complete", {}, format="json")
    err(take(api, child), 409, "SCOPE_COMPLETED")
    assert api.get("/v1/quotas/openai").json()["available"] == 10


def test_a_waiting_take_is_granted_when_the_tokens_come(api, run):
    put(api, limit=20, period_ms=1000)  # one token per 50 ms
    take(api, run, amount=20)
    response = take(api, run, amount=5, waitMs=5000)
    assert response.status_code == 200 and response.json()["granted"] is True


def test_a_take_whose_tokens_come_after_the_wait_is_refused_at_once(api, run):
    put(api, limit=1, period_ms=3_600_000)
    take(api, run)
    started = time.monotonic()
    err(take(api, run, waitMs=20_000), 409, "QUOTA_EXHAUSTED")
    # Not a duration assertion on the service: only that it did not sit out the wait.
    assert time.monotonic() - started < 20


def test_a_waiting_take_is_answered_with_the_runs_code_when_it_is_cancelled(api, run):
    put(api, limit=1, period_ms=40_000)  # the token is back in 40 s, past the 30 s cap
    take(api, run)
    put(api, limit=1, period_ms=20_000)  # now within the wait: the take waits

    other = make_client(Quota.objects.get(name="openai").project)

    def cancel():
        try:
            time.sleep(0.5)
            other.post(f"/v1/runs/{run['id']}/cancel", {}, format="json")
        finally:
            connection.close()

    thread = threading.Thread(target=cancel)
    thread.start()
    response = take(api, run, waitMs=25_000)
    thread.join()
    err(response, 409, "SCOPE_CANCELLED")


def test_quotas_are_per_project(api, other_api, run):
    put(api)
    err(other_api.get("/v1/quotas/openai"), 404, "NOT_FOUND")
    other_run = other_api.post("/v1/runs", {}, format="json").json()
    err(take(other_api, other_run), 404, "NOT_FOUND")
    err(take(other_api, run), 404, "NOT_FOUND")


def test_permissions(project, run):
    put(make_client(project))
    writer = make_client(project, permissions=["coordination_write"])
    reader = make_client(project, permissions=["coordination_read"])
    err(put(writer), 403, "PERMISSION_DENIED")
    err(take(reader, run), 403, "PERMISSION_DENIED")
    assert take(writer, run).status_code == 200
    assert reader.get("/v1/quotas/openai").status_code == 200


def test_a_waiting_take_is_answered_with_deadline_exceeded_when_the_runs_deadline_passes(api):
    deadline = (datetime.now(UTC) + timedelta(seconds=1.5)).isoformat()
    run = api.post("/v1/runs", {"deadline": deadline}, format="json").json()
    put(api, limit=1, period_ms=20_000)
    take(api, run)
    # The token is 20 s away, within the wait: the take waits, and re-checks the run meanwhile.
    err(take(api, run, waitMs=25_000), 409, "DEADLINE_EXCEEDED")
