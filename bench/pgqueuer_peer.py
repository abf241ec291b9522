"""pgqueuer as a same-run peer of bench.throughput: drain N no-op jobs enqueued beforehand.

pgqueuer (https://github.com/janbjorge/pgqueuer) is a job queue on PostgreSQL alone, the
closest thing to runstate's task table that exists as a library. The peer measures how fast
its consumers empty a queue, on the same server in the same run, through its public API only:

* a database of its own (``runstate_bench_pgqueuer``, dropped first if a crashed run left it),
  with pgqueuer's schema from ``Queries.install()`` — runstate's tables are never touched;
* N jobs enqueued before the clock starts (``Queries.enqueue`` with lists, 1,000 a call);
* D dequeuers (``QueueManager``, one connection each, ``run(batch_size=B)``) in one asyncio
  loop, whose no-op entrypoint counts the jobs and shuts every manager down at the N-th.
  The clock runs from the start of the managers until all of them have returned, i.e. until
  the last completions are written (pgqueuer deletes a finished job and logs it in batches);
* afterwards ``Queries.uninstall()`` and the database is dropped.

Verification: the entrypoint ran N times on N distinct jobs, the queue table is empty, and
the log holds N ``successful`` entries for N distinct jobs.

The measurement helpers (quiet machine, CPU) are in bench/harness/, and bench/throughput/peer.py drives this
module step by step; here is only what talks to pgqueuer. pgqueuer is in the development
lock (requirements-dev.txt), not in the runtime lock (requirements.txt).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

PGQUEUER_DATABASE = "runstate_bench_pgqueuer"
ENTRYPOINT = "runstate_bench_noop"
INSTALL_HINT = ".venv/bin/pip install --require-hashes -r requirements-dev.txt"
ENQUEUE_CHUNK = 1000


def pgqueuer_version() -> str | None:
    """Return the installed pgqueuer version, or None when it cannot be imported."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        import pgqueuer  # noqa: F401

        return version("pgqueuer")
    except (ImportError, PackageNotFoundError):
        return None


def require_pgqueuer() -> str:
    """Return pgqueuer's version, or stop the benchmark (exit status 1) saying how to install it."""
    found = pgqueuer_version()
    if found is None:
        raise SystemExit(
            "error: the pgqueuer peer needs the benchmark's own requirements, and pgqueuer is not installed.\n"
            f"       Install them with: {INSTALL_HINT}\n"
            "       (or run without the peer: --no-pgqueuer)"
        )
    return found


@dataclass
class DrainResult:
    """One drain: how many jobs, by how many dequeuers of which batch, in how long, verified how."""

    jobs: int
    dequeuers: int
    batch: int
    seconds: float
    verification: dict[str, Any]
    first_job_s: float = 0.0  # from the start of the dequeuers to the first job run (timed)
    shutdown_s: float = 0.0  # from the last job logged until every dequeuer returned (not timed)
    cpu: Any = None  # what the drain cost, when the caller measured it (bench.harness.meters.CpuMeter)

    @property
    def rate(self) -> float:
        """Jobs drained per second."""
        return self.jobs / self.seconds


class PgqueuerPeer:
    """A throwaway database holding pgqueuer's schema, its queued jobs and D dequeuer connections.

    Use it as a context manager (creates and installs; uninstalls and drops on exit), then:
    ``enqueue(n)``, ``connect()`` (returns the dequeuers' backend pids, for CPU accounting),
    ``drain(n)`` (the timed part), ``verify(n)``. One asyncio loop serves every step, since
    the async connections belong to the loop that opened them.
    """

    def __init__(self, params: dict[str, Any], *, dequeuers: int = 5, batch: int = 10) -> None:
        self.params = {**params, "dbname": PGQUEUER_DATABASE}
        self.admin = {**params, "dbname": "postgres"}
        self.dequeuers = dequeuers
        self.batch = batch
        self.executed: list[int] = []  # job ids, in the order the entrypoint ran them
        self.first_job_s = 0.0  # from the start of the dequeuers to the first job run
        self.shutdown_s = 0.0  # from the last job logged until every dequeuer returned (not timed)
        self._connections: list[Any] = []
        self._runner: asyncio.Runner | None = None

    # Set-up and clean-up -------------------------------------------------------------------

    def __enter__(self) -> PgqueuerPeer:
        self._admin_execute("DROP DATABASE IF EXISTS {} WITH (FORCE)")
        self._admin_execute("CREATE DATABASE {}")
        self._runner = asyncio.Runner()
        self._run(self._with_queries(lambda queries: queries.install()))
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._runner is not None:
                self._run(self._close_connections())
                self._run(self._with_queries(lambda queries: queries.uninstall()))
                self._runner.close()
        finally:
            self._admin_execute("DROP DATABASE IF EXISTS {} WITH (FORCE)")

    def _admin_execute(self, statement: str) -> None:
        import psycopg
        from psycopg import sql

        with psycopg.connect(**self.admin, autocommit=True) as conn:
            conn.execute(sql.SQL(statement).format(sql.Identifier(PGQUEUER_DATABASE)))

    def _run(self, coroutine: Any) -> Any:
        assert self._runner is not None, "use PgqueuerPeer as a context manager"
        return self._runner.run(coroutine)

    async def _connect(self) -> Any:
        import psycopg

        return await psycopg.AsyncConnection.connect(**self.params, autocommit=True)

    async def _with_queries(self, action: Any) -> Any:
        """Run ``action(Queries)`` on a connection of its own."""
        from pgqueuer import Queries

        conn = await self._connect()
        try:
            return await action(Queries.from_psycopg_connection(conn))
        finally:
            await conn.close()

    async def _close_connections(self) -> None:
        for conn in self._connections:
            await conn.close()
        self._connections = []

    # Steps -----------------------------------------------------------------------------------

    def enqueue(self, jobs: int) -> None:
        """Queue ``jobs`` no-op jobs (no payload), ``ENQUEUE_CHUNK`` per statement."""

        async def enqueue_all(queries: Any) -> None:
            for start in range(0, jobs, ENQUEUE_CHUNK):
                count = min(ENQUEUE_CHUNK, jobs - start)
                await queries.enqueue([ENTRYPOINT] * count, [None] * count, [0] * count)

        self._run(self._with_queries(enqueue_all))

    def connect(self) -> list[int]:
        """Open one connection per dequeuer (before the clock starts); return their backend pids."""

        async def open_all() -> list[Any]:
            return [await self._connect() for _ in range(self.dequeuers)]

        self._connections = self._run(open_all())
        return [conn.info.backend_pid for conn in self._connections]

    def drain(self, jobs: int) -> float:
        """Start the dequeuers; return the seconds until the last of ``jobs`` finished (its log committed).

        The dequeuers' own shutdown afterwards (listener and buffer tasks winding down, about
        a second with the psycopg driver) is not timed; ``shutdown_s`` says how long it took.
        """
        return self._run(self._drain(jobs))

    async def _drain(self, jobs: int) -> float:
        from pgqueuer import PsycopgDriver, Queries, QueueManager
        from pgqueuer.models import Job

        managers: list[QueueManager] = []
        started = time.perf_counter()
        state = {"logged": 0, "finished": 0.0}

        class CountingQueries(Queries):
            """pgqueuer's queries, counting the finished jobs as their log batches commit."""

            async def log_jobs(self, job_status: list) -> None:
                await super().log_jobs(job_status)
                state["logged"] += len(job_status)  # failures too, so a failing job cannot hang the drain
                if state["logged"] >= jobs and not state["finished"]:
                    state["finished"] = time.perf_counter()
                    for manager in managers:
                        manager.shutdown.set()

        async def noop(job: Job) -> None:
            if not self.executed:
                self.first_job_s = time.perf_counter() - started
            self.executed.append(job.id)

        for conn in self._connections:
            manager = QueueManager(CountingQueries(PsycopgDriver(conn)))
            manager.entrypoint(ENTRYPOINT)(noop)
            managers.append(manager)
        started = time.perf_counter()
        # No log aggregation during the run: the log then still holds one row per finished job.
        await asyncio.gather(*(m.run(batch_size=self.batch, log_aggregation_interval=timedelta(0)) for m in managers))
        self.shutdown_s = time.perf_counter() - state["finished"]
        return state["finished"] - started

    def verify(self, jobs: int) -> dict[str, Any]:
        """Check that every job ran once and left the queue with one ``successful`` log entry."""
        import psycopg

        with psycopg.connect(**self.params, autocommit=True) as conn:
            queued = conn.execute("SELECT count(*) FROM pgqueuer").fetchone()[0]
            logged, distinct = conn.execute(
                "SELECT count(*), count(DISTINCT job_id) FROM pgqueuer_log WHERE status = 'successful'"
            ).fetchone()
        executed, executed_distinct = len(self.executed), len(set(self.executed))
        return {
            "executed": executed,
            "executed_distinct": executed_distinct,
            "left_in_queue": queued,
            "logged_successful": logged,
            "logged_distinct": distinct,
            "ok": executed == executed_distinct == logged == distinct == jobs and queued == 0,
        }


def verification_text(v: dict[str, Any], expected: int) -> str:
    """Return the one-line verification verdict of a drain."""
    verdict = "OK" if v["ok"] else "FAILED"
    return (
        f"verify {verdict}: entrypoint ran {v['executed']}/{expected} times on {v['executed_distinct']} distinct jobs, "
        f"{v['left_in_queue']} left in the queue, {v['logged_successful']} 'successful' log entries "
        f"on {v['logged_distinct']} distinct jobs"
    )
