"""``python -m bench.celery``: start a worker per size, run both scenarios on it, report (see the package)."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import redis

from bench import celery as package
from bench.celery.figures import CPU_HEADER, TABLE_HEADER, json_figures
from bench.celery.tasks import COUNTER, QUEUE, noop, plain_noop
from bench.harness.celery_worker import celery_worker_command
from bench.harness.env import RECORD_PATH, ROOT, ensure_database, git_revision
from bench.harness.meters import PolledCpuMeter, wait_for_quiet
from bench.harness.report import write_json
from bench.harness.threads import in_threads, wait_for

_worker: subprocess.Popen | None = None


def start_worker(processes: int, log_path: Path) -> subprocess.Popen:
    command = celery_worker_command(pool="prefork", concurrency=processes, include="bench.celery.tasks", queue=QUEUE)
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
    with PolledCpuMeter(_worker.pid) as meter:
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
        with PolledCpuMeter(_worker.pid) as meter:
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
    parser = argparse.ArgumentParser(prog="python -m bench.celery", description=package.__doc__.splitlines()[0])
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

    ensure_database(os.environ["DATABASE_URL"])  # tasks set its default
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
                quiet = wait_for_quiet(100 * args.quiet_threshold, args.max_quiet_wait)
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
        write_json(args.json, json_figures(results, cpu_results, all_exact))
        print(f"figures written to {args.json}")
    if args.record:
        record(args, [*lines, "", *CPU_HEADER, *cpu_lines], quiet_notes)
    return 0 if all_exact else 1


def record(args, lines: list[str], quiet_notes: list[str]) -> None:
    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    section = [
        "",
        f"### `bench.celery` — {when}, revision {git_revision()}",
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
