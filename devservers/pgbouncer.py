"""PgBouncer in front of a PostgreSQL server of this machine, for the tests and the benchmarks.

Debian's ``pgbouncer`` on a free port of its own, in a temporary directory, in transaction
mode (by default) with a pool of ``pool_size`` server connections per database and user
(``docs/deploy.md``, "Behind PgBouncer", gives the same ``pgbouncer.ini``). It refuses root,
so when the caller is root it runs as ``PG_OS_USER``, as the throwaway clusters do.
``point_at`` does what a failover manager does after a promotion: it writes the new primary
into the ini and RELOADs. ``tests/clusters.py`` puts it in front of throwaway clusters,
``bench/pooler.py`` in front of the benchmark's server.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Protocol

import psycopg

from devservers import PG_OS_USER
from devservers.net import free_port, port_open

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"


class Server(Protocol):
    """What PgBouncer needs of its server: where it listens, and the database the callers use."""

    port: int
    database: str


class PgBouncer:
    """PgBouncer in front of ``server`` (a throwaway cluster or the machine's own), in a directory of its own."""

    def __init__(self, server: Server, *, pool_mode: str = "transaction", pool_size: int = 10, **settings: str) -> None:
        """Set PgBouncer up; ``settings`` add to or override the ini's ``[pgbouncer]`` (``query_wait_timeout="5"``)."""
        self.server = server
        self.pool_mode = pool_mode
        self.pool_size = pool_size
        self.settings = settings
        self.port = free_port()
        self.as_root = os.geteuid() == 0
        self.dir = Path(tempfile.mkdtemp(prefix="runstate-pgbouncer-"))
        self.ini_path = self.dir / "pgbouncer.ini"
        self.log_path = self.dir / "pgbouncer.log"
        self.process: subprocess.Popen | None = None

    def ini(self) -> str:
        """Return the ``pgbouncer.ini``: every database of the server, ``pool_mode``, ``pool_size`` per pool."""
        extra = "".join(f"{name} = {value}\n" for name, value in self.settings.items())
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
server_login_retry = 1
logfile = {self.log_path}
pidfile = {self.dir / "pgbouncer.pid"}
{extra}"""

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

    def admin(self, command: str) -> list[dict]:
        """Run ``command`` on the admin console (``SHOW POOLS``, ``RELOAD``...); return its rows."""
        # The console speaks only the simple query protocol: a client-side cursor sends it.
        with psycopg.connect(self.url("pgbouncer"), autocommit=True, cursor_factory=psycopg.ClientCursor) as conn:
            cursor = conn.execute(command)
            if cursor.description is None:
                return []
            names = [column.name for column in cursor.description]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    def show(self, what: str) -> list[dict]:
        """Return the rows of the admin console's ``SHOW <what>`` (POOLS, SERVERS, CLIENTS...)."""
        return self.admin(f"SHOW {what}")

    def revoke_key(self, key: str) -> int:
        """Revoke the API key ``key`` in a transaction run through PgBouncer; return the rows changed.

        The revoke's ``NOTIFY`` (migration 0009's trigger) is sent from a pooled server session:
        only an API process whose LISTEN connection is on that server hears it.
        """
        with psycopg.connect(self.url(), autocommit=True) as pooled:
            return pooled.execute(
                "UPDATE coordination_apikey SET revoked_at = now() WHERE revoked_at IS NULL AND prefix = %s",
                (key.split("_")[1],),
            ).rowcount

    def point_at(self, server: Server) -> None:
        """Send the pools to ``server`` from now on: rewrite the ini's ``[databases]`` host and RELOAD.

        What a failover manager does after promoting a standby. PgBouncer closes each server
        connection to the old host as it is released and opens new ones on the new host;
        client connections stay open.
        """
        self.server = server
        self.ini_path.write_text(self.ini())  # the file keeps its owner (PgBouncer's OS user)
        self.admin("RELOAD")

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
