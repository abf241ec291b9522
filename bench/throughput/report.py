"""The throughput report: the main table and the dated section ``--record`` appends to docs/benchmarks.md."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import sys
from typing import Any

from bench.harness.env import cpu_model, django_version, git_revision
from bench.harness.report import markdown_table
from bench.throughput.scenario import ScenarioResult
from bench.throughput.service import service_modes


def results_table(results: list[ScenarioResult], baselines: dict[int, float], peer: Any = None) -> str:
    """Return the main table: one row per (mode, W), then the pgqueuer peer's drain when it ran."""
    header = [
        "mode",
        "W",
        "tasks",
        "submit/s",
        "claim+complete/s",
        "pipeline/s",
        "claim p50 ms",
        "claim p99 ms",
        "complete p50 ms",
        "pgbench -N TPS",
        "pipeline/pgbench",
        "claim+complete/pgbench",
        "claim+complete/pgqueuer",
        "verified",
    ]
    rows = []
    for r in results:
        tps = baselines.get(r.workers)
        rows.append(
            [
                r.mode,
                str(r.workers),
                str(r.tasks),
                f"{r.submit_rate:.0f}",
                f"{r.claim_complete_rate:.0f}",
                f"{r.pipeline_rate:.0f}",
                f"{r.claim_ms(0.50):.2f}",
                f"{r.claim_ms(0.99):.2f}",
                f"{r.complete_ms(0.50):.2f}",
                f"{tps:.0f}" if tps else "-",
                f"{r.pipeline_rate / tps:.2f}" if tps else "-",
                f"{r.claim_complete_rate / tps:.2f}" if tps else "-",
                f"{r.claim_complete_rate / peer.rate:.2f}" if peer else "-",
                "yes" if r.verification["ok"] else "NO",
            ]
        )
    if peer:
        label = f"pgqueuer drain ({peer.dequeuers} x batch {peer.batch})"
        rows.append(
            [label, str(peer.dequeuers), str(peer.jobs), "-", f"{peer.rate:.0f}", *["-"] * 7, "1.00"]
            + ["yes" if peer.verification["ok"] else "NO"]
        )
    return markdown_table(header, rows)


def record_section(
    args: argparse.Namespace,
    facts: dict[str, str],
    table: str,
    statements: str,
    details: list[str],
    verdicts: list[str],
) -> str:
    """Return the dated Markdown section ``--record`` appends to docs/benchmarks.md."""
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    service_n = args.tasks if args.service else "-"
    http_n = args.http_tasks if args.http else "-"
    baseline = f"pgbench -s {args.pgbench_scale} -T {args.pgbench_seconds}" if args.pgbench else "no pgbench"
    machine = (
        f"- Machine: {os.cpu_count()} CPUs (nproc), {cpu_model()}, {platform.system()} {platform.release()}\n"
        f"- PostgreSQL {facts['server_version']} on the same machine "
        f"(synchronous_commit={facts['synchronous_commit']}, "
        f"fsync={facts['fsync']}, shared_buffers={facts['shared_buffers']})\n"
        f"- Python {platform.python_version()}, Django {django_version()}\n"
        f"- Command: `python -m bench.throughput {' '.join(sys.argv[1:])}`\n"
        f"- Settings: service N={service_n} ({'; '.join(f'{m.name}: {m.sizes}' for m in service_modes(args))}), "
        f"HTTP N={http_n}, batch B={args.batch}, W={args.workers}, {baseline}, {peer_settings(args)}, "
        f"uvicorn processes={args.http_processes}, SDK consume concurrency={args.sdk_concurrency}, DEBUG off"
        + (f", PgBouncer (transaction mode) pool size {args.pgbouncer_pool_size}" if args.pgbouncer else "")
    )
    body = "\n".join(
        [
            f"### `bench.throughput` — {now}, commit {git_revision()}",
            "",
            machine,
            "",
            table,
            "",
            *([*(f"- {v}" for v in verdicts), ""] if verdicts else []),
            "CPU and verification:",
            "",
            *(f"- {d}" for d in details),
            "",
            "SQL statements per operation:",
            "",
            statements,
            "",
        ]
    )
    return body


def peer_settings(args: argparse.Namespace) -> str:
    """Return how the pgqueuer peer ran, for the record."""
    if not args.pgqueuer:
        return "no pgqueuer peer"
    return f"pgqueuer N={args.pgqueuer_jobs} ({args.pgqueuer_dequeuers} dequeuers x batch {args.pgqueuer_batch})"
