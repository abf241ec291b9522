"""Servers of their own for the tests that run runstate as it is deployed past one machine.

- ``ThrowawayPostgres`` (``tests/reliability/throwaway.py``): a cluster made with ``initdb`` in a
  temporary directory, on a free port, trust authentication, as the ``postgres`` OS user when
  the tests run as root (PostgreSQL refuses root).
- ``PgBouncer``: Debian's ``pgbouncer`` in front of such a cluster, on a free port of its own,
  in transaction mode with a pool of ``pool_size`` server connections per database and user
  (``docs/deploy.md``, "Behind PgBouncer", gives the same ``pgbouncer.ini``). It refuses root
  too, so it runs as the same OS user as the cluster.

``pgbouncer_in_front`` starts both and always stops and deletes both, whatever the test did.
- ``StreamingPair``: a primary and its synchronous streaming standby, named together by one
  multi-host ``DATABASE_URL``; ``ApiOnPair`` runs a uvicorn API (and workers, beat) on it.
Nothing here touches the machine's own servers (PostgreSQL on 5432). When ``pgbouncer`` is
missing the tests fail with a message naming ``scripts/ensure_pgbouncer.sh``, which
``scripts/test`` runs to install it; ``RUNSTATE_TEST_SKIP_PGBOUNCER=1`` skips them instead,
on a machine that cannot install it.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest

from tests.processes import ROOT, free_port, manage, stop_process_groups
from tests.reliability.throwaway import PG_OS_USER, ThrowawayPostgres, port_open
from tests.workers.live import wait_until

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"


def require_pgbouncer() -> None:
    """Fail (or skip, with ``RUNSTATE_TEST_SKIP_PGBOUNCER=1``) when the ``pgbouncer`` program is missing."""
    if Path(PGBOUNCER).exists():
        return
    message = f"these tests need PgBouncer at {PGBOUNCER}: run scripts/ensure_pgbouncer.sh (apt-get install pgbouncer)"
    if os.environ.get("RUNSTATE_TEST_SKIP_PGBOUNCER") == "1":
        pytest.skip(message)
    pytest.fail(message)


class PgBouncer:
    """PgBouncer in front of ``server`` (a ``ThrowawayPostgres``), in a temporary directory on a free port."""

    def __init__(self, server: ThrowawayPostgres, *, pool_mode: str = "transaction", pool_size: int = 10) -> None:
        self.server = server
        self.pool_mode = pool_mode
        self.pool_size = pool_size
        self.port = free_port()
        self.as_root = os.geteuid() == 0
        self.dir = Path(tempfile.mkdtemp(prefix="runstate-pgbouncer-"))
        self.ini_path = self.dir / "pgbouncer.ini"
        self.log_path = self.dir / "pgbouncer.log"
        self.process: subprocess.Popen | None = None

    def ini(self) -> str:
        """Return the ``pgbouncer.ini``: every database of the server, ``pool_mode``, ``pool_size`` per pool."""
        return f"""\
[databases]
* = host=127.0.0.1 port={self.server.port}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir =
auth_type = trust
auth_file = {self.dir / "userlist.txt"}
admin_users = postgres
stats_users = postgres
pool_mode = {self.pool_mode}
default_pool_size = {self.pool_size}
min_pool_size = 0
reserve_pool_size = 0
max_client_conn = 1000
max_db_connections = {self.pool_size}
server_reset_query =
ignore_startup_parameters = extra_float_digits
logfile = {self.log_path}
pidfile = {self.dir / "pgbouncer.pid"}
"""

    def url(self, database: str | None = None, **query: str) -> str:
        """Return a ``DATABASE_URL`` through the pooler (the server's test database by default)."""
        tail = "&".join(f"{key}={value}" for key, value in query.items())
        return f"postgres://postgres@127.0.0.1:{self.port}/{database or self.server.database}" + (
            f"?{tail}" if tail else ""
        )

    def start(self) -> None:
        """Write the configuration and start PgBouncer; wait until it accepts connections."""
        self.ini_path.write_text(self.ini())
        (self.dir / "userlist.txt").write_text('"postgres" ""\n')
        prefix: list[str] = []
        if self.as_root:  # "PgBouncer should not run as root"
            account = pwd.getpwnam(PG_OS_USER)
            for path in (self.dir, *self.dir.iterdir()):
                os.chown(path, account.pw_uid, account.pw_gid)
            prefix = ["runuser", "-u", PG_OS_USER, "--"]
        self.process = subprocess.Popen(
            [*prefix, PGBOUNCER, str(self.ini_path)],
            cwd=self.dir,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while not port_open(self.port):
            if self.process.poll() is not None:
                raise RuntimeError(f"pgbouncer exited ({self.process.returncode}):\n{self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for pgbouncer:\n{self.log()}")
            time.sleep(0.05)

    def show(self, what: str) -> list[dict]:
        """Return the rows of the admin console's ``SHOW <what>`` (POOLS, SERVERS, CLIENTS...)."""
        # The console speaks only the simple query protocol: a client-side cursor sends it.
        with psycopg.connect(self.url("pgbouncer"), autocommit=True, cursor_factory=psycopg.ClientCursor) as conn:
            cursor = conn.execute(f"SHOW {what}")
            names = [column.name for column in cursor.description]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    def server_connections(self, database: str | None = None) -> int:
        """Count the server connections PgBouncer holds to ``database`` now (any state)."""
        database = database or self.server.database
        rows = [row for row in self.show("POOLS") if row["database"] == database]
        return sum(row[key] for row in rows for key in row if key.startswith("sv_") and isinstance(row[key], int))

    def log(self) -> str:
        """Return PgBouncer's log."""
        try:
            return self.log_path.read_text(errors="replace")
        except (FileNotFoundError, PermissionError):
            return ""

    def stop(self) -> None:
        """Stop PgBouncer (SIGTERM, then SIGKILL) and wait for it."""
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, 15)
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, 9)
            self.process.wait()

    def destroy(self) -> None:
        """Stop PgBouncer and delete its directory."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


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
        deadline = time.monotonic() + 60
        while self.sync_state() != "sync":
            if time.monotonic() > deadline:
                raise RuntimeError(f"the standby never became synchronous:\n{self.standby.log()}")
            time.sleep(0.1)

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

    ``start_api()`` migrates the pair's database, creates an API key of ``project`` and starts
    one API process, never restarted: after a promotion it must find the new primary by
    itself. ``spawn`` starts more processes (a ``runstate worker``, a Celery worker, beat) in
    the same environment, plus what it is given; each runs in its own process group and logs
    to ``log_dir/<name>.log``. ``stop()`` stops them all.
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
            **env,
        )
        self.env.pop("RUNSTATE_LISTEN_DATABASE_URL", None)
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

        wait_until(ready, timeout_s=90, what="the API to be ready")

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
        """Return the end of every child's log."""
        return "\n".join(f"--- {name}\n{self.log(name)}" for name in self.children)

    def assert_alive(self) -> None:
        """Fail, with the logs, when a child has exited."""
        dead = {name: child.returncode for name, child in self.children.items() if child.poll() is not None}
        assert not dead, f"exited: {dead}\n{self.logs()}"

    def client(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {self.key}"}, timeout=self.REQUEST_TIMEOUT_S
        )

    def stop(self) -> None:
        """Stop every child (SIGTERM to its group, then SIGKILL)."""
        stop_process_groups(self.children.values())
