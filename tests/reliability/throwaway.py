"""Throwaway PostgreSQL and Redis servers that a test may stop and start again.

Each runs from a fresh temporary directory on a free port, so stopping one never touches the
machine's own servers (PostgreSQL on 5432, Redis on 6379). PostgreSQL refuses to run as
root, so when the tests run as root (CI) its commands run as the ``postgres`` OS user and
the directory belongs to it. Both keep nothing on disk that matters: trust authentication,
``fsync`` off, Redis without snapshots or an append-only file (a restart empties it, as a
broker restart without persistence does).
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from devservers import PG_OS_USER
from devservers.net import free_port, port_open
from tests.waiting import wait_until


def _pg_bin() -> Path:
    """Where the server's programs (initdb, pg_ctl) are: RUNSTATE_TEST_PG_BIN, else ``pg_config --bindir``."""
    if os.environ.get("RUNSTATE_TEST_PG_BIN"):
        return Path(os.environ["RUNSTATE_TEST_PG_BIN"])
    try:
        found = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        found = ""
    return Path(found or "/usr/lib/postgresql/15/bin")


PG_BIN = _pg_bin()
REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


class ThrowawayPostgres:
    """A PostgreSQL cluster in a temporary directory, stoppable and restartable on its port."""

    database = "runstate"

    # Server settings given on the command line: nothing on disk matters to these tests.
    DEFAULT_SETTINGS = {
        "fsync": "off",
        "synchronous_commit": "off",
        "full_page_writes": "off",
        "max_connections": "100",
    }

    def __init__(self, **settings: str) -> None:
        """``settings`` override or add server settings (``synchronous_commit="on"``...)."""
        self.settings = {**self.DEFAULT_SETTINGS, **settings}
        self.port = free_port()
        self.as_root = os.geteuid() == 0
        self.dir = Path(tempfile.mkdtemp(prefix="runstate-pg-"))
        self.data_dir = self.dir / "data"
        self.log_path = self.dir / "postgres.log"
        if self.as_root:
            account = pwd.getpwnam(PG_OS_USER)
            os.chown(self.dir, account.pw_uid, account.pw_gid)

    def _run(self, *command: str, timeout_s: float = 60) -> None:
        prefix = ["runuser", "-u", PG_OS_USER, "--"] if self.as_root else []
        done = subprocess.run(
            [*prefix, *command], cwd=self.dir, capture_output=True, text=True, timeout=timeout_s, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"{command[0]} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}\n{self.log()}")

    def log(self) -> str:
        """Return the server log (empty before the first start)."""
        try:
            return self.log_path.read_text(errors="replace")
        except (FileNotFoundError, PermissionError):
            return ""

    def url(self, database: str | None = None) -> str:
        """Return a ``DATABASE_URL`` for ``database`` (the test database by default)."""
        return f"postgres://postgres@127.0.0.1:{self.port}/{database or self.database}"

    def init(self) -> None:
        """Create the cluster and the test database, and start the server."""
        self._run(
            str(PG_BIN / "initdb"),
            "-D",
            str(self.data_dir),
            "-U",
            "postgres",
            "--auth=trust",
            "--encoding=UTF8",
            "--no-sync",
        )
        self.start()
        import psycopg

        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {self.database}")

    def start(self) -> None:
        """Start the server on its port and wait until it accepts connections."""
        options = f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.dir} " + " ".join(
            f"-c {name}={value}" for name, value in self.settings.items()
        )
        self._run(
            str(PG_BIN / "pg_ctl"), "-D", str(self.data_dir), "-l", str(self.log_path), "-o", options, "-w", "start"
        )

    def init_standby_of(self, primary: ThrowawayPostgres, *, application_name: str) -> None:
        """Make this cluster a streaming standby of ``primary`` (``pg_basebackup -R``) and start it.

        It connects as ``application_name``, the name ``synchronous_standby_names`` lists.
        """
        self._run(
            str(PG_BIN / "pg_basebackup"),
            "-D",
            str(self.data_dir),
            "-d",
            f"host=127.0.0.1 port={primary.port} user=postgres application_name={application_name}",
            "-R",
            "-X",
            "stream",
            "-c",
            "fast",
            "--no-sync",
        )
        self.start()

    def promote(self) -> None:
        """Promote this standby to a primary (``pg_ctl promote``) and wait until it accepts writes."""
        self._run(str(PG_BIN / "pg_ctl"), "-D", str(self.data_dir), "-w", "promote")

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``fast``: disconnect every client; ``immediate``: as a crash would)."""
        self._run(str(PG_BIN / "pg_ctl"), "-D", str(self.data_dir), "-m", mode, "-w", "stop")

    def running(self) -> bool:
        """Tell whether the server's postmaster is up."""
        return (self.data_dir / "postmaster.pid").exists()

    def destroy(self) -> None:
        """Stop the server if it runs and delete its directory."""
        if self.running():
            try:
                self.stop("immediate")
            except (RuntimeError, subprocess.TimeoutExpired):
                pass
        shutil.rmtree(self.dir, ignore_errors=True)


class ThrowawayRedis:
    """A Redis server without persistence, stoppable and restartable on its port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="runstate-redis-"))
        self.log_path = self.dir / "redis.log"
        self.process: subprocess.Popen | None = None

    def url(self, db: int = 0) -> str:
        """Return a ``redis://`` URL of database ``db`` on this server."""
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self) -> None:
        """Start the server on its port and wait until it accepts connections."""
        command = [
            REDIS_SERVER,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.dir),
            "--logfile",
            str(self.log_path),
        ]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        wait_until(lambda: port_open(self.port) or self.process.poll() is not None, what="redis to listen")
        if self.process.poll() is not None:
            raise RuntimeError(f"redis-server exited ({self.process.returncode}):\n{self.log()}")

    def stop(self) -> None:
        """Stop the server (SIGTERM; nothing is saved) and wait until the port is free."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        wait_until(lambda: not port_open(self.port), what="redis to close its port")

    def log(self) -> str:
        """Return the server log."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def destroy(self) -> None:
        """Stop the server and delete its directory."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def _require(path: str, what: str) -> None:
    # A failure, not a skip: the restart tests are part of the suite, and a machine that
    # runs the PostgreSQL suite has the server's programs (scripts/test starts one).
    if not Path(path).exists():
        pytest.fail(f"the restart tests need {what} at {path}")


@pytest.fixture(scope="module")
def throwaway_postgres():
    """A fresh PostgreSQL server with an empty ``runstate`` database, destroyed after the module."""
    _require(str(PG_BIN / "initdb"), "PostgreSQL's initdb (RUNSTATE_TEST_PG_BIN)")
    server = ThrowawayPostgres()
    try:
        server.init()
        yield server
    finally:
        server.destroy()


@pytest.fixture(scope="module")
def throwaway_redis():
    """A fresh Redis server, destroyed after the module."""
    _require(REDIS_SERVER, "redis-server")
    server = ThrowawayRedis()
    try:
        server.start()
        yield server
    finally:
        server.destroy()
