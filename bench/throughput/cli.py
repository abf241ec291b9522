"""``python -m bench.throughput``: the command line, and the order the measures run in."""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path

from bench import throughput
from bench.harness.env import RECORD_PATH, ROOT, cpu_model, server_facts, setup_django, truncate_coordination_tables
from bench.harness.meters import POSTMASTER, QUIET, find_postmaster
from bench.harness.pgbench import (
    PGBENCH_DATABASE,
    PgbenchResult,
    find_pgbench,
    notify_probe,
    pgbench_init,
    pgbench_run,
    pgbench_through,
)
from bench.harness.report import write_json
from bench.harness.servers import DiscardingOtlpReceiver, UvicornServer, tracing_env
from bench.pooler import BenchPgBouncer
from bench.throughput.figures import JSON_WORKERS, RunFigures, json_figures
from bench.throughput.http_pipeline import HTTP_MODES, run_http_scenario
from bench.throughput.peer import peer_lines, run_pgqueuer_peer
from bench.throughput.report import record_section, results_table
from bench.throughput.request_costs import RequestCosts, measure_request_costs
from bench.throughput.scenario import ScenarioResult, scenario_lines
from bench.throughput.sdk_drain import SdkDrain, run_sdk_drain
from bench.throughput.service import ALL_MODES, run_service_scenario, service_api, service_modes
from bench.throughput.statements import (
    count_http_statements,
    count_service_statements,
    statements_table,
    time_service_calls,
)
from bench.throughput.verdicts import http_verdicts, pgbouncer_verdicts, target_verdicts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(prog="python -m bench.throughput", description=throughput.__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", "--n", type=int, default=20_000, help="tasks per service-layer scenario (20000)")
    parser.add_argument("--http-tasks", type=int, default=5_000, help="tasks per HTTP scenario (5000)")
    parser.add_argument("--workers", default="4", help="comma-separated worker counts W (4; e.g. 4,8)")
    parser.add_argument(
        "--batch", type=int, default=10, help="unbatched mode (and HTTP): max claims per claim call B (10)"
    )
    parser.add_argument("--modes", default="unbatched,batched", help="service-layer modes to run (unbatched,batched)")
    parser.add_argument(
        "--batched-sizes",
        default="100,50,50",
        help="batched mode: tasks per tasks_submit_many, task_claim max, claims per claims_complete_many (100,50,50)",
    )
    parser.add_argument(
        "--service", action=argparse.BooleanOptionalAction, default=True, help="run the service-layer scenario"
    )
    parser.add_argument("--http", action=argparse.BooleanOptionalAction, default=True, help="run the HTTP scenario")
    parser.add_argument(
        "--tracing",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="also run the unbatched HTTP pipeline on a server with tracing on (100%% sampled, OTLP to a local sink)",
    )
    parser.add_argument(
        "--pgbouncer",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="also run each HTTP pipeline on a server behind a PgBouncer in transaction mode started here",
    )
    parser.add_argument(
        "--pgbouncer-pool-size", type=int, default=10, help="--pgbouncer: PgBouncer's server connections (10)"
    )
    parser.add_argument("--http-processes", type=int, default=2, help="uvicorn worker processes (2)")
    parser.add_argument("--http-modes", default="unbatched,batched", help="HTTP scenarios to run (unbatched,batched)")
    parser.add_argument(
        "--sdk", action=argparse.BooleanOptionalAction, default=True, help="run the SDK consume-loop scenario"
    )
    parser.add_argument("--sdk-concurrency", type=int, default=8, help="the SDK consume loop's concurrency (8)")
    parser.add_argument(
        "--cost-calls", type=int, default=1000, help="sequential requests per kind for the CPU costs (1000)"
    )
    parser.add_argument("--pgbench", action=argparse.BooleanOptionalAction, default=True, help="run the baseline")
    parser.add_argument("--pgbench-seconds", type=int, default=15, help="pgbench -T (15)")
    parser.add_argument("--pgbench-scale", type=int, default=10, help="pgbench -i -s (10)")
    parser.add_argument(
        "--pgqueuer",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the pgqueuer peer (from requirements-dev.txt)",
    )
    parser.add_argument("--pgqueuer-jobs", type=int, help="jobs the pgqueuer peer drains (default: --tasks)")
    parser.add_argument("--pgqueuer-dequeuers", type=int, default=5, help="pgqueuer QueueManagers (5)")
    parser.add_argument("--pgqueuer-batch", type=int, default=10, help="pgqueuer dequeue batch size (10)")
    parser.add_argument(
        "--json", type=Path, metavar="PATH", help=f"also write the W = {JSON_WORKERS} figures as JSON to PATH"
    )
    parser.add_argument(
        "--quiet-threshold",
        type=float,
        default=25.0,
        help="before each timed phase, wait until the machine is less busy than this (percent of all CPUs; 25)",
    )
    parser.add_argument(
        "--max-quiet-wait", type=float, default=300.0, help="wait at most this many seconds for quiet (300)"
    )
    parser.add_argument(
        "--notify-probe",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with pgbench: also time a one-row INSERT transaction with and without pg_notify()",
    )
    parser.add_argument("--fresh-db", action="store_true", help="drop and recreate the benchmark database first")
    parser.add_argument("--show-sql", action="store_true", help="print every counted SQL statement")
    parser.add_argument("--record", action="store_true", help=f"append the figures to {RECORD_PATH.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    args.worker_counts = [int(w) for w in args.workers.split(",") if w.strip()]
    if not args.worker_counts or min(args.worker_counts) < 1 or args.tasks < 1 or args.http_tasks < 1:
        parser.error("--workers, --tasks and --http-tasks must be positive")
    if not 1 <= args.batch <= 100:
        parser.error("--batch must be between 1 and 100")
    args.mode_names = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.mode_names or not set(args.mode_names) <= set(ALL_MODES):
        parser.error("--modes takes unbatched, batched or both")
    try:
        args.batched_sizes = tuple(int(x) for x in args.batched_sizes.split(","))
    except ValueError:
        args.batched_sizes = ()
    if len(args.batched_sizes) != 3 or min(args.batched_sizes) < 1:
        parser.error("--batched-sizes takes three positive numbers: SUBMIT,CLAIM,COMPLETE")
    args.http_mode_names = [m.strip() for m in args.http_modes.split(",") if m.strip()]
    if not set(args.http_mode_names) <= set(HTTP_MODES):
        parser.error("--http-modes takes unbatched, batched or both")
    if args.pgbouncer and (not args.http or args.pgbouncer_pool_size < 1):
        parser.error("--pgbouncer runs the HTTP pipelines (not with --no-http) with a positive --pgbouncer-pool-size")
    if args.sdk_concurrency < 1 or args.cost_calls < 1:
        parser.error("--sdk-concurrency and --cost-calls must be positive")
    args.pgqueuer_jobs = args.pgqueuer_jobs or args.tasks
    if min(args.pgqueuer_jobs, args.pgqueuer_dequeuers, args.pgqueuer_batch) < 1:
        parser.error("--pgqueuer-jobs, --pgqueuer-dequeuers and --pgqueuer-batch must be positive")
    if args.json and JSON_WORKERS not in args.worker_counts:
        parser.error(f"--json writes the W = {JSON_WORKERS} figures: include {JSON_WORKERS} in --workers")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run every scenario, print the report, optionally record it."""
    args = parse_args(argv)
    peer_version = None
    if args.pgqueuer:
        from bench.pgqueuer_peer import require_pgqueuer

        peer_version = require_pgqueuer()  # before any work: a missing peer is an error, never a skip
    QUIET.update(threshold_pct=args.quiet_threshold, max_wait_s=args.max_quiet_wait)
    setup_django(fresh=args.fresh_db)
    from django.conf import settings

    url = os.environ["DATABASE_URL"]
    facts = server_facts()
    POSTMASTER["pid"] = find_postmaster()
    print(
        f"runstate throughput: {os.cpu_count()} CPUs ({cpu_model()}), PostgreSQL {facts['server_version']} "
        f"(synchronous_commit={facts['synchronous_commit']}, fsync={facts['fsync']}), "
        f"database {settings.DATABASES['default']['NAME']}, DEBUG={settings.DEBUG}, "
        f"CONN_MAX_AGE={settings.DATABASES['default'].get('CONN_MAX_AGE')}"
    )
    if not truncate_coordination_tables():
        print("note: the database name has no 'bench' in it; tables are not truncated, scenarios use fresh projects")

    service_api()  # stops with a clear message when this checkout lacks the batched services
    modes = service_modes(args)
    every_mode = service_modes(args, ALL_MODES)  # statements and per-call costs: always both
    service_sql = count_service_statements(every_mode)
    costs, costs_note = time_service_calls(every_mode)
    http_sql = count_http_statements(args.batch) if args.http else None  # in-process: needs no server
    statements = statements_table(service_sql, http_sql, every_mode, costs, costs_note)
    print("\nSQL statements per operation\n" + statements)
    if args.show_sql:
        for op, sqls in service_sql.items():
            print(f"\n-- {op}")
            for sql in sqls:
                print(f"   {sql[:400]}")

    pgbench = find_pgbench() if args.pgbench else None
    if args.pgbench and not pgbench:
        print("warning: pgbench not found (PATH, /usr/lib/postgresql/*/bin); no baseline")
    if pgbench:
        print(f"\ninitialising {PGBENCH_DATABASE} (pgbench -i -s {args.pgbench_scale}) ...", flush=True)
        pgbench_init(pgbench, url, args.pgbench_scale)

    results: list[ScenarioResult] = []
    baselines: dict[int, float] = {}
    pgbench_results: dict[int, PgbenchResult] = {}
    pooled_pgbench: dict[int, PgbenchResult] = {}  # pgbench -N through PgBouncer (--pgbouncer)
    details: list[str] = []
    server = UvicornServer(args.http_processes) if args.http else None
    sink = DiscardingOtlpReceiver().__enter__() if args.http and args.tracing else None
    traced = UvicornServer(args.http_processes, tracing_env(sink.url), "bench-uvicorn-tracing") if sink else None
    bouncer = BenchPgBouncer(url, args.pgbouncer_pool_size) if args.http and args.pgbouncer else None
    pooled = UvicornServer(args.http_processes, name="bench-uvicorn-pgbouncer", pooler=bouncer) if bouncer else None
    pooling = contextlib.ExitStack()  # PgBouncer and the server behind it, stopped in that order's reverse
    costs: RequestCosts | None = None
    sdk_drain: SdkDrain | None = None
    if server:
        server.__enter__()
    if traced:
        traced.__enter__()

    def http_scenario(
        target: UvicornServer, workers: int, http_mode: str, sizes: tuple[int, int, int], what: str, suffix: str = ""
    ) -> None:
        """Run one HTTP scenario on ``target``, print and keep its lines (its mode ``http <mode> <suffix>``)."""
        print(f"W={workers}: {what} ...", flush=True)
        result = run_http_scenario(target, args.http_tasks, workers, http_mode, sizes)
        result.mode = " ".join(filter(None, (result.mode, suffix)))
        results.append(result)
        for line in scenario_lines(result):
            print("  " + line)
            details.append(f"{result.mode.replace('http', 'HTTP', 1)} W={workers}: {line}")

    try:
        if bouncer:
            pooling.enter_context(bouncer)
            pooling.enter_context(pooled)
            print(f"\n{bouncer.describe()}; the second API server's DATABASE_URL goes through it")
            details.append(bouncer.describe())
        if server:
            print(f"\nserver CPU per request: {args.cost_calls} of each kind, one at a time ...", flush=True)
            costs = measure_request_costs(server, args.cost_calls)
            print("  " + costs.summary())
            details.append(costs.summary())
        if pooled:
            print(f"server CPU per request through PgBouncer: {args.cost_calls} of each kind ...", flush=True)
            pooled_costs = measure_request_costs(pooled, args.cost_calls)
            print("  " + pooled_costs.summary())
            details.append(pooled_costs.summary())
        for workers in args.worker_counts:
            for mode in modes if args.service else []:
                print(f"\nW={workers}: service layer {mode.name}, {args.tasks} tasks, {mode.sizes} ...", flush=True)
                result = run_service_scenario(args.tasks, workers, mode)
                results.append(result)
                for line in scenario_lines(result):
                    print("  " + line)
                    details.append(f"service {mode.name} W={workers}: {line}")
            for http_mode in args.http_mode_names if server else []:
                sizes = args.batched_sizes if http_mode == "batched" else (1, args.batch, 1)
                http_scenario(server, workers, http_mode, sizes, f"HTTP {http_mode}, {args.http_tasks} tasks, {sizes}")
                if traced and http_mode == "unbatched":
                    http_scenario(traced, workers, http_mode, sizes, "HTTP unbatched, tracing on", "tracing")
                if pooled:
                    http_scenario(pooled, workers, http_mode, sizes, f"HTTP {http_mode} through PgBouncer")

            if pgbench:
                print(f"W={workers}: pgbench -N -c {workers} -j {workers} -T {args.pgbench_seconds} ...", flush=True)
                baseline = pgbench_run(pgbench, url, workers, args.pgbench_seconds)
                pgbench_results[workers] = baseline
                baselines[workers] = baseline.tps
                print("  " + baseline.summary())
                details.append(baseline.summary())
                if bouncer:  # the same transactions through the same PgBouncer: what the hop costs anything
                    print(f"W={workers}: pgbench -N -c {workers} through PgBouncer ...", flush=True)
                    pooled_pgbench[workers], line = pgbench_through(pgbench, bouncer, workers, args.pgbench_seconds)
                    line += f"; {pooled_pgbench[workers].tps / baseline.tps:.2f}x direct"
                    print("  " + line)
                    details.append(line)
                if args.notify_probe:
                    probe = notify_probe(pgbench, url, workers, 8)
                    line = (
                        f"NOTIFY probe -c {workers}: one-row INSERT transaction {probe['plain']:.0f} TPS, "
                        f"with pg_notify {probe['notify']:.0f} TPS ({probe['notify'] / probe['plain']:.2f}x)"
                    )
                    print("  " + line)
                    details.append(line)
        if server and args.sdk:
            print(f"\nSDK consume: {args.http_tasks} tasks, concurrency {args.sdk_concurrency} ...", flush=True)
            sdk_drain = run_sdk_drain(server, args.http_tasks, args.sdk_concurrency)
            print("  " + sdk_drain.summary())
            details.append(f"SDK consume: {sdk_drain.summary()}")
    finally:
        pooling.close()
        if server:
            server.__exit__()
        if traced:
            traced.__exit__()
        if sink:
            sink.__exit__()
            details.append(f"tracing: {sink.requests} OTLP exports, {sink.received_bytes / 1e6:.1f} MB, discarded")
    peer = None
    if args.pgqueuer:
        print(
            f"\npgqueuer {peer_version}: drain {args.pgqueuer_jobs} jobs, "
            f"{args.pgqueuer_dequeuers} dequeuers x batch {args.pgqueuer_batch} ...",
            flush=True,
        )
        peer = run_pgqueuer_peer(url, args.pgqueuer_jobs, args.pgqueuer_dequeuers, args.pgqueuer_batch)
        for line in peer_lines(peer, peer_version):
            print("  " + line)
            details.append(line)

    table = results_table(results, baselines, peer)
    verdicts = (
        target_verdicts(results, pgbench_results, peer)
        + http_verdicts(results, baselines, costs, sdk_drain, pgbench_results.get(JSON_WORKERS))
        + pgbouncer_verdicts(results, baselines, pooled_pgbench)
    )
    print("\n" + table + "\n")
    for verdict in verdicts:
        print(verdict)
    if args.record:
        section = record_section(args, facts, table, statements, details, verdicts)
        RECORD_PATH.parent.mkdir(parents=True, exist_ok=True)
        existing = RECORD_PATH.read_text() if RECORD_PATH.exists() else "# Benchmarks\n"
        RECORD_PATH.write_text(existing.rstrip("\n") + "\n\n" + section)
        print(f"\nrecorded in {RECORD_PATH.relative_to(ROOT)}")
    if args.json:
        figures = RunFigures(
            results,
            baselines,
            peer,
            service_sql,
            args.batch,
            costs,
            sdk_drain,
            pgbench_results.get(JSON_WORKERS),
            pooled_pgbench.get(JSON_WORKERS),
        )
        write_json(args.json, json_figures(figures))
        print(f"\nfigures written to {args.json}")
    verified = [r.verification["ok"] for r in results] + [x.verification["ok"] for x in (peer, sdk_drain) if x]
    return 0 if all(verified) else 1
