"""Suites of the test database run again with every connection but LISTEN through PgBouncer (issue 30, item 1).

Each runs as a pytest run of its own whose ``DATABASE_URL`` goes through a PgBouncer in
transaction mode with a pool of 10 (``tests/clusters.py``), configured as docs/deploy.md
("Behind PgBouncer") gives it (``RUNSTATE_DB_POOLER=transaction``, prepared statements off),
with the LISTEN connections straight to PostgreSQL. pytest-django creates that run's test
database through PgBouncer too. A module of its own, so that test_pgbouncer.py's stack is
gone by then.

- ``tests/reliability/test_load.py``: an SDK swarm on two API processes, two Celery workers
  and beat, then the ``Ledger`` (nothing claimed or finished twice, nothing acknowledged
  lost, no group decided twice, nothing accepted under a cancelled run). The swarm runs as
  long as that test's own (``RUNSTATE_SOAK_SECONDS``, 10 s by default): shorter, on a loaded
  machine, it may not make every kind of wait in both directions, which that test asserts.
- ``tests/concurrency/test_cancel_fairness.py``, the fair gate, on the fast paths (the
  statements every creator and cancel takes by default): a creator arriving while a cancel
  waits queues behind it and is refused; back-to-back creators never hold a cancel off. Its
  race helpers see a transaction wait on a lock by the ``application_name`` PgBouncer gives
  every server connection it lends that client (``tests/concurrency/util.py`` ``backend_pid``):
  behind PgBouncer a connection has no backend of its own. The careful paths' rounds take
  about three minutes more on this machine (as they do directly, where the suite runs them).

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


def pytest_through_pgbouncer(redis, tmp_path, *arguments: str) -> str:
    """Run pytest with ``arguments`` on a fresh cluster behind PgBouncer; return its output without HTTP lines."""
    with pgbouncer_in_front(pool_size=POOL_SIZE) as bouncer:
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
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-s", *arguments]
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
    output = "\n".join(line for line in (done.stdout + done.stderr).splitlines() if "HTTP Request:" not in line)
    assert done.returncode == 0, output[-6000:]
    return output


def test_the_load_tests_ledger_is_clean_through_pgbouncer(throwaway_redis, tmp_path):  # noqa: F811 - fixture
    output = pytest_through_pgbouncer(throwaway_redis, tmp_path, "tests/reliability/test_load.py")
    print(
        "\n"
        + "\n".join(line for line in output.splitlines() if "peak database connections" in line or "ledger" in line)
    )
    assert "1 passed" in output, output[-6000:]
    assert "ledger check: 0 violation(s)" in output, output[-6000:]


def test_the_fair_gate_holds_through_pgbouncer(throwaway_redis, tmp_path):  # noqa: F811 - fixture
    output = pytest_through_pgbouncer(
        throwaway_redis, tmp_path, "tests/concurrency/test_cancel_fairness.py", "-k", "fast"
    )
    print("\n" + output.splitlines()[-1])
    assert "16 passed" in output and "failed" not in output, output[-6000:]
