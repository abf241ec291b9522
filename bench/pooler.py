"""PgBouncer in transaction mode in front of the benchmark's PostgreSQL (``python -m bench.throughput --pgbouncer``).

The PgBouncer is the tests' (``devservers/pgbouncer.py``: Debian's ``pgbouncer``, the
``pgbouncer.ini`` of docs/deploy.md, "Behind PgBouncer", in a temporary directory on a free
port, run as the ``postgres`` OS user when the benchmark runs as root), put in front of the
server of ``DATABASE_URL`` instead of a throwaway cluster. It must run on this machine
(127.0.0.1 or localhost), as the tests' PgBouncer points at 127.0.0.1. ``server_env`` is the
environment docs/deploy.md gives an API process behind it: requests through PgBouncer,
prepared statements off, the LISTEN connection straight to PostgreSQL.
"""

from __future__ import annotations

import dataclasses
from typing import Any

LISTEN_APP_NAME = "runstate-bench-listen"


@dataclasses.dataclass(frozen=True)
class MachinePostgres:
    """The benchmark's PostgreSQL server as ``devservers.pgbouncer.PgBouncer`` wants it: a port and a database."""

    port: int
    database: str
    direct_url: str


class BenchPgBouncer:
    """PgBouncer (transaction mode, ``pool_size`` server connections) before the server of ``direct_url``."""

    def __init__(self, direct_url: str, pool_size: int = 10) -> None:
        from bench.harness.env import db_params
        from devservers.pgbouncer import PGBOUNCER, PgBouncer

        params = db_params(direct_url)
        if params.get("host", "127.0.0.1") not in ("127.0.0.1", "localhost"):
            raise SystemExit(f"--pgbouncer needs PostgreSQL on this machine (127.0.0.1), not {params['host']}")
        self.program = PGBOUNCER
        self.server = MachinePostgres(int(params.get("port", 5432)), params["dbname"], direct_url)
        self.pool_size = pool_size
        self._bouncer = PgBouncer(self.server, pool_mode="transaction", pool_size=pool_size)

    def __enter__(self) -> BenchPgBouncer:
        from pathlib import Path

        if not Path(self.program).exists():
            raise SystemExit(f"--pgbouncer needs PgBouncer at {self.program}: run scripts/ensure_pgbouncer.sh")
        try:
            self._bouncer.start()
        except BaseException:
            self._bouncer.destroy()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._bouncer.destroy()

    @property
    def pid(self) -> int:
        """The process started (``runuser`` when running as root, its child PgBouncer): its tree is PgBouncer's."""
        return self._bouncer.process.pid

    @property
    def url(self) -> str:
        """The benchmark database through PgBouncer."""
        return self._bouncer.url()

    def server_env(self) -> dict[str, str]:
        """Return the API server's environment behind PgBouncer (docs/deploy.md, "Behind PgBouncer")."""
        direct = self.server.direct_url
        return {
            "DATABASE_URL": self.url,
            "RUNSTATE_DB_POOLER": "transaction",
            "RUNSTATE_DB_PREPARE_THRESHOLD": "off",
            "RUNSTATE_LISTEN_DATABASE_URL": direct
            + ("&" if "?" in direct else "?")
            + f"application_name={LISTEN_APP_NAME}",
        }

    def stats(self) -> dict[str, int]:
        """Return PgBouncer's totals for the benchmark database: transactions, queries, server wait (us)."""
        rows = [row for row in self._bouncer.show("STATS") if row["database"] == self.server.database]
        keys = {"xacts": "total_xact_count", "queries": "total_query_count", "wait_us": "total_wait_time"}
        return {name: sum(int(row[key]) for row in rows) for name, key in keys.items()}

    def server_connections(self) -> int:
        """Return the server connections PgBouncer holds to the benchmark database now."""
        return self._bouncer.server_connections(self.server.database)

    def describe(self) -> str:
        """Return how PgBouncer runs, for the report."""
        return f"PgBouncer ({self.program}) in transaction mode, pool size {self.pool_size}, port {self._bouncer.port}"


def stats_per_task(before: dict[str, int], after: dict[str, int], tasks: int) -> dict[str, Any]:
    """Return the PgBouncer counters' change over a scenario, per task (``wait_us``: client wait for a server)."""
    return {name: (after[name] - before[name]) / tasks for name in before}
