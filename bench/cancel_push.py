"""A cancel pushed to running handlers: from the cancel's commit to the handler's signal (issue 38).

On PostgreSQL, with the mailbox's default lease (30 s: a renewal every 10 s): ``--handlers``
(1,000) handlers running across ``--processes`` (4) worker processes of the Python SDK's
``consume`` and, with ``--typescript``, of the TypeScript SDK's and, with ``--celery``, of
Celery workers running ``@runstate_task`` handlers (``bench/cancel_push_celery.py``; the threads
pool, a thread per handler, behind PgBouncer in transaction mode as docs/deploy.md advises for
so many connections, the claim watch's LISTEN straight to PostgreSQL), each handler waiting
on its signal. Per round, ``--single`` (50) tasks are cancelled one by one (``POST /v1/tasks/{id}/
cancel``), then one run cancel covers every handler left. A handler's latency is from its
cancel's commit, taken as the arrival of the cancel's answer (sent once the transaction
committed; a signal that trips before it counts 0), to its signal tripping, both read from this
machine's clock; the same from the request's sending is printed beside it. Each worker records
which channel told a handler: the claim watch (``push``), a renewal, or its claim loop (a run's
refusal answered to its next claim call stops every handler of the loop, as fast as a push).

Rounds: ``--rounds`` (5) per language; one per language with the API process restarted while
the cancels are issued (through the services, the server down: every handler must still hear
its cancel once the watch reconnects; its latencies include the restart and are left out of
the p99; for Celery, whose watch reads the database itself, its LISTEN connections are
terminated instead, just before the cancels); one of the Python workers, and one of the
Celery workers, with the watch turned off: the renewal-only figures.

``push_cancel_missed`` counts the handlers, over every round with the watch on, that renewal
told or that nothing told within ``--timeout-s``. ``--json PATH`` writes ``push_cancel_p99_ms``
(``python``, ``typescript``, ``celery``: null for a language not measured),
``push_cancel_missed``, ``handlers``; per language ``renewal_only_p99_ms``,
``single_cancel_p99_ms``, ``run_cancel_p99_ms`` and ``from_request_p99_ms``; ``rounds``.
``--sqlite`` runs the same on the embedded default instead (no ``DATABASE_URL``: a fresh
SQLite file, ``var/bench-cancel-push.sqlite3``, where the watch polls the event log; not with
``--celery``, whose workers need PostgreSQL).
Run: ``.venv/bin/python -m bench.cancel_push [--typescript] [--celery]`` (``--celery`` needs
PgBouncer, ``scripts/ensure_pgbouncer.sh``, and Redis at ``CELERY_BROKER_URL``, by default
``redis://127.0.0.1:6379/13``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from bench.harness.celery_worker import celery_worker_command
from bench.harness.env import ROOT, bench_environment, setup_django
from bench.harness.fixtures import http_fixture
from bench.harness.report import write_json
from bench.harness.servers import UvicornServer
from bench.harness.threads import percentile

MAILBOX = "bench-push"
CELERY_BROKER_URL = "redis://127.0.0.1:6379/13"
TS_WORKER = ROOT / "bench" / "cancel_push_worker.mjs"
TS_DIST = ROOT / "sdk" / "typescript" / "dist" / "src" / "index.js"


# The worker processes -----------------------------------------------------------------------


def python_worker(url: str, key: str, run_id: str, concurrency: int, renewal_only: bool) -> None:
    """Consume ``run_id``; print ``start <task>`` and ``trip <task> <time> <reason> <push|renewal>`` lines."""
    from runstate import AsyncRunstate
    from runstate._worker import engine, watch

    if renewal_only:
        watch.PATH = "/claims/watch-off"  # a 404: the loop keeps renewal alone
    # Which channel told each claim: the watch, a renewal, else the claim loop (a run's refusal
    # answered to its next claim call, which stops every handler of the loop at once).
    pushed: set[str] = set()
    renewed: set[str] = set()
    original_pushed, original_renewed = engine.Engine._pushed, engine.Engine._renewed

    def tracking_push(self, event_type: str, claim_id: str, data: dict) -> None:
        pushed.add(claim_id)
        original_pushed(self, event_type, claim_id, data)

    def tracking_renewal(self, held, result, sent) -> None:
        tripped = held.ctx.signal.is_set()
        original_renewed(self, held, result, sent)
        if not tripped and held.ctx.signal.is_set():
            renewed.add(held.claim.id)

    engine.Engine._pushed = tracking_push  # type: ignore[method-assign]
    engine.Engine._renewed = tracking_renewal  # type: ignore[method-assign]

    async def handler(ctx) -> None:
        print(f"start {ctx.task_id}", flush=True)
        try:
            await ctx.signal.wait()
        finally:  # also when the loop cancels the handler, its claim gone (a run cancel)
            source = "push" if ctx.claim_id in pushed else "renewal" if ctx.claim_id in renewed else "refusal"
            print(f"trip {ctx.task_id} {time.time():.6f} {ctx.stop_reason} {source}", flush=True)

    async def main() -> None:
        async with AsyncRunstate(url, key) as rs:
            await rs.scope(run_id).consume(MAILBOX, handler, concurrency=concurrency, drain_timeout=0.5)

    asyncio.run(main())


@dataclass
class Workers:
    """The worker processes of one round and what they printed."""

    processes: list[subprocess.Popen] = field(default_factory=list)
    started: set[str] = field(default_factory=set)
    trips: dict[str, tuple[float, str, str]] = field(default_factory=dict)  # task -> (time, reason, source)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def read(self, process: subprocess.Popen) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            parts = line.split()
            with self.lock:
                if parts[:1] == ["start"]:
                    self.started.add(parts[1])
                elif parts[:1] == ["trip"]:
                    self.trips[parts[1]] = (float(parts[2]), parts[3], parts[4])

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


# The Celery workers' environment: their broker, their project, PgBouncer (set by ``main``).
CELERY_ENV: dict[str, str] = {}


def celery_command(index: int, concurrency: int) -> list[str]:
    """A Celery worker running ``bench.cancel_push_celery`` with a thread per handler."""
    from bench.cancel_push_celery import QUEUE

    return celery_worker_command(
        pool="threads",
        concurrency=concurrency,
        include="bench.cancel_push_celery",
        queue=QUEUE,
        hostname=f"push{index}@%h",
    )


def start_workers(language: str, url: str, key: str, run_id: str, handlers: int, processes: int, renewal_only: bool):
    env = bench_environment() | {"PYTHONUNBUFFERED": "1"}
    if language == "celery":
        env |= CELERY_ENV | ({"BENCH_PUSH_RENEWAL_ONLY": "1"} if renewal_only else {})
    workers = Workers()
    for index in range(processes):
        share = handlers // processes + (1 if index < handlers % processes else 0)
        if language == "python":
            command = [sys.executable, "-m", "bench.cancel_push", "--worker", url, key, run_id, str(share)]
            command += ["--renewal-only"] if renewal_only else []
        elif language == "celery":
            command = celery_command(index, share)
        else:
            command = ["node", str(TS_WORKER), url, key, run_id, str(share), MAILBOX]
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        workers.processes.append(process)
        threading.Thread(target=workers.read, args=(process,), daemon=True).start()
    return workers


# One round -------------------------------------------------------------------------------------


@dataclass
class Round:
    language: str
    kind: str  # "push", "restart" or "renewal"
    single: list[float]  # ms from the cancel's commit (its answer), one per single cancel
    run: list[float]  # ms from the run cancel's commit, one per handler it stopped
    missed: int  # handlers that renewal told, or nothing did
    from_request: list[float] = field(default_factory=list)  # ms from each cancel's request, every handler


def wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def one_round(server: UvicornServer, key: str, language: str, kind: str, args) -> Round:
    import httpx

    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=f"{server.url}/v1", headers=headers, timeout=60) as http:
        run_id = http.post("/runs", json={"name": f"push {language} {kind}"}).raise_for_status().json()["id"]
        if language == "celery":
            tickets = submit_celery(run_id, args.handlers)
        else:
            tickets = []
            for start in range(0, args.handlers, 1000):
                items = [{"input": {"n": n}} for n in range(start, min(args.handlers, start + 1000))]
                answer = http.post(f"/mailboxes/{MAILBOX}/tasks/batch", json={"runId": run_id, "tasks": items})
                tickets += [task["id"] for task in answer.raise_for_status().json()["tasks"]]
        workers = start_workers(language, server.url, key, run_id, args.handlers, args.processes, kind == "renewal")
        try:
            if not wait_for(lambda: len(workers.started) >= args.handlers, 120):
                raise RuntimeError(f"only {len(workers.started)} of {args.handlers} handlers started")
            if kind == "restart" and language == "celery":
                cut_celery_listeners()
            elif kind == "restart":
                return restart_round(server, run_id, tickets, workers, language, args)
            sent: dict[str, tuple[float, float]] = {}
            for task_id in tickets[: args.single]:
                sent[task_id] = timed(lambda task_id=task_id: http.post(f"/tasks/{task_id}/cancel", json={}))
            run_sent = timed(lambda: http.post(f"/runs/{run_id}/cancel", json={"reason": "bench"}))
            for task_id in tickets[args.single :]:
                sent[task_id] = run_sent
            wait_for(lambda: len(workers.trips) >= args.handlers, args.timeout_s)
        finally:
            workers.stop()
    return measured(language, kind, tickets, sent, workers, args.single)


def submit_celery(run_id: str, handlers: int) -> list[str]:
    """Submit the decorated handler's tasks (their Celery messages follow each commit); return their ids."""
    from bench.cancel_push_celery import hold

    tickets: list[str] = []
    for start in range(0, handlers, 1000):
        tasks = hold.submit_many(uuid.UUID(run_id), [{"n": n} for n in range(start, min(handlers, start + 1000))])
        tickets += [str(task.id) for task in tasks]
    return tickets


def cut_celery_listeners() -> None:
    """Terminate the Celery workers' LISTEN connections (as a database restart would): their watches reconnect."""
    from django.db import connection

    from bench.pooler import LISTEN_APP_NAME

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = %s",
            [LISTEN_APP_NAME],
        )
        (cut,) = cursor.fetchone()
    if not cut:
        raise RuntimeError("no Celery worker's LISTEN connection to cut")


def restart_round(server: UvicornServer, run_id: str, tickets: list[str], workers: Workers, language: str, args):
    """Stop the API process, cancel through the services while it is down, start it again on its port."""
    from coordination.services.runs import run_cancel
    from coordination.services.tasks import task_cancel

    server.__exit__(None, None, None)
    project_id = project_of(run_id)
    sent: dict[str, tuple[float, float]] = {}
    for task_id in tickets[: args.single]:
        sent[task_id] = timed(lambda task_id=task_id: task_cancel(project_id=project_id, task_id=uuid.UUID(task_id)))
    run_sent = timed(lambda: run_cancel(project_id=project_id, run_id=uuid.UUID(run_id), reason="bench"))
    for task_id in tickets[args.single :]:
        sent[task_id] = run_sent
    server.__enter__()
    wait_for(lambda: len(workers.trips) >= args.handlers, args.timeout_s)
    workers.stop()
    return measured(language, "restart", tickets, sent, workers, args.single)


def timed(cancel) -> tuple[float, float]:
    """Call ``cancel``; return when it was sent and when its answer came (its commit, at most that late)."""
    sent = time.time()
    answer = cancel()
    if hasattr(answer, "raise_for_status"):
        answer.raise_for_status()
    return sent, time.time()


def project_of(run_id: str) -> uuid.UUID:
    from coordination.models import Run

    return Run.objects.values_list("project_id", flat=True).get(id=run_id)


def measured(language: str, kind: str, tickets: list[str], sent: dict, workers: Workers, single: int) -> Round:
    """The round's latencies: from each cancel's answer (its commit; a trip before the answer counts 0) and request.

    Missed: a handler renewal told, or none; the claim loop stopping every handler when the
    run's refusal answers its next claim call (``refusal``) is not a miss, it comes as fast.
    """
    with workers.lock:
        trips = dict(workers.trips)
    tripped = [t for t in tickets if t in trips]
    latencies = {t: max(0.0, trips[t][0] - sent[t][1]) * 1000 for t in tripped}
    missed = sum(1 for t in tickets if t not in trips or trips[t][2] == "renewal")
    return Round(
        language,
        kind,
        [latencies[t] for t in tickets[:single] if t in latencies],
        [latencies[t] for t in tickets[single:] if t in latencies],
        missed,
        [(trips[t][0] - sent[t][0]) * 1000 for t in tripped],
    )


# The figures ------------------------------------------------------------------------------------


def p99(values: list[float]) -> float | None:
    return round(percentile(values, 0.99), 1) if values else None


def json_figures(rounds: list[Round], handlers: int) -> dict[str, Any]:
    """Return what ``--json`` writes (see the module's docstring); a language not measured is null."""
    languages = ("python", "typescript", "celery")

    def of(language: str, kinds: tuple[str, ...], part: str = "all") -> list[float]:
        values: list[float] = []
        for r in rounds:
            if r.language == language and r.kind in kinds:
                values += (r.single if part != "run" else []) + (r.run if part != "single" else [])
        return values

    return {
        "push_cancel_p99_ms": {language: p99(of(language, ("push",))) for language in languages},
        "push_cancel_missed": sum(r.missed for r in rounds if r.kind in ("push", "restart")),
        "handlers": handlers,
        "renewal_only_p99_ms": {language: p99(of(language, ("renewal",))) for language in languages},
        "single_cancel_p99_ms": {language: p99(of(language, ("push",), "single")) for language in languages},
        "run_cancel_p99_ms": {language: p99(of(language, ("push",), "run")) for language in languages},
        "from_request_p99_ms": {
            language: p99([v for r in rounds if r.language == language and r.kind == "push" for v in r.from_request])
            for language in languages
        },
        "rounds": len(rounds),
    }


def report(rounds: list[Round]) -> None:
    for r in rounds:
        print(
            f"{r.language:<10} {r.kind:<8} single p50 {percentile(r.single, 0.5) if r.single else 0:7.1f} ms "
            f"p99 {p99(r.single) or 0:7.1f} ms | run cancel ({len(r.run)}) p50 "
            f"{percentile(r.run, 0.5) if r.run else 0:7.1f} ms p99 {p99(r.run) or 0:7.1f} ms | "
            f"from the request p99 {p99(r.from_request) or 0:7.1f} ms | missed {r.missed}"
        )


def celery_setup(stack: contextlib.ExitStack) -> str:
    """Start PgBouncer for the Celery workers, empty their queue, ensure their project; return its API key."""
    import redis

    from bench.pooler import BenchPgBouncer
    from coordination.services.keys import ALL_PERMISSIONS, api_key_create

    bouncer = stack.enter_context(BenchPgBouncer(os.environ["DATABASE_URL"], pool_size=20))
    broker = os.environ["CELERY_BROKER_URL"]
    redis.Redis.from_url(broker).flushdb()
    from bench.cancel_push_celery import PROJECT, hold

    CELERY_ENV.update(bouncer.server_env() | {"CELERY_BROKER_URL": broker, "BENCH_PUSH_PROJECT": PROJECT})
    issued = api_key_create(project_id=hold.project_id, permissions=list(ALL_PERMISSIONS), name="bench celery")
    return issued.plaintext


def use_fresh_sqlite() -> None:
    """Point this process and its children at a fresh embedded SQLite file (no ``DATABASE_URL``)."""
    path = ROOT / "var" / "bench-cancel-push.sqlite3"
    for stale in path.parent.glob(f"{path.name}*"):  # the file, its -wal and -shm
        stale.unlink()
    os.environ.update(DATABASE_URL="", RUNSTATE_SQLITE_PATH=str(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--handlers", type=int, default=1000)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--single", type=int, default=50, help="tasks cancelled one by one per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--typescript", action="store_true", help="also the TypeScript SDK (built in sdk/typescript)")
    parser.add_argument("--celery", action="store_true", help="also Celery workers (@runstate_task), behind PgBouncer")
    parser.add_argument("--no-renewal", action="store_true", help="skip the renewal-only round")
    parser.add_argument("--sqlite", action="store_true", help="the embedded default (a fresh SQLite file)")
    parser.add_argument("--timeout-s", type=float, default=30.0, help="how long a round waits for every trip")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    parser.add_argument("--worker", nargs=4, metavar=("URL", "KEY", "RUN", "CONCURRENCY"), help=argparse.SUPPRESS)
    parser.add_argument("--renewal-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        url, key, run_id, concurrency = args.worker
        python_worker(url, key, run_id, int(concurrency), args.renewal_only)
        return
    if args.typescript and not TS_DIST.exists():
        sys.exit(f"--typescript needs the built SDK ({TS_DIST}): cd sdk/typescript && npm ci && npm run build")
    if args.celery:
        if args.sqlite:
            sys.exit("--celery needs PostgreSQL: leave out --sqlite")
        os.environ.setdefault("CELERY_BROKER_URL", CELERY_BROKER_URL)
    if args.sqlite:
        use_fresh_sqlite()
    setup_django()
    from coordination.services.mailboxes import mailbox_ensure

    project, key = http_fixture("cancel-push")
    mailbox_ensure(project_id=project.id, name=MAILBOX, mode="WORK")  # the default lease: 30 s
    keys = {"python": key, "typescript": key}
    languages = ["python"] + (["typescript"] if args.typescript else []) + (["celery"] if args.celery else [])
    plan = [(language, "push") for language in languages for _ in range(args.rounds)]
    plan += [(language, "restart") for language in languages]
    renewal_only = [language for language in ("python", "celery") if language in languages]
    plan += [] if args.no_renewal else [(language, "renewal") for language in renewal_only]
    rounds: list[Round] = []
    with contextlib.ExitStack() as stack:
        if args.celery:
            keys["celery"] = celery_setup(stack)
        server = stack.enter_context(UvicornServer(name="bench-cancel-push"))
        for language, kind in plan:
            rounds.append(one_round(server, keys[language], language, kind, args))
            report(rounds[-1:])
    figures = json_figures(rounds, args.handlers)
    print(figures)
    if args.json:
        write_json(args.json, figures)
        print(f"figures written to {args.json}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
