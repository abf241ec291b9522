"""The same-run baseline: ``pgbench -N`` against the same PostgreSQL server, with its CPU per transaction.

Also the NOTIFY probe: a one-row INSERT transaction with and without ``pg_notify``.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from bench.harness.env import db_params, ensure_database
from bench.harness.meters import QUIET, machine_jiffies, process_tree_seconds, wait_for_quiet
from bench.pooler import BenchPgBouncer

PGBENCH_DATABASE = "runstate_pgbench"


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
    machine_before = machine_jiffies()
    process = subprocess.Popen(
        [pgbench, "-N", "-c", str(clients), "-j", str(clients), "-T", str(seconds), PGBENCH_DATABASE],
        env=pgbench_env(url),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(min(1.0, seconds / 4))
    pids = _pgbench_backends(url)
    first = {pid: process_tree_seconds(pid) for pid in pids}
    window_start = last_sample = time.perf_counter()
    last = dict(first)
    while process.poll() is None:
        time.sleep(0.25)
        sample = {pid: process_tree_seconds(pid) for pid in pids}
        if all(sample[pid] >= last[pid] for pid in pids) and any(Path(f"/proc/{pid}").exists() for pid in pids):
            last, last_sample = sample, time.perf_counter()
    stdout, stderr = process.communicate()
    if process.returncode:
        raise RuntimeError(f"pgbench failed ({process.returncode}): {stderr}")
    busy, total = machine_jiffies()
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
    before = process_tree_seconds(bouncer.pid)
    result = pgbench_run(pgbench, bouncer.url, clients, seconds)
    pooler_ms = 1000 * (process_tree_seconds(bouncer.pid) - before) / (result.tps * seconds)
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
