"""Workers ride out a failover: ``runstate worker`` and ``@runstate_task`` keep going through a promotion.

A primary with a synchronous standby (``tests/clusters.StreamingPair``) and one uvicorn API
on their multi-host ``DATABASE_URL`` (``ApiOnPair``), as in ``test_failover.py``. An SDK
client submits tasks with keys, one after another, the whole time, and a worker started
before the switch does them: ``runstate worker`` (the command, a child process, talking to
the API) or a Celery worker running a ``@runstate_task`` (a child process on the multi-host
URL itself, with beat beside it). Both workers record every claim, renew, complete and
handler effect in a ledger of their own (``fault_consumer``, ``fault_tasks``). The primary
is stopped with ``pg_ctl stop -m immediate``, and after 2 s without a primary the standby is
promoted. Then:

- while there is no primary, a request answers ``503 SERVICE_UNAVAILABLE`` in the error
  envelope with ``Retry-After`` (not a hang, not a 500), on the hot path and on the DRF path
  alike, and the SDK submit sent meanwhile is answered 503, retried, and acknowledged once
  the standby is promoted;
- the worker process started before the switch is still the one running, never restarted,
  and it does the tasks submitted after the promotion;
- every acknowledged submit ends ``SUCCEEDED``, once: the ledger (the submits and all the
  worker recorded) is clean against the promoted database, drained (nothing left queued or
  held), with no task finished twice; a task whose complete went unanswered at the switch
  was taken over after its lease (counted in the report).

The Celery worker uses the Redis database of ``RUNSTATE_TEST_WORKER_BROKER_URL`` (flushed
first). Durations are reported (``-s``), never asserted.
"""

import logging
import sys
import time
from pathlib import Path

import pytest

from tests.clusters import ApiOnPair, Submitter, refused_without_a_primary, streaming_pair
from tests.reliability.ledger import LEDGER_DIR_ENV
from tests.waiting import wait_until
from tests.workers.live import TEST_BROKER_URL, beat_command, purge_broker, worker_command

pytestmark = [pytest.mark.postgres_only]

logging.getLogger("httpx").setLevel(logging.WARNING)

NO_PRIMARY_FOR_S = 2.0
LEASE_MS = 2000  # a task held at the switch whose complete is lost runs again within ~3 s
HANDLER_S = 0.2
BURST = 20  # tasks submitted at once just before the crash: more than the worker takes in a second
# Every acknowledged task is done within this of the load's end: the 2 s lease, the 1 s sweep,
# and room to spare, but less than the re-wake sweep's 60 s, which a lost message would wait for.
DRAIN_TIMEOUT_S = 30
AFTER_PROMOTION = 10  # submits acknowledged after the promotion before the load stops
# The SDK's retries wait Retry-After (1 s) at first, then its growing jittered backoff: ~30 s in all.
SDK_RETRIES = 10
CLI_PROJECT = "failover-cli"
CLI_MAILBOX = "failover-cli"
CELERY_MODULE = "tests.reliability.fault_tasks"
CELERY_PROJECT = "faults"  # tests/reliability/fault_tasks.py
CELERY_MAILBOX = "faults-bulk"  # bound to fault_tasks.bulk: a lease of 2 s


def prepare(api: ApiOnPair, mailbox: str) -> str:
    """Create the mailbox (a 2 s lease) and a run; return the run's id."""
    with api.client() as client:
        body = {"mode": "WORK", "leaseTtlMs": LEASE_MS, "maxAttempts": 10}
        assert client.put(f"/v1/mailboxes/{mailbox}", json=body).status_code in (200, 201)
        created = client.post("/v1/runs", json={"name": "failover-workers"})
    assert created.status_code == 201, created.text
    return created.json()["id"]


def ride_through_failover(api: ApiOnPair, submitter: Submitter, worker_pid: int, *, what: str) -> dict:
    """Warm up, crash the primary, probe without one, promote, load after; return what was seen.

    Asserts what holds for every worker: the answers without a primary, the SDK's retry
    through them, every acknowledged submit done once by the same worker process.
    """
    pair = api.pair
    submitter.start()
    try:
        wait_until(
            lambda: len(api.pair.succeeded(submitter.task_ids())) >= 20,
            interval_s=0.25,
            what=f"{what} to complete 20 tasks",
        )
        assert pair.sync_state() == "sync"

        submitter.burst(BURST)  # claimed, held and queued tasks at the crash
        pair.primary.stop("immediate")
        stopped_at = time.monotonic()
        refused = refused_without_a_primary(api, submitter.run_id, submitter.mailbox)
        wait_until(lambda: submitter.seen(503), what="the SDK's submit to be answered 503")
        time.sleep(max(0.0, NO_PRIMARY_FOR_S - (time.monotonic() - stopped_at)))
        pair.standby.promote()
        promoted_at, promoted_wall = time.monotonic(), time.time()

        wait_until(
            lambda: submitter.count(promoted_at) >= AFTER_PROMOTION,
            interval_s=0.05,
            what=f"{AFTER_PROMOTION} submits acknowledged after the promotion",
        )
    finally:
        submitter.stop()

    # Without a primary: 503 in the envelope, at once (the call returned), with Retry-After.
    assert [(name, status, code, retry) for name, status, code, retry in refused] == [
        ("submit", 503, "SERVICE_UNAVAILABLE", "1"),
        ("run", 503, "SERVICE_UNAVAILABLE", "1"),
    ], f"{refused}\n{api.api_log()}"
    # The SDK retried its submit through the 503s to an acknowledgement.
    retried = [answers for _, _, answers in submitter.acknowledged if 503 in answers]
    assert retried and all(answers[-1] in (200, 201) for answers in retried), retried
    assert submitter.gave_up == [], submitter.gave_up

    acknowledged = submitter.task_ids()
    wait_until(
        lambda: len(api.pair.succeeded(acknowledged)) == len(acknowledged),
        limit_s=DRAIN_TIMEOUT_S,
        interval_s=0.25,
        what=f"{what} to complete every acknowledged submit",
        explain=lambda: api.task_states(acknowledged),
    )
    api.assert_alive()
    seen = api.pair.tasks(acknowledged)
    # The worker process that was running before the switch did the work submitted after it.
    after = submitter.task_ids(promoted_at)
    assert {seen[task_id][2]["pid"] for task_id in after} == {worker_pid}
    query = (
        "SELECT extract(epoch FROM min(finished_at)) FROM coordination_task"
        " WHERE run_id = %s AND finished_at > to_timestamp(%s)"
    )
    ((first_finished,),) = api.pair.sql(query, submitter.run_id, promoted_wall)
    return {
        "no_primary_s": round(promoted_at - stopped_at, 2),
        "first_completion_after_promotion_s": round(float(first_finished) - promoted_wall, 2),
        "acknowledged": len(acknowledged),
        "after_promotion": len(after),
        "retried_submits": len(retried),
        "taken_over": sum(1 for _, attempts, _ in seen.values() if attempts > 1),
    }


def ledger_counts(api: ApiOnPair, submitter: Submitter, ledger_dir: Path) -> str:
    """Hold the promoted database to the submits and the worker's own ledger; return the counts."""
    paths = [submitter.ledger.path, *sorted(ledger_dir.glob("*.jsonl"))]
    return api.check_ledgers(*paths, drained_runs=[submitter.run_id])


@pytest.fixture
def api_on_pair(tmp_path):
    """Return a function starting the API on a fresh pair for ``project`` (with ``env``); stop all afterwards."""
    started: list[ApiOnPair] = []
    with streaming_pair() as pair:

        def start(project: str, **env: str) -> ApiOnPair:
            api = ApiOnPair(pair, broker_url=TEST_BROKER_URL, log_dir=tmp_path, project=project, **env)
            started.append(api)
            api.start_api()
            return api

        try:
            yield start
        finally:
            for api in started:
                api.stop()


def test_runstate_worker_rides_out_a_failover_and_completes_each_acknowledged_submit_once(api_on_pair, tmp_path):
    api = api_on_pair(CLI_PROJECT)
    run_id = prepare(api, CLI_MAILBOX)
    ledger_dir = tmp_path / "ledgers"
    ledger_dir.mkdir()
    worker = api.spawn(
        "worker",
        [
            # The command as ``runstate`` runs it, from this checkout (``-m`` puts it first on the path).
            sys.executable,
            "-m",
            "runstate.cli",
            "worker",
            "tests.reliability.fault_consumer:work",
            "--mailbox",
            CLI_MAILBOX,
            "--scope",
            run_id,
            "--concurrency",
            "4",
            "--lease-ttl-ms",
            str(LEASE_MS),
        ],
        RUNSTATE_URL=api.url,
        RUNSTATE_API_KEY=api.key,
        **{LEDGER_DIR_ENV: str(ledger_dir)},
    )
    submitter = Submitter(api, run_id, CLI_MAILBOX, task_input={"seconds": HANDLER_S}, max_retries=SDK_RETRIES)
    seen = ride_through_failover(api, submitter, worker.pid, what="runstate worker")

    api.stop()  # SIGTERM: the worker drains and says what it did
    assert worker.returncode == 0, api.log("worker")
    assert "worker stopped: ConsumeSummary(" in api.log("worker")
    counts = ledger_counts(api, submitter, ledger_dir)
    print(f"\nrunstate worker through a failover: {seen}; ledger {counts}")


def test_runstate_task_on_a_celery_worker_rides_out_a_failover_and_completes_each_acknowledged_submit_once(
    api_on_pair, tmp_path
):
    purge_broker()
    # The re-wake sweep at its default: the work must not wait for it (DRAIN_TIMEOUT_S is shorter).
    api = api_on_pair(CELERY_PROJECT, RUNSTATE_TASK_MODULES=CELERY_MODULE, RUNSTATE_REWAKE_AFTER_S="60")
    run_id = prepare(api, CELERY_MAILBOX)
    ledger_dir = tmp_path / "ledgers"
    ledger_dir.mkdir()
    env = {LEDGER_DIR_ENV: str(ledger_dir)}
    worker = api.spawn("worker", worker_command(4, include=(CELERY_MODULE,)), **env)
    api.spawn("beat", beat_command(tmp_path), **env)
    submitter = Submitter(api, run_id, CELERY_MAILBOX, task_input={"seconds": HANDLER_S}, max_retries=SDK_RETRIES)
    seen = ride_through_failover(api, submitter, worker.pid, what="the Celery worker")

    counts = ledger_counts(api, submitter, ledger_dir)
    print(f"\n@runstate_task through a failover: {seen}; ledger {counts}")
