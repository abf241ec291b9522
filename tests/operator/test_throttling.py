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


@pytest.mark.postgres_only  # the suite's Redis broker (the SQLite run has none)
def test_a_burst_on_one_event_loop_is_counted_in_redis_every_hit_once(settings, monkeypatch, caplog):
    """The hot path's burst (a thousand waits arriving together) queues for Redis; it never falls back.

    redis-py's asyncio pool refuses a command past its 100 connections ("Too many
    connections"); a failure turns the shared limit into a per-process one for
    ``REDIS_BACKOFF_S``, so a burst must wait for a connection instead.
    """
    import asyncio
    import uuid

    assert settings.CELERY_BROKER_URL.startswith("redis://")
    # What is checked is the pool's limit, not Redis's speed: on a loaded machine a cold pool's
    # connections may take longer than the 0.25 s a request allows them (a fallback by design).
    monkeypatch.setattr(throttling, "REDIS_TIMEOUT_S", 10.0)
    monkeypatch.setattr(throttling, "REDIS_CONNECT_TIMEOUT_S", 10.0)
    monkeypatch.setattr(throttling, "REDIS_POOL_WAIT_S", 30.0)
    monkeypatch.setattr(throttling.limiter, "_redis_down_until", 0.0)
    monkeypatch.setattr(throttling.limiter, "_async", {})
    rate, key, burst = Rate(count=10_000, period_s=3600), f"burst-{uuid.uuid4().hex}", 600

    async def hits():
        return await asyncio.gather(*(throttling.limiter.ahit(key, rate) for _ in range(burst)))

    with caplog.at_level("WARNING", logger=throttling.logger.name):
        counts = sorted(count for count, _ in asyncio.run(hits()))
    assert not [record for record in caplog.records if "Redis unavailable" in record.getMessage()]
    assert throttling.limiter._redis_down_until == 0.0
    assert counts == list(range(1, burst + 1))  # every hit counted once, in Redis's one window
    assert throttling.limiter.local._windows.get(key) is None


@pytest.mark.postgres_only  # the suite's Redis broker (the SQLite run has none)
def test_a_burst_of_request_threads_is_counted_in_redis_every_hit_once(settings, monkeypatch, caplog):
    """The same for the views' threads: 300 requests counting at once wait for a connection, none falls back."""
    import threading
    import uuid

    assert settings.CELERY_BROKER_URL.startswith("redis://")
    monkeypatch.setattr(throttling, "REDIS_TIMEOUT_S", 10.0)  # the pool's limit, not Redis's speed (above)
    monkeypatch.setattr(throttling, "REDIS_POOL_WAIT_S", 30.0)
    monkeypatch.setattr(throttling.limiter, "_redis_down_until", 0.0)
    monkeypatch.setattr(throttling.limiter, "_redis", None)
    rate, key, burst = Rate(count=10_000, period_s=3600), f"burst-{uuid.uuid4().hex}", 300
    start, counts = threading.Barrier(burst), []

    def hit():
        start.wait()
        counts.append(throttling.limiter.hit(key, rate)[0])

    with caplog.at_level("WARNING", logger=throttling.logger.name):
        threads = [threading.Thread(target=hit) for _ in range(burst)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert not [record for record in caplog.records if "Redis unavailable" in record.getMessage()]
    assert sorted(counts) == list(range(1, burst + 1))
