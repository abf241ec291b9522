"""The throughput targets and the lines that say, in the same run, whether each is met."""

from __future__ import annotations

from typing import Any

from bench.harness.pgbench import PgbenchResult
from bench.throughput.figures import JSON_WORKERS, pgbouncer_ratios, server_cpu_ratios
from bench.throughput.request_costs import RequestCosts
from bench.throughput.scenario import ScenarioResult
from bench.throughput.sdk_drain import SdkDrain

# The targets (issue 14), each a same-run ratio: the unbatched pipeline against pgbench -N TPS;
# the batched submit against pgbench -N TPS and the batched drain against pgqueuer's drain.
UNBATCHED_PIPELINE_TARGET = 0.25


BATCHED_SUBMIT_TARGET = 1.0


BATCHED_DRAIN_TARGET = 1.0


# Issue 27 (it raised issue 15's 0.25 and replaced its milliseconds with a ratio), same run:
# the HTTP pipelines and the SDK consume drain against pgbench -N TPS; server (uvicorn) CPU per
# unbatched submit, claim and complete against the CPU of one pgbench -N transaction
# (pgbench's own and its backends').
HTTP_UNBATCHED_PIPELINE_TARGET = 0.2


HTTP_BATCHED_PIPELINE_TARGET = 0.6


SDK_DRAIN_TARGET = 0.35


REQUEST_CPU_RATIO_TARGET = 3.0


# Issue 29: the unbatched HTTP pipeline with tracing on (100% sampled, OTLP) keeps this much of it off.
TRACING_TARGET = 0.7


# Issue 30, same run: each HTTP pipeline through PgBouncer (transaction mode) against direct connections.
PGBOUNCER_TARGET = 0.8


def target_verdicts(results: list[ScenarioResult], baselines: dict[int, PgbenchResult], peer: Any = None) -> list[str]:
    """Return one line per service-layer row, with its ratios and whether each target is met.

    Unbatched: pipeline >= 0.25 x pgbench -N TPS. Batched: submit >= 1.0 x pgbench -N TPS and
    drain (claim + complete) >= 1.0 x pgqueuer's drain. Also compares CPU cost (ours per task
    vs pgbench's per transaction), which holds even when other processes share the machine.
    """

    def verdict(ratio: float, target: float) -> str:
        return f"{ratio:.2f}x (target >= {target}x: {'met' if ratio >= target else 'NOT met'})"

    lines = []
    for r in results:
        baseline = baselines.get(r.workers)
        if not r.mode.startswith("service") or (baseline is None and peer is None):
            continue
        batched = "unbatched" not in r.mode
        ours = r.submit_cpu.bench_s + r.submit_cpu.backend_s + r.claim_cpu.bench_s + r.claim_cpu.backend_s
        ours_ms = 1000 * ours / r.tasks
        parts = [f"W={r.workers}: {r.mode}"]
        if baseline is not None:
            tps = baseline.tps
            pipeline = r.pipeline_rate / tps
            submit = r.submit_rate / tps
            parts.append(
                f"pipeline {r.pipeline_rate:.0f} tasks/s vs pgbench -N {tps:.0f} TPS = "
                + (f"{pipeline:.2f}x" if batched else verdict(pipeline, UNBATCHED_PIPELINE_TARGET))
                + f"; submit {r.submit_rate:.0f}/s = "
                + (verdict(submit, BATCHED_SUBMIT_TARGET) if batched else f"{submit:.2f}x")
                + f"; claim+complete {r.claim_complete_rate / tps:.2f}x."
            )
        if peer is not None:
            drain = r.claim_complete_rate / peer.rate
            parts.append(
                f"Claim+complete {r.claim_complete_rate:.0f}/s vs pgqueuer's drain {peer.rate:.0f} jobs/s = "
                + (verdict(drain, BATCHED_DRAIN_TARGET) if batched else f"{drain:.2f}x")
                + "."
            )
        cost = f"CPU per task {ours_ms:.2f} ms (Python + postgres)"
        if baseline is not None and baseline.backend_ms_per_txn is not None:
            theirs = baseline.client_ms_per_txn + baseline.backend_ms_per_txn
            cost += f" vs {theirs:.2f} ms per pgbench transaction = {theirs / ours_ms:.2f}x cost ratio"
        parts.append(cost)
        lines.append(" ".join(parts))
    return lines


def http_verdicts(
    results: list[ScenarioResult],
    baselines: dict[int, float],
    costs: RequestCosts | None,
    sdk_drain: SdkDrain | None,
    pgbench: PgbenchResult | None = None,
) -> list[str]:
    """Return issue 27's verdicts: the HTTP pipelines and the SDK drain vs pgbench, server CPU per request.

    The server CPU per unbatched request is judged against the CPU of one transaction of the
    W = 4 ``pgbench`` run; issue 29's tracing ratio comes first.
    """

    def verdict(ratio: float, target: float) -> str:
        return f"{ratio:.2f}x (target >= {target}x: {'met' if ratio >= target else 'NOT met'})"

    lines = []
    untraced = {r.workers: r for r in results if r.mode == "http unbatched"}
    for r in results:
        plain = untraced.get(r.workers)
        if r.mode == "http unbatched tracing" and plain is not None:
            lines.append(
                f"W={r.workers}: HTTP unbatched pipeline with tracing on {r.pipeline_rate:.0f} tasks/s vs off "
                f"{plain.pipeline_rate:.0f} tasks/s = " + verdict(r.pipeline_rate / plain.pipeline_rate, TRACING_TARGET)
            )
    pipeline_targets = {"http unbatched": HTTP_UNBATCHED_PIPELINE_TARGET, "http batched": HTTP_BATCHED_PIPELINE_TARGET}
    for r in results:
        tps = baselines.get(r.workers)
        if r.mode not in pipeline_targets or tps is None:
            continue
        lines.append(
            f"W={r.workers}: HTTP {r.mode.split()[1]} pipeline {r.pipeline_rate:.0f} tasks/s vs pgbench -N "
            f"{tps:.0f} TPS = " + verdict(r.pipeline_rate / tps, pipeline_targets[r.mode])
        )
    tps = baselines.get(JSON_WORKERS) or (max(baselines.values()) if baselines else None)
    if sdk_drain and tps:
        lines.append(
            f"SDK consume drain {sdk_drain.drain_rate:.0f} tasks/s vs pgbench -N {tps:.0f} TPS = "
            + verdict(sdk_drain.drain_rate / tps, SDK_DRAIN_TARGET)
        )
    ratios = server_cpu_ratios(costs, pgbench)
    for op, ratio in (ratios or {}).items():
        lines.append(
            f"server CPU per unbatched {op}: {costs.uvicorn_ms[op]:.2f} ms vs pgbench -N "
            f"{pgbench.cpu_ms_per_txn:.2f} CPU ms/txn = {ratio:.2f}x "
            f"(target <= {REQUEST_CPU_RATIO_TARGET}x: {'met' if ratio <= REQUEST_CPU_RATIO_TARGET else 'NOT met'})"
        )
    return lines


def pgbouncer_verdicts(
    results: list[ScenarioResult], baselines: dict[int, float], pooled_pgbench: dict[int, PgbenchResult]
) -> list[str]:
    """Return issue 30's verdicts: each HTTP pipeline through PgBouncer against the direct one, and their CPU.

    Beside them, ``pgbench -N`` through the same PgBouncer against direct: what the hop costs
    transactions that are not runstate's, on the same machine.
    """
    direct = {(r.mode, r.workers): r for r in results}
    lines = [
        f"W={workers}: pgbench -N through PgBouncer {pooled.tps:.0f} TPS vs direct {baselines[workers]:.0f} TPS "
        f"= {pooled.tps / baselines[workers]:.2f}x"
        for workers, pooled in pooled_pgbench.items()
        if baselines.get(workers)
    ]
    for (mode, workers), ratio in pgbouncer_ratios(results).items():
        pooled, plain = direct[(mode, workers)], direct[(mode.removesuffix(" pgbouncer"), workers)]

        def cpu(r: ScenarioResult) -> str:
            ms = lambda seconds: 1000 * seconds / r.tasks  # noqa: E731
            postgres = (r.database or {}).get("backend_cpu_s")
            if postgres is None:
                postgres = r.submit_cpu.postgres_s + r.claim_cpu.postgres_s
            parts = [
                f"uvicorn {ms(r.submit_cpu.server_s + r.claim_cpu.server_s):.2f}",
                f"postgres {ms(postgres):.2f}",
            ]
            if r.submit_cpu.pooler_pid:
                parts.append(f"pgbouncer {ms(r.submit_cpu.pooler_s + r.claim_cpu.pooler_s):.2f}")
            return " + ".join(parts)

        met = "met" if ratio["pipeline"] >= PGBOUNCER_TARGET else "NOT met"
        name = plain.mode.removeprefix("http ")
        lines.append(
            f"W={workers}: HTTP {name} pipeline through PgBouncer {pooled.pipeline_rate:.0f} tasks/s "
            f"vs direct {plain.pipeline_rate:.0f} tasks/s = {ratio['pipeline']:.2f}x "
            f"(target >= {PGBOUNCER_TARGET}x: {met}); submit {ratio['submit']:.2f}x, claim+complete "
            f"{ratio['drain']:.2f}x; CPU ms/task through PgBouncer {cpu(pooled)} vs direct {cpu(plain)} "
            "(postgres: the benchmark database's backends, or the whole server's where they were not measured)"
        )
    return lines
