"""Timers: 10,000 timers due within the same second, fired by a real Celery worker and beat.

Each timer gets its ETA message at creation (as ``timer_create`` does) and the 1 s sweep is the
safety net. Prints p50/p99/max lateness (fired time minus due time) and the fire rate, for
each of ``--runs`` bursts (default 5, one worker and beat for all of them, a fresh run of
timers each). ``--json PATH`` writes ``timer_lateness_p99_ms_runs`` (one p99 per run),
``timer_lateness_p99_ms_max`` (the worst of them) and the p50 and max of each run.
Run: ``.venv/bin/python -m bench.timers [--timers N] [--runs R] [--lead S] [--concurrency N] [--json PATH]``.
"""

import argparse
import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import timedelta

from bench.harness.env import ROOT, bench_environment, setup_django
from bench.harness.report import write_json
from bench.harness.threads import percentile

BROKER_URL = os.environ.get("RUNSTATE_BENCH_BROKER_URL", "redis://127.0.0.1:6379/11")


def start(command: list[str], log_name: str) -> subprocess.Popen:
    log = (ROOT / "var" / log_name).open("w")
    env = {**bench_environment(), "CELERY_BROKER_URL": BROKER_URL}
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=log, start_new_session=True)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--timers", type=int, default=10_000)
    parser.add_argument("--lead", type=float, default=30.0, help="seconds between creation and the due second")
    parser.add_argument("--concurrency", type=int, default=8, help="worker threads")
    parser.add_argument("--runs", type=int, default=5, help="bursts, one after the other")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args()
    setup_django()

    import redis

    os.environ["CELERY_BROKER_URL"] = BROKER_URL
    from runstate_project.celery import app

    app.conf.broker_url = BROKER_URL
    redis.Redis.from_url(BROKER_URL).flushdb()
    (ROOT / "var").mkdir(exist_ok=True)
    celery = [sys.executable, "-m", "celery", "-A", "runstate_project"]
    worker = start(
        [
            *celery,
            "worker",
            "--pool=threads",
            f"--concurrency={args.concurrency}",
            "--loglevel=WARNING",
            "--without-gossip",
            "--without-mingle",
        ],
        "bench-timers-worker.log",
    )
    beat = start(
        [*celery, "beat", "--loglevel=WARNING", "--scheduler", "django_celery_beat.schedulers:DatabaseScheduler"],
        "bench-timers-beat.log",
    )
    try:
        runs = [burst(args) for _ in range(args.runs)]
    finally:
        stop(beat)
        stop(worker)
    p99s = [round(r["p99_ms"], 1) for r in runs]
    print(f"p99 lateness per run (ms): {p99s}; worst {max(p99s):.0f} ms (target < 250 ms in every run)")
    if args.json:
        write_json(args.json, json_figures(runs))


def burst(args) -> dict:
    """Arm ``args.timers`` timers due within one second, wait until they fired; return the lateness figures."""
    from django.utils import timezone

    from coordination.models import Timer
    from coordination.services.keys import project_ensure
    from coordination.services.runs import run_create
    from workers.dispatch import dispatch_timer

    project = project_ensure(name=f"bench-timers-{uuid.uuid4().hex[:8]}")
    run = run_create(project_id=project.id)
    due_second = (timezone.now() + timedelta(seconds=args.lead)).replace(microsecond=0)
    spread = [due_second + timedelta(microseconds=int(i * 1_000_000 / args.timers)) for i in range(args.timers)]
    started = time.perf_counter()
    timers = Timer.objects.bulk_create(
        [Timer(project_id=project.id, run=run, run_path=run.path, fire_at=at) for at in spread], batch_size=2000
    )
    for timer in timers:
        dispatch_timer(timer.id, timer.fire_at)
    print(f"armed and dispatched {len(timers)} timers in {time.perf_counter() - started:.1f} s, due {due_second}")
    deadline = time.monotonic() + args.lead + 180
    while time.monotonic() < deadline:
        left = Timer.objects.filter(run=run, state="ARMED").count()
        if not left:
            break
        time.sleep(0.5)
    rows = list(Timer.objects.filter(run=run, state="FIRED").values_list("fire_at", "fired_at"))
    late_ms = [(fired - due).total_seconds() * 1000 for due, fired in rows]
    fired_times = sorted(fired for _, fired in rows)
    span = (fired_times[-1] - fired_times[0]).total_seconds() if len(fired_times) > 1 else 0.0
    print(f"fired {len(rows)}/{len(timers)} timers")
    print(
        f"lateness ms: p50 {percentile(late_ms, 0.5):.0f}, p99 {percentile(late_ms, 0.99):.0f}, "
        f"max {max(late_ms, default=0):.0f}; fire rate {len(rows) / span if span else float('nan'):,.0f} timers/s "
        f"over {span:.2f} s"
    )
    return {
        "p50_ms": percentile(late_ms, 0.5),
        "p99_ms": percentile(late_ms, 0.99),
        "max_ms": max(late_ms, default=0),
        "fired": len(rows),
    }


def json_figures(runs: list[dict]) -> dict:
    """Return what ``--json`` writes: each run's (``burst``'s) p50, p99 and worst lateness, and timers fired."""
    p99s = [round(r["p99_ms"], 1) for r in runs]
    return {
        "timer_lateness_p99_ms_runs": p99s,
        "timer_lateness_p99_ms_max": max(p99s),
        "timer_lateness_p50_ms_runs": [round(r["p50_ms"], 1) for r in runs],
        "timer_lateness_max_ms_runs": [round(r["max_ms"], 1) for r in runs],
        "timers_fired_runs": [r["fired"] for r in runs],
    }


if __name__ == "__main__":
    main()
