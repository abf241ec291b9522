"""What the Celery benchmark reports: its tables' headers, and the figures ``--json`` writes."""

from __future__ import annotations

TABLE_HEADER = [
    "| processes | pipeline: plain no-op | pipeline: `@runstate_task` no-op | ratio | submit only "
    "| drain: plain no-op | drain: `@runstate_task` no-op | ratio |",
    "| --- | --- | --- | --- | --- | --- | --- | --- |",
]
CPU_HEADER = [
    "| processes | CPU ms/task, drain: plain worker | plain PostgreSQL | `@runstate_task` worker | "
    "`@runstate_task` PostgreSQL |",
    "| --- | --- | --- | --- | --- |",
]


def json_figures(results: list[tuple], cpu_results: dict[int, list[float]], exact: bool) -> dict:
    """Return what ``--json`` writes: the top-level keys are those of 2 worker processes (else the first size)."""
    sizes = {}
    for size, plain, guarded, submitted, plain_drain, guarded_drain in results:
        plain_w, plain_pg, guarded_w, guarded_pg = cpu_results[size]
        sizes[size] = {
            "plain_drain_per_s": round(plain_drain, 1),
            "runstate_drain_per_s": round(guarded_drain, 1),
            "ratio_drain": round(guarded_drain / plain_drain, 3),
            "plain_pipeline_per_s": round(plain, 1),
            "runstate_pipeline_per_s": round(guarded, 1),
            "ratio_pipeline": round(guarded / plain, 3),
            "runstate_submit_only_per_s": round(submitted, 1),
            "plain_worker_cpu_ms_per_task": round(plain_w, 3),
            "plain_postgres_cpu_ms_per_task": round(plain_pg, 3),
            "runstate_worker_cpu_ms_per_task": round(guarded_w, 3),
            "runstate_postgres_cpu_ms_per_task": round(guarded_pg, 3),
        }
    top = sizes.get(2) or next(iter(sizes.values()))
    return {**top, "processes": {str(size): figures for size, figures in sizes.items()}, "exactly_once": exact}
