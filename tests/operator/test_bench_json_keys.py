"""Every ``--json`` key the benchmarks wrote before issue 40 split them keeps its name (issue 40).

Bars and docs/benchmarks.md read these keys; a rename or a lost key breaks them silently. Each
benchmark builds its figures in one function (``json_figures``), called here with made-up
measurements, so the test checks the keys the function writes, not a list beside it; and
bench/README.md, where a reader looks them up, names every one.
"""

import re
from pathlib import Path

import pytest

from bench import cancel_push, groups, limits, mcp, retention, stream, timers
from bench.celery import figures as celery_figures
from bench.harness.meters import CpuMeter
from bench.harness.pgbench import PgbenchResult
from bench.pgqueuer_peer import DrainResult
from bench.throughput.figures import RunFigures, json_figures
from bench.throughput.request_costs import RequestCosts
from bench.throughput.scenario import ScenarioResult
from bench.throughput.sdk_drain import SdkDrain

pytestmark = pytest.mark.single_backend

ROOT = Path(__file__).resolve().parents[2]
RATES = {"submit_per_s", "drain_per_s", "pipeline_per_s"}
PER_REQUEST = {"submit", "claim", "complete"}

# The keys as they were at 154bad6, before the split.
THROUGHPUT = {
    "service_unbatched": RATES,
    "service_batched": RATES,
    "http_unbatched": RATES,
    "http_batched": RATES,
    "http_unbatched_tracing": RATES,
    "http_unbatched_pgbouncer": RATES,
    "http_batched_pgbouncer": RATES,
    "pgbouncer_ratio": {"http_unbatched", "http_batched"},
    "sdk_consume_drain_per_s": None,
    "server_cpu_ms": PER_REQUEST,
    "pgbench_tps": None,
    "pgbench_tps_pgbouncer": None,
    "pgqueuer_drain_per_s": None,
    "pgbench_cpu_ms_per_txn": None,
    "server_cpu_ratio": PER_REQUEST,
    "statements": PER_REQUEST,
}
CELERY = {
    "plain_drain_per_s",
    "runstate_drain_per_s",
    "ratio_drain",
    "plain_pipeline_per_s",
    "runstate_pipeline_per_s",
    "ratio_pipeline",
    "runstate_submit_only_per_s",
    "plain_worker_cpu_ms_per_task",
    "plain_postgres_cpu_ms_per_task",
    "runstate_worker_cpu_ms_per_task",
    "runstate_postgres_cpu_ms_per_task",
}
WAIT_FIGURES = ("p99_ms", "park_cpu_ms_per_wait", "server_cpu_ms_per_answer")
GROUPS = {
    "verdict_p99_ms_service",
    "finalized_service",
    "verdict_p99_ms_http",
    "finalized_http",
    "finalized_count",
    *(f"{what}_wait_{figure}" for what in ("group", "barrier") for figure in WAIT_FIGURES),
}
TIMERS = {
    "timer_lateness_p99_ms_runs",
    "timer_lateness_p99_ms_max",
    "timer_lateness_p50_ms_runs",
    "timer_lateness_max_ms_runs",
    "timers_fired_runs",
}
MCP = {"mcp_call_overhead_p50_ms", "mcp_tasks_per_s", "sdk_tasks_per_s", "mcp_pair_p50_ms", "sdk_pair_p50_ms"}
RETENTION = {
    "retention_drop_s",
    "retention_delete_s",
    "retention_vacuum_s",
    "events_per_day",
    "partition_mb",
    "bytes_per_event",
}
STREAM = {"sse_delivery_p99_ms", "sse_gaps", "sse_duplicates"}
CANCEL_PUSH = {
    "push_cancel_p99_ms",
    "push_cancel_missed",
    "handlers",
    "renewal_only_p99_ms",
    "single_cancel_p99_ms",
    "run_cancel_p99_ms",
    "from_request_p99_ms",
    "rounds",
}
LIMITS = {
    "pool_pairs_per_s",
    "quota_takes_per_s",
    "pgbench_tps_pool",
    "pgbench_tps_quota",
    "pool_ratio",
    "quota_ratio",
    "pool_max_in_use",
    "pool_capacity",
}


def scenario(mode: str, seconds: float = 2.0) -> ScenarioResult:
    """A scenario of 1,000 tasks, as ``run_threads`` answers its submit and its drain (two threads)."""
    drained = [([0.001] * 50, [0.001] * 500, 500, 1)] * 2  # claim and complete latencies, done, empty claims
    return ScenarioResult.from_phases(
        mode, 4, 1000, 10, (seconds, [0, 0], CpuMeter()), (seconds, drained, CpuMeter()), {"ok": True}, None
    )


def test_a_scenario_adds_up_what_its_threads_answered():
    result = scenario("service unbatched")

    assert (result.claim_calls, result.empty_claim_calls) == (102, 2)  # 50 claims and an empty one each
    assert (len(result.claim_latencies), len(result.complete_latencies)) == (100, 1000)
    assert (result.submit_rate, result.claim_complete_rate, result.pipeline_rate) == (500.0, 500.0, 250.0)


def a_whole_throughput_run() -> RunFigures:
    """Every part of ``bench.throughput`` ran (``--tracing --pgbouncer``, the SDK, pgbench and the peer)."""
    modes = ["service unbatched", "service batched", "http unbatched", "http batched", "http unbatched tracing"]
    modes += ["http unbatched pgbouncer", "http batched pgbouncer"]
    pgbench = PgbenchResult(4, 4000.0, "quiet", 80.0, 0.1, 0.3)
    per_request = {"submit": 1.2, "claim": 1.5, "complete": 1.3}
    return RunFigures(
        results=[scenario(mode) for mode in modes],
        baselines={4: 4000.0},
        peer=DrainResult(jobs=1000, dequeuers=5, batch=10, seconds=0.5, verification={"ok": True}),
        service_sql={"submit": ["BEGIN", "INSERT", "COMMIT"], "claim (max 10)": ["SELECT"], "complete": ["UPDATE"]},
        batch=10,
        costs=RequestCosts(calls=100, uvicorn_ms=per_request, postgres_ms=per_request),
        sdk_drain=SdkDrain(tasks=1000, concurrency=8, drain_rate=900.0, cpu=CpuMeter(), verification={"ok": True}),
        pgbench=pgbench,
        pgbench_pgbouncer=pgbench,
    )


def test_throughput_writes_every_key_it_wrote_before_the_split():
    figures = json_figures(a_whole_throughput_run())

    assert set(figures) == set(THROUGHPUT)
    for key, inner in THROUGHPUT.items():
        assert figures[key] is not None, key
        if inner is not None:
            assert set(figures[key]) == inner, key
    assert figures["statements"] == {"submit": 3, "claim": 1, "complete": 1}
    assert figures["http_unbatched"]["pipeline_per_s"] == 250.0  # 1,000 tasks over 2 s + 2 s
    assert figures["server_cpu_ratio"]["claim"] == round(1.5 / 0.4, 2)  # per pgbench transaction's 0.1 + 0.3 ms


def test_throughput_writes_null_for_a_part_that_did_not_run():
    run = a_whole_throughput_run()
    run.results = [r for r in run.results if r.mode.startswith("service")]
    run.sdk_drain = run.peer = run.costs = None

    figures = json_figures(run)

    assert set(figures) == set(THROUGHPUT)
    assert figures["http_unbatched"] is None
    assert figures["pgbouncer_ratio"] is None
    assert figures["sdk_consume_drain_per_s"] is None
    assert figures["server_cpu_ratio"] is None


def other_benchmarks_figures() -> dict[str, tuple[dict, set[str]]]:
    """Each other benchmark's ``json_figures`` on made-up measurements, beside the keys it wrote before."""
    runs = [{"p50_ms": 10.0, "p99_ms": 40.0, "max_ms": 60.0, "fired": 100}] * 2
    verdicts = {"verdict_p99_ms_service": 20.0, "finalized_service": 1}
    verdicts |= {"verdict_p99_ms_http": 40.0, "finalized_http": 1}
    waits = {"group": (50.0, 0.2, 0.1), "barrier": (60.0, 0.2, 0.1)}
    celery_results = [(2, 900.0, 400.0, 1200.0, 1000.0, 500.0)]
    ledger = {"max_in_use": 8, "capacity": 8}
    return {
        "bench/celery": (celery_figures.json_figures(celery_results, {2: [0.5, 0.1, 1.5, 0.9]}, True), CELERY),
        "bench/groups.py": (groups.json_figures(verdicts, waits), GROUPS),
        "bench/timers.py": (timers.json_figures(runs), TIMERS),
        "bench/mcp.py": (mcp.json_figures(1000, 4.0, 2.0, 3.0, 2.0), MCP),
        "bench/retention.py": (retention.json_figures(0.01, 5.0, 2.0, 1_000_000, 200.0), RETENTION),
        "bench/stream.py": (stream.json_figures(120.0, 0, 0), STREAM),
        "bench/limits.py": (limits.json_figures(900.0, 1500.0, 3000.0, 3000.0, ledger), LIMITS),
        "bench/cancel_push.py": (cancel_push.json_figures(pushed_rounds(), 4), CANCEL_PUSH),
    }


def pushed_rounds() -> list:
    """Two Python rounds with the watch (one missed handler in the second), a restart round, a renewal round."""
    return [
        cancel_push.Round("python", "push", single=[10.0], run=[20.0, 30.0, 40.0], missed=0),
        cancel_push.Round("python", "push", single=[12.0], run=[22.0, 32.0], missed=1),
        cancel_push.Round("python", "restart", single=[900.0], run=[950.0], missed=0),
        cancel_push.Round("python", "renewal", single=[9000.0], run=[9500.0], missed=2),
    ]


def test_cancel_push_counts_only_the_rounds_with_the_watch_and_nulls_a_language_not_measured():
    figures = cancel_push.json_figures(pushed_rounds(), 4)

    assert figures["push_cancel_p99_ms"] == {"python": 40.0, "typescript": None, "celery": None}
    assert figures["push_cancel_missed"] == 1  # the renewal round's handlers are not push misses
    assert figures["renewal_only_p99_ms"]["python"] == 9500.0
    assert (figures["single_cancel_p99_ms"]["python"], figures["run_cancel_p99_ms"]["python"]) == (12.0, 40.0)
    assert (figures["handlers"], figures["rounds"]) == (4, 4)


@pytest.mark.parametrize("benchmark", sorted(other_benchmarks_figures()))
def test_every_other_benchmark_writes_the_keys_it_wrote_before(benchmark):
    figures, keys = other_benchmarks_figures()[benchmark]
    if benchmark == "bench/celery":
        assert set(figures) == keys | {"processes", "exactly_once"}
        assert set(figures["processes"]["2"]) == keys
    else:
        assert set(figures) == keys


def test_groups_counts_the_finalize_furthest_from_one():
    verdicts = {"verdict_p99_ms_service": 20.0, "finalized_service": 1}
    verdicts |= {"verdict_p99_ms_http": 40.0, "finalized_http": 2}
    assert groups.json_figures(verdicts, {})["finalized_count"] == 2
    assert "finalized_count" not in groups.json_figures({}, {"group": (50.0, 0.2, 0.1)})


def test_bench_readme_names_every_key():
    readme = (ROOT / "bench" / "README.md").read_text()
    named = set(re.findall(r"`([a-z0-9_]+)`", readme))
    every = {*THROUGHPUT, *CELERY, *GROUPS, *TIMERS, *MCP, *RETENTION, *STREAM, *LIMITS}
    assert sorted(every - named) == []
