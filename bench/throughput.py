"""Task throughput: submit -> claim -> complete on PostgreSQL, against pgbench -N and pgqueuer.

    .venv/bin/python -m bench.throughput [--tasks N] [--workers 4[,8]] [--modes unbatched,batched]
                                         [--no-http] [--http-processes 2] [--no-sdk] [--no-pgqueuer]
                                         [--tracing] [--pgbouncer] [--json PATH] [--record]

For each worker count W (4 unless ``--workers`` says otherwise) it measures, in this order
and never overlapping:

* service layer, per mode: N tasks submitted by W threads, then W worker threads claiming
  and completing until the run is empty. *unbatched*: ``task_submit`` per task,
  ``task_claim(max_claims=B)`` (``--batch``, 10), ``claim_complete`` per claim; *batched*:
  ``tasks_submit_many`` of 100, ``task_claim`` of 50, ``claims_complete_many`` of 50
  (``--batched-sizes``);
* HTTP (``--http``, on by default), through uvicorn on 127.0.0.1 with ``--http-processes``
  worker processes (2), driven by W threads with keep-alive ``httpx.Client``s, per
  ``--http-modes``: *unbatched* (one submit per task, claims of ``--batch``, one complete
  per claim) and *batched* (the batch endpoints: submits of 100, claims of 50, completes of
  50, as ``--batched-sizes``); with ``--tracing``, the unbatched one again on a second server
  with tracing on (``OTEL_TRACES_SAMPLER=always_on``, the batch span processor, OTLP/HTTP to a
  local receiver that discards), right after the untraced one (``http_unbatched_tracing``);
  with ``--pgbouncer``, each HTTP pipeline again right after its direct one, on a server whose
  ``DATABASE_URL`` goes through a PgBouncer in transaction mode started here on a free port
  (``--pgbouncer-pool-size`` server connections, 10; bench/pooler.py), prepared statements off
  and the LISTEN connection direct, as docs/deploy.md deploys it (``http_unbatched_pgbouncer``,
  ``http_batched_pgbouncer``; PgBouncer's CPU and its transactions and queries per task too);
* baseline: ``pgbench -N -c W -j W -T 15`` against the same PostgreSQL server.

With the HTTP server up, once: the server's CPU per unbatched request of each kind (submit,
claim of 1, complete; ``--cost-calls`` of each, one at a time from one client, the uvicorn
processes' CPU time divided by the calls; with ``--pgbouncer`` the pooled server's too, and
PgBouncer's), and the SDK scenario (``--sdk``): a backlog of
the HTTP N tasks submitted with ``submit_many``, drained by the SDK's real ``consume`` loop
(``AsyncRunstate``, ``--sdk-concurrency`` 8) in this process.

Then, once, the same-run peer (``--pgqueuer``, on by default; bench/pgqueuer_peer.py):
pgqueuer draining N no-op jobs enqueued beforehand with 5 dequeuers x batch 10, in a
database of its own. It needs pgqueuer (requirements-dev.txt); without it the benchmark stops.

Before any timing it counts the SQL statements of one call of each kind in each mode
(service layer, ``CaptureQueriesContext``) and of one request of each kind (in-process
Django test client, every connection counted). Every scenario is verified afterwards with
one query: N tasks, all ``SUCCEEDED`` with ``attempts == 1``, N ``task.succeeded`` events;
and over its two phases, per task: the CPU of the benchmark database's backends (every one
connected to it, read from /proc: the API servers' and PgBouncer's too, no other database's),
and the WAL written, the whole server's (``pg_current_wal_lsn()`` before and after, other
sessions' writes too) and the benchmark database's alone (its records read back with
``pg_walinspect``, when the role may create it).

The database (``DATABASE_URL``, default ``postgres://postgres@127.0.0.1:5432/runstate_bench``)
is created when missing and migrated; when its name contains ``bench`` the coordination
tables are truncated before each scenario (otherwise each scenario only uses its own fresh
project and run). ``--record`` appends the figures to docs/benchmarks.md; ``--json PATH``
writes the W = 4 figures as JSON.

Not a test: pytest never collects this module (see bench/__init__.py).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import glob
import json
import math
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench.pooler import BenchPgBouncer, stats_per_task

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/runstate_bench"
PGBENCH_DATABASE = "runstate_pgbench"
RECORD_PATH = ROOT / "docs" / "benchmarks.md"
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
MAILBOX = "bench"
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


# Environment and database -------------------------------------------------------------------


def bench_environment() -> dict[str, str]:
    """Return the environment the benchmark (and its uvicorn subprocess) runs with.

    DEBUG is off unless the caller set it: with DEBUG on, Django keeps every SQL statement in
    ``connection.queries``, which is not what production pays.
    """
    env = dict(os.environ)
    env.setdefault("DATABASE_URL", DEFAULT_DATABASE_URL)
    env.setdefault("DJANGO_SETTINGS_MODULE", "runstate_project.settings")
    env.setdefault("DEBUG", "0")
    env.setdefault("SECRET_KEY", "runstate-bench-not-a-secret")
    env.setdefault("LOG_LEVEL", "WARNING")
    return env


def db_params(url: str) -> dict[str, Any]:
    """Split a database URL into psycopg connection keywords (``dbname`` included)."""
    import dj_database_url

    parsed = dj_database_url.parse(url)
    params = {
        "host": parsed.get("HOST") or None,
        "port": parsed.get("PORT") or None,
        "user": parsed.get("USER") or None,
        "password": parsed.get("PASSWORD") or None,
        "dbname": parsed.get("NAME"),
    }
    return {k: v for k, v in params.items() if v not in (None, "")}


def ensure_database(url: str, name: str | None = None) -> str:
    """Create the database of ``url`` (or ``name`` on the same server) when missing."""
    import psycopg
    from psycopg import sql

    params = db_params(url)
    name = name or params["dbname"]
    admin = {**params, "dbname": "postgres"}
    with psycopg.connect(**admin, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone()
        if not exists:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            print(f"created database {name}")
    return name


def drop_database(url: str) -> None:
    """Drop the database of ``url``; only a benchmark database (its name contains ``bench``)."""
    import psycopg
    from psycopg import sql

    params = db_params(url)
    if "bench" not in params["dbname"]:
        raise SystemExit(f"--fresh-db refuses to drop {params['dbname']!r}: its name has no 'bench' in it")
    with psycopg.connect(**{**params, "dbname": "postgres"}, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(params["dbname"])))
    print(f"dropped database {params['dbname']}")


def setup_django(*, fresh: bool = False) -> None:
    """Configure the environment, ``django.setup()`` and migrate the benchmark database."""
    os.environ.update(bench_environment())
    import django
    from django.core.management import call_command

    if fresh:
        drop_database(os.environ["DATABASE_URL"])
    ensure_database(os.environ["DATABASE_URL"])
    django.setup()
    call_command("migrate", verbosity=0)


def truncate_coordination_tables() -> bool:
    """Empty every coordination table when the database is a benchmark database; say whether."""
    from django.apps import apps
    from django.db import connection

    if "bench" not in connection.settings_dict["NAME"]:
        return False
    tables = [m._meta.db_table for m in apps.get_app_config("coordination").get_models()]
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {', '.join(connection.ops.quote_name(t) for t in tables)} CASCADE")
    return True


def server_facts() -> dict[str, str]:
    """Return the PostgreSQL version and the settings that bound commit throughput."""
    from django.db import connection

    facts = {}
    with connection.cursor() as cursor:
        cursor.execute("SHOW server_version")
        facts["server_version"] = cursor.fetchone()[0]
        for setting in ("synchronous_commit", "fsync", "shared_buffers", "max_connections"):
            cursor.execute(f"SHOW {setting}")
            facts[setting] = cursor.fetchone()[0]
    return facts


def cpu_model() -> str:
    """Return the CPU model name from /proc/cpuinfo (or the platform's processor)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_revision() -> str:
    """Return the short commit the benchmark ran on (``+dirty`` when the tree has changes).

    ``BENCH_GIT_REVISION`` overrides it (for a copy made with ``git archive``, which has no .git).
    """
    if os.environ.get("BENCH_GIT_REVISION"):
        return os.environ["BENCH_GIT_REVISION"]
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# CPU accounting ---------------------------------------------------------------------------


def _machine_jiffies() -> tuple[int, int]:
    """Return (busy, total) jiffies of all CPUs from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


def _process_tree_seconds(pid: int) -> float:
    """Return user+system CPU seconds of ``pid`` and its descendants (0 if gone)."""
    total = 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / CLK_TCK
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except (OSError, IndexError, ValueError):
        return total
    return total + sum(_process_tree_seconds(int(child)) for child in children)


POSTMASTER = {"pid": None}  # the local PostgreSQL server's postmaster, when it runs on this machine


def find_postmaster() -> int | None:
    """Return the postmaster pid (the parent of our backend) if PostgreSQL runs on this machine."""
    from django.db import connection

    connection.ensure_connection()
    try:
        backend = connection.connection.info.backend_pid
        fields = Path(f"/proc/{backend}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


def _postgres_seconds(pid: int | None) -> float:
    """Return CPU-seconds of the whole PostgreSQL server: live processes plus reaped backends."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        reaped = (int(fields[13]) + int(fields[14])) / CLK_TCK  # cutime + cstime
    except (OSError, IndexError, ValueError):
        return 0.0
    return reaped + _process_tree_seconds(pid)


class CpuMeter:
    """CPU-seconds spent over an interval: the machine, this process, PostgreSQL, a server process.

    Runs share the machine with whatever else is running, so every phase reports what it
    used itself and what the rest used at the same time: other PostgreSQL work (autovacuum,
    WAL writer, other clients; under HTTP also the server's own backends, which live for one
    request each) and other processes.
    """

    def __init__(self, server_pid: int | None = None, pooler_pid: int | None = None) -> None:
        self.server_pid = server_pid
        self.pooler_pid = pooler_pid  # PgBouncer's, with --pgbouncer
        self.backend_s = 0.0  # set by run_threads: CPU of the PostgreSQL backends of our threads

    def __enter__(self) -> CpuMeter:
        self._wall = time.perf_counter()
        self._machine = _machine_jiffies()[0]
        times = os.times()
        self._own = times.user + times.system
        self._server = _process_tree_seconds(self.server_pid) if self.server_pid else 0.0
        self._pooler = _process_tree_seconds(self.pooler_pid) if self.pooler_pid else 0.0
        self._postgres = _postgres_seconds(POSTMASTER["pid"])
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = time.perf_counter() - self._wall
        times = os.times()
        self.machine_s = (_machine_jiffies()[0] - self._machine) / CLK_TCK
        self.bench_s = times.user + times.system - self._own
        self.server_s = _process_tree_seconds(self.server_pid) - self._server if self.server_pid else 0.0
        self.pooler_s = _process_tree_seconds(self.pooler_pid) - self._pooler if self.pooler_pid else 0.0
        self.postgres_s = _postgres_seconds(POSTMASTER["pid"]) - self._postgres

    @property
    def other_postgres_s(self) -> float:
        """CPU-seconds of PostgreSQL not spent by our threads' own backends."""
        return max(0.0, self.postgres_s - self.backend_s)

    @property
    def others_s(self) -> float:
        """CPU-seconds of everything else on the machine meanwhile (not us, not PostgreSQL)."""
        ours = self.bench_s + self.server_s + self.pooler_s + max(self.postgres_s, self.backend_s)
        return max(0.0, self.machine_s - ours)

    def summary(self) -> str:
        """Return the CPU use as percent of one CPU (100% = one CPU fully busy)."""
        pct = lambda seconds: f"{100 * seconds / max(self.wall_s, 1e-9):.0f}%"  # noqa: E731
        parts = [f"bench {pct(self.bench_s)}"]
        if self.backend_s:
            parts.append(f"its postgres backends {pct(self.backend_s)}")
        if self.server_pid:
            parts.append(f"uvicorn {pct(self.server_s)}")
        if self.pooler_pid:
            parts.append(f"pgbouncer {pct(self.pooler_s)}")
        if POSTMASTER["pid"]:
            parts.append(f"other postgres {pct(self.other_postgres_s)}")
        parts.append(f"other processes {pct(self.others_s)}")
        return f"CPU {', '.join(parts)} (100% = one of {os.cpu_count()} CPUs)"

    def per_task_ms(self, tasks: int) -> str:
        """Return CPU milliseconds per task, ours only (bench + backends + uvicorn + PgBouncer)."""
        parts = [f"bench {1000 * self.bench_s / tasks:.2f}"]
        if self.backend_s:
            parts.append(f"postgres {1000 * self.backend_s / tasks:.2f}")
        if self.server_pid:
            parts.append(f"uvicorn {1000 * self.server_s / tasks:.2f}")
        if self.pooler_pid:
            parts.append(f"pgbouncer {1000 * self.pooler_s / tasks:.2f}")
        return " + ".join(parts) + " CPU ms/task"


def machine_busy_pct(seconds: float = 2.0) -> float:
    """Return how busy the whole machine was over the next ``seconds`` (100% = all CPUs)."""
    busy, total = _machine_jiffies()
    time.sleep(seconds)
    busy2, total2 = _machine_jiffies()
    return 100 * (busy2 - busy) / max(total2 - total, 1)


def wait_for_quiet(threshold_pct: float, max_wait_s: float) -> str:
    """Wait until the machine is idle below ``threshold_pct`` (at most ``max_wait_s``); describe it."""
    started = time.monotonic()
    busy = machine_busy_pct()
    while busy > threshold_pct and time.monotonic() - started < max_wait_s:
        busy = machine_busy_pct()
    waited = time.monotonic() - started
    quiet = "quiet" if busy <= threshold_pct else "BUSY"
    return f"background load before start {busy:.0f}% of the machine ({quiet}, waited {waited:.0f} s)"


# Threads ---------------------------------------------------------------------------------


QUIET = {"threshold_pct": 25.0, "max_wait_s": 0.0}  # set from --quiet-threshold / --max-quiet-wait


def _backend_seconds() -> tuple[int | None, float]:
    """Return this thread's PostgreSQL backend pid (if connected) and its CPU-seconds so far."""
    from django.db import connection

    if connection.connection is None or connection.vendor != "postgresql":
        return None, 0.0
    pid = connection.connection.info.backend_pid
    return pid, _process_tree_seconds(pid)


def run_threads(
    count: int,
    work: Callable[[int, Any], Any],
    *,
    setup: Callable[[int], Any] | None = None,
    teardown: Callable[[Any], None] | None = None,
    server_pid: int | None = None,
    pooler_pid: int | None = None,
) -> tuple[float, list[Any], CpuMeter]:
    """Run ``work(i, setup(i))`` on ``count`` threads started together; return (seconds, results, cpu).

    First waits for the machine to be quiet (``QUIET``). Setup (connections, HTTP clients)
    happens before the clock starts. Every thread closes its Django connection at the end.
    """
    from django.db import connection

    note = wait_for_quiet(**QUIET)
    barrier = threading.Barrier(count + 1)
    results: list[Any] = [None] * count
    errors: list[BaseException] = []
    backend_s = [0.0] * count

    def body(index: int) -> None:
        context = None
        try:
            context = setup(index) if setup else None
            pid, cpu_before = _backend_seconds()
            barrier.wait()
            results[index] = work(index, context)
            if pid is not None:
                backend_s[index] = _process_tree_seconds(pid) - cpu_before
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)
            barrier.abort()
        finally:
            if teardown and context is not None:
                teardown(context)
            connection.close()

    threads = [threading.Thread(target=body, args=(i,), name=f"bench-{i}") for i in range(count)]
    for thread in threads:
        thread.start()
    try:
        barrier.wait(timeout=120)
    except threading.BrokenBarrierError:
        pass
    with CpuMeter(server_pid, pooler_pid) as cpu:
        started = time.perf_counter()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - started
    if errors:
        raise errors[0]
    cpu.backend_s = sum(backend_s)
    cpu.note = note
    return elapsed, results, cpu


def percentile(values: list[float], fraction: float) -> float:
    """Nearest-rank percentile of ``values`` (0 when empty)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


# Results ---------------------------------------------------------------------------------


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


def verify_run(run_id: uuid.UUID, expected: int) -> dict[str, Any]:
    """One query: every task of the run SUCCEEDED exactly once (attempts 1, one event each)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT count(*),
                   count(*) FILTER (WHERE state = 'SUCCEEDED' AND attempts = 1),
                   (SELECT count(*) FROM coordination_event e
                     WHERE e.run_id = %s AND e.type = 'task.succeeded'),
                   (SELECT count(DISTINCT e.subject_id) FROM coordination_event e
                     WHERE e.run_id = %s AND e.type = 'task.succeeded')
              FROM coordination_task WHERE run_id = %s
            """,
            [run_id, run_id, run_id],
        )
        total, succeeded_once, events, distinct = cursor.fetchone()
    ok = total == succeeded_once == events == distinct == expected
    return {
        "tasks": total,
        "succeeded_attempt_1": succeeded_once,
        "succeeded_events": events,
        "distinct_subjects": distinct,
        "ok": ok,
    }


# The WAL records since a position that belong to this database: those touching one of its
# relations (a block reference ``rel <tablespace>/<database oid>/<relation>``), and every record
# of a transaction that wrote one (its commit). pg_walinspect reads only flushed WAL.
DATABASE_WAL_SQL = """
WITH records AS (
    SELECT xid, record_length, fpi_length, coalesce(block_ref, '') LIKE %(ours)s AS ours
    FROM pg_get_wal_records_info(%(start)s, pg_current_wal_flush_lsn())
)
SELECT coalesce(sum(record_length), 0)::bigint, coalesce(sum(fpi_length), 0)::bigint FROM records
WHERE ours OR xid IN (SELECT xid FROM records WHERE ours AND xid <> 0)
"""


DATABASE_BACKENDS_SQL = (
    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
)


class DatabaseMeter:
    """What the benchmark database's server side did while the block runs (``figures``): CPU and WAL.

    - ``backend_cpu_s``: the CPU of every backend connected to the benchmark database (the API
      servers' pools, PgBouncer's server connections), read from /proc at the start and at
      the end (one that left in between is missed; the pools keep theirs). Unlike the whole
      server's, no other database's work counts. None with ``backends=False``: the service
      scenarios' threads connect and leave inside the block, and ``run_threads`` counts
      their backends itself.
    - ``server``: the WAL bytes of ``pg_wal_lsn_diff`` between the positions before and after
      (other sessions' writes count too).
    - ``database``: the benchmark database's WAL bytes alone, read back from the WAL with
      ``pg_walinspect`` (PostgreSQL 15's contrib, created in the database when the role may);
      a temporary replication slot of this meter's own connection keeps the WAL until then
      and goes with the connection. None when either cannot be had (``note`` says why).
      ``database_fpi``: the part of it that is full-page images (the first change of a page
      after a checkpoint).
    """

    def __init__(self, *, backends: bool = True) -> None:
        self.backends = backends

    def __enter__(self) -> DatabaseMeter:
        import psycopg

        self.note = ""
        self._conn = psycopg.connect(**db_params(os.environ["DATABASE_URL"]), autocommit=True)
        try:
            self._conn.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
            self._conn.execute(
                "SELECT pg_create_physical_replication_slot(%s, true, true)", [f"bench_wal_{os.getpid()}"]
            )
            self._inspect = True
        except psycopg.Error as error:
            self.note, self._inspect = f"no per-database WAL figure: {error}".strip(), False
        self._start = self._conn.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
        self._cpu = {pid: _process_tree_seconds(pid) for (pid,) in self._conn.execute(DATABASE_BACKENDS_SQL)}
        return self

    def __exit__(self, *exc) -> None:
        import psycopg

        try:
            pids = [pid for (pid,) in self._conn.execute(DATABASE_BACKENDS_SQL)]
            query = "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)::bigint"
            self.figures = {
                "backend_cpu_s": sum(_process_tree_seconds(pid) - self._cpu.get(pid, 0.0) for pid in pids)
                if self.backends
                else None,
                "server": self._conn.execute(query, [self._start]).fetchone()[0],
                "database": None,
            }
            if self._inspect:
                oid = self._conn.execute("SELECT oid FROM pg_database WHERE datname = current_database()")
                ours = f"%/{oid.fetchone()[0]}/%"
                try:
                    rows = self._conn.execute(DATABASE_WAL_SQL, {"start": self._start, "ours": ours})
                    self.figures["database"], self.figures["database_fpi"] = rows.fetchone()
                except psycopg.Error as error:
                    self.note = f"no per-database WAL figure: {error}".strip()
        finally:
            self._conn.close()  # and the temporary slot with it
        if self.note:
            print(f"  note: {self.note}")


def verification_text(v: dict[str, Any], expected: int) -> str:
    """Return the one-line verification verdict."""
    verdict = "OK" if v["ok"] else "FAILED"
    return (
        f"verify {verdict}: {v['tasks']}/{expected} tasks, {v['succeeded_attempt_1']} SUCCEEDED with attempts=1, "
        f"{v['succeeded_events']} task.succeeded events on {v['distinct_subjects']} distinct tasks"
    )


# Service layer ---------------------------------------------------------------------------


SERVICE_API = (
    "coordination.services.tasks: task_submit, tasks_submit_many, TaskSpec; "
    "coordination.services.claims: task_claim, claim_complete, claims_complete_many"
)


def service_api() -> SimpleNamespace:
    """Import the service functions the benchmark drives; stop with a clear message when they are missing."""
    try:
        from coordination.services.claims import claim_complete, claims_complete_many, task_claim
        from coordination.services.tasks import TaskSpec, task_submit, tasks_submit_many
    except ImportError as exc:
        raise SystemExit(
            f"error: bench.throughput drives the service layer through {SERVICE_API}, "
            f"and this checkout lacks part of it ({exc}).\n"
            "       Run it on a revision that has the batched services (issue 14)."
        ) from exc
    return SimpleNamespace(
        task_submit=task_submit,
        tasks_submit_many=tasks_submit_many,
        TaskSpec=TaskSpec,
        task_claim=task_claim,
        claim_complete=claim_complete,
        claims_complete_many=claims_complete_many,
    )


@dataclass(frozen=True)
class ServiceMode:
    """How the service layer is driven: tasks per submit call, claims per claim call, per complete call.

    A size of 1 uses the one-at-a-time function (``task_submit``, ``claim_complete``); more
    uses the batched one (``tasks_submit_many``, ``claims_complete_many``).
    """

    name: str
    submit_batch: int
    claim_max: int
    complete_batch: int

    @property
    def calls(self) -> list[tuple[str, int]]:
        """The submit, claim and complete call as named in the statements table, with the tasks per call."""
        many = lambda name, size: name if size == 1 else f"{name} many ({size})"  # noqa: E731
        return [
            (many("submit", self.submit_batch), self.submit_batch),
            (f"claim (max {self.claim_max})", self.claim_max),
            (many("complete", self.complete_batch), self.complete_batch),
        ]

    @property
    def sizes(self) -> str:
        return f"submit {self.submit_batch}, claim max {self.claim_max}, complete {self.complete_batch} per call"


class ServiceCalls:
    """One project, WORK mailbox and run, driven through the service layer the way ``mode`` says."""

    def __init__(self, label: str, mode: ServiceMode) -> None:
        self.api = service_api()
        self.mode = mode
        self.project, self.mailbox, self.run = service_fixture(label)

    def submit(self, numbers: list[int]) -> None:
        """Submit one task per number (input ``{"i": n}``), in calls of ``mode.submit_batch``."""
        where = {"project_id": self.project.id, "mailbox": self.mailbox, "run_id": self.run.id}
        size = self.mode.submit_batch
        for start in range(0, len(numbers), size):
            chunk = numbers[start : start + size]
            if size == 1:
                self.api.task_submit(**where, input={"i": chunk[0]})
            else:
                self.api.tasks_submit_many(**where, items=[self.api.TaskSpec(input={"i": i}) for i in chunk])

    def claim(self, worker_id: str = "w", max_claims: int | None = None) -> list[Any]:
        """One claim call of up to ``mode.claim_max`` tasks (or ``max_claims``)."""
        return self.api.task_claim(
            project_id=self.project.id,
            mailbox=self.mailbox,
            run_id=self.run.id,
            worker_id=worker_id,
            max_claims=max_claims or self.mode.claim_max,
        )

    def complete(self, claims: list[Any], latencies: list[float] | None = None) -> None:
        """Complete ``claims`` in calls of ``mode.complete_batch``; append each call's seconds to ``latencies``."""
        size = self.mode.complete_batch
        for start in range(0, len(claims), size):
            chunk = claims[start : start + size]
            started = time.perf_counter()
            if size == 1:
                self.api.claim_complete(
                    project_id=self.project.id, claim_id=chunk[0].claim_id, outcome={"i": chunk[0].task.input["i"]}
                )
            else:
                answers = self.api.claims_complete_many(
                    project_id=self.project.id, items=[(c.claim_id, {"i": c.task.input["i"]}) for c in chunk]
                )
                refused = [a for a in answers if isinstance(a, Exception)]
                if refused:
                    raise RuntimeError(f"claims_complete_many refused {len(refused)} of {len(chunk)}: {refused[0]!r}")
            if latencies is not None:
                latencies.append(time.perf_counter() - started)


ALL_MODES = ("unbatched", "batched")


def service_modes(args: argparse.Namespace, names: tuple[str, ...] | list[str] | None = None) -> list[ServiceMode]:
    """Return the modes ``--modes`` (or ``names``) asks for: unbatched (one call per task) and batched."""
    submit, claim, complete = args.batched_sizes
    known = {
        "unbatched": ServiceMode("unbatched", 1, args.batch, 1),
        "batched": ServiceMode("batched", submit, claim, complete),
    }
    return [known[name] for name in (names or args.mode_names)]


def service_fixture(label: str):
    """Create a fresh project, WORK mailbox and run; return them."""
    from coordination.services.keys import project_ensure
    from coordination.services.mailboxes import mailbox_ensure
    from coordination.services.runs import run_create

    project = project_ensure(name=f"bench-{label}-{uuid.uuid4().hex[:8]}")
    mailbox, _ = mailbox_ensure(project_id=project.id, name=MAILBOX, mode="WORK")
    run = run_create(project_id=project.id, name=f"bench {label}")
    return project, mailbox, run


def count_service_statements(modes: list[ServiceMode]) -> dict[str, list[str]]:
    """Capture the SQL of one submit, one claim of 1 and one complete call of each mode.

    Unbatched, that is one ``task_submit``, ``task_claim(max_claims=1)``, one of ``max_claims=B``
    and one ``claim_complete``; batched, one call of each batched size.
    """
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    captured: dict[str, list[str]] = {}
    for index, mode in enumerate(modes):
        (submit_op, _), (claim_op, _), (complete_op, _) = mode.calls
        calls = ServiceCalls(f"statements-{mode.name}", mode)
        tasks = max(mode.submit_batch, mode.claim_max, mode.complete_batch) + 1
        with CaptureQueriesContext(connection) as q:
            calls.submit(list(range(mode.submit_batch)))
        captured[submit_op] = [x["sql"] for x in q.captured_queries]
        calls.submit(list(range(mode.submit_batch, tasks + mode.submit_batch)))
        if index == 0:
            with CaptureQueriesContext(connection) as q:
                first = calls.claim(max_claims=1)
            captured["claim (max 1)"] = [x["sql"] for x in q.captured_queries]
            assert len(first) == 1, len(first)
        with CaptureQueriesContext(connection) as q:
            claims = calls.claim()
        captured[claim_op] = [x["sql"] for x in q.captured_queries]
        assert len(claims) == mode.claim_max, (len(claims), mode.claim_max)
        claims += calls.claim()
        with CaptureQueriesContext(connection) as q:
            calls.complete(claims[: mode.complete_batch])
        captured[complete_op] = [x["sql"] for x in q.captured_queries]
    return captured


def time_service_calls(modes: list[ServiceMode], calls: int = 200) -> tuple[dict[str, tuple[float, float, float]], str]:
    """Cost of each call on one thread, nothing else of ours running: (Python CPU, PostgreSQL CPU, wall) ms.

    Python CPU is this thread's CPU time; PostgreSQL CPU is its backend's, read from /proc.
    Each mode submits, claims and completes at least ``calls`` tasks (10 calls of its largest
    batch at least). Also returns how busy the machine was before the measurement.
    """
    note = wait_for_quiet(**QUIET)
    print(f"per-call costs: {note}", flush=True)
    costs: dict[str, tuple[float, float, float]] = {}
    for mode in modes:
        costs.update(_time_mode_calls(mode, calls))
    return costs, note


def _time_mode_calls(mode: ServiceMode, calls: int) -> dict[str, tuple[float, float, float]]:
    """Time every call of one mode on this thread; see ``time_service_calls``."""
    from django.db import connection

    service = ServiceCalls(f"per-call-{mode.name}", mode)
    connection.ensure_connection()
    backend = connection.connection.info.backend_pid if connection.vendor == "postgresql" else None
    costs: dict[str, tuple[float, float, float]] = {}

    def timed(name: str, count: int, call: Callable[[int], Any]) -> list[Any]:
        results = []
        pg_before = _process_tree_seconds(backend) if backend else 0.0
        cpu_before, wall_before = time.thread_time(), time.perf_counter()
        for i in range(count):
            results.append(call(i))
        cpu, wall = time.thread_time() - cpu_before, time.perf_counter() - wall_before
        pg = (_process_tree_seconds(backend) - pg_before) if backend else float("nan")
        costs[name] = (1000 * cpu / count, 1000 * pg / count, 1000 * wall / count)
        return results

    sizes = (mode.submit_batch, mode.claim_max, mode.complete_batch)
    tasks = max(calls, 10 * max(sizes))
    tasks += -tasks % math.lcm(*sizes)
    (submit_op, submit), (claim_op, _), (complete_op, complete) = mode.calls
    timed(submit_op, tasks // submit, lambda i: service.submit(list(range(i * submit, (i + 1) * submit))))
    claimed = timed(claim_op, tasks // mode.claim_max, lambda i: service.claim())
    claims = [claim for batch in claimed for claim in batch]
    assert len(claims) == tasks, (len(claims), tasks)
    timed(complete_op, tasks // complete, lambda i: service.complete(claims[i * complete : (i + 1) * complete]))
    return costs


def run_service_scenario(tasks: int, workers: int, mode: ServiceMode) -> ScenarioResult:
    """Submit ``tasks`` with ``workers`` threads, then claim and complete them all with ``workers`` threads."""
    from django.db import connection

    truncate_coordination_tables()
    service = ServiceCalls(f"svc-{mode.name}-w{workers}", mode)
    connection.close()

    def submitter(index: int, _context) -> int:
        service.submit(list(range(index, tasks, workers)))
        return 0

    def claimer(index: int, _context) -> tuple[list[float], list[float], int, int]:
        claim_lat, complete_lat, done, empty = [], [], 0, 0
        worker_id = f"bench-{index}"
        while True:
            started = time.perf_counter()
            claims = service.claim(worker_id)
            claim_lat.append(time.perf_counter() - started)
            if not claims:
                empty += 1
                break
            service.complete(claims, complete_lat)
            done += len(claims)
        return claim_lat[:-1], complete_lat, done, empty

    def connect(_index: int) -> bool:
        connection.ensure_connection()
        return True

    connection.close()
    with DatabaseMeter(backends=False) as database:
        submit_s, _, submit_cpu = run_threads(workers, submitter, setup=connect)
        claim_s, results, claim_cpu = run_threads(workers, claimer, setup=connect)
    verification = verify_run(service.run.id, tasks)
    connection.close()
    return ScenarioResult(
        mode=f"service {mode.name}",
        workers=workers,
        tasks=tasks,
        batch=mode.claim_max,
        submit_s=submit_s,
        claim_complete_s=claim_s,
        claim_latencies=[x for r in results for x in r[0]],
        complete_latencies=[x for r in results for x in r[1]],
        claim_calls=sum(len(r[0]) + r[3] for r in results),
        empty_claim_calls=sum(r[3] for r in results),
        verification=verification,
        submit_cpu=submit_cpu,
        claim_cpu=claim_cpu,
        database=database.figures,
    )


# HTTP ------------------------------------------------------------------------------------


def http_fixture(label: str) -> tuple[Any, str]:
    """Create a fresh project and an all-permissions API key; return (project, plaintext key)."""
    from coordination.services.keys import ALL_PERMISSIONS, api_key_create, project_ensure

    project = project_ensure(name=f"bench-{label}-{uuid.uuid4().hex[:8]}")
    issued = api_key_create(project_id=project.id, permissions=list(ALL_PERMISSIONS), name="bench")
    return project, issued.plaintext


def count_http_statements(batch: int) -> dict[str, tuple[int, int, int]]:
    """Count SQL statements and connections of one request of each kind, in-process.

    Uses Django's test client against the real URL conf and middleware, and counts every
    statement on every connection (the claims view reads and claims in executor threads).
    Connections are counted twice: as Django opens them (``connection_created``, which a
    connection pool also sends for every connection it hands out) and as PostgreSQL starts
    sessions (``pg_stat_database.sessions``, read on a connection of our own).
    """
    import psycopg
    from django.db import connection
    from django.db.backends.signals import connection_created
    from django.test import Client

    _, key = http_fixture("http-statements")
    client = Client(HTTP_AUTHORIZATION=f"Bearer {key}")
    statements: list[str] = []
    state = {"connections": 0}
    wrapped = []

    def counting(execute, sql, params, many, context):
        statements.append(sql)
        return execute(sql, params, many, context)

    def on_connect(sender, connection, **kwargs):
        state["connections"] += 1
        if counting not in connection.execute_wrappers:
            connection.execute_wrappers.append(counting)
            wrapped.append(connection)

    observer = psycopg.connect(**db_params(os.environ["DATABASE_URL"]), autocommit=True)

    def sessions() -> int:
        # A backend reports its session when it first goes idle; give it a moment.
        time.sleep(0.05)
        query = "SELECT sessions FROM pg_stat_database WHERE datname = current_database()"
        return observer.execute(query).fetchone()[0]

    def measure(method: str, path: str, body: dict) -> tuple[tuple[int, int, int], dict]:
        connection.close()
        statements.clear()
        state["connections"] = 0
        before = sessions()
        response = getattr(client, method)(path, body, content_type="application/json")
        assert response.status_code in (200, 201), (path, response.status_code, response.content[:300])
        connection.close()
        return (len(statements), state["connections"], sessions() - before), response.json()

    counts: dict[str, tuple[int, int, int]] = {}
    connection_created.connect(on_connect, weak=False)
    try:
        counts["PUT /v1/mailboxes/{name}"], _ = measure("put", f"/v1/mailboxes/{MAILBOX}", {"mode": "WORK"})
        counts["POST /v1/runs"], run = measure("post", "/v1/runs", {"name": "statements"})
        submit_path = f"/v1/mailboxes/{MAILBOX}/tasks"
        counts["POST /v1/mailboxes/{name}/tasks"], _ = measure("post", submit_path, {"runId": run["id"], "input": {}})
        for i in range(batch):
            measure("post", submit_path, {"runId": run["id"], "input": {"i": i}})
        claims_path = f"/v1/mailboxes/{MAILBOX}/claims"
        counts[f"POST /v1/mailboxes/{{name}}/claims (max {batch})"], answer = measure(
            "post", claims_path, {"runId": run["id"], "max": batch}
        )
        claim_id = answer["claims"][0]["claimId"]
        counts["POST /v1/claims/{id}/complete"], _ = measure("post", f"/v1/claims/{claim_id}/complete", {"outcome": 1})
    finally:
        observer.close()
        connection_created.disconnect(on_connect)
        for wrapper in wrapped:
            if counting in wrapper.execute_wrappers:
                wrapper.execute_wrappers.remove(counting)
    return counts


def free_port() -> int:
    """Return a TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class UvicornServer:
    """``uvicorn runstate_project.asgi:application`` as a subprocess on a free local port.

    Started as ``scripts/start`` starts it: ``--workers`` processes, uvicorn's defaults for
    the event loop and the HTTP parser (uvloop and httptools, from ``uvicorn[standard]``).
    With ``pooler``, its requests go through that PgBouncer (``BenchPgBouncer.server_env``).
    """

    def __init__(
        self,
        processes: int = 1,
        extra_env: dict[str, str] | None = None,
        name: str = "bench-uvicorn",
        pooler: Any = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.processes = processes
        self.pooler = pooler  # a bench.pooler.BenchPgBouncer the server's DATABASE_URL goes through, or None
        self.extra_env = (pooler.server_env() if pooler else {}) | (extra_env or {})
        self.log_path = ROOT / "var" / f"{name}.log"

    def __enter__(self) -> UvicornServer:
        import httpx

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("w")
        options = ["--host", "127.0.0.1", "--port", str(self.port), "--no-access-log", "--log-level", "warning"]
        if self.processes > 1:
            options += ["--workers", str(self.processes)]
        command = [sys.executable, "-m", "uvicorn", "runstate_project.asgi:application", *options]
        env = bench_environment() | self.extra_env
        self.process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=self._log, stderr=self._log)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"uvicorn exited ({self.process.returncode}); see {self.log_path}")
            try:
                if httpx.get(f"{self.url}/v1/healthz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.__exit__()
        raise RuntimeError(f"uvicorn did not answer /v1/healthz within 60 s; see {self.log_path}")

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


class DiscardingOtlpReceiver:
    """An OTLP/HTTP endpoint on a free local port that reads each export and discards it (``--tracing``).

    What a collector costs the exporter (a request per batch, answered 200) without keeping
    anything; it counts the bytes it was sent, for the record.
    """

    def __enter__(self) -> DiscardingOtlpReceiver:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - the http.server convention
                receiver.received_bytes += len(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                receiver.requests += 1
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.received_bytes = 0
        self.requests = 0
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def tracing_env(endpoint: str) -> dict[str, str]:
    """Return the ``OTEL_*`` variables of a traced API server: every trace sampled, OTLP to ``endpoint``."""
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_TRACES_SAMPLER": "always_on",
        "OTEL_SERVICE_NAME": "runstate-bench",
    }


def _checked(response: Any) -> dict:
    """Return a 200/201 answer's JSON; raise with the request and the answer otherwise."""
    if response.status_code not in (200, 201):
        request = response.request
        raise RuntimeError(f"{request.method} {request.url}: {response.status_code} {response.text[:500]}")
    return response.json()


def http_run(server: UvicornServer, label: str) -> tuple[dict[str, str], str]:
    """Create a fresh project, key, WORK mailbox and run over HTTP; return (headers, run id)."""
    import httpx

    _, key = http_fixture(label)
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as client:
        _checked(client.put(f"/v1/mailboxes/{MAILBOX}", json={"mode": "WORK"}))
        run_id = _checked(client.post("/v1/runs", json={"name": f"bench {label}"}))["id"]
    return headers, run_id


HTTP_MODES = ("unbatched", "batched")


def run_http_scenario(
    server: UvicornServer, tasks: int, workers: int, mode: str, sizes: tuple[int, int, int]
) -> ScenarioResult:
    """The service scenario through HTTP: W threads, one keep-alive ``httpx.Client`` each.

    *unbatched*: one ``POST /v1/mailboxes/{name}/tasks`` per task, claims of ``max`` = the
    claim size, one ``POST /v1/claims/{id}/complete`` per claim. *batched*: ``POST
    /v1/mailboxes/{name}/tasks/batch`` of the submit size, claims of the claim size, ``POST
    /v1/claims/complete`` of the complete size. ``sizes`` is (submit, claim, complete). On a
    server behind PgBouncer (``server.pooler``) the mode is labelled ``... pgbouncer``, and
    PgBouncer's CPU and its transactions and queries per task are measured too.
    """
    import httpx
    from django.db import connection

    submit_size, claim_size, complete_size = sizes if mode == "batched" else (1, sizes[1], 1)
    truncate_coordination_tables()
    headers, run_id = http_run(server, f"http-{mode}-w{workers}")
    connection.close()
    pooler_before = server.pooler.stats() if server.pooler else None

    def open_client(_index: int) -> httpx.Client:
        client = httpx.Client(base_url=server.url, headers=headers, timeout=60)
        _checked(client.get("/v1/healthz"))  # open the keep-alive connection before the clock starts
        return client

    def submitter(index: int, client: httpx.Client) -> int:
        mine = list(range(index, tasks, workers))
        for start in range(0, len(mine), submit_size):
            chunk = mine[start : start + submit_size]
            if mode == "batched":
                body = {"runId": run_id, "tasks": [{"input": {"i": i}} for i in chunk]}
                _checked(client.post(f"/v1/mailboxes/{MAILBOX}/tasks/batch", json=body))
            else:
                _checked(
                    client.post(f"/v1/mailboxes/{MAILBOX}/tasks", json={"runId": run_id, "input": {"i": chunk[0]}})
                )
        return 0

    def complete(client: httpx.Client, claims: list[dict], latencies: list[float]) -> None:
        if mode == "batched":
            for start in range(0, len(claims), complete_size):
                items = [
                    {"claimId": c["claimId"], "outcome": c["task"]["input"]}
                    for c in claims[start : start + complete_size]
                ]
                started = time.perf_counter()
                results = _checked(client.post("/v1/claims/complete", json={"items": items}))["results"]
                latencies.append(time.perf_counter() - started)
                refused = [r for r in results if not r["ok"]]
                if refused:
                    raise RuntimeError(f"batch complete refused {len(refused)} items: {refused[:3]}")
            return
        for claim in claims:
            started = time.perf_counter()
            _checked(client.post(f"/v1/claims/{claim['claimId']}/complete", json={"outcome": claim["task"]["input"]}))
            latencies.append(time.perf_counter() - started)

    def claimer(index: int, client: httpx.Client) -> tuple[list[float], list[float], int, int]:
        claim_lat, complete_lat, done, empty = [], [], 0, 0
        body = {"runId": run_id, "max": claim_size, "workerId": f"bench-http-{index}"}
        while True:
            started = time.perf_counter()
            claims = _checked(client.post(f"/v1/mailboxes/{MAILBOX}/claims", json=body))["claims"]
            claim_lat.append(time.perf_counter() - started)
            if not claims:
                empty += 1
                break
            complete(client, claims, complete_lat)
            done += len(claims)
        return claim_lat[:-1], complete_lat, done, empty

    pids = {"server_pid": server.process.pid, "pooler_pid": server.pooler.pid if server.pooler else None}
    clients = {"setup": open_client, "teardown": httpx.Client.close}
    with DatabaseMeter() as database:
        submit_s, _, submit_cpu = run_threads(workers, submitter, **clients, **pids)
        claim_s, results, claim_cpu = run_threads(workers, claimer, **clients, **pids)
    pooler = stats_per_task(pooler_before, server.pooler.stats(), tasks) if server.pooler else None
    verification = verify_run(uuid.UUID(run_id), tasks)
    connection.close()
    return ScenarioResult(
        mode=f"http {mode}" + (" pgbouncer" if server.pooler else ""),
        workers=workers,
        tasks=tasks,
        batch=claim_size,
        submit_s=submit_s,
        claim_complete_s=claim_s,
        claim_latencies=[x for r in results for x in r[0]],
        complete_latencies=[x for r in results for x in r[1]],
        claim_calls=sum(len(r[0]) + r[3] for r in results),
        empty_claim_calls=sum(r[3] for r in results),
        verification=verification,
        submit_cpu=submit_cpu,
        claim_cpu=claim_cpu,
        database=database.figures,
        pooler=pooler,
    )


@dataclass
class RequestCosts:
    """Server CPU per unbatched request of each kind, from one client sending them one at a time."""

    calls: int
    uvicorn_ms: dict[str, float]  # the uvicorn process tree (every worker process)
    postgres_ms: dict[str, float]  # the whole PostgreSQL server meanwhile
    pooler_ms: dict[str, float] | None = None  # PgBouncer, when the server's requests go through it
    wall_ms: dict[str, float] | None = None  # one request's time in the client, answer read

    def summary(self) -> str:
        parts = [
            f"{op} {self.uvicorn_ms[op]:.2f} ms uvicorn + {self.postgres_ms[op]:.2f} ms postgres"
            + (f" + {self.pooler_ms[op]:.2f} ms pgbouncer" if self.pooler_ms else "")
            + (f" (wall {self.wall_ms[op]:.2f} ms)" if self.wall_ms else "")
            for op in self.uvicorn_ms
        ]
        where = " through PgBouncer" if self.pooler_ms else ""
        return f"server CPU per request{where} ({self.calls} sequential requests of each kind): " + "; ".join(parts)


def measure_request_costs(server: UvicornServer, calls: int) -> RequestCosts:
    """Send ``calls`` submits, then ``calls`` claims of ``max`` 1, then their completes, one at a time.

    One client and no concurrency, so the server's CPU over each phase divided by the calls
    is what one request of that kind costs it (the machine's other load adds nothing to a
    process's own CPU time; it only stretches the wall clock).
    """
    import httpx
    from django.db import connection

    truncate_coordination_tables()
    headers, run_id = http_run(server, "http-costs")
    connection.close()
    uvicorn_ms: dict[str, float] = {}
    postgres_ms: dict[str, float] = {}
    pooler_ms: dict[str, float] = {}
    wall_ms: dict[str, float] = {}
    claims: list[dict] = []
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as client:
        for _ in range(20):  # warm every worker process: imports, pool, prepared statements
            _checked(client.post(f"/v1/mailboxes/{MAILBOX}/tasks", json={"runId": run_id, "input": {}}))
        warm = _checked(client.post(f"/v1/mailboxes/{MAILBOX}/claims", json={"runId": run_id, "max": 20}))["claims"]
        for claim in warm:
            _checked(client.post(f"/v1/claims/{claim['claimId']}/complete", json={"outcome": 0}))

        def phase(op: str, request: Callable[[int], None]) -> None:
            with CpuMeter(server.process.pid, server.pooler.pid if server.pooler else None) as cpu:
                for i in range(calls):
                    request(i)
            wall_ms[op] = 1000 * cpu.wall_s / calls
            uvicorn_ms[op] = 1000 * cpu.server_s / calls
            postgres_ms[op] = 1000 * cpu.postgres_s / calls
            pooler_ms[op] = 1000 * cpu.pooler_s / calls

        submit_body = {"runId": run_id, "input": {"i": 0}}
        claim_body = {"runId": run_id, "max": 1}
        phase("submit", lambda i: _checked(client.post(f"/v1/mailboxes/{MAILBOX}/tasks", json=submit_body)))
        phase(
            "claim",
            lambda i: claims.extend(
                _checked(client.post(f"/v1/mailboxes/{MAILBOX}/claims", json=claim_body))["claims"]
            ),
        )
        if len(claims) != calls:
            raise RuntimeError(f"expected {calls} claims, got {len(claims)}")
        phase(
            "complete",
            lambda i: _checked(client.post(f"/v1/claims/{claims[i]['claimId']}/complete", json={"outcome": i})),
        )
    return RequestCosts(calls, uvicorn_ms, postgres_ms, pooler_ms if server.pooler else None, wall_ms)


@dataclass
class SdkDrain:
    """The SDK's ``consume`` loop draining a backlog submitted with ``submit_many`` (``sdk_consume_drain``)."""

    tasks: int
    concurrency: int
    drain_rate: float
    cpu: CpuMeter = field(repr=False)  # over the submit and the drain
    verification: dict[str, Any]

    def summary(self) -> str:
        return (
            f"consume (concurrency {self.concurrency}) drained {self.drain_rate:.0f} tasks/s; "
            f"over submit_many and drain: {self.cpu.summary()}, {self.cpu.per_task_ms(self.tasks)}; "
            f"{verification_text(self.verification, self.tasks)}"
        )


def run_sdk_drain(server: UvicornServer, tasks: int, concurrency: int) -> SdkDrain:
    """``sdk_consume_drain`` against ``server`` with a fresh key, metered and verified."""
    from django.db import connection

    truncate_coordination_tables()
    _, key = http_fixture("sdk-consume")
    connection.close()
    verification: dict[str, Any] = {}

    def verify(run_id: uuid.UUID, expected: int) -> dict[str, Any]:
        verification.update(verify_run(run_id, expected))
        connection.close()
        return verification

    with CpuMeter(server.process.pid) as cpu:
        rate = sdk_consume_drain(server.url, key, tasks=tasks, concurrency=concurrency, mailbox=MAILBOX, verify=verify)
    return SdkDrain(tasks, concurrency, rate, cpu, verification)


# pgbench ---------------------------------------------------------------------------------


def find_pgbench() -> str | None:
    """Return the pgbench executable: on PATH, else the newest under /usr/lib/postgresql."""
    found = shutil.which("pgbench")
    if found:
        return found
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/pgbench"), key=lambda p: int(p.split("/")[4]))
    return candidates[-1] if candidates else None


def pgbench_env(url: str) -> dict[str, str]:
    """Return the environment pointing libpq (pgbench) at the server of ``url``."""
    params = db_params(url)
    env = dict(os.environ)
    for key, var in (("host", "PGHOST"), ("port", "PGPORT"), ("user", "PGUSER"), ("password", "PGPASSWORD")):
        if key in params:
            env[var] = str(params[key])
    return env


def pgbench_init(pgbench: str, url: str, scale: int) -> None:
    """Create ``runstate_pgbench`` when missing and (re)initialise it at ``scale``."""
    ensure_database(url, PGBENCH_DATABASE)
    subprocess.run(
        [pgbench, "-i", "-q", "-s", str(scale), PGBENCH_DATABASE],
        env=pgbench_env(url),
        check=True,
        capture_output=True,
        text=True,
    )


TPS_LINE = re.compile(r"^tps = ([0-9.]+)(?: \((.*)\))?", re.MULTILINE)


def parse_tps(output: str) -> float:
    """Return the TPS figure, excluding connection set-up when pgbench prints both."""
    matches = TPS_LINE.findall(output)
    if not matches:
        raise ValueError(f"no 'tps = ' line in pgbench output:\n{output}")
    for value, note in matches:
        if "excluding" in note or "without initial connection" in note:
            return float(value)
    return float(matches[-1][0])


@dataclass
class PgbenchResult:
    """One ``pgbench -N`` run: its TPS and what it cost in CPU."""

    clients: int
    tps: float
    note: str
    machine_pct: float  # of the whole machine, during the run
    client_ms_per_txn: float  # pgbench's own CPU
    backend_ms_per_txn: float | None  # its PostgreSQL backends' CPU (sampled), None if unknown

    @property
    def cpu_ms_per_txn(self) -> float | None:
        """Return the CPU of one transaction, pgbench's own and its backends' (None if the backends' is unknown)."""
        return None if self.backend_ms_per_txn is None else self.client_ms_per_txn + self.backend_ms_per_txn

    def summary(self) -> str:
        """Return the detail line."""
        backend = f"{self.backend_ms_per_txn:.2f}" if self.backend_ms_per_txn is not None else "?"
        return (
            f"pgbench -N -c {self.clients}: {self.tps:.0f} TPS; {self.note}; machine {self.machine_pct:.0f}% busy; "
            f"pgbench {self.client_ms_per_txn:.2f} + postgres {backend} CPU ms/txn"
        )


def _pgbench_backends(url: str) -> list[int]:
    """Return the pids of the backends pgbench has open on ``runstate_pgbench``."""
    import psycopg

    with psycopg.connect(**{**db_params(url), "dbname": "postgres"}, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND application_name = 'pgbench'",
            [PGBENCH_DATABASE],
        ).fetchall()
    return [row[0] for row in rows]


def pgbench_run(pgbench: str, url: str, clients: int, seconds: int) -> PgbenchResult:
    """Run ``pgbench -N -c W -j W -T seconds``; return its TPS and CPU cost.

    The backends' CPU is sampled from /proc while pgbench runs (from 1 s in to the last
    sample before they exit), and scaled by the TPS over the same window.
    """
    import resource

    note = wait_for_quiet(**QUIET)
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    machine_before = _machine_jiffies()
    process = subprocess.Popen(
        [pgbench, "-N", "-c", str(clients), "-j", str(clients), "-T", str(seconds), PGBENCH_DATABASE],
        env=pgbench_env(url),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(min(1.0, seconds / 4))
    pids = _pgbench_backends(url)
    first = {pid: _process_tree_seconds(pid) for pid in pids}
    window_start = last_sample = time.perf_counter()
    last = dict(first)
    while process.poll() is None:
        time.sleep(0.25)
        sample = {pid: _process_tree_seconds(pid) for pid in pids}
        if all(sample[pid] >= last[pid] for pid in pids) and any(Path(f"/proc/{pid}").exists() for pid in pids):
            last, last_sample = sample, time.perf_counter()
    stdout, stderr = process.communicate()
    if process.returncode:
        raise RuntimeError(f"pgbench failed ({process.returncode}): {stderr}")
    busy, total = _machine_jiffies()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    tps = parse_tps(stdout)
    client_s = (children.ru_utime + children.ru_stime) - (children_before.ru_utime + children_before.ru_stime)
    window = last_sample - window_start
    backend_s = sum(last[pid] - first[pid] for pid in pids)
    return PgbenchResult(
        clients=clients,
        tps=tps,
        note=note,
        machine_pct=100 * (busy - machine_before[0]) / max(total - machine_before[1], 1),
        client_ms_per_txn=1000 * client_s / (tps * seconds),
        backend_ms_per_txn=1000 * backend_s / (tps * window) if pids and window > 1 else None,
    )


def pgbench_through(pgbench: str, bouncer: BenchPgBouncer, clients: int, seconds: int) -> tuple[PgbenchResult, str]:
    """Run ``pgbench -N`` through ``bouncer``; return its result and a line with PgBouncer's CPU per transaction."""
    before = _process_tree_seconds(bouncer.pid)
    result = pgbench_run(pgbench, bouncer.url, clients, seconds)
    pooler_ms = 1000 * (_process_tree_seconds(bouncer.pid) - before) / (result.tps * seconds)
    return result, f"through PgBouncer: {result.summary()} + pgbouncer {pooler_ms:.2f} CPU ms/txn"


NOTIFY_PROBE_SCRIPTS = {
    "plain": "BEGIN;\nINSERT INTO runstate_notify_probe (v) VALUES (1);\nEND;\n",
    "notify": "BEGIN;\nINSERT INTO runstate_notify_probe (v) VALUES (1);\n"
    "SELECT pg_notify('runstate_bench_probe', 'x');\nEND;\n",
}


def notify_probe(pgbench: str, url: str, clients: int, seconds: int) -> dict[str, float]:
    """TPS of a one-row INSERT transaction with and without ``pg_notify`` (every event-writing statement notifies).

    A transaction that notifies takes a cluster-wide lock at commit and holds it through its
    WAL flush, so such commits are serialized; this shows what that costs on this server.
    """
    import tempfile

    import psycopg

    with psycopg.connect(**{**db_params(url), "dbname": PGBENCH_DATABASE}, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS runstate_notify_probe (id bigserial PRIMARY KEY, v int)")
        conn.execute("TRUNCATE runstate_notify_probe")
    tps = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, script in NOTIFY_PROBE_SCRIPTS.items():
            path = Path(folder) / f"{name}.sql"
            path.write_text(script)
            wait_for_quiet(**QUIET)
            done = subprocess.run(
                [pgbench, "-n", "-f", str(path), "-c", str(clients), "-j", str(clients), "-T", str(seconds)]
                + [PGBENCH_DATABASE],
                env=pgbench_env(url),
                check=True,
                capture_output=True,
                text=True,
            )
            tps[name] = parse_tps(done.stdout)
    return tps


# pgqueuer peer ---------------------------------------------------------------------------


def run_pgqueuer_peer(url: str, jobs: int, dequeuers: int, batch: int) -> Any:
    """Drain ``jobs`` pre-enqueued no-op jobs with pgqueuer (bench/pgqueuer_peer.py); return its DrainResult.

    Enqueueing and the dequeuers' connections come before the clock; the CPU of this
    process and of the dequeuers' PostgreSQL backends is measured over the drain.
    """
    from bench.pgqueuer_peer import DrainResult, PgqueuerPeer

    with PgqueuerPeer(db_params(url), dequeuers=dequeuers, batch=batch) as peer:
        peer.enqueue(jobs)
        pids = peer.connect()
        note = wait_for_quiet(**QUIET)
        before = {pid: _process_tree_seconds(pid) for pid in pids}
        with CpuMeter() as cpu:
            seconds = peer.drain(jobs)
        cpu.backend_s = sum(_process_tree_seconds(pid) - before[pid] for pid in pids)
        cpu.note = note
        verification = peer.verify(jobs)
    return DrainResult(
        jobs=jobs,
        dequeuers=dequeuers,
        batch=batch,
        seconds=seconds,
        verification=verification,
        first_job_s=peer.first_job_s,
        shutdown_s=peer.shutdown_s,
        cpu=cpu,
    )


def peer_lines(peer: Any, version: str) -> list[str]:
    """Return the pgqueuer peer's detail lines (rate, CPU, verification)."""
    from bench.pgqueuer_peer import verification_text as peer_verification_text

    return [
        f"pgqueuer {version}, {peer.dequeuers} dequeuers x batch {peer.batch}: drain {peer.rate:.0f} jobs/s "
        f"({peer.jobs} jobs in {peer.seconds:.2f} s, first job after {peer.first_job_s:.2f} s; "
        f"dequeuers' shutdown afterwards {peer.shutdown_s:.1f} s, not timed); {peer.cpu.note}; "
        f"{peer.cpu.per_task_ms(peer.jobs).replace('task', 'job')} (shutdown included)",
        peer_verification_text(peer.verification, peer.jobs),
    ]


# Report ----------------------------------------------------------------------------------


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """Return a Markdown table (readable as plain text too)."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"  # noqa: E731
    return "\n".join([line(header), "| " + " | ".join("-" * w for w in widths) + " |", *(line(r) for r in rows)])


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


def statements_table(
    service: dict[str, list[str]],
    http: dict[str, tuple[int, int, int]] | None,
    modes: list[ServiceMode],
    costs: dict[str, tuple[float, float, float]] | None = None,
    costs_note: str = "",
) -> str:
    """Return the statement-count tables (service layer with per-call costs, and per HTTP request)."""
    costs = costs or {}
    rows = []
    for op, sqls in service.items():
        cost = costs.get(op)
        cells = [f"{c:.2f}" for c in cost] if cost else ["", "", ""]
        rows.append([op, str(len(sqls)), *cells, summarize_sqls(sqls)])
    for mode in modes:
        ops = mode.calls
        per_task = sum(len(service[op]) / size for op, size in ops)
        transactions = sum(sum(1 for sql in service[op] if sql.strip().upper() == "BEGIN") / size for op, size in ops)
        total = ["", "", ""]
        if all(op in costs for op, _ in ops):
            total = [f"{sum(costs[op][k] / size for op, size in ops):.2f}" for k in range(3)]
        rows.append(
            [
                f"per task, {mode.name} (submit/{mode.submit_batch} + claim/{mode.claim_max} + "
                f"complete/{mode.complete_batch})",
                f"{per_task:.2f}",
                *total,
                f"{transactions:.2f} transactions",
            ]
        )
    header = [
        "service call",
        "statements",
        "Python CPU ms",
        "PostgreSQL CPU ms",
        "wall ms",
        "statements in order (BEGIN and COMMIT included)",
    ]
    text = markdown_table(header, rows)
    text += (
        "\n\nCosts per call on one thread with nothing else of ours running "
        "(Python CPU: that thread; PostgreSQL CPU: its backend)" + (f"; {costs_note}." if costs_note else ".")
    )
    if http:
        http_rows = [[op, str(n), str(opened), str(started)] for op, (n, opened, started) in http.items()]
        header = [
            "HTTP request (in-process)",
            "statements (BEGIN/COMMIT not counted)",
            "connections Django opened (or took from its pool)",
            "new PostgreSQL sessions",
        ]
        text += "\n\n" + markdown_table(header, http_rows)
    return text


def summarize_sqls(sqls: list[str], limit: int = 24) -> str:
    """Return the statements' labels in order, a run of the same label as one (``INSERT task (x100)``).

    A batched call can run hundreds of statements; past ``limit`` labels the rest is counted.
    """
    runs: list[list[Any]] = []
    for label in (summarize_sql(sql) for sql in sqls):
        if runs and runs[-1][0] == label:
            runs[-1][1] += 1
        else:
            runs.append([label, 1])
    labels = [label if count == 1 else f"{label} (x{count})" for label, count in runs]
    if len(labels) > limit:
        labels = [*labels[:limit], f"... {len(labels) - limit} more"]
    return ", ".join(labels)


def summarize_sql(sql: str) -> str:
    """Return a short label for one statement, e.g. ``SELECT run FOR KEY SHARE``."""
    text = " ".join(sql.split())
    verb = text.split(" ", 1)[0].upper()
    table = re.search(r'(?:FROM|INTO|UPDATE) "coordination_(\w+)"', text)
    label = f"{verb} {table.group(1)}" if table else verb
    for clause in ("FOR KEY SHARE", "FOR NO KEY UPDATE", "FOR UPDATE SKIP LOCKED", "FOR UPDATE"):
        if clause in text:
            label += f" {clause}"
            break
    if verb == "INSERT" and table:
        label += f" x{text.count('), (') + 1}" if "), (" in text else ""
    return label


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
            f"### `bench/throughput.py` — {now}, commit {git_revision()}",
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


def django_version() -> str:
    """Return Django's version string."""
    import django

    return django.get_version()


# JSON ------------------------------------------------------------------------------------


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


def write_json(path: Path, figures: dict[str, Any]) -> None:
    """Write ``figures`` to ``path`` (indented, keys in the order given)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(figures, indent=2) + "\n")


def peer_settings(args: argparse.Namespace) -> str:
    """Return how the pgqueuer peer ran, for the record."""
    if not args.pgqueuer:
        return "no pgqueuer peer"
    return f"pgqueuer N={args.pgqueuer_jobs} ({args.pgqueuer_dequeuers} dequeuers x batch {args.pgqueuer_batch})"


# Main ------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(prog="python -m bench.throughput", description=__doc__.split("\n\n")[0])
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


# The SDK's consume loop ---------------------------------------------------------------------


def sdk_consume_drain(
    base_url: str,
    api_key: str,
    *,
    tasks: int = 2_000,
    concurrency: int = 8,
    mailbox: str = "bench-sdk",
    timeout_s: float = 600.0,
    verify: Callable[[uuid.UUID, int], dict[str, Any]] | None = None,
) -> float:
    """Return the tasks/s of the real ``consume`` loop draining a backlog; self-contained.

    In a fresh run on ``mailbox`` (a WORK mailbox, ensured) of the server at ``base_url``,
    ``tasks`` no-op tasks are submitted with ``submit_many`` (1,000 a request) before the
    clock starts. Then one ``AsyncRunstate`` worker (``concurrency`` async handlers that
    return at once; completions buffered and renewals batched, as shipped) drains them: the
    time runs from the start of the loop until its summary has recorded every task as
    completed. Raises ``RuntimeError`` if a task failed or was lost, or the backlog did not
    drain within ``timeout_s``. ``verify`` (e.g. ``verify_run``) is called with the run id
    and ``tasks`` afterwards; a result without ``ok`` raises too.
    """
    import asyncio

    from runstate import AsyncRunstate

    async def drain() -> tuple[str, float]:
        async with AsyncRunstate(base_url=base_url, api_key=api_key, timeout=60) as rs:
            await rs.mailboxes.ensure(mailbox, mode="WORK")
            run = await rs.scopes.create(name=f"bench sdk consume c={concurrency}")
            await run.tasks.submit_many(mailbox, [{"input": {"i": i}} for i in range(tasks)])

            async def handler(ctx: Any) -> None:
                return None

            worker = run.worker(mailbox, handler, concurrency=concurrency, handle_signals=False)
            started = time.perf_counter()
            running = asyncio.create_task(worker.run())
            while worker.summary.completed < tasks:
                summary = worker.summary
                if running.done() or summary.failed or summary.lost or time.perf_counter() > started + timeout_s:
                    worker.stop()
                    await asyncio.gather(running, return_exceptions=True)
                    raise RuntimeError(f"consume did not drain {tasks} tasks: {summary}")
                await asyncio.sleep(0.005)
            elapsed = time.perf_counter() - started
            worker.stop()
            await running
            return run.id, elapsed

    run_id, elapsed = asyncio.run(drain())
    if verify is not None:
        verification = verify(uuid.UUID(run_id), tasks)
        if not verification.get("ok"):
            raise RuntimeError(f"consume drained, but the run does not verify: {verification}")
    return tasks / elapsed


if __name__ == "__main__":
    sys.exit(main())
