"""Servers of their own for the tests that run runstate as it is deployed past one machine.

- ``ThrowawayPostgres`` (``tests/reliability/throwaway.py``): a cluster made with ``initdb`` in a
  temporary directory, on a free port, trust authentication, as the ``postgres`` OS user when
  the tests run as root (PostgreSQL refuses root).
- ``PgBouncer`` (``devservers/pgbouncer.py``, which the benchmarks share): Debian's
  ``pgbouncer`` in front of such a cluster, on a free port of its own, as the same OS user.

``pgbouncer_in_front`` starts both and always stops and deletes both, whatever the test did.
- ``StreamingPair``: a primary and its synchronous streaming standby, named together by one
  multi-host ``DATABASE_URL``; ``ApiOnPair`` runs a uvicorn API (and workers, beat) on it,
  or on a PgBouncer in front of it; ``Submitter`` submits with keys through the SDK, and
  ``Answers`` notes every HTTP answer a client got in each phase of a failover.
Nothing here touches the machine's own servers (PostgreSQL on 5432). When ``pgbouncer`` is
missing the tests fail with a message naming ``scripts/ensure_pgbouncer.sh``, which
``scripts/test`` runs to install it; ``RUNSTATE_TEST_SKIP_PGBOUNCER=1`` skips them instead,
on a machine that cannot install it.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest

from devservers.pgbouncer import PGBOUNCER, PgBouncer
from runstate import Runstate, RunstateError
from tests.processes import ROOT, free_port, manage, stop_process_groups
from tests.reliability.ledger import Ledger, check_in_process, watch_sdk
from tests.reliability.throwaway import ThrowawayPostgres
from tests.waiting import wait_until


def require_pgbouncer() -> None:
    """Fail (or skip, with ``RUNSTATE_TEST_SKIP_PGBOUNCER=1``) when the ``pgbouncer`` program is missing."""
    if Path(PGBOUNCER).exists():
        return
    message = f"these tests need PgBouncer at {PGBOUNCER}: run scripts/ensure_pgbouncer.sh (apt-get install pgbouncer)"
    if os.environ.get("RUNSTATE_TEST_SKIP_PGBOUNCER") == "1":
        pytest.skip(message)
    pytest.fail(message)


@contextlib.contextmanager
def pgbouncer_in_front(*, pool_mode: str = "transaction", pool_size: int = 10) -> Iterator[PgBouncer]:
    """A fresh cluster with an empty ``runstate`` database and PgBouncer in front; both gone afterwards."""
    require_pgbouncer()
    server = ThrowawayPostgres()
    bouncer = PgBouncer(server, pool_mode=pool_mode, pool_size=pool_size)
    try:
        server.init()
        bouncer.start()
        yield bouncer
    finally:
        bouncer.destroy()
        server.destroy()


# A primary and its synchronous streaming standby -------------------------------------------

STANDBY_NAME = "standby1"


class StreamingPair:
    """A primary and a synchronous streaming standby (``docs/deploy.md``, "Failover to a standby").

    The primary runs with ``synchronous_standby_names`` naming the standby and
    ``synchronous_commit=on``: a commit is acknowledged only once the standby has flushed its
    WAL, so a promotion loses nothing that was acknowledged. The standby is made with
    ``pg_basebackup -R`` (it streams from the primary as ``STANDBY_NAME``) and runs without
    ``synchronous_standby_names``, so once promoted it commits alone. ``url()`` names both
    hosts with ``target_session_attrs=read-write``: a connection lands on whichever is primary.
    """

    def __init__(self) -> None:
        self.primary = ThrowawayPostgres(synchronous_commit="on")
        self.standby = ThrowawayPostgres(synchronous_commit="on")

    @property
    def database(self) -> str:
        return self.primary.database

    def start(self) -> None:
        """Create the primary and its database, then the standby; wait until it replicates synchronously."""
        self.primary.init()
        self.standby.init_standby_of(self.primary, application_name=STANDBY_NAME)
        # Named only now: with it set and no standby connected, every commit (the database's
        # creation included) would wait for one. ALTER SYSTEM lands in postgresql.auto.conf,
        # which pg_basebackup has already copied, so the standby keeps none once promoted.
        with psycopg.connect(self.primary.url("postgres"), autocommit=True) as conn:
            conn.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{STANDBY_NAME}'")
            conn.execute("SELECT pg_reload_conf()")
        wait_until(
            lambda: self.sync_state() == "sync",
            what="the standby to replicate synchronously",
            interval_s=0.1,
            explain=self.standby.log,
        )

    def sync_state(self) -> str | None:
        """Return the standby's ``sync_state`` as the primary sees it (None: not streaming)."""
        with psycopg.connect(self.primary.url("postgres"), autocommit=True) as conn:
            row = conn.execute(
                "SELECT sync_state FROM pg_stat_replication WHERE application_name = %s", [STANDBY_NAME]
            ).fetchone()
        return row[0] if row else None

    def url(self, database: str | None = None, **query: str) -> str:
        """Return the multi-host ``DATABASE_URL``: both servers, read-write sessions only."""
        params = {"target_session_attrs": "read-write", **query}
        tail = "&".join(f"{key}={value}" for key, value in params.items())
        hosts = f"127.0.0.1:{self.primary.port},127.0.0.1:{self.standby.port}"
        return f"postgres://postgres@{hosts}/{database or self.database}?{tail}"

    def sql(self, query: str, *params) -> list[tuple]:
        """Run ``query`` on whichever server accepts writes now; return its rows."""
        with psycopg.connect(self.url(), autocommit=True, connect_timeout=5) as conn:
            return conn.execute(query, params).fetchall()

    def tasks(self, task_ids: list[str]) -> dict[str, tuple[str, int, dict | None]]:
        """Return ``{task id: (state, attempts, outcome)}`` as the server accepting writes has them."""
        query = "SELECT id::text, state, attempts, outcome FROM coordination_task WHERE id = ANY(%s::uuid[])"
        return {task_id: (state, attempts, outcome) for task_id, state, attempts, outcome in self.sql(query, task_ids)}

    def succeeded(self, task_ids: list[str]) -> list[str]:
        """Return those of ``task_ids`` that are ``SUCCEEDED``."""
        return [task_id for task_id, (state, _, _) in self.tasks(task_ids).items() if state == "SUCCEEDED"]

    def destroy(self) -> None:
        """Stop both servers and delete their directories."""
        self.standby.destroy()
        self.primary.destroy()


@contextlib.contextmanager
def streaming_pair() -> Iterator[StreamingPair]:
    """A fresh primary with an empty ``runstate`` database and a synchronous standby; both gone afterwards."""
    pair = StreamingPair()
    try:
        pair.start()
        yield pair
    finally:
        pair.destroy()


class ApiOnPair:
    """A uvicorn API on a ``StreamingPair``'s multi-host ``DATABASE_URL``, and processes beside it.

    ``env`` adds to the environment or overrides it: ``DATABASE_URL`` through a PgBouncer in
    front of the pair, ``RUNSTATE_LISTEN_DATABASE_URL``... ``start_api()`` migrates the pair's
    database, creates an API key of ``project`` and starts one API process, never restarted:
    after a promotion it must find the new primary by itself. ``spawn`` starts more processes
    (a ``runstate worker``, a Celery worker, beat) in the same environment, plus what it is
    given; each runs in its own process group and logs to ``log_dir/<name>.log``. ``stop()``
    stops them all.
    """

    REQUEST_TIMEOUT_S = 15.0

    def __init__(self, pair: StreamingPair, *, broker_url: str, log_dir: Path, project: str, **env: str) -> None:
        self.pair = pair
        self.log_dir = log_dir
        self.project = project
        self.env = dict(os.environ)
        self.env.update(
            DATABASE_URL=pair.url(),
            CELERY_BROKER_URL=broker_url,
            DJANGO_SETTINGS_MODULE="runstate_project.settings",
            PYTHONUNBUFFERED="1",
            RUNSTATE_VAR_DIR=str(log_dir / "var"),
            RUNSTATE_DB_POOL_SIZE="8",
            RUNSTATE_RATE_LIMIT="1000000/min",
        )
        self.env.pop("RUNSTATE_LISTEN_DATABASE_URL", None)  # the suite's, unless ``env`` gives one
        self.env.update(env)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.key = ""
        self.api: subprocess.Popen | None = None
        self.children: dict[str, subprocess.Popen] = {}

    def start_api(self) -> None:
        """Migrate, create the key, start the API and wait until it is ready."""
        manage(self.env, "migrate", "--noinput")
        permissions = "resource_config,coordination_write,coordination_read"
        out = manage(self.env, "create_api_key", "--project", self.project, "--permissions", permissions)
        self.key = out.strip().splitlines()[-1]
        uvicorn = [sys.executable, "-m", "uvicorn", "runstate_project.asgi:application", "--log-level", "warning"]
        self.api = self.spawn("api", [*uvicorn, "--host", "127.0.0.1", "--port", str(self.port)])

        def ready() -> bool:
            assert self.api.poll() is None, self.api_log()
            try:
                return httpx.get(f"{self.url}/v1/readyz", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(ready, waits=2, what="the API to be ready")

    def spawn(self, name: str, command: list[str], **env: str) -> subprocess.Popen:
        """Start ``command`` as the child ``name`` in this environment plus ``env``."""
        with open(self.log_dir / f"{name}.log", "wb") as log:
            child = subprocess.Popen(
                command,
                cwd=ROOT,
                env={**self.env, **env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.children[name] = child
        return child

    def log(self, name: str, tail: int = 4000) -> str:
        """Return the end of the child ``name``'s log."""
        return (self.log_dir / f"{name}.log").read_text(errors="replace")[-tail:]

    def api_log(self) -> str:
        return self.log("api")

    def logs(self) -> str:
        """Return the end of every child's log, each headed by whether the child still runs.

        An exited child's log is headed too by its lines that say why (Celery's ``CRITICAL``
        and the exception's last line): its end may be a traceback written a character a line.
        """
        exited = self.exited()
        parts = []
        for name in self.children:
            parts.append(f"--- {name} ({f'exited {exited[name]}' if name in exited else 'running'})")
            if name in exited:
                whole = (self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()
                why = [line for line in whole if "CRITICAL" in line or re.search(r"\b\w+(Error|Exception): ", line)]
                parts += [f"why: {line}" for line in why[-10:]]
            parts.append(self.log(name))
        return "\n".join(parts)

    def task_states(self, task_ids: list[str]) -> str:
        """Say how many of ``task_ids`` are in each state, then every child's log (a failed drain's explanation)."""
        states = Counter(state for state, _, _ in self.pair.tasks(task_ids).values())
        return f"{states} of {len(task_ids)}\n{self.logs()}"

    def exited(self) -> dict[str, int]:
        """Return the exit status of each child that has exited, by name."""
        return {name: child.returncode for name, child in self.children.items() if child.poll() is not None}

    def assert_alive(self) -> None:
        """Fail, with the logs, when a child has exited."""
        dead = self.exited()
        assert not dead, f"exited: {dead}\n{self.logs()}"

    def check_ledgers(self, *paths: Path, drained_runs=()) -> str:
        """Hold the database (the promoted standby, after a failover) to the ledgers at ``paths``; return the counts."""
        ((project_id,),) = self.pair.sql("SELECT id::text FROM coordination_project WHERE name = %s", self.project)
        return check_in_process(self.env, project_id, *paths, drained_runs=drained_runs)

    def client(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {self.key}"}, timeout=self.REQUEST_TIMEOUT_S
        )

    def stop(self) -> None:
        """Stop every child (SIGTERM to its group, then SIGKILL)."""
        stop_process_groups(self.children.values())


def refused_without_a_primary(api: ApiOnPair, run_id: str, mailbox: str) -> list[tuple[str, int, str | None, str]]:
    """Send a submit (the hot path) and a run read (DRF); return each answer's status, code and Retry-After."""
    answers = []
    with api.client() as client:
        for name, method, path, body in (
            ("submit", "POST", f"/v1/mailboxes/{mailbox}/tasks", {"runId": run_id, "input": {}}),
            ("run", "GET", f"/v1/runs/{run_id}", None),
        ):
            response = client.request(method, path, json=body)
            answers.append((name, response.status_code, error_code(response), response.headers.get("Retry-After", "")))
    return answers


def error_code(response: httpx.Response) -> str | None:
    """Return the error envelope's code (None for an answer without one)."""
    try:
        return response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


class Answers:
    """Every HTTP request that watched clients sent, in which phase of a failover, and the answer it got.

    The test moves ``phase`` along (``"before"``, ``"down"``...). An answer is kept as
    ``(phase when sent, phase when answered, status, error code)``; a request that got no
    answer (a transport error, a timeout) is counted in ``sent`` and nowhere else, whether or
    not the SDK retried it.
    """

    def __init__(self) -> None:
        self.phase = "before"
        self.lock = threading.Lock()
        self.sent: Counter[str] = Counter()
        self.answers: list[tuple[str, str, int, str | None]] = []

    def watch(self, http: httpx.Client) -> None:
        """Note every request ``http`` sends and every answer it gets."""

        def sent(request: httpx.Request) -> None:
            request.extensions["failover_phase"] = phase = self.phase
            with self.lock:
                self.sent[phase] += 1

        def answered(response: httpx.Response) -> None:
            code = None
            if response.status_code >= 400:
                response.read()  # an event hook sees the answer before its body is read
                code = error_code(response)
            answer = (response.request.extensions["failover_phase"], self.phase, response.status_code, code)
            with self.lock:
                self.answers.append(answer)

        hooks = http.event_hooks
        http.event_hooks = {"request": [*hooks["request"], sent], "response": [*hooks["response"], answered]}

    def sent_in(self, *phases: str) -> list[tuple[str, str, int, str | None]]:
        """Return the answers to the requests sent in one of ``phases``."""
        with self.lock:
            return [answer for answer in self.answers if answer[0] in phases]

    def unanswered(self) -> int:
        """Count the requests sent that got no answer."""
        with self.lock:
            return sum(self.sent.values()) - len(self.answers)


class SdkClient:
    """An SDK client that calls runstate in a thread of its own until stopped, each call in a ledger of its own.

    Its SDK client retries ``max_retries`` times: at least the 503's ``Retry-After`` second
    apart at first, then with its growing jittered backoff (10 retries: about 30 s in all).
    Subclasses write ``_run``, which loops until ``stopping`` is set.
    """

    def __init__(self, api: ApiOnPair, *, name: str, max_retries: int = 10, timeout_s: float = 30.0) -> None:
        self.name = name
        self.ledger = Ledger(path=api.log_dir / f"{name}.jsonl", source=name)
        self.rs = Runstate(api.url, api.key, max_retries=max_retries, timeout=timeout_s)
        watch_sdk(self.rs)
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"failover-{name}", daemon=True)

    @property
    def http(self) -> httpx.Client:
        """The SDK's HTTP client (for ``Answers.watch``)."""
        return self.rs._http._client

    def _run(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(60)
        assert not self.thread.is_alive(), f"{self.name} hangs"
        self.rs.close()


class Submitter(SdkClient):
    """One SDK client submitting tasks with keys under ``run_id``, one after another, until stopped.

    Every submit goes in the ledger. The HTTP answers behind the call in progress are kept,
    so a submit answered 503 and retried by the SDK to its acknowledgement shows as such.
    """

    def __init__(
        self,
        api: ApiOnPair,
        run_id: str,
        mailbox: str,
        *,
        task_input: dict | None = None,
        every_s: float = 0.05,
        max_retries: int = 10,
        timeout_s: float = 30.0,
        name: str = "submitter",
    ) -> None:
        super().__init__(api, name=name, max_retries=max_retries, timeout_s=timeout_s)
        self.run_id = run_id
        self.mailbox = mailbox
        self.task_input = task_input or {}
        self.every_s = every_s
        http = self.http
        http.event_hooks = {**http.event_hooks, "response": [*http.event_hooks["response"], self._answered]}
        self.statuses: list[int] = []  # the HTTP answers to the call in progress
        self.acknowledged: list[tuple[str, float, list[int]]] = []  # task id, when, the call's answers
        self.gave_up: list[str] = []  # calls that raised after the SDK's retries

    def _answered(self, response: httpx.Response) -> None:
        with self.lock:
            self.statuses.append(response.status_code)

    def _run(self) -> None:
        scope = self.rs.scope(self.run_id)
        n = 0
        while not self.stopping.is_set():
            with self.lock:
                self.statuses = []
            try:
                with self.ledger.op("submit", run_id=self.run_id) as call:
                    # The key makes a submit sent again (after the SDK gave up) the same submit.
                    ticket = scope.tasks.submit(self.mailbox, {"i": n, **self.task_input}, key=f"{self.name}-{n}")
                    call.done(task_id=ticket.id)
            except RunstateError as error:
                with self.lock:
                    self.gave_up.append(f"{type(error).__name__}: {error}")
                self.stopping.wait(0.2)
                continue
            with self.lock:
                self.acknowledged.append((ticket.id, time.monotonic(), list(self.statuses)))
            n += 1
            self.stopping.wait(self.every_s)

    def burst(self, count: int) -> None:
        """Submit ``count`` tasks in one batch (with keys), so that work waits in the mailbox at the switch."""
        items = [{"input": {"i": f"b{k}", **self.task_input}, "key": f"{self.name}-b{k}"} for k in range(count)]
        started = time.monotonic_ns()
        tickets = self.rs.scope(self.run_id).tasks.submit_many(self.mailbox, items)
        now = time.monotonic()
        for ticket in tickets:
            self.ledger.record("submit", ok=True, started_ns=started, run_id=self.run_id, task_id=ticket.id)
        with self.lock:
            self.acknowledged += [(ticket.id, now, [201]) for ticket in tickets]

    def seen(self, status: int) -> bool:
        """Whether the call in progress has been answered ``status``."""
        with self.lock:
            return status in self.statuses

    def count(self, after: float = float("-inf")) -> int:
        with self.lock:
            return sum(1 for _, at, _ in self.acknowledged if at > after)

    def task_ids(self, after: float = float("-inf")) -> list[str]:
        with self.lock:
            return [task_id for task_id, at, _ in self.acknowledged if at > after]
