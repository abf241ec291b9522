"""Load and scale-out: a swarm of SDK clients on two API servers, two Celery workers and beat.

The deployment is what several machines would run: two ``uvicorn`` API processes on two
ports (a connection pool of ``RUNSTATE_DB_POOL_SIZE=10`` each), two Celery worker processes
(thread pool, 3 threads each) and one beat, on the test PostgreSQL database and one Redis
broker (``RUNSTATE_TEST_WORKER_BROKER_URL``, flushed first). About 35 database connections
in all, whatever the number of clients: long-polls hold none while they wait.

N client threads (``tests/reliability/swarm.py``) use the ``runstate`` SDK, client ``i`` on
server ``i % 2``, for D seconds: submit, claim, renew, complete, fail and retry, groups of
every condition with verdicts, runs cancelled while a worker is claiming and completing
under them, and tasks for a ``@runstate_task`` mailbox that the Celery workers run. Every
wait (group waits, task results, claim long-polls) is made on the *other* server than the
change that releases it, so a release can only come through the database's NOTIFY.

Each client also keeps one group wait parked for the whole run, so the servers carry N
long-polls on top of the traffic, and an event follower reads the whole event log, each
page through the other server than the last.

Asserted: not one 5xx answer (503 included) among all HTTP answers, retries included; every
wait released, both ways across the servers, and a group wait saw the decision its decider
was told; both Celery workers ran tasks; the event follower saw every event of the database
once, in cursor order; no client thread hit an unexpected error; at most 50 connections from
the deployment's processes to the database at any time; and the ``Ledger``
(``tests/reliability/ledger.py``) finds the database clean: nothing claimed or finished
twice, nothing acknowledged lost, no group decided twice, nothing accepted under a run after
its cancel, a Celery handler run at most once per claim. No duration is asserted.

The test prints per-operation counts and p50/p99 latency, the HTTP status totals per
server and the wait release latency. Settings (environment):

- ``RUNSTATE_SOAK_CLIENTS`` (default 10): N client threads.
- ``RUNSTATE_SOAK_SECONDS`` (default 10): D, how long clients keep starting scenarios.
- ``RUNSTATE_SOAK_RECORD`` (unset): when set, append the figures to ``docs/benchmarks.md``
  (the recorded soak is ``RUNSTATE_SOAK_CLIENTS=50 RUNSTATE_SOAK_SECONDS=60``).
"""

import datetime as dt
import os
import platform
import subprocess
import threading
from pathlib import Path

import pytest
from django.db import connection

from coordination.models import Event
from coordination.services.keys import ALL_PERMISSIONS, api_key_create, project_ensure
from tests.reliability.ledger import Ledger
from tests.reliability.swarm import APPLICATION_NAME_PREFIX, PROJECT, deployment, run_swarm
from tests.workers.live import ROOT, TEST_BROKER_URL, beat_command, child_env, purge_broker

CLIENTS = int(os.environ.get("RUNSTATE_SOAK_CLIENTS", "10"))
SECONDS = float(os.environ.get("RUNSTATE_SOAK_SECONDS", "10"))
RECORD = bool(os.environ.get("RUNSTATE_SOAK_RECORD"))
DB_POOL_SIZE = 10
WORKER_CONCURRENCY = 3
# The topology's budget on a server whose max_connections (100) other suites share.
MAX_CONNECTIONS = 50

pytestmark = [
    pytest.mark.soak,
    pytest.mark.postgres_only,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not TEST_BROKER_URL.startswith("redis://"), reason="the live workers need a Redis broker"),
    pytest.mark.timeout(SECONDS + 600),
]


def event_cursors(project_id) -> set[str]:
    """Return the API cursor of every event of the project (``<txid>-<id>``)."""
    return {f"{txid}-{id}" for txid, id in Event.objects.filter(project_id=project_id).values_list("txid", "id")}


def other_test_sessions() -> int:
    """Count the pytest processes on the machine besides this one (other suites sharing the CPUs)."""
    count = 0
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            words = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if cmdline.parent.name != str(os.getpid()) and any(w.endswith(b"pytest") for w in words[:3]):
            count += 1
    return count


class ConnectionSampler(threading.Thread):
    """Sample the deployment's database connections every half second (keep the peak), and other pytest sessions.

    Only the topology's own processes count (by ``application_name``): in the whole suite, other
    fixtures' servers (the SDK tests' uvicorn and its pool) stay connected to the same database.
    """

    def __init__(self) -> None:
        super().__init__(name="connection-sampler", daemon=True)
        self.peak = 0
        self.other_sessions = 0
        self.stopping = threading.Event()

    def run(self) -> None:
        try:
            with connection.cursor() as cursor:
                while not self.stopping.wait(0.5):
                    cursor.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                        "AND application_name LIKE %s",
                        [APPLICATION_NAME_PREFIX + "%"],
                    )
                    self.peak = max(self.peak, cursor.fetchone()[0])
                    self.other_sessions = max(self.other_sessions, other_test_sessions())
        finally:
            connection.close()

    def stop(self) -> int:
        self.stopping.set()
        self.join(10)
        return self.peak


def test_swarm_on_two_servers_and_two_workers_releases_every_wait_without_a_5xx(tmp_path):
    purge_broker()
    project = project_ensure(name=PROJECT)
    # One key per client, as each worker of a swarm would have (and each key's rate limit).
    keys = [
        api_key_create(project_id=project.id, permissions=list(ALL_PERMISSIONS), name=f"swarm {i}").plaintext
        for i in range(CLIENTS)
    ]
    env = child_env(DEBUG="0", SECRET_KEY="runstate-swarm-test", LOG_LEVEL="WARNING")
    ledger = Ledger(source="swarm")
    with deployment(
        env=env,
        log_dir=tmp_path,
        root=ROOT,
        beat_command=beat_command(tmp_path),
        ledger_path=tmp_path / "effects.jsonl",
        db_pool_size=DB_POOL_SIZE,
        worker_concurrency=WORKER_CONCURRENCY,
    ) as started:
        sampler = ConnectionSampler()
        sampler.start()
        result = run_swarm(
            servers=started.servers,
            api_keys=keys,
            seconds=SECONDS,
            ledger=ledger,
            database_cursors=lambda: event_cursors(project.id),
        )
        peak_connections = sampler.stop()
        other_sessions = sampler.other_sessions
        dead = started.dead()
        logs = started.logs()
    report = ledger.merge(Ledger.load(tmp_path / "effects.jsonl")).check(project.id)

    summary = result.summary()
    print(f"\n{summary}\n\npeak database connections: {peak_connections}\n{report.describe()}")
    if RECORD:
        record(result, report, peak_connections, other_sessions)

    assert not dead, f"processes exited during the run: {dead}\n{logs}"
    assert peak_connections <= MAX_CONNECTIONS, f"{peak_connections} connections to the database at the peak"
    assert not result.stats.failures, "\n\n".join(result.stats.failures[:10])
    assert result.stats.count_5xx() == 0, "\n".join(result.stats.server_errors[:20]) + f"\n{logs}"
    unreleased = result.waits.unreleased()
    assert not unreleased, f"{len(unreleased)} waits not released: {unreleased[:10]}"
    # Released waits on each server whose deciding change was made through the other one.
    # (Plain group waits are decided by whichever of the concurrent verdicts comes last, on
    # either server; every other kind is decided through the other server by construction.)
    pairs = result.waits.pairs()
    kinds = {kind for kind, _, decider in pairs if decider.startswith("api")} - {"group"}
    assert {"group-parked", "claim", "result"} <= kinds, f"waits made: {pairs}"
    for kind in kinds:
        across = {(w, d) for (k, w, d) in pairs if k == kind and w != d}
        assert across == {("api0", "api1"), ("api1", "api0")}, f"{kind} waits released across servers: {pairs}"
    assert len(result.celery_pids) == 2 and set(result.celery_pids) == set(started.worker_pids), (
        f"Celery tasks per worker pid {dict(result.celery_pids)}, workers {started.worker_pids}"
    )
    assert report.clean, report.describe()


def record(result, report, connections: int, other_sessions: int) -> None:
    """Append this run's figures to docs/benchmarks.md."""
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    revision = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout.strip()
    with connection.cursor() as cursor:
        cursor.execute("SHOW server_version")
        pg_version = cursor.fetchone()[0]
    load = os.getloadavg()
    section = "\n".join(
        [
            "",
            f"### `tests/reliability/test_load.py` — {now}, commit {revision}",
            "",
            f"- Machine: {os.cpu_count()} CPUs, {platform.system()} {platform.release()}; PostgreSQL {pg_version} "
            f"and Redis on the same machine; load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}; "
            f"other pytest sessions running on the same CPUs meanwhile: up to {other_sessions}",
            f"- Command: `RUNSTATE_SOAK_CLIENTS={result.clients} RUNSTATE_SOAK_SECONDS={result.seconds:g} "
            "RUNSTATE_SOAK_RECORD=1 .venv/bin/python -m pytest tests/reliability/test_load.py -s`",
            f"- Topology: 2 uvicorn API processes (pool {DB_POOL_SIZE} each), 2 Celery workers "
            f"(threads, concurrency {WORKER_CONCURRENCY}), 1 beat, one PostgreSQL, one Redis; "
            f"peak {connections} connections to the database",
            f"- Result: ledger {'clean' if report.clean else 'NOT CLEAN'}; {len(result.stats.failures)} client errors",
            "",
            "```",
            *result.summary().splitlines()[:4],
            "```",
            "",
            *result.summary().splitlines()[5:],
            "",
        ]
    )
    with open(ROOT / "docs" / "benchmarks.md", "a") as handle:
        handle.write(section)
