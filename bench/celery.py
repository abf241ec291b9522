"""Celery throughput: tasks through ``@runstate_task`` against a plain Celery no-op, same run, same worker.

    .venv/bin/python -m bench.celery [--tasks N] [--processes 2,4] [--submitters S] [--record] [--json PATH]

For each worker size W (prefork, ``--concurrency=W``), one ``celery worker`` process serves
both scenarios, one after the other:

* plain: N messages of a plain ``@shared_task`` whose body is one Redis ``INCR`` (how the
  benchmark learns it ran); time from the first send until the counter reaches N;
* runstate: N ``noop.submit(run, {})`` calls (a task row, its event, the Celery message
  after commit), each executed by the decorated no-op (claim by id under a lease, the
  process's shared renewer, complete); time from the first submit until N tasks are
  ``SUCCEEDED``.

S threads (``--submitters``, default 2) send or submit in both scenarios; the submitting
process keeps mailboxes in its process cache, as API and worker processes do. The ratio
runstate / plain is what the guarantees cost: two short transactions per task (claim,
complete) plus the submit's, on PostgreSQL. Afterwards one query checks every task
``SUCCEEDED`` exactly once (``attempts = 1``, N ``task.succeeded`` events).

Drain scenarios also report CPU milliseconds per task: the worker's (its main process and
pool children, from /proc) and PostgreSQL's (the backends connected to the benchmark
database, polled every 0.1 s from ``pg_stat_activity``; a backend that comes and goes
between two polls is missed, so with a connection per task that figure is a lower bound).
``--json PATH`` writes the figures of 2 worker processes (``plain_drain_per_s``,
``runstate_drain_per_s``, ``ratio_drain``, ``plain_pipeline_per_s``,
``runstate_pipeline_per_s``, ``ratio_pipeline``, and the CPU figures) and of every size.

Needs PostgreSQL (``DATABASE_URL``, default
``postgres://postgres@127.0.0.1:5432/runstate_bench_celery``, created and migrated when
missing) and Redis (``--broker``, default ``redis://127.0.0.1:6379/12``; the benchmark
FLUSHES that Redis database). ``--record`` appends the figures to docs/benchmarks.md.
Not a test: pytest never collects this module.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "runstate_project.settings")
os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/runstate_bench_celery")
os.environ.setdefault("CELERY_BROKER_URL", "redis://127.0.0.1:6379/12")
os.environ.setdefault("DEBUG", "0")
os.environ.setdefault("SECRET_KEY", "runstate-bench-not-a-secret")
os.environ.setdefault("LOG_LEVEL", "WARNING")

if __name__ == "__main__":
    # Before Django starts: create the benchmark database when it is missing.
    import dj_database_url
    import psycopg

    _db = dj_database_url.parse(os.environ["DATABASE_URL"])
    _admin = {
        "host": _db["HOST"] or "127.0.0.1",
        "port": _db["PORT"] or 5432,
        "user": _db["USER"],
        "password": _db["PASSWORD"] or None,
    }
    with psycopg.connect(dbname="postgres", autocommit=True, **_admin) as _conn:
        if not _conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [_db["NAME"]]).fetchone():
            _conn.execute(f'CREATE DATABASE "{_db["NAME"]}"')

import django  # noqa: E402
from django.apps import apps  # noqa: E402

if not apps.ready:
    django.setup()

import argparse  # noqa: E402
import datetime as dt  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import redis  # noqa: E402
from celery import shared_task  # noqa: E402

from workers import runstate_task  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RECORD_PATH = ROOT / "docs" / "benchmarks.md"
QUEUE = "bench-celery"
COUNTER = "bench-celery:plain-done"
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


@runstate_task(mailbox="bench-noop", project="bench-celery", lease_ttl=30, name="bench.celery.noop", queue=QUEUE)
def noop(ctx):
    """Do nothing: what is measured is runstate's claim, heartbeat and completion around it."""
    return None


_counter_client: redis.Redis | None = None


@shared_task(name="bench.celery.plain_noop", ignore_result=True, acks_late=True, queue=QUEUE)
def plain_noop():
    """Do nothing but count (the benchmark's only way to see that it ran)."""
    global _counter_client
    if _counter_client is None:
        _counter_client = redis.Redis.from_url(os.environ["CELERY_BROKER_URL"])
    _counter_client.incr(COUNTER)


def machine_busy(interval_s: float = 1.0) -> float:
    """Return the fraction of all CPUs busy over ``interval_s`` (from /proc/stat; 0 where unavailable)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as handle:
            fields = [int(value) for value in handle.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return idle, sum(fields)

    try:
        idle_before, total_before = sample()
        time.sleep(interval_s)
        idle_after, total_after = sample()
    except OSError:
        return 0.0
    total = total_after - total_before
    return 1 - (idle_after - idle_before) / total if total else 0.0


def wait_for_quiet(threshold: float, max_wait_s: float) -> str:
    """Wait until the machine is less than ``threshold`` busy (at most ``max_wait_s``); say what was found."""
    deadline = time.monotonic() + max_wait_s
    busy = machine_busy()
    while busy >= threshold and time.monotonic() < deadline:
        busy = machine_busy(2.0)
    return f"{'quiet' if busy < threshold else 'BUSY'} ({busy:.0%} busy before)"


_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_ms(pid: int) -> float:
    """Return the CPU time (user + system) process ``pid`` used so far, in ms; 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) * 1000 / _TICKS_PER_S


def process_tree(pid: int) -> list[int]:
    """Return ``pid`` and its descendants (from /proc/*/stat)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    parents[int(entry)] = int(handle.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    tree, frontier = [pid], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        tree.extend(frontier)
    return tree


_meter_db = None  # the CPU meter's own connection (psycopg), kept for the whole run


class CpuMeter:
    """CPU used by the worker's process tree and by the benchmark database's PostgreSQL backends."""

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
            used = cpu_ms(pid)
            first, _ = self._backends.get(pid, (0.0 if new else used, used))
            self._backends[pid] = (first, max(used, self._backends.get(pid, (0, 0))[1]))

    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            self._poll()

    def __enter__(self) -> CpuMeter:
        self._started_at = self._db.execute("SELECT now()").fetchone()[0]
        self._worker_pids = process_tree(self.worker_pid)
        self._worker_before = sum(cpu_ms(pid) for pid in self._worker_pids)
        self._poll()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._poll()
        self.worker_ms = sum(cpu_ms(pid) for pid in self._worker_pids) - self._worker_before
        self.postgres_ms = sum(last - first for first, last in self._backends.values())


_worker: subprocess.Popen | None = None


def start_worker(processes: int, log_path: Path) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "runstate_project",
        "worker",
        "--pool=prefork",
        f"--concurrency={processes}",
        "--include=bench.celery",
        f"--queues={QUEUE}",
        "--loglevel=WARNING",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
    ]
    global _worker
    log = open(log_path, "ab")  # noqa: SIM115 - the child owns it until it exits
    _worker = subprocess.Popen(command, cwd=ROOT, env=dict(os.environ), stdout=log, stderr=subprocess.STDOUT)
    return _worker


def stop_worker(worker: subprocess.Popen) -> None:
    worker.terminate()
    try:
        worker.wait(30)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait()


def in_threads(count: int, threads: int, action) -> None:
    """Call ``action(i)`` for i in range(count), spread over ``threads`` threads."""
    from django.db import connection

    def work(start: int) -> None:
        try:
            for i in range(start, count, threads):
                action(i)
        finally:
            connection.close()

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.02)


def pause_consuming() -> None:
    """Have the worker stop taking messages from the benchmark queue (Celery remote control)."""
    from runstate_project.celery import app

    if not app.control.cancel_consumer(QUEUE, reply=True, limit=1, timeout=10):
        raise SystemExit("the worker did not answer cancel_consumer")


def resume_consuming() -> None:
    from runstate_project.celery import app

    if not app.control.add_consumer(QUEUE, reply=True, limit=1, timeout=10):
        raise SystemExit("the worker did not answer add_consumer")


CPU: dict[str, tuple[float, float]] = {}  # scenario -> (worker ms, PostgreSQL ms) per task, last drain


def run_plain(broker: redis.Redis, tasks: int, submitters: int, drain: bool = False) -> float:
    """Return tasks/s: from the first send to the last run, or (``drain``) of a queue filled beforehand."""
    broker.delete(COUNTER)
    if drain:
        pause_consuming()
    started = time.perf_counter()
    in_threads(tasks, submitters, lambda i: plain_noop.apply_async())
    if not drain:
        wait_for(lambda: int(broker.get(COUNTER) or 0) >= tasks, 600, "the plain tasks")
        return tasks / (time.perf_counter() - started)
    with CpuMeter(_worker.pid) as meter:
        started = time.perf_counter()
        resume_consuming()
        wait_for(lambda: int(broker.get(COUNTER) or 0) >= tasks, 600, "the plain tasks")
        elapsed = time.perf_counter() - started
    CPU["plain"] = (meter.worker_ms / tasks, meter.postgres_ms / tasks)
    return tasks / elapsed


def run_runstate(tasks: int, submitters: int, drain: bool = False) -> tuple[float, float, bool]:
    """Return (tasks/s as ``run_plain`` measures it, submit-only tasks/s, exactly-once check)."""
    from coordination.models import Event, Task
    from coordination.services.runs import run_create

    run = run_create(project_id=noop.project_id, name="bench")
    if drain:
        pause_consuming()
    started = submit_started = time.perf_counter()
    in_threads(tasks, submitters, lambda i: noop.submit(run.id, {}))
    submit_done = time.perf_counter()

    def all_done() -> bool:
        return Task.objects.filter(run=run, state="SUCCEEDED").count() >= tasks

    if drain:
        with CpuMeter(_worker.pid) as meter:
            started = time.perf_counter()
            resume_consuming()
            wait_for(all_done, 600, "the runstate tasks")
            elapsed = time.perf_counter() - started
        CPU["runstate"] = (meter.worker_ms / tasks, meter.postgres_ms / tasks)
    else:
        wait_for(all_done, 600, "the runstate tasks")
        elapsed = time.perf_counter() - started
    rows = Task.objects.filter(run=run)
    events = Event.objects.filter(run_id=run.id, type="task.succeeded")
    exactly_once = (
        rows.count() == tasks
        and not rows.exclude(state="SUCCEEDED", attempts=1).exists()
        and events.count() == tasks
        and events.values("subject_id").distinct().count() == tasks
    )
    return tasks / elapsed, tasks / (submit_done - submit_started), exactly_once


def warm_up(broker: redis.Redis) -> None:
    """Wait until the worker runs tasks of both kinds (pool started, connections open)."""
    run_plain(broker, 8, 1)
    run_runstate(8, 1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.celery", description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=2000, help="tasks per scenario (default 2000)")
    parser.add_argument("--processes", default="2,4", help="worker sizes, comma-separated (default 2,4)")
    parser.add_argument("--submitters", type=int, default=2, help="threads sending or submitting (default 2)")
    parser.add_argument("--repeat", type=int, default=1, help="rounds per size; the median is reported")
    parser.add_argument("--record", action="store_true", help="append the figures to docs/benchmarks.md")
    parser.add_argument("--json", metavar="PATH", help="write the figures (2 processes at the top level) as JSON")
    parser.add_argument("--quiet-threshold", type=float, default=0.25, help="wait for the machine below this busy")
    parser.add_argument("--max-quiet-wait", type=float, default=300, help="seconds to wait for a quiet machine")
    args = parser.parse_args(argv)
    sizes = [int(size) for size in args.processes.split(",")]

    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    # The submitting process reads the mailbox from the process cache, as an API process or a
    # worker does (``RunstateTask.submit``; issue 27).
    from coordination.plumbing import process_cache

    process_cache.enable()
    broker_url = os.environ["CELERY_BROKER_URL"]
    broker = redis.Redis.from_url(broker_url)
    broker.flushdb()
    log_path = ROOT / "var" / "bench-celery-worker.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"PostgreSQL {os.environ['DATABASE_URL'].rsplit('/', 1)[-1]}, broker {broker_url}, worker log {log_path}")
    print(f"{args.tasks} tasks per scenario, {args.submitters} submitting threads, {os.cpu_count()} CPUs")

    results = []
    cpu_results: dict[int, list[float]] = {}
    quiet_notes: list[str] = []
    all_exact = True
    for size in sizes:
        worker = start_worker(size, log_path)
        try:
            warm_up(broker)
            rounds = []
            for _ in range(args.repeat):
                quiet = wait_for_quiet(args.quiet_threshold, args.max_quiet_wait)
                quiet_notes.append(quiet)
                plain = run_plain(broker, args.tasks, args.submitters)
                guarded, submitted, exact = run_runstate(args.tasks, args.submitters)
                plain_drain = run_plain(broker, args.tasks, args.submitters, drain=True)
                guarded_drain, _, exact_drain = run_runstate(args.tasks, args.submitters, drain=True)
                all_exact = all_exact and exact and exact_drain
                cpu = (*CPU["plain"], *CPU["runstate"])
                rounds.append((plain, guarded, submitted, plain_drain, guarded_drain, *cpu))
                print(
                    f"  {size} processes: pipeline plain {plain:5.0f}/s runstate {guarded:4.0f}/s "
                    f"(submit only {submitted:4.0f}/s); drain plain {plain_drain:5.0f}/s runstate "
                    f"{guarded_drain:4.0f}/s; exactly once: {'yes' if exact and exact_drain else 'NO'}; {quiet}"
                )
                print(
                    "    CPU ms per task (drain): plain worker {:.2f} PostgreSQL {:.2f}; "
                    "runstate worker {:.2f} PostgreSQL {:.2f}".format(*cpu)
                )
        finally:
            stop_worker(worker)
        medians = [statistics.median(column) for column in zip(*rounds, strict=True)]
        results.append((size, *medians[:5]))
        cpu_results[size] = medians[5:]

    lines = [
        f"| {size} | {plain:.0f} | {guarded:.0f} | {guarded / plain:.2f} | {submitted:.0f} "
        f"| {plain_drain:.0f} | {guarded_drain:.0f} | {guarded_drain / plain_drain:.2f} |"
        for size, plain, guarded, submitted, plain_drain, guarded_drain in results
    ]
    cpu_lines = [
        f"| {size} | {plain_w:.2f} | {plain_pg:.2f} | {guarded_w:.2f} | {guarded_pg:.2f} |"
        for size, (plain_w, plain_pg, guarded_w, guarded_pg) in cpu_results.items()
    ]
    print()
    print("\n".join([*TABLE_HEADER, *lines]))
    print()
    print("\n".join([*CPU_HEADER, *cpu_lines]))
    if args.json:
        write_json(args.json, results, cpu_results, all_exact)
    if args.record:
        record(args, [*lines, "", *CPU_HEADER, *cpu_lines], quiet_notes)
    return 0 if all_exact else 1


def write_json(path: str, results: list[tuple], cpu_results: dict[int, list[float]], exact: bool) -> None:
    """Write the figures: the top-level keys are those of 2 worker processes (else the first size)."""
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
    document = {**top, "processes": {str(size): figures for size, figures in sizes.items()}, "exactly_once": exact}
    Path(path).write_text(json.dumps(document, indent=2) + "\n")
    print(f"figures written to {path}")


def record(args, lines: list[str], quiet_notes: list[str]) -> None:
    try:
        revision = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        revision = os.environ.get("BENCH_GIT_REVISION", "unknown")
    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    section = [
        "",
        f"### `bench/celery.py` — {when}, revision {revision}",
        "",
        f"{platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()}; "
        f"{args.tasks} tasks per scenario, {args.submitters} submitting threads, median of {args.repeat}; "
        f"machine before each round: {', '.join(quiet_notes)}.",
        "",
        *TABLE_HEADER,
        *lines,
        "",
    ]
    with open(RECORD_PATH, "a") as handle:
        handle.write("\n".join(section))
    print(f"recorded in {RECORD_PATH}")


if __name__ == "__main__":
    sys.exit(main())
