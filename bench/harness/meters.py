"""What a phase cost: CPU of the machine, this process, PostgreSQL and the servers; the database's WAL.

``CpuMeter`` and ``DatabaseMeter`` wrap a timed block; ``wait_for_quiet`` holds a phase back
until the shared machine is idle enough (``QUIET``, set from the command line).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from bench.harness.env import db_params

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def machine_jiffies() -> tuple[int, int]:
    """Return (busy, total) jiffies of all CPUs from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


def process_tree_seconds(pid: int) -> float:
    """Return user+system CPU seconds of ``pid`` and its descendants (0 if gone)."""
    total = 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / CLK_TCK
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except (OSError, IndexError, ValueError):
        return total
    return total + sum(process_tree_seconds(int(child)) for child in children)


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


def postgres_seconds(pid: int | None) -> float:
    """Return CPU-seconds of the whole PostgreSQL server: live processes plus reaped backends."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        reaped = (int(fields[13]) + int(fields[14])) / CLK_TCK  # cutime + cstime
    except (OSError, IndexError, ValueError):
        return 0.0
    return reaped + process_tree_seconds(pid)


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
        self._machine = machine_jiffies()[0]
        times = os.times()
        self._own = times.user + times.system
        self._server = process_tree_seconds(self.server_pid) if self.server_pid else 0.0
        self._pooler = process_tree_seconds(self.pooler_pid) if self.pooler_pid else 0.0
        self._postgres = postgres_seconds(POSTMASTER["pid"])
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = time.perf_counter() - self._wall
        times = os.times()
        self.machine_s = (machine_jiffies()[0] - self._machine) / CLK_TCK
        self.bench_s = times.user + times.system - self._own
        self.server_s = process_tree_seconds(self.server_pid) - self._server if self.server_pid else 0.0
        self.pooler_s = process_tree_seconds(self.pooler_pid) - self._pooler if self.pooler_pid else 0.0
        self.postgres_s = postgres_seconds(POSTMASTER["pid"]) - self._postgres

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
    busy, total = machine_jiffies()
    time.sleep(seconds)
    busy2, total2 = machine_jiffies()
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


QUIET = {"threshold_pct": 25.0, "max_wait_s": 0.0}  # set from --quiet-threshold / --max-quiet-wait


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
        self._cpu = {pid: process_tree_seconds(pid) for (pid,) in self._conn.execute(DATABASE_BACKENDS_SQL)}
        return self

    def __exit__(self, *exc) -> None:
        import psycopg

        try:
            pids = [pid for (pid,) in self._conn.execute(DATABASE_BACKENDS_SQL)]
            query = "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)::bigint"
            self.figures = {
                "backend_cpu_s": sum(process_tree_seconds(pid) - self._cpu.get(pid, 0.0) for pid in pids)
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


_meter_db = None  # the CPU meter's own connection (psycopg), kept for the whole run


class PolledCpuMeter:
    """CPU (ms) of a process tree (``worker_ms``) and of the benchmark database's backends (``postgres_ms``).

    Unlike ``DatabaseMeter``, it polls ``pg_stat_activity`` every 0.1 s, so backends that come
    and go during the block count too (bench.celery: a Celery worker's connections); one
    that lives less than a poll is still missed, so with a connection per task the PostgreSQL
    figure is a lower bound. This process's own backend is left out.
    """

    def __init__(self, worker_pid: int) -> None:
        import psycopg
        from django.db import connection

        global _meter_db
        self.worker_pid = worker_pid
        if _meter_db is None or _meter_db.closed:
            # Opened once and kept: a busy server may have no connection to spare later.
            _meter_db = psycopg.connect(os.environ["DATABASE_URL"], autocommit=True)
        self._db = _meter_db
        # This process's own backend (it polls for the tasks' end) is not the worker's cost.
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            self._own = cursor.fetchone()[0]
        self._stop = threading.Event()
        self._backends: dict[int, tuple[float, float]] = {}  # pid -> (CPU at first sight, last seen)

    def _poll(self) -> None:
        rows = self._db.execute(
            "SELECT pid, backend_start >= %s FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND pid <> %s",
            [self._started_at, self._own],
        ).fetchall()
        for pid, new in rows:
            used = 1000 * process_tree_seconds(pid)
            first, _ = self._backends.get(pid, (0.0 if new else used, used))
            self._backends[pid] = (first, max(used, self._backends.get(pid, (0, 0))[1]))

    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            self._poll()

    def __enter__(self) -> PolledCpuMeter:
        self._started_at = self._db.execute("SELECT now()").fetchone()[0]
        self._worker_before = 1000 * process_tree_seconds(self.worker_pid)  # its pool's children too
        self._poll()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._poll()
        self.worker_ms = 1000 * process_tree_seconds(self.worker_pid) - self._worker_before
        self.postgres_ms = sum(last - first for first, last in self._backends.values())


def wait_idle(pids: list[int], timeout_s: float = 20.0) -> float:
    """Return once the processes used under 50 ms of CPU each in a second, twice in a row (at most ``timeout_s``).

    Return the CPU seconds they had used (together) when they went quiet.
    """
    deadline = time.monotonic() + timeout_s
    quiet = 0
    before = [process_tree_seconds(pid) for pid in pids]
    went_quiet = sum(before)
    while quiet < 2 and time.monotonic() < deadline:
        time.sleep(1)
        after = [process_tree_seconds(pid) for pid in pids]
        if all(b - a < 0.05 for a, b in zip(before, after, strict=True)):
            went_quiet = sum(before) if quiet == 0 else went_quiet
            quiet += 1
        else:
            quiet = 0
        before = after
    return went_quiet
