"""A swarm of SDK clients doing mixed work against a multi-process deployment, and what it saw.

The deployment (started by ``deployment``): two uvicorn API processes on two ports, two
Celery worker processes and one beat, all on one PostgreSQL database and one Redis broker,
as on several machines. Nothing is shared between the API processes but the database.

``run_swarm`` starts N client threads. Client ``i`` talks to server ``i % 2`` (its *home*)
with the ``runstate`` SDK, and owns a second SDK client on the other server (its *peer*),
through which it waits: every long-poll (group waits, task results, claims) is made on one
server and released by a change made through the other, or by a Celery worker. Each client
loops over scenarios until the time is up:

* ``work``: a claim long-poll on the peer released by a submit on home; submit (keyed and
  not; a keyed resubmit through peer answers the same task), claim, renew, complete, fail
  with retry and claim again; a task-result wait on peer;
* ``group``: a group (any condition) with three members, a group wait on peer, members
  claimed under the gate, renewed, completed or failed, verdicts sent at once through both
  servers (exactly one may answer as the finalizing one);
* ``cancel``: a root run and a child; a worker thread on peer claims, renews and completes
  under the child while home cancels the root at a random moment; a group wait and a task
  result wait on peer must be released by the cancel, the worker must be refused, and
  Celery tasks submitted under the child race the cancel;
* ``celery``: tasks submitted to a mailbox bound to ``@runstate_task`` (run by the two
  Celery workers), results awaited on peer;
* ``crowd``: a run opened to the whole swarm: before each scenario a client claims and
  completes a few tasks under some other client's open run (through its own server), while
  that client cancels it at a random moment;
* ``clock``: a barrier whose wait on peer is released by arrivals through home, and a timer
  and a group deadline that only the sweeps (beat and the workers) act on, awaited on peer.

Every HTTP answer's status is counted by the transport under the SDK (retries included),
every SDK call is timed per operation, and what each call answered is written to the
``Ledger`` (``tests/reliability/ledger.py``), which checks the database afterwards.
"""

from __future__ import annotations

import datetime as dt
import logging
import random
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.processes import answers_health, free_port, stop_process_groups
from tests.waiting import WAIT_S, wait_until

PROJECT = "swarm"
WORK_MAILBOX = "swarm-work"
GROUP_MAILBOX = "swarm-group"
CELERY_MAILBOX = "swarm-celery"
TASK_MODULE = "tests.reliability.swarm_tasks"
# The file the Celery handlers append their ledger entries to (set by ``deployment``).
LEDGER_ENV = "RUNSTATE_SWARM_LEDGER"
# Each process of the deployment names its database connections ``<prefix><process>``, so the
# connections of the topology can be counted apart from others on the same database.
APPLICATION_NAME_PREFIX = "runstate-swarm-"
# Every wait must be released well before this; it only bounds a hang.
WAIT_LIMIT_MS = 60_000
SCENARIOS = ("work", "group", "cancel", "celery", "clock", "crowd", "work", "group")
GROUP_CONDITIONS = ("ALL_TERMINAL", "N_ACCEPTED", "FIRST_ACCEPTED")


def percentile(values: list[float], fraction: float) -> float:
    """Return the nearest-rank percentile of ``values`` (0 when empty)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, int(round(fraction * len(ordered) + 0.5)) - 1))
    return ordered[rank]


# Topology ------------------------------------------------------------------------------------


@dataclass
class Deployment:
    servers: list[str]
    worker_pids: list[int]
    log_dir: Path
    children: list[subprocess.Popen] = field(default_factory=list)

    def logs(self) -> str:
        """Return the tail of every child's log (for a failure message)."""
        parts = []
        for path in sorted(self.log_dir.glob("*.log")):
            text = path.read_text(errors="replace")
            parts.append(f"--- {path.name}\n{text[-3000:]}")
        return "\n".join(parts)

    def dead(self) -> list[str]:
        """Return the logs of the children that exited."""
        return [f"{c.args[:4]} exited {c.returncode}" for c in self.children if c.poll() is not None]


def uvicorn_command(port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "uvicorn",
        "runstate_project.asgi:application",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--no-access-log",
        "--log-level",
        "warning",
    ]


def celery_worker_command(concurrency: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "runstate_project",
        "worker",
        "--pool=threads",
        f"--concurrency={concurrency}",
        f"--include={TASK_MODULE}",
        "--loglevel=WARNING",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
    ]


def _with_application_name(database_url: str, name: str) -> str:
    """Return ``database_url`` asking PostgreSQL to show its connections as ``name``."""
    return f"{database_url}{'&' if '?' in database_url else '?'}application_name={name}"


@contextmanager
def deployment(
    *,
    env: dict[str, str],
    log_dir: Path,
    root: Path,
    beat_command: list[str],
    ledger_path: Path,
    db_pool_size: int = 10,
    worker_concurrency: int = 3,
) -> Iterator[Deployment]:
    """Start two API servers, two Celery workers and beat with ``env`` (database and broker set).

    The API servers get a connection pool of ``db_pool_size`` each and know the decorated
    task module (``RUNSTATE_TASK_MODULES``), so a submit to its mailbox is dispatched to Celery.
    The Celery handlers append one ``effect`` per execution to the ledger at ``ledger_path``.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {
        **env,
        "RUNSTATE_TASK_MODULES": TASK_MODULE,
        "RUNSTATE_DB_POOL_SIZE": str(db_pool_size),
        LEDGER_ENV: str(ledger_path),
    }
    ports = [free_port(), free_port()]
    commands = [
        ("api0", uvicorn_command(ports[0])),
        ("api1", uvicorn_command(ports[1])),
        ("worker0", celery_worker_command(worker_concurrency)),
        ("worker1", celery_worker_command(worker_concurrency)),
        ("beat", beat_command),
    ]
    logs, children = [], []
    try:
        for name, command in commands:
            log = open(log_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed below
            logs.append(log)
            tagged = {
                **env,
                "DATABASE_URL": _with_application_name(env["DATABASE_URL"], APPLICATION_NAME_PREFIX + name),
            }
            children.append(
                subprocess.Popen(
                    command, cwd=root, env=tagged, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
        servers = [f"http://127.0.0.1:{port}" for port in ports]
        started = Deployment(servers=servers, worker_pids=[children[2].pid, children[3].pid], log_dir=log_dir)
        started.children = children

        def healthy(url: str) -> bool:
            if started.dead():
                raise RuntimeError(f"a process exited while starting: {started.dead()}\n{started.logs()}")
            return answers_health(url)

        # Five processes importing the project at once (it had 90 s): more than one state's wait.
        wait_until(
            lambda: all(healthy(url) for url in servers),
            what="both API processes to answer",
            interval_s=0.2,
            waits=2,
            explain=started.logs,
        )
        yield started
    finally:
        stop_process_groups(children)
        for log in logs:
            log.close()


# Measurements ----------------------------------------------------------------------------------


class Stats:
    """Latency per SDK operation, answer codes, and every HTTP status per server (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.latencies: dict[str, list[float]] = defaultdict(list)
        self.codes: Counter[tuple[str, str]] = Counter()
        self.statuses: Counter[tuple[str, int]] = Counter()
        self.server_errors: list[str] = []
        self.failures: list[str] = []
        self.scenarios: Counter[str] = Counter()

    @contextmanager
    def timed(self, op: str) -> Iterator[None]:
        from runstate import RunstateError

        start = time.perf_counter()
        code = "ok"
        try:
            yield
        except RunstateError as exc:
            code = exc.code
            raise
        except BaseException as exc:
            code = type(exc).__name__
            raise
        finally:
            elapsed = time.perf_counter() - start
            with self._lock:
                self.latencies[op].append(elapsed)
                self.codes[(op, code)] += 1

    def status(self, server: str, request: httpx.Request, status: int) -> None:
        with self._lock:
            self.statuses[(server, status)] += 1
            if status >= 500:
                self.server_errors.append(f"{status} {request.method} {request.url} via {server}")

    def fail(self, text: str) -> None:
        with self._lock:
            self.failures.append(text)

    def total_requests(self) -> int:
        return sum(self.statuses.values())

    def count_5xx(self) -> int:
        return sum(n for (_, status), n in self.statuses.items() if status >= 500)

    def table(self) -> str:
        """Return per-operation counts, error codes and p50/p99 latency as a Markdown table."""
        rows = [
            "| operation | calls | answered with an error code | p50 ms | p99 ms |",
            "| --- | ---: | --- | ---: | ---: |",
        ]
        for op in sorted(self.latencies):
            values = self.latencies[op]
            errors = ", ".join(f"{code} {n}" for (o, code), n in sorted(self.codes.items()) if o == op and code != "ok")
            rows.append(
                f"| {op} | {len(values)} | {errors or '-'} | {percentile(values, 0.5) * 1000:.0f} "
                f"| {percentile(values, 0.99) * 1000:.0f} |"
            )
        return "\n".join(rows)

    def status_line(self) -> str:
        by_status: Counter[int] = Counter()
        by_server: Counter[str] = Counter()
        for (server, status), n in self.statuses.items():
            by_status[status] += n
            by_server[server] += n
        statuses = ", ".join(f"{status}: {n}" for status, n in sorted(by_status.items()))
        servers = ", ".join(f"{server}: {n}" for server, n in sorted(by_server.items()))
        return f"{self.total_requests()} HTTP answers ({statuses}); per server {servers}; 5xx: {self.count_5xx()}"


class CountingTransport(httpx.HTTPTransport):
    """Count the status of every answer (retried attempts too) under the SDK's HTTP client."""

    def __init__(self, stats: Stats, server: str) -> None:
        super().__init__()
        self.stats = stats
        self.server = server

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        self.stats.status(self.server, request, response.status_code)
        return response


@dataclass
class WaitRecord:
    kind: str
    subject: str
    wait_server: str
    decide_server: str
    released: bool = False
    state: str | None = None
    expected: Any = None
    seen: Any = None
    # Seconds from the deciding call's answer to the wait's answer (negative when the wait
    # answered first: the server notified before the decider read its own answer).
    release_s: float | None = None


class Waits:
    """Every wait the swarm made, with where it waited and where the change was made."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.records: list[WaitRecord] = []

    def add(self, record: WaitRecord) -> WaitRecord:
        with self._lock:
            self.records.append(record)
        return record

    def unreleased(self) -> list[WaitRecord]:
        return [r for r in self.records if not r.released]

    def pairs(self) -> Counter[tuple[str, str, str]]:
        return Counter((r.kind, r.wait_server, r.decide_server) for r in self.records if r.released)

    def release_latencies(self, kind: str | None = None) -> list[float]:
        return [
            max(r.release_s, 0.0)
            for r in self.records
            if r.released and r.release_s is not None and kind in (None, r.kind)
        ]

    def release_table(self) -> str:
        """Return, per kind of wait, how many were released and how long after the deciding answer."""
        rows = [
            "| wait | released | waiting server -> deciding server | release after the deciding answer p50 / p99 ms |",
            "| --- | ---: | --- | --- |",
        ]
        for kind in sorted({r.kind for r in self.records}):
            records = [r for r in self.records if r.kind == kind]
            released = sum(r.released for r in records)
            pairs = Counter(f"{r.wait_server}->{r.decide_server}" for r in records if r.released)
            latencies = self.release_latencies(kind)
            timing = (
                f"{percentile(latencies, 0.5) * 1000:.0f} / {percentile(latencies, 0.99) * 1000:.0f}"
                if latencies
                else "- (decided by a worker or a sweep)"
            )
            where = ", ".join(f"{pair} {n}" for pair, n in sorted(pairs.items()))
            rows.append(f"| {kind} | {released} of {len(records)} | {where} | {timing} |")
        return "\n".join(rows)


# Clients ----------------------------------------------------------------------------------------


class ExpectedRefusal(Exception):  # noqa: N818 - a scenario's planned end, not an error
    """A worker loop under a cancelled run was refused, as planned."""


class Board:
    """Runs that clients open to the whole swarm: others claim and complete under them until cancelled."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: list[str] = []

    def post(self, run_id: str) -> None:
        with self._lock:
            self._runs.append(run_id)

    def take_down(self, run_id: str) -> None:
        with self._lock:
            self._runs.remove(run_id)

    def pick(self, rng: random.Random) -> str | None:
        with self._lock:
            return rng.choice(self._runs) if self._runs else None


class SwarmClient:
    """One swarm member: an SDK client on its home server and one on the other (its peer)."""

    def __init__(
        self,
        index: int,
        *,
        servers: list[str],
        api_key: str,
        stats: Stats,
        waits: Waits,
        ledger: Any,
        pool: ThreadPoolExecutor,
        until: float,
        board: Board,
    ) -> None:
        from runstate import Runstate

        self.index = index
        self.home_name, self.peer_name = f"api{index % 2}", f"api{(index + 1) % 2}"
        home_url, peer_url = servers[index % 2], servers[(index + 1) % 2]
        self.home = Runstate(home_url, api_key, transport=CountingTransport(stats, self.home_name))
        self.peer = Runstate(peer_url, api_key, transport=CountingTransport(stats, self.peer_name))
        self.stats, self.waits, self.ledger, self.pool = stats, waits, ledger, pool
        self.board = board
        self.until = until
        self.random = random.Random(index)
        self.celery_pids: Counter[int] = Counter()

    def close(self) -> None:
        self.home.close()
        self.peer.close()

    def call(self, label: str, fn: Callable, /, *args, ledger: tuple[str, dict] | None = None, answer=None, **kwargs):
        """Call ``fn``, timed as ``label``; with ``ledger=(op, fields)`` record it, adding ``answer(result)``."""
        with self.stats.timed(label):
            if ledger is None:
                return fn(*args, **kwargs)
            op, fields = ledger
            with self.ledger.op(op, **fields) as entry:
                result = fn(*args, **kwargs)
                if answer is not None:
                    entry.done(**answer(result))
                return result

    def loop(self) -> None:
        # Neighbours (one on each server) start with the same scenario, so even a short run
        # makes every kind of wait on both servers.
        shift = (self.index // 2) % len(SCENARIOS)
        order = SCENARIOS[shift:] + SCENARIOS[:shift]
        try:
            parked = self.park()
        except Exception:  # noqa: BLE001 - reported at the end
            self.stats.fail(f"client {self.index} park: {traceback.format_exc()}")
            parked = None
        turn = 0
        while time.monotonic() < self.until:
            name = order[turn % len(order)]
            turn += 1
            try:
                self.help()
                getattr(self, name)()
                self.stats.scenarios[name] += 1
            except Exception:  # noqa: BLE001 - every unexpected error is a test failure, reported at the end
                self.stats.fail(f"client {self.index} {name}: {traceback.format_exc()}")
        if parked is not None:
            try:
                self.unpark(*parked)
            except Exception:  # noqa: BLE001 - reported at the end
                self.stats.fail(f"client {self.index} unpark: {traceback.format_exc()}")

    def park(self):
        """Open a group wait on peer that stays parked for the whole run (decided by ``unpark``).

        With every client holding one, the servers carry N long-polls beyond the swarm's own
        traffic on their small connection pools; runs longer than the server's 30 s cap make
        the SDK poll again.
        """
        run = self.call("run.create", self.home.scopes.create, name=f"parked-{self.index}")
        group = self.call(
            "group.create",
            run.groups.create,
            mailbox=GROUP_MAILBOX,
            condition="FIRST_ACCEPTED",
            expected_members=1,
            parent_scope_id=run.id,
        )
        gate_id = group.data["scopeId"]
        member = self.member(group, {"m": 0}, key="m0", gate_id=gate_id)
        gate = self.home.scope(gate_id)
        claims = []
        while not claims:
            claims = self.claim(gate.tasks, GROUP_MAILBOX, run_id=gate_id, max=1, wait_ms=2000)
        self.complete(claims[0], {"member": member.id})
        record = self.waits.add(WaitRecord("group-parked", group.id, self.peer_name, self.home_name))
        # It outlasts the run (and the server's 30 s cap, so the SDK polls again).
        timeout_ms = int((self.until - time.monotonic()) * 1000) + WAIT_LIMIT_MS
        return group, member.id, record, self.group_wait(record, group.id, timeout_ms)

    def unpark(self, group, member_id: str, record: WaitRecord, waiting: Future) -> None:
        answer, decided_at = self.verdict(group, member_id, "accept")
        self.settle(record, waiting, decided_at)
        if record.state != "FINALIZED" or answer["outcome"] != "SUCCESS":
            record.released = False
            self.stats.fail(f"parked group {group.id}: decided {answer['outcome']}, the wait saw {record.state}")

    # Recorded operations ----------------------------------------------------------------------

    def submit(self, tasks, mailbox: str, input: dict, *, run_id: str, key: str | None = None, label="task.submit"):
        return self.call(
            label,
            tasks.submit,
            mailbox,
            input,
            key=key,
            ledger=("submit", {"run_id": run_id}),
            answer=lambda ticket: {"task_id": ticket.id},
        )

    def member(self, group, input: dict, *, key: str, gate_id: str):
        return self.call(
            "group.submit",
            group.submit,
            input,
            key=key,
            ledger=("submit", {"run_id": gate_id, "group_id": group.id}),
            answer=lambda ticket: {"task_id": ticket.id},
        )

    def claim(self, tasks, mailbox: str, *, run_id: str, max: int, wait_ms: int = 0):
        return self.call(
            "task.claim",
            tasks.claim,
            mailbox,
            max=max,
            wait_ms=wait_ms,
            ledger=("claim", {"run_id": run_id}),
            answer=lambda claims: {"claim_ids": [c.id for c in claims]},
        )

    def renew(self, claim):
        return self.call("claim.renew", claim.renew, ledger=("renew", {"claim_id": claim.id}))

    def complete(self, claim, outcome: dict):
        return self.call(
            "claim.complete",
            claim.complete,
            outcome,
            ledger=("complete", {"claim_id": claim.id, "outcome": outcome}),
            answer=lambda task: {"state": task["state"]},
        )

    def fail(self, claim, error: dict, *, retry: bool):
        return self.call(
            "claim.fail",
            claim.fail,
            error,
            retry=retry,
            ledger=("fail", {"claim_id": claim.id, "error": error, "retry": retry}),
            answer=lambda task: {"state": task["state"]},
        )

    def end_run(self, scope, verb: str):
        return self.call(f"run.{verb}", getattr(scope, verb), ledger=(f"{verb}_run", {"run_id": scope.id}))

    # Waits (on the peer) --------------------------------------------------------------------

    def wait_on_peer(self, record: WaitRecord, fn: Callable[[], Any], done: Callable[[Any], bool]) -> Future:
        """Start a wait on the peer server in the pool; the future answers (answer, monotonic time)."""
        started = threading.Event()

        def wait():
            started.set()
            answer = self.call(f"wait.{record.kind}", fn)
            at = time.monotonic()
            record.released = done(answer)
            return answer, at

        future = self.pool.submit(wait)
        started.wait(5)
        # Let the request reach the server and park before the deciding change is made.
        time.sleep(0.15)
        return future

    def settle(self, record: WaitRecord, future: Future, decided_at: float | None):
        try:
            answer, at = future.result(timeout=WAIT_LIMIT_MS / 1000 + 30)
        except Exception as exc:  # noqa: BLE001 - an unreleased wait is what the test reports
            self.stats.fail(f"client {self.index}: {record.kind} wait on {record.subject} failed: {exc!r}")
            record.released = False
            return None
        if decided_at is not None:
            record.release_s = at - decided_at
        return answer

    def group_wait(self, record: WaitRecord, group_id: str, timeout_ms: int = WAIT_LIMIT_MS) -> Future:
        peer_group = self.peer.groups.by_id(group_id)

        def wait():
            group = peer_group.wait(timeout_ms=timeout_ms)
            record.state = group["state"]
            self.ledger.record(
                "group_decision", ok=True, group_id=group_id, outcome=group["outcome"], reason=group["outcomeReason"]
            )
            return group

        return self.wait_on_peer(record, wait, lambda group: group["state"] == "FINALIZED")

    def result_wait(self, record: WaitRecord, task_id: str, states: tuple[str, ...]) -> Future:
        peer_ticket = self.peer.tasks.get(task_id)

        def wait():
            task = peer_ticket.result(timeout_ms=WAIT_LIMIT_MS)
            record.state = task["state"]
            return task

        return self.wait_on_peer(record, wait, lambda task: task["state"] in states)

    # Scenarios ------------------------------------------------------------------------------

    def work(self) -> None:
        """Submit, claim (a claim wait on peer released by a submit here), renew, fail and retry, complete."""
        run = self.call("run.create", self.home.scopes.create, name=f"work-{self.index}")
        claim_record = self.waits.add(WaitRecord("claim", run.id, self.peer_name, self.home_name))
        peer_tasks = self.peer.scope(run.id).tasks
        claim_wait = self.wait_on_peer(
            claim_record,
            lambda: self.claim(peer_tasks, WORK_MAILBOX, run_id=run.id, max=1, wait_ms=WAIT_LIMIT_MS // 2),
            bool,
        )
        tickets, first_submit_at = [], None
        for n in range(4):
            key = f"w{n}" if n % 2 else None
            tickets.append(self.submit(run.tasks, WORK_MAILBOX, {"n": n}, run_id=run.id, key=key))
            first_submit_at = first_submit_at or time.monotonic()
        # The same key and input through the other server answer the same task.
        again = self.submit(peer_tasks, WORK_MAILBOX, {"n": 1}, run_id=run.id, key="w1", label="task.resubmit")
        if again.id != tickets[1].id:
            self.stats.fail(f"run {run.id}: a keyed resubmit through {self.peer_name} made another task")
        done: set[str] = set()
        for claim in self.settle(claim_record, claim_wait, first_submit_at) or []:
            self.finish_claim(claim, done)
        # A result wait on the peer for the last task, released by its completion here.
        last = tickets[-1]
        result_record = self.waits.add(WaitRecord("result", last.id, self.peer_name, self.home_name))
        result_wait = self.result_wait(result_record, last.id, ("SUCCEEDED",))
        completed_at: dict[str, float] = {}
        deadline = time.monotonic() + WAIT_S
        while len(done) < len(tickets):
            if time.monotonic() > deadline:
                raise AssertionError(f"run {run.id}: only {len(done)} of {len(tickets)} tasks done after {WAIT_S:g} s")
            for claim in self.claim(run.tasks, WORK_MAILBOX, run_id=run.id, max=2, wait_ms=2000):
                self.finish_claim(claim, done, completed_at)
        self.settle(result_record, result_wait, completed_at.get(last.id))
        self.end_run(run, "complete")

    def finish_claim(self, claim, done: set[str], completed_at: dict[str, float] | None = None) -> None:
        """Renew a claim, then fail it with a retry (a quarter of first attempts) or complete it."""
        self.renew(claim)
        if claim.attempt == 1 and self.random.random() < 0.25:
            self.fail(claim, {"why": "retry me"}, retry=True)
            return
        self.complete(claim, {"task": claim.task_id, "attempt": claim.attempt, "client": self.index})
        done.add(claim.task_id)
        if completed_at is not None:
            completed_at[claim.task_id] = time.monotonic()

    def group(self) -> None:
        """A group of three under a run; wait on peer; members claimed, finished and judged here."""
        condition = self.random.choice(GROUP_CONDITIONS)
        run = self.call("run.create", self.home.scopes.create, name=f"group-{self.index}")
        group = self.call(
            "group.create",
            run.groups.create,
            mailbox=GROUP_MAILBOX,
            condition=condition,
            threshold=2 if condition == "N_ACCEPTED" else None,
            expected_members=3,
            parent_scope_id=run.id,
        )
        gate_id = group.data["scopeId"]
        record = self.waits.add(WaitRecord("group", group.id, self.peer_name, self.home_name))
        waiting = self.group_wait(record, group.id)
        members = [self.member(group, {"m": m}, key=f"m{m}", gate_id=gate_id).id for m in range(3)]
        gate = self.home.scope(gate_id)
        finished: dict[str, str] = {}
        decided_at, decision = None, None
        deadline = time.monotonic() + WAIT_S
        while len(finished) < len(members):
            if time.monotonic() > deadline:
                raise AssertionError(f"group {group.id}: members not all claimable within {WAIT_S:g} s")
            for claim in self.claim(gate.tasks, GROUP_MAILBOX, run_id=gate_id, max=3, wait_ms=2000):
                self.renew(claim)
                if claim.task_id == members[2] and self.random.random() < 0.3:
                    self.fail(claim, {"why": "member fails"}, retry=False)
                    finished[claim.task_id] = "FAILED"
                else:
                    self.complete(claim, {"member": claim.task_id})
                    finished[claim.task_id] = "SUCCEEDED"
        # Verdicts at once, alternately through each server: reject the first member sometimes,
        # accept the others. Exactly one of them may answer as the one that finalized the group.
        peer_group = self.peer.groups.by_id(group.id)
        verdicts = []
        for position, task_id in enumerate(members):
            if finished[task_id] == "FAILED":
                continue
            verb = "reject" if position == 0 and self.random.random() < 0.4 else "accept"
            handle, server = (group, self.home_name) if position % 2 == 0 else (peer_group, self.peer_name)
            verdicts.append((server, self.pool.submit(self.verdict, handle, task_id, verb)))
        finalizers = []
        for server, future in verdicts:
            answer, at = future.result(timeout=120)
            if answer["groupState"] == "FINALIZED" and not answer["late"]:
                finalizers.append(server)
                decided_at, decision = at, (answer["outcome"], answer["outcomeReason"])
        if len(finalizers) > 1:
            self.stats.fail(f"group {group.id}: {len(finalizers)} verdicts answered as the finalizing one")
        if finalizers:
            record.decide_server = finalizers[0]
        if decision is None:
            status = self.call("group.status", group.status)
            if status["state"] != "FINALIZED":
                raise AssertionError(f"group {group.id} ({condition}) not decided: {status['state']}")
            decision = (status["outcome"], status["outcomeReason"])
        record.expected = decision
        answer = self.settle(record, waiting, decided_at)
        if answer is not None:
            record.seen = (answer["outcome"], answer["outcomeReason"])
            if record.seen != decision:
                record.released = False
                self.stats.fail(f"group {group.id}: the wait saw {record.seen}, the decider {decision}")

    def verdict(self, group, task_id: str, verb: str) -> tuple[dict, float]:
        answer = self.call(
            f"group.{verb}",
            getattr(group, verb),
            task_id,
            ledger=("verdict", {"group_id": group.id, "task_id": task_id, "verdict": f"{verb.upper()}ED"}),
            answer=lambda a: {
                "group_state": a["groupState"],
                "outcome": a["outcome"],
                "reason": a["outcomeReason"],
            },
        )
        return answer, time.monotonic()

    def cancel(self) -> None:
        """Cancel a root run while a worker on peer claims, renews and completes under its child."""
        from runstate import ScopeCancelledError

        root = self.call("run.create", self.home.scopes.create, name=f"cancel-{self.index}")
        child = self.call("run.child", root.child, name="child")
        group = self.call(
            "group.create",
            child.groups.create,
            mailbox=GROUP_MAILBOX,
            condition="ALL_TERMINAL",
            expected_members=2,
            parent_scope_id=child.id,
        )
        gate_id = group.data["scopeId"]
        for m in range(2):
            self.member(group, {"m": m}, key=f"m{m}", gate_id=gate_id)
        tickets = [self.submit(child.tasks, WORK_MAILBOX, {"n": n}, run_id=child.id) for n in range(6)]
        # Work for the Celery workers too, racing the cancel (each ends SUCCEEDED or CANCELLED).
        for i in range(2):
            self.submit(child.tasks, CELERY_MAILBOX, {"i": i, "seconds": 0.3}, run_id=child.id, label="celery.submit")
        group_record = self.waits.add(WaitRecord("group-cancel", group.id, self.peer_name, self.home_name))
        group_wait = self.group_wait(group_record, group.id)
        result_record = self.waits.add(WaitRecord("result-cancel", tickets[-1].id, self.peer_name, self.home_name))
        result_wait = self.result_wait(result_record, tickets[-1].id, ("SUCCEEDED", "CANCELLED"))
        worker = self.pool.submit(self.worker_until_refused, child.id)
        time.sleep(self.random.uniform(0.05, 0.5))
        self.end_run(root, "cancel")
        cancelled_at = time.monotonic()
        try:
            worker.result(timeout=90)
        except ExpectedRefusal:
            pass
        # New work under the cancelled subtree is refused, through either server.
        for client, name in ((self.home, "home"), (self.peer, "peer")):
            try:
                self.claim(client.scope(child.id).tasks, WORK_MAILBOX, run_id=child.id, max=1)
            except ScopeCancelledError:
                continue
            self.stats.fail(f"run {child.id}: a claim through {name} was not refused after the cancel")
        answer = self.settle(group_record, group_wait, cancelled_at)
        if answer is not None and (answer["outcome"], answer["outcomeReason"]) != ("FAILURE", "cancelled"):
            group_record.released = False
            self.stats.fail(f"group {group.id}: after the cancel the wait saw {answer['outcome']}")
        self.settle(result_record, result_wait, cancelled_at)

    def crowd(self) -> None:
        """Open a run to the swarm: other clients, through either server, work under it until it is cancelled here."""
        root = self.call("run.create", self.home.scopes.create, name=f"crowd-{self.index}")
        child = self.call("run.child", root.child, name="crowd")
        for n in range(12):
            self.submit(child.tasks, WORK_MAILBOX, {"n": n}, run_id=child.id)
        self.board.post(child.id)
        try:
            time.sleep(self.random.uniform(0.5, 2.0))
        finally:
            self.board.take_down(child.id)
        self.end_run(root, "cancel")

    def help(self) -> None:
        """Claim and complete a few tasks under a run another client opened (refusals after its cancel expected)."""
        from runstate import ScopeCancelledError

        run_id = self.board.pick(self.random)
        if run_id is None:
            return
        tasks = self.home.scope(run_id).tasks
        try:
            for _ in range(3):
                claims = self.claim(tasks, WORK_MAILBOX, run_id=run_id, max=1, wait_ms=200)
                if not claims:
                    return
                self.renew(claims[0])
                self.complete(claims[0], {"task": claims[0].task_id, "helper": self.index})
        except ScopeCancelledError:
            return

    def worker_until_refused(self, run_id: str) -> None:
        """Claim, renew and complete under ``run_id`` through peer until the run is refused."""
        from runstate import ScopeCancelledError

        tasks = self.peer.scope(run_id).tasks
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            try:
                for claim in self.claim(tasks, WORK_MAILBOX, run_id=run_id, max=1, wait_ms=500):
                    self.renew(claim)
                    time.sleep(self.random.uniform(0, 0.05))
                    self.complete(claim, {"task": claim.task_id})
            except ScopeCancelledError:
                raise ExpectedRefusal() from None
        raise AssertionError(f"run {run_id}: the worker was never refused")

    def celery(self) -> None:
        """Tasks for the Celery workers (bound mailbox), results awaited on peer."""
        run = self.call("run.create", self.home.scopes.create, name=f"celery-{self.index}")
        pending = []
        for i in range(3):
            ticket = self.submit(run.tasks, CELERY_MAILBOX, {"i": i}, run_id=run.id, label="celery.submit")
            record = self.waits.add(WaitRecord("celery-result", ticket.id, self.peer_name, "worker"))
            peer_ticket = self.peer.tasks.get(ticket.id)
            pending.append((record, self.pool.submit(self._celery_wait, record, peer_ticket)))
        for record, future in pending:
            try:
                task = future.result(timeout=WAIT_LIMIT_MS / 1000 + 30)
            except Exception as exc:  # noqa: BLE001 - reported as an unreleased wait
                self.stats.fail(f"client {self.index}: celery task {record.subject}: {exc!r}")
                continue
            if task["state"] == "SUCCEEDED":
                self.celery_pids[task["outcome"]["pid"]] += 1
            else:
                self.stats.fail(f"celery task {record.subject} ended {task['state']}: {task['error']}")
        self.end_run(run, "complete")

    def clock(self) -> None:
        """A barrier released through home, a timer and a group deadline fired by the sweeps; waits on peer."""
        from runstate import ConflictError

        run = self.call("run.create", self.home.scopes.create, name=f"clock-{self.index}")
        deadline = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=3)
        group = self.call(
            "group.create",
            run.groups.create,
            mailbox=GROUP_MAILBOX,
            condition="FIRST_ACCEPTED",
            deadline=deadline,
            parent_scope_id=run.id,
        )
        try:
            self.member(group, {"m": 0}, key="m0", gate_id=group.data["scopeId"])
        except ConflictError as exc:
            # On a busy machine the deadline may pass first; the group is decided all the same.
            if exc.code != "GROUP_CLOSED":
                raise
        group_record = self.waits.add(WaitRecord("group-deadline", group.id, self.peer_name, "sweep"))
        group_wait = self.group_wait(group_record, group.id)
        timer = self.call("timer.create", run.timers.create, after_seconds=1)
        timer_record = self.waits.add(WaitRecord("timer", timer.id, self.peer_name, "sweep"))
        peer_timer = self.peer.timers.get(timer.id)
        timer_wait = self.wait_on_peer(
            timer_record, lambda: peer_timer.wait(timeout_ms=WAIT_LIMIT_MS), lambda t: t["fired_at"] is not None
        )
        barrier = self.call("barrier.create", run.barriers.create, target=2)
        barrier_record = self.waits.add(WaitRecord("barrier", barrier.id, self.peer_name, self.home_name))
        peer_barrier = self.peer.barriers.get(barrier.id)
        barrier_wait = self.wait_on_peer(
            barrier_record,
            lambda: peer_barrier.wait(timeout_ms=WAIT_LIMIT_MS),
            lambda b: b["state"] == "RELEASED",
        )
        for key in ("a", "b"):
            self.call("barrier.arrive", barrier.arrive, key)
        self.settle(barrier_record, barrier_wait, time.monotonic())
        self.settle(timer_record, timer_wait, None)
        answer = self.settle(group_record, group_wait, None)
        if answer is not None and (answer["outcome"], answer["outcomeReason"]) != ("FAILURE", "deadline"):
            group_record.released = False
            self.stats.fail(f"group {group.id}: past its deadline the wait saw {answer['outcome']}")
        self.end_run(run, "complete")

    def _celery_wait(self, record: WaitRecord, ticket) -> dict:
        task = self.call("wait.celery-result", ticket.result, timeout_ms=WAIT_LIMIT_MS)
        record.state = task["state"]
        record.released = task["state"] == "SUCCEEDED"
        return task


class EventFollower(threading.Thread):
    """Read the project's event log page by page, each page through the other server.

    The cursor one server answered is continued on the other, so nothing about a reader may
    live in a server process. ``drain`` reads on after the swarm until every event the
    database holds was seen (or a limit passes), then reports what was missed or repeated.
    """

    def __init__(self, servers: list[str], api_key: str, stats: Stats) -> None:
        from runstate import Runstate

        super().__init__(name="swarm-events", daemon=True)
        self.clients = [
            Runstate(url, api_key, transport=CountingTransport(stats, f"api{i}")) for i, url in enumerate(servers)
        ]
        self.stats = stats
        self.seen: list[str] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        cursor, turn = None, 0
        try:
            while not self.stopping.is_set():
                client = self.clients[turn % len(self.clients)]
                turn += 1
                with self.stats.timed("events.list"):
                    page = client.events.list(after=cursor, limit=1000, wait_ms=1000)
                self.seen.extend(event["id"] for event in page["events"])
                cursor = page["nextCursor"]
        except Exception:  # noqa: BLE001 - reported at the end
            self.stats.fail(f"event follower: {traceback.format_exc()}")

    def drain(self, database_cursors: Callable[[], set[str]]) -> tuple[int, int]:
        """Follow until every event in ``database_cursors()`` was seen, ``WAIT_S`` at most.

        Return (events, pages seen twice).
        """
        deadline = time.monotonic() + WAIT_S
        expected = database_cursors()
        while time.monotonic() < deadline and not expected <= set(self.seen):
            time.sleep(0.5)
            expected = database_cursors()
        self.stopping.set()
        self.join(10)
        for client in self.clients:
            client.close()
        seen = set(self.seen)
        missed = expected - seen
        repeated = len(self.seen) - len(seen)
        if missed:
            self.stats.fail(
                f"the event follower never saw {len(missed)} of {len(expected)} events: {sorted(missed)[:5]}"
            )
        if repeated:
            self.stats.fail(f"the event follower saw {repeated} events twice")
        if self.seen != sorted(self.seen, key=lambda c: tuple(int(part) for part in c.split("-"))):
            self.stats.fail("the event follower saw events out of cursor order")
        return len(expected), repeated


@dataclass
class SwarmResult:
    clients: int
    seconds: float
    elapsed: float
    stats: Stats
    waits: Waits
    celery_pids: Counter[int]
    events: int

    def summary(self) -> str:
        released = len(self.waits.records) - len(self.waits.unreleased())
        latencies = self.waits.release_latencies()
        scenarios = ", ".join(f"{name} {n}" for name, n in sorted(self.stats.scenarios.items()))
        return "\n".join(
            [
                f"{self.clients} clients for {self.seconds:g} s (elapsed {self.elapsed:.1f} s); scenarios: {scenarios}",
                self.stats.status_line(),
                f"waits released: {released} of {len(self.waits.records)} "
                f"(release after the deciding answer: p50 {percentile(latencies, 0.5) * 1000:.0f} ms, "
                f"p99 {percentile(latencies, 0.99) * 1000:.0f} ms)",
                f"Celery tasks per worker pid: {dict(self.celery_pids)}; "
                f"events followed through both servers in turn: {self.events}",
                "",
                self.stats.table(),
                "",
                self.waits.release_table(),
            ]
        )


def run_swarm(
    *,
    servers: list[str],
    api_keys: list[str],
    seconds: float,
    ledger: Any,
    database_cursors: Callable[[], set[str]],
) -> SwarmResult:
    """Run ``len(api_keys)`` clients (client ``i`` on ``servers[i % 2]``) for ``seconds``; return what they saw.

    An event follower reads the whole log meanwhile; ``database_cursors()`` answers the
    cursors of every event of the project in the database, which it must all have seen.
    """
    from runstate import Runstate

    stats, waits = Stats(), Waits()
    # One INFO line per request would drown the figures.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    with Runstate(servers[0], api_keys[0]) as setup:
        setup.mailboxes.ensure(WORK_MAILBOX, mode="WORK", lease_ttl_ms=30_000, max_attempts=3)
        setup.mailboxes.ensure(GROUP_MAILBOX, mode="WORK", lease_ttl_ms=30_000, max_attempts=1)
        setup.mailboxes.ensure(CELERY_MAILBOX, mode="WORK", lease_ttl_ms=10_000, max_attempts=3)
    board = Board()
    follower = EventFollower(servers, api_keys[0], stats)
    follower.start()
    start = time.monotonic()
    until = start + seconds
    with ThreadPoolExecutor(max_workers=4 * len(api_keys), thread_name_prefix="swarm-wait") as pool:
        clients = [
            SwarmClient(
                i,
                servers=servers,
                api_key=key,
                stats=stats,
                waits=waits,
                ledger=ledger,
                pool=pool,
                until=until,
                board=board,
            )
            for i, key in enumerate(api_keys)
        ]
        threads = [threading.Thread(target=c.loop, name=f"swarm-{c.index}") for c in clients]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(seconds + 300)
            if thread.is_alive():
                stats.fail(f"{thread.name} still running {seconds + 300:g} s after the end")
        for client in clients:
            client.close()
    elapsed = time.monotonic() - start
    events, _ = follower.drain(database_cursors)
    pids: Counter[int] = Counter()
    for client in clients:
        pids.update(client.celery_pids)
    return SwarmResult(len(api_keys), seconds, elapsed, stats, waits, pids, events)
