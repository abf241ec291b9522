"""PostgreSQL and the broker restart under load; the service rides through and loses nothing.

Everything runs as in production, against throwaway servers this module starts (never the
machine's own): ``manage.py migrate``, a uvicorn API, a Celery worker and beat. Client
threads submit, claim, complete, long-poll and arm timers over HTTP the whole time, and
record every answer. Then one server is stopped for a few seconds and started again:

- PostgreSQL down: every answer is ``503 SERVICE_UNAVAILABLE`` in the error envelope (never
  another 5xx, never a hang), ``/v1/readyz`` is 503 and ``/v1/healthz`` 200; once it is back
  the same processes serve, listen and sweep again, and every acknowledged change is there.
- Redis (the broker) down: the API keeps answering without a 5xx (the rate limiter counts
  locally, dispatch failures are left to the re-wake sweep); once it is back the worker
  does the work submitted meanwhile, although the messages for it were never sent.

Durations are reported (``-s``), never asserted.
"""

import logging
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psycopg
import pytest
from psycopg_pool import PoolTimeout

from runstate_project.postgresql.base import FailFastPool, check_idle_connection
from tests.processes import free_port, manage, stop_process_groups
from tests.reliability.ledger import Ledger, check_in_process
from tests.reliability.throwaway import (  # noqa: F401 - fixtures
    ThrowawayPostgres,
    throwaway_postgres,
    throwaway_redis,
)
from tests.waiting import wait_until
from tests.workers.live import beat_command

pytestmark = [pytest.mark.postgres_only]

# One line per request of the load would drown the report.
logging.getLogger("httpx").setLevel(logging.WARNING)

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "celery-live"  # the project of tests.workers.celery_tasks
BOUND_MAILBOX = "celery-live-bulk"  # bound to tests.workers.celery_tasks.bulk
PLAIN_MAILBOX = "restart-plain"  # claimed by the client threads
PROBE_MAILBOX = "restart-probe"  # nobody claims here but the test itself
WORKER_APP_NAME = "runstate-restart-worker"  # application_name of the Celery worker's sessions
REQUEST_TIMEOUT_S = 15.0
DOWN_FOR_S = 3.0


# The stack -----------------------------------------------------------------------------


@dataclass
class Stack:
    """The API, worker and beat processes on the throwaway servers, and an API key."""

    pg: object
    redis: object
    url: str
    key: str
    log_dir: Path
    env: dict[str, str]
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    def client(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {self.key}"}, timeout=REQUEST_TIMEOUT_S
        )

    def sql(self, query: str, *params) -> list[tuple]:
        with psycopg.connect(self.pg.url(), connect_timeout=5) as conn:
            return conn.execute(query, params).fetchall()

    def states(self, table: str, ids) -> dict[str, str]:
        rows = self.sql(f"SELECT id::text, state FROM {table} WHERE id = ANY(%s::uuid[])", list(ids))  # noqa: S608
        return dict(rows)

    def logs(self) -> str:
        parts = []
        for name in self.processes:
            text = (self.log_dir / f"{name}.log").read_text(errors="replace")
            parts.append(f"--- {name} (last 4000 chars)\n{text[-4000:]}")
        return "\n".join(parts)

    def assert_processes_alive(self) -> None:
        dead = {name: p.returncode for name, p in self.processes.items() if p.poll() is not None}
        assert not dead, f"processes exited: {dead}\n{self.logs()}"


def stack_env(pg, redis, log_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        DATABASE_URL=pg.url(),
        CELERY_BROKER_URL=redis.url(0),
        DJANGO_SETTINGS_MODULE="runstate_project.settings",
        PYTHONUNBUFFERED="1",
        RUNSTATE_VAR_DIR=str(log_dir / "var"),
        RUNSTATE_DB_POOL_SIZE="5",
        # Every process knows the bound mailbox; lost wake-ups are sent again after 2 s.
        RUNSTATE_TASK_MODULES="tests.workers.celery_tasks",
        RUNSTATE_REWAKE_AFTER_S="2",
        # The limiter stays on (it talks to the throwaway Redis) but never refuses this load.
        RUNSTATE_RATE_LIMIT="1000000/min",
    )
    return env


@pytest.fixture(scope="module")
def stack(throwaway_postgres, throwaway_redis, tmp_path_factory):  # noqa: F811 - pytest fixtures
    """Migrate the throwaway database, create a key, start API, worker and beat on the throwaway servers."""
    log_dir = tmp_path_factory.mktemp("restarts")
    env = stack_env(throwaway_postgres, throwaway_redis, log_dir)
    manage(env, "migrate", "--noinput")
    key = manage(
        env,
        "create_api_key",
        "--project",
        PROJECT,
        "--permissions",
        "resource_config,coordination_write,coordination_read",
    )
    port = free_port()
    commands = {
        "api": [
            sys.executable,
            "-m",
            "uvicorn",
            "runstate_project.asgi:application",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        "worker": [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "runstate_project",
            "worker",
            "--pool=threads",
            "--concurrency=4",
            "--include=tests.workers.celery_tasks",
            "--loglevel=INFO",
            "--without-gossip",
            "--without-mingle",
        ],
        "beat": beat_command(log_dir),
    }
    # The worker's sessions carry a name of their own, so the test can tell them apart.
    worker_env = {**env, "DATABASE_URL": f"{throwaway_postgres.url()}?application_name={WORKER_APP_NAME}"}
    built = Stack(
        pg=throwaway_postgres,
        redis=throwaway_redis,
        url=f"http://127.0.0.1:{port}",
        key=key.strip().splitlines()[-1],
        log_dir=log_dir,
        env=env,
    )
    try:
        for name, command in commands.items():
            with open(log_dir / f"{name}.log", "wb") as log:
                built.processes[name] = subprocess.Popen(
                    command,
                    cwd=ROOT,
                    env=worker_env if name == "worker" else env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )

        def ready() -> bool:
            built.assert_processes_alive()
            try:
                return httpx.get(f"{built.url}/v1/readyz", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(ready, waits=2, what="the API to be ready")
        with built.client() as client:
            for name in (BOUND_MAILBOX, PLAIN_MAILBOX, PROBE_MAILBOX):
                assert client.put(f"/v1/mailboxes/{name}", json={"mode": "WORK"}).status_code in (200, 201)
        yield built
    finally:
        stop_process_groups(built.processes.values())


# The load ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """One request: what it did, the phase it started and ended in, and the answer."""

    op: str
    started: str
    ended: str
    status: int | None  # None: no answer (a timeout or a refused connection)
    code: str | None  # the error envelope's code, if any


class Load:
    """Client threads submitting, claiming, completing, long-polling and arming timers until stopped.

    Every answer is recorded with the phase (set by the test) it started and ended in, and
    every submit, claim and complete in a ``Ledger`` (a 503 or no answer is an unknown
    outcome), which the database is held to afterwards.
    """

    def __init__(self, stack: Stack, run_id: str, tag: str) -> None:
        self.stack, self.run_id, self.tag = stack, run_id, tag
        self.phase = "before"
        self.ledger = Ledger(path=stack.log_dir / f"ledger-{tag}.jsonl", source=tag)
        self.ledger_counts = ""
        self.answers: list[Answer] = []
        self.submitted: set[str] = set()  # acknowledged plain task ids
        self.completed: set[str] = set()
        self.bound: set[str] = set()
        self.timers: set[str] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- recording

    def call(self, client: httpx.Client, op: str, method: str, path: str, **kwargs) -> httpx.Response | None:
        started = self.phase
        try:
            response = client.request(method, path, **kwargs)
        except httpx.TransportError:
            response = None
        code = None
        if response is not None and response.status_code >= 400:
            try:
                code = response.json()["error"]["code"]
            except (ValueError, KeyError, TypeError):
                code = "<no envelope>"
        with self._lock:
            self.answers.append(
                Answer(op, started, self.phase, response.status_code if response is not None else None, code)
            )
        return response

    def record(self, op: str, response: httpx.Response | None, **fields) -> bool:
        """Record ``op`` in the ledger; return whether it was acknowledged."""
        if response is None:
            self.ledger.record(op, unknown=True, **fields)
            return False
        self.ledger.record_response(op, response, **fields)
        return 200 <= response.status_code < 300

    def in_phase(self, phase: str) -> list[Answer]:
        with self._lock:
            return [a for a in self.answers if a.started == a.ended == phase]

    def unexpected(self) -> list[Answer]:
        """Answers no phase allows: no answer at all, a 5xx other than 503, a 503 outside the envelope."""
        with self._lock:
            return [
                a
                for a in self.answers
                if a.status is None
                or (a.status >= 500 and a.status != 503)
                or (a.status == 503 and a.code != "SERVICE_UNAVAILABLE")
            ]

    # -- threads

    def start(self) -> None:
        workers = [
            (self._submit, PLAIN_MAILBOX),
            (self._submit, PLAIN_MAILBOX),
            (self._submit, BOUND_MAILBOX),
            (self._claim, None),
            (self._claim, None),
            (self._wait, None),
            (self._wait, None),
            (self._arm_timers, None),
        ]
        for index, (target, arg) in enumerate(workers):
            thread = threading.Thread(target=target, args=(index, arg), name=f"load-{index}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stopping.set()
        for thread in self._threads:
            thread.join(REQUEST_TIMEOUT_S + 35)
        assert not any(thread.is_alive() for thread in self._threads), "a client thread hangs"

    def _pause(self, response: httpx.Response | None) -> None:
        # Back off a little while the service refuses, as a client honouring Retry-After would.
        self._stopping.wait(0.25 if response is None or response.status_code >= 500 else 0.02)

    def _submit(self, index: int, mailbox: str) -> None:
        with self.stack.client() as client:
            n = 0
            while not self._stopping.is_set():
                # A key makes the retry of an unanswered submit idempotent.
                key = f"{self.tag}-{index}-{n}"
                body = {
                    "runId": self.run_id,
                    "key": key,
                    "input": {"i": n, "log": str(self.stack.log_dir / "bulk.log")},
                }
                response = self.call(client, "submit", "POST", f"/v1/mailboxes/{mailbox}/tasks", json=body)
                acknowledged = response is not None and response.status_code in (200, 201)
                task_id = response.json()["id"] if acknowledged else None
                if self.record("submit", response, run_id=self.run_id, task_id=task_id):
                    with self._lock:
                        (self.bound if mailbox == BOUND_MAILBOX else self.submitted).add(task_id)
                    n += 1
                self._pause(response)

    def _claim(self, index: int, _) -> None:
        with self.stack.client() as client:
            while not self._stopping.is_set():
                body = {"runId": self.run_id, "workerId": f"load-{index}", "max": 5, "waitMs": 1000}
                response = self.call(client, "claim", "POST", f"/v1/mailboxes/{PLAIN_MAILBOX}/claims", json=body)
                claims = response.json()["claims"] if response is not None and response.status_code == 200 else []
                if not self.record("claim", response, run_id=self.run_id, claim_ids=[c["claimId"] for c in claims]):
                    self._pause(response)
                    continue
                for claim in claims:
                    path = f"/v1/claims/{claim['claimId']}/complete"
                    done = self.call(client, "complete", "POST", path, json={"outcome": index})
                    told = {"state": "SUCCEEDED"} if done is not None and done.status_code == 200 else {}
                    if self.record("complete", done, claim_id=claim["claimId"], outcome=index, **told):
                        with self._lock:
                            self.completed.add(claim["task"]["id"])

    def _wait(self, index: int, _) -> None:
        with self.stack.client() as client:
            while not self._stopping.is_set():
                with self._lock:
                    ids = sorted(self.submitted)[-20:]
                if not ids:
                    self._stopping.wait(0.1)
                    continue
                path = f"/v1/tasks/{random.choice(ids)}/result"  # noqa: S311 - not crypto
                response = self.call(client, "wait", "GET", path, params={"timeoutMs": 2000})
                self._pause(response)

    def _arm_timers(self, index: int, _) -> None:
        with self.stack.client() as client:
            while not self._stopping.is_set():
                body = {"runId": self.run_id, "afterSeconds": 1}
                response = self.call(client, "timer", "POST", "/v1/timers", json=body)
                if response is not None and response.status_code == 201:
                    with self._lock:
                        self.timers.add(response.json()["id"])
                self._stopping.wait(0.2)


def probe(stack: Stack) -> tuple[int, dict, int]:
    """Return readyz's status and body, and healthz's status."""
    ready = httpx.get(f"{stack.url}/v1/readyz", timeout=REQUEST_TIMEOUT_S)
    health = httpx.get(f"{stack.url}/v1/healthz", timeout=REQUEST_TIMEOUT_S)
    return ready.status_code, ready.json(), health.status_code


def new_run(stack: Stack, name: str) -> str:
    with stack.client() as client:
        response = client.post("/v1/runs", json={"name": name})
    assert response.status_code == 201, response.text
    return response.json()["id"]


def warm_up(load: Load) -> None:
    wait_until(
        lambda: (
            len(load.submitted) >= 20 and len(load.completed) >= 5 and len(load.bound) >= 5 and len(load.timers) >= 3
        ),
        what="the load to get going",
    )


def assert_nothing_lost(stack: Stack, load: Load) -> None:
    """The database holds to the ledger; bound work gets done and timers fire."""

    def bound_done() -> bool:
        states = stack.states("coordination_task", load.bound)
        return len(states) == len(load.bound) and set(states.values()) == {"SUCCEEDED"}

    def states() -> str:
        seen = Counter(stack.states("coordination_task", load.bound).values())
        return f"{seen} of {len(load.bound)}\n{stack.logs()}"

    wait_until(bound_done, waits=2, interval_s=0.5, what="every acknowledged bound task to be done", explain=states)

    def timers_fired() -> bool:
        states = stack.states("coordination_timer", load.timers)
        return len(states) == len(load.timers) and set(states.values()) <= {"FIRED", "ACKNOWLEDGED"}

    wait_until(timers_fired, waits=2, interval_s=0.5, what="every acknowledged timer to fire")

    # The ledger reads the database through Django: check in a process set up for the throwaway one.
    (project_id,) = stack.sql("SELECT id::text FROM coordination_project WHERE name = %s", PROJECT)[0]
    load.ledger_counts = check_in_process(stack.env, project_id, load.ledger.path)


def report(title: str, load: Load, **figures) -> None:
    phases = {}
    for phase in ("before", "down", "after"):
        answers = load.in_phase(phase)
        phases[phase] = dict(Counter(a.status for a in answers))
    print(
        f"\n{title}: answers by phase {phases}; ledger {load.ledger_counts}; "
        f"acknowledged: {len(load.submitted)} submits, {len(load.completed)} completions, "
        f"{len(load.bound)} bound submits, {len(load.timers)} timers; "
        + ", ".join(f"{name} {value}" for name, value in figures.items())
    )


# The scenarios -------------------------------------------------------------------------


def test_a_postgres_restart_costs_503s_while_down_and_nothing_once_back(stack):
    pg = stack.pg
    load = Load(stack, new_run(stack, "pg-restart"), tag="pg")
    load.start()
    try:
        warm_up(load)

        load.phase = "stopping"
        pg.stop("fast")
        load.phase = "down"
        down_at = time.monotonic()
        wait_until(lambda: len(load.in_phase("down")) >= 20, what="answers while PostgreSQL is down")
        ready_status, ready_body, health_status = probe(stack)
        assert ready_status == 503, ready_body
        assert ready_body["checks"]["database"] != "ok" and ready_body["checks"]["broker"] == "ok", ready_body
        assert ready_body["error"]["code"] == "SERVICE_UNAVAILABLE"
        assert health_status == 200, "liveness does not depend on the database"
        time.sleep(max(0.0, DOWN_FOR_S - (time.monotonic() - down_at)))

        load.phase = "starting"
        pg.start()
        load.phase = "after"
        restarted_at = time.monotonic()
        wait_until(lambda: probe(stack)[0] == 200, what="readyz to answer 200 again")
        ready_after_s = time.monotonic() - restarted_at
        before = (len(load.submitted), len(load.completed), len(load.bound), len(load.timers))
        wait_until(
            lambda: (
                len(load.submitted) > before[0] + 10
                and len(load.completed) > before[1] + 5
                and len(load.bound) > before[2] + 3
                and len(load.timers) > before[3] + 2
            ),
            what="the load to be served again",
        )
        served_after_s = time.monotonic() - restarted_at
        assert_worker_connections_persist(stack, load)
    finally:
        load.stop()

    # The same API process listens again: its LISTEN connection is back (every session
    # present now began after the restart), and a long-poll started now is released by a change.
    wait_until(
        lambda: stack.sql("SELECT count(*) FROM pg_stat_activity WHERE query = 'LISTEN runstate'")[0][0] >= 1,
        what="the NOTIFY listener to reconnect",
    )
    assert_long_poll_released(stack, load.run_id)
    assert_sweeps_run(stack, load.run_id)

    down = load.in_phase("down")
    assert down and {(a.status, a.code) for a in down} == {(503, "SERVICE_UNAVAILABLE")}, Counter(
        (a.status, a.code) for a in down
    )
    assert load.unexpected() == [], f"{Counter((a.op, a.status, a.code) for a in load.unexpected())}\n{stack.logs()}"
    assert_nothing_lost(stack, load)
    stack.assert_processes_alive()
    report(
        "PostgreSQL restart",
        load,
        ready_after_s=round(ready_after_s, 2),
        load_served_after_s=round(served_after_s, 2),
    )


def assert_worker_connections_persist(stack: Stack, load: Load) -> None:
    """The worker reconnected after the restart and keeps its connections: no new session per task.

    Its threads (4) and the renewer hold at most one session each, its claim watch two (its
    ``LISTEN`` and its reads); the same sessions serve while more bound tasks are done (the
    renewer may have reconnected once, and the watch's reads reconnect just after its ``LISTEN``).
    """

    def sessions() -> set[int]:
        query = "SELECT pid FROM pg_stat_activity WHERE application_name = %s"
        return {pid for (pid,) in stack.sql(query, WORKER_APP_NAME)}

    def watch_listening() -> bool:
        query = "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s AND query = 'LISTEN runstate'"
        return stack.sql(query, WORKER_APP_NAME)[0][0] >= 1

    def bound_succeeded() -> int:
        return list(stack.states("coordination_task", set(load.bound)).values()).count("SUCCEEDED")

    wait_until(lambda: bool(sessions()), what="the worker to reconnect")
    wait_until(watch_listening, what="the worker's claim watch to listen again")
    before, done_before = sessions(), bound_succeeded()
    wait_until(lambda: bound_succeeded() >= done_before + 10, what="10 more bound tasks to be done")
    after = sessions()
    assert 1 <= len(after) <= 7, after
    # A connection per task (Celery's default with Django) would show new sessions here.
    assert len(after - before) <= 2, f"new sessions while 10 tasks ran: before {before}, after {after}"


def assert_long_poll_released(stack: Stack, run_id: str) -> None:
    with stack.client() as client:
        submitted = client.post(f"/v1/mailboxes/{PROBE_MAILBOX}/tasks", json={"runId": run_id, "input": {}})
        assert submitted.status_code == 201, submitted.text
        task_id = submitted.json()["id"]
        answer: dict = {}

        def wait() -> None:
            with stack.client() as waiter:
                answer["response"] = waiter.get(f"/v1/tasks/{task_id}/result", params={"timeoutMs": 20000}, timeout=40)

        waiting = threading.Thread(target=wait)
        waiting.start()
        time.sleep(0.5)  # let the wait begin (released either way: it re-reads once it has)
        claims = client.post(f"/v1/mailboxes/{PROBE_MAILBOX}/claims", json={"runId": run_id, "max": 1}).json()["claims"]
        assert [c["task"]["id"] for c in claims] == [task_id]
        assert client.post(f"/v1/claims/{claims[0]['claimId']}/complete", json={"outcome": "ok"}).status_code == 200
        waiting.join(45)
    assert answer["response"].status_code == 200
    assert answer["response"].json()["state"] == "SUCCEEDED"


def assert_sweeps_run(stack: Stack, run_id: str) -> None:
    """Beat and the worker sweep again: a lease left to expire now is settled."""
    with stack.client() as client:
        submitted = client.post(f"/v1/mailboxes/{PROBE_MAILBOX}/tasks", json={"runId": run_id, "input": {}})
        assert submitted.status_code == 201, submitted.text
        task_id = submitted.json()["id"]
        body = {"runId": run_id, "max": 1, "leaseTtlMs": 200}
        claims = client.post(f"/v1/mailboxes/{PROBE_MAILBOX}/claims", json=body).json()["claims"]
        assert [c["task"]["id"] for c in claims] == [task_id]
        wait_until(
            lambda: client.get(f"/v1/tasks/{task_id}").json()["state"] != "RUNNING",
            interval_s=0.2,
            what="the lease sweep to settle an expired lease",
        )


def test_b_broker_restart_costs_no_5xx_and_work_submitted_meanwhile_gets_done(stack):
    redis = stack.redis
    load = Load(stack, new_run(stack, "broker-restart"), tag="redis")
    load.start()
    try:
        warm_up(load)

        load.phase = "stopping"
        redis.stop()
        load.phase = "down"
        down_at = time.monotonic()
        bound_before = len(load.bound)
        wait_until(
            lambda: len(load.in_phase("down")) >= 20 and len(load.bound) > bound_before + 3,
            what="bound submits acknowledged while Redis is down",
        )
        ready_status, ready_body, health_status = probe(stack)
        assert ready_status == 503, ready_body
        assert ready_body["checks"] == {"database": "ok", "broker": ready_body["checks"]["broker"]}
        assert ready_body["checks"]["broker"] != "ok"
        assert health_status == 200
        time.sleep(max(0.0, DOWN_FOR_S - (time.monotonic() - down_at)))
        submitted_while_down = len(load.bound) - bound_before

        load.phase = "starting"
        redis.start()
        load.phase = "after"
        restarted_at = time.monotonic()
        wait_until(lambda: probe(stack)[0] == 200, what="readyz to answer 200 again")
        ready_after_s = time.monotonic() - restarted_at
        bound_after = len(load.bound)
        wait_until(lambda: len(load.bound) > bound_after + 3, what="bound submits after the restart")
    finally:
        load.stop()

    down = load.in_phase("down")
    assert down and all(a.status is not None and a.status < 500 for a in down), Counter(a.status for a in down)
    assert load.unexpected() == [], f"{Counter((a.op, a.status, a.code) for a in load.unexpected())}\n{stack.logs()}"
    settle_started = time.monotonic()
    assert_nothing_lost(stack, load)
    assert_sweeps_run(stack, load.run_id)
    stack.assert_processes_alive()
    report(
        "Redis restart",
        load,
        bound_submits_while_down=submitted_while_down,
        ready_after_s=round(ready_after_s, 2),
        all_work_done_after_s=round(time.monotonic() - settle_started, 2),
    )


def test_c_the_pool_refuses_at_once_while_the_server_is_down_and_serves_once_it_is_back():
    """The API's pool raises the server's refusal, not its 30 s timeout, and recovers by itself."""
    server = ThrowawayPostgres()
    try:
        server.init()
        pool = FailFastPool(
            conninfo=server.url(),
            min_size=1,
            max_size=2,
            timeout=30,
            reconnect_timeout=5,
            check=check_idle_connection,  # as the project's settings configure it
            open=True,
        )

        def serves() -> bool:
            try:
                with pool.connection() as conn:
                    return conn.execute("SELECT 1").fetchone() == (1,)
            except psycopg.OperationalError:
                return False

        try:
            assert serves()
            server.stop("fast")
            for _ in range(3):  # the dead pooled connection first, then an empty pool
                with pytest.raises(psycopg.OperationalError) as refused, pool.connection() as conn:
                    conn.execute("SELECT 1")
                assert not isinstance(refused.value, PoolTimeout), refused.value
            server.start()
            wait_until(serves, interval_s=0.2, what="the pool to serve again")
        finally:
            pool.close()
    finally:
        server.destroy()


def test_d_a_server_that_is_up_but_full_is_waited_for_not_refused():
    """A server refusing new connections because it is full is up: a request waits for the pool's own."""
    server = ThrowawayPostgres()
    try:
        server.init()
        with psycopg.connect(server.url(), autocommit=True) as admin:
            admin.execute("CREATE ROLE capped LOGIN CONNECTION LIMIT 1")
        pool = FailFastPool(
            conninfo=server.url().replace("postgres@", "capped@"), min_size=1, max_size=1, timeout=30, open=True
        )
        try:
            pool.wait(timeout=30)
            held = pool.getconn()  # the role's only slot: the pool's check connection is refused
            giving_back = threading.Timer(1.0, pool.putconn, args=(held,))
            giving_back.start()
            try:
                with pool.connection() as conn:  # waits past the grace, probes, is told "too many"
                    assert conn.execute("SELECT current_user").fetchone() == ("capped",)
            finally:
                giving_back.join()
        finally:
            pool.close()
    finally:
        server.destroy()
