"""What ``--json`` writes: one key per part of the run, for the W = 4 figures.

``json_figures`` builds them; tests/operator/test_bench_json_keys.py holds every key to its name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.harness.pgbench import PgbenchResult
from bench.throughput.request_costs import RequestCosts
from bench.throughput.scenario import ScenarioResult
from bench.throughput.sdk_drain import SdkDrain

JSON_WORKERS = 4  # --json writes the figures of this worker count


@dataclass
class RunFigures:
    """Everything one run measured, for the report and for ``--json``."""

    results: list[ScenarioResult]
    baselines: dict[int, float]
    peer: Any  # bench.pgqueuer_peer.DrainResult, or None when the peer did not run
    service_sql: dict[str, list[str]]
    batch: int
    costs: RequestCosts | None = None
    sdk_drain: SdkDrain | None = None
    pgbench: PgbenchResult | None = None  # the W = 4 run, for the CPU ratios
    pgbench_pgbouncer: PgbenchResult | None = None  # the W = 4 run through PgBouncer (--pgbouncer)


def server_cpu_ratios(costs: RequestCosts | None, pgbench: PgbenchResult | None) -> dict[str, float] | None:
    """Return server CPU per unbatched request of each kind ÷ CPU per ``pgbench -N`` transaction, same run."""
    per_txn = pgbench.cpu_ms_per_txn if pgbench else None
    if costs is None or not per_txn:
        return None
    return {op: costs.uvicorn_ms[op] / per_txn for op in ("submit", "claim", "complete") if op in costs.uvicorn_ms}


def json_figures(run: RunFigures) -> dict[str, Any]:
    """Return the figures ``--json`` writes: W = 4, one key per part (None for a part that did not run).

    Rates are per second; ``server_cpu_ms`` is the uvicorn processes' CPU per unbatched
    request of each kind (``measure_request_costs``), ``pgbench_cpu_ms_per_txn`` the CPU of one
    ``pgbench -N`` transaction (pgbench's and its backends') and ``server_cpu_ratio`` the first
    over the second, per kind (issue 27's target: <= 3); ``http_*_pgbouncer`` are the HTTP
    pipelines through PgBouncer (``--pgbouncer``) and ``pgbouncer_ratio`` their pipeline rate
    over the direct one's, per mode (issue 30's target: >= 0.8), ``pgbench_tps_pgbouncer``
    ``pgbench -N`` through the same PgBouncer; ``statements`` are the SQL statements
    (BEGIN and COMMIT included) of one unbatched submit, one claim of ``--batch`` and one
    complete. A new part adds its key here.
    """

    def rates(mode: str) -> dict[str, float] | None:
        found = [r for r in run.results if r.mode == mode and r.workers == JSON_WORKERS]
        if not found:
            return None
        r = found[0]
        return {
            "submit_per_s": round(r.submit_rate, 1),
            "drain_per_s": round(r.claim_complete_rate, 1),
            "pipeline_per_s": round(r.pipeline_rate, 1),
        }

    def statements(op: str) -> int | None:
        return len(run.service_sql[op]) if op in run.service_sql else None

    tps = run.baselines.get(JSON_WORKERS)
    costs = run.costs
    per_txn = run.pgbench.cpu_ms_per_txn if run.pgbench else None
    ratios = server_cpu_ratios(costs, run.pgbench)
    return {
        "service_unbatched": rates("service unbatched"),
        "service_batched": rates("service batched"),
        "http_unbatched": rates("http unbatched"),
        "http_batched": rates("http batched"),
        "http_unbatched_tracing": rates("http unbatched tracing"),
        "http_unbatched_pgbouncer": rates("http unbatched pgbouncer"),
        "http_batched_pgbouncer": rates("http batched pgbouncer"),
        "pgbouncer_ratio": {
            "http_" + mode.removeprefix("http ").removesuffix(" pgbouncer"): round(ratio["pipeline"], 2)
            for (mode, workers), ratio in pgbouncer_ratios(run.results).items()
            if workers == JSON_WORKERS
        }
        or None,
        "sdk_consume_drain_per_s": round(run.sdk_drain.drain_rate, 1) if run.sdk_drain else None,
        "server_cpu_ms": {op: round(ms, 3) for op, ms in costs.uvicorn_ms.items()} if costs else None,
        "pgbench_tps": round(tps, 1) if tps else None,
        "pgbench_tps_pgbouncer": round(run.pgbench_pgbouncer.tps, 1) if run.pgbench_pgbouncer else None,
        "pgqueuer_drain_per_s": round(run.peer.rate, 1) if run.peer else None,
        "pgbench_cpu_ms_per_txn": round(per_txn, 3) if per_txn else None,
        "server_cpu_ratio": {op: round(ratio, 2) for op, ratio in ratios.items()} if ratios else None,
        "statements": {
            "submit": statements("submit"),
            "claim": statements(f"claim (max {run.batch})"),
            "complete": statements("complete"),
        },
    }


def pgbouncer_ratios(results: list[ScenarioResult]) -> dict[tuple[str, int], dict[str, float]]:
    """Return, per HTTP mode run through PgBouncer, its rates ÷ the direct run's (same W, same run)."""
    direct = {(r.mode, r.workers): r for r in results}
    ratios = {}
    for r in results:
        plain = direct.get((r.mode.removesuffix(" pgbouncer"), r.workers))
        if not r.mode.endswith(" pgbouncer") or plain is None:
            continue
        ratios[(r.mode, r.workers)] = {
            "submit": r.submit_rate / plain.submit_rate,
            "drain": r.claim_complete_rate / plain.claim_complete_rate,
            "pipeline": r.pipeline_rate / plain.pipeline_rate,
        }
    return ratios
