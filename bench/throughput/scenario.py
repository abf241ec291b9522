"""One throughput scenario's figures (service layer or HTTP, one worker count) and its report lines."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bench.harness.fixtures import verification_text
from bench.harness.meters import CpuMeter
from bench.harness.threads import percentile


@dataclass
class ScenarioResult:
    """The figures of one scenario (service layer or HTTP) at one worker count."""

    mode: str
    workers: int
    tasks: int
    batch: int
    submit_s: float
    claim_complete_s: float
    claim_latencies: list[float] = field(repr=False)
    complete_latencies: list[float] = field(repr=False)
    claim_calls: int
    empty_claim_calls: int
    verification: dict[str, Any]
    submit_cpu: CpuMeter = field(repr=False)
    claim_cpu: CpuMeter = field(repr=False)
    # Over both phases: the database's backends' CPU, WAL bytes the whole server's and the database's.
    database: dict[str, float | None] | None = None
    # Through PgBouncer: its transactions, queries and client wait (us) per task (bench/pooler.py).
    pooler: dict[str, float] | None = None

    @classmethod
    def from_phases(
        cls,
        mode: str,
        workers: int,
        tasks: int,
        batch: int,
        submitted: tuple[float, list[Any], CpuMeter],
        drained: tuple[float, list[Any], CpuMeter],
        verification: dict[str, Any],
        database: dict[str, float | None] | None,
        pooler: dict[str, float] | None = None,
    ) -> ScenarioResult:
        """Build a scenario's result from ``run_threads``'s answers for its submit and its drain.

        Each drain thread answers (claim latencies, complete latencies, tasks done, empty claims).
        """
        submit_s, _, submit_cpu = submitted
        claim_s, results, claim_cpu = drained
        return cls(
            mode=mode,
            workers=workers,
            tasks=tasks,
            batch=batch,
            submit_s=submit_s,
            claim_complete_s=claim_s,
            claim_latencies=[x for r in results for x in r[0]],
            complete_latencies=[x for r in results for x in r[1]],
            claim_calls=sum(len(r[0]) + r[3] for r in results),
            empty_claim_calls=sum(r[3] for r in results),
            verification=verification,
            submit_cpu=submit_cpu,
            claim_cpu=claim_cpu,
            database=database,
            pooler=pooler,
        )

    @property
    def submit_rate(self) -> float:
        return self.tasks / self.submit_s

    @property
    def claim_complete_rate(self) -> float:
        return self.tasks / self.claim_complete_s

    @property
    def pipeline_rate(self) -> float:
        return self.tasks / (self.submit_s + self.claim_complete_s)

    def claim_ms(self, fraction: float) -> float:
        return 1000 * percentile(self.claim_latencies, fraction)

    def complete_ms(self, fraction: float) -> float:
        return 1000 * percentile(self.complete_latencies, fraction)


def scenario_lines(result: ScenarioResult) -> list[str]:
    """Return the per-scenario detail lines (rates, latencies, CPU, verification)."""
    n = result.tasks
    return [
        f"submit {result.submit_rate:.0f} tasks/s ({result.submit_s:.1f} s); {result.submit_cpu.note}; "
        f"{result.submit_cpu.summary()}; {result.submit_cpu.per_task_ms(n)}",
        f"claim+complete {result.claim_complete_rate:.0f} tasks/s ({result.claim_complete_s:.1f} s); "
        f"{result.claim_cpu.note}; {result.claim_cpu.summary()}; {result.claim_cpu.per_task_ms(n)}",
        f"{result.claim_calls} claim calls ({result.empty_claim_calls} empty), "
        f"claim p50/p99 {result.claim_ms(0.5):.2f}/{result.claim_ms(0.99):.2f} ms, "
        f"complete p50/p99 {result.complete_ms(0.5):.2f}/{result.complete_ms(0.99):.2f} ms; "
        f"pipeline {result.pipeline_rate:.0f} tasks/s",
        *([database_text(result.database, n)] if result.database else []),
        *(
            [
                f"through PgBouncer: {result.pooler['xacts']:.2f} transactions and {result.pooler['queries']:.2f} "
                f"queries per task; clients waited {result.pooler['wait_us'] / 1000:.3f} ms per task for a server"
            ]
            if result.pooler
            else []
        ),
        verification_text(result.verification, result.tasks),
    ]


def database_text(database: dict[str, float | None], tasks: int) -> str:
    """Return a scenario's database line: its backends' CPU, then WAL per task, the database's and the server's."""
    ours = (
        f"{database['database'] / tasks:,.0f} bytes/task this database's (pg_walinspect; "
        f"{database['database_fpi'] / tasks:,.0f} of them full-page images), "
        if database["database"]
        else ""
    )
    backends = database["backend_cpu_s"]
    cpu = "" if backends is None else f"this database's postgres backends {1000 * backends / tasks:.2f} CPU ms/task; "
    return cpu + f"WAL {ours}{database['server'] / tasks:,.0f} bytes/task the whole server's (other sessions' too)"
