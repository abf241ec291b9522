"""The load test and its ledger with every database connection through PgBouncer but LISTEN (issue 30, item 1).

``tests/reliability/test_load.py`` (an SDK swarm on two API processes, two Celery workers
and beat, then the ``Ledger``: nothing claimed or finished twice, nothing acknowledged lost,
no group decided twice, nothing accepted under a cancelled run) runs in a pytest run of its
own whose ``DATABASE_URL`` goes through a PgBouncer in transaction mode with a pool of 10
(``tests/clusters.py``), as docs/deploy.md ("Behind PgBouncer") configures it, with the
LISTEN connections straight to PostgreSQL. pytest-django creates that run's test database
through PgBouncer too. A module of its own, so that test_pgbouncer.py's stack is gone by then. The swarm runs as long
as test_load.py's own (``RUNSTATE_SOAK_SECONDS``, 10 s by default): shorter, on a loaded
machine, it may not make every kind of wait in both directions, which that test asserts.

Not here: the fair-gate tests (``tests/concurrency/test_cancel_fairness.py``). Their race
helpers find the contending transaction by its connection's backend pid
(``tests/concurrency/util.py`` ``backend_pid``), which behind PgBouncer is PgBouncer's own
cancel key, not a server backend, and a transaction's server backend is not known before it
runs; they would need another way to see a transaction wait on a lock.

Durations are reported (``-s``), never asserted.
"""

import os
import subprocess
import sys

import pytest

from tests.clusters import pgbouncer_in_front
from tests.reliability.test_pgbouncer import LISTEN_APP_NAME, POOL_SIZE
from tests.reliability.test_restarts import ROOT
from tests.reliability.throwaway import throwaway_redis  # noqa: F401 - fixture

pytestmark = [pytest.mark.postgres_only, pytest.mark.soak]


def without_http_lines(output: str) -> str:
    return "\n".join(line for line in output.splitlines() if "HTTP Request:" not in line)


def test_the_load_tests_ledger_is_clean_through_pgbouncer(throwaway_redis, tmp_path):  # noqa: F811 - fixture
    """tests/reliability/test_load.py in a pytest run of its own, every connection through PgBouncer but LISTEN."""
    with pgbouncer_in_front(pool_size=POOL_SIZE) as bouncer:
        run_the_load_test(bouncer, throwaway_redis, tmp_path)


def run_the_load_test(bouncer, redis, tmp_path) -> None:
    env = {
        **os.environ,
        "DATABASE_URL": bouncer.url(),
        "RUNSTATE_DB_POOLER": "transaction",
        "RUNSTATE_DB_PREPARE_THRESHOLD": "off",
        # pytest-django creates test_<name> through PgBouncer (its "*" line serves every database).
        "RUNSTATE_LISTEN_DATABASE_URL": bouncer.server.url(f"test_{bouncer.server.database}")
        + f"?application_name={LISTEN_APP_NAME}",
        "RUNSTATE_VAR_DIR": str(tmp_path / "var"),
        "RUNSTATE_TEST_WORKER_BROKER_URL": redis.url(1),
        "CELERY_BROKER_URL": redis.url(2),
    }
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-s", "tests/reliability/test_load.py"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    output = without_http_lines(done.stdout + done.stderr)
    tail = "\n".join(line for line in output.splitlines() if "peak database connections" in line or "ledger" in line)
    print(f"\n{tail}")
    assert done.returncode == 0, output[-6000:]
    assert "1 passed" in output, output[-6000:]
    assert "ledger check: 0 violation(s)" in output, output[-6000:]
