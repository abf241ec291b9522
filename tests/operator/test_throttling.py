"""Per-key rate limits: 429 RATE_LIMITED with Retry-After and the error envelope."""

import pytest
from django.test import override_settings

from coordination.api import throttling
from coordination.api.throttling import LocalWindows, Rate, parse_rate
from tests.conftest import make_client


@pytest.fixture(autouse=True)
def fresh_local_windows(monkeypatch):
    monkeypatch.setattr(throttling.limiter, "local", LocalWindows())


@pytest.mark.parametrize("broker", ["filesystem://", None])
def test_a_key_over_its_limit_gets_429_with_retry_after_and_the_envelope(project, settings, broker):
    """Counted in-process on the filesystem broker, in Redis when the suite's broker is Redis."""
    if broker is not None:
        settings.CELERY_BROKER_URL = broker
    client = make_client(project)
    with override_settings(RUNSTATE_RATE_LIMIT="3/hour"):
        statuses = [client.get("/v1/runs").status_code for _ in range(3)]
        refused = client.get("/v1/runs")
    assert statuses == [200, 200, 200]
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "RATE_LIMITED"
    assert set(refused.json()["error"]) == {"code", "message", "details"}
    retry_after = int(refused["Retry-After"])
    assert 1 <= retry_after <= 3600


def test_limits_are_per_key(project):
    first, second = make_client(project), make_client(project)
    with override_settings(RUNSTATE_RATE_LIMIT="2/hour"):
        assert [first.get("/v1/runs").status_code for _ in range(3)] == [200, 200, 429]
        assert second.get("/v1/runs").status_code == 200


def test_probes_schema_and_the_metrics_scrape_token_are_not_limited(project, anon):
    with override_settings(RUNSTATE_RATE_LIMIT="1/hour", RUNSTATE_METRICS_TOKEN="scrape-token-0123456789"):
        for _ in range(3):
            assert anon.get("/v1/healthz").status_code == 200
            assert anon.get("/v1/metrics", HTTP_AUTHORIZATION="Bearer scrape-token-0123456789").status_code == 200


def test_a_keys_metrics_scrape_counts_against_its_limit(project):
    client = make_client(project)
    with override_settings(RUNSTATE_RATE_LIMIT="2/hour"):
        assert [client.get("/v1/metrics").status_code for _ in range(3)] == [200, 200, 429]


def test_off_disables_limits(project):
    client = make_client(project)
    with override_settings(RUNSTATE_RATE_LIMIT="off"):
        assert {client.get("/v1/runs").status_code for _ in range(5)} == {200}


def test_a_window_ends_after_its_period():
    windows = LocalWindows()
    rate = Rate(count=1, period_s=1)
    assert windows.hit("k", rate)[0] == 1
    count, remaining = windows.hit("k", rate)
    assert count == 2 and 0 < remaining <= 1
    windows._windows["k"] = (0.0, 2)  # as if the window had ended
    assert windows.hit("k", rate)[0] == 1


def test_redis_failures_fall_back_to_counting_in_process(project, settings, monkeypatch):
    settings.CELERY_BROKER_URL = "redis://127.0.0.1:1/0"  # nothing listens there
    monkeypatch.setattr(throttling.limiter, "_redis", None)
    monkeypatch.setattr(throttling.limiter, "_redis_down_until", 0.0)
    client = make_client(project)
    with override_settings(RUNSTATE_RATE_LIMIT="1/hour"):
        assert [client.get("/v1/runs").status_code for _ in range(2)] == [200, 429]


@pytest.mark.parametrize(
    "text, rate",
    [("6000/min", Rate(6000, 60)), ("10/s", Rate(10, 1)), ("5/2h", Rate(5, 7200)), ("1/day", Rate(1, 86400))],
)
def test_rates_parse(text, rate):
    assert parse_rate(text) == rate


@pytest.mark.parametrize("text", ["off", "0", "", "0/min"])
def test_rates_that_disable(text):
    assert parse_rate(text) is None


def test_a_malformed_rate_is_reported():
    with pytest.raises(ValueError, match="RUNSTATE_RATE_LIMIT"):
        parse_rate("lots")
