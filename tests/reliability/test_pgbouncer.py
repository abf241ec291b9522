"""runstate behind PgBouncer in transaction mode (issue 30, item 1).

The module starts a PostgreSQL cluster and a PgBouncer of its own (``tests/clusters.py``:
transaction mode, 10 server connections for the database) and a throwaway Redis, migrates
through PgBouncer, and runs the stack as ``docs/deploy.md`` ("Behind PgBouncer") deploys it:
two uvicorn API processes, two Celery workers and beat, every one with ``DATABASE_URL``
through PgBouncer (``RUNSTATE_DB_POOLER=transaction``, ``RUNSTATE_DB_PREPARE_THRESHOLD=off``)
and the LISTEN hub's connection straight to PostgreSQL (``RUNSTATE_LISTEN_DATABASE_URL``).
Through it:

- submit, claim and complete over HTTP, across both API processes, while PostgreSQL never
  sees more than PgBouncer's 10 server connections for the requests;
- a long-poll and an event stream on one API process are woken by work done on the other;
  every LISTEN session is a direct one, and a notification sent from a transaction that went
  through PgBouncer reaches both API processes (a revoked key is refused at once by processes
  that cache keys for an hour: only a notification makes them forget);
- bound work is done by the Celery workers through PgBouncer;
- a cancel cascades to the subtree, its tasks and its claims;
- and every process refuses to start on a configuration that would break behind the pooler.

``test_pgbouncer_load.py`` runs the load test and its ledger through PgBouncer.

Durations are reported (``-s``), never asserted.
"""

import json
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.clusters import pgbouncer_in_front
from tests.processes import free_port, stop_process_groups
from tests.reliability.test_restarts import BOUND_MAILBOX, PLAIN_MAILBOX, PROJECT, ROOT, Stack, manage, stack_env
from tests.reliability.throwaway import throwaway_redis  # noqa: F401 - fixture
from tests.waiting import wait_until
from tests.workers.live import beat_command

pytestmark = [pytest.mark.postgres_only]

POOL_SIZE = 10
LISTEN_APP_NAME = "runstate-listen"  # application_name of the LISTEN hubs' direct sessions
API_PROCESSES = ("api-a", "api-b")
WORKERS = ("worker-1", "worker-2")
PERMISSIONS = "resource_config,coordination_write,coordination_read"


@pytest.fixture(scope="module")
def bouncer():
    """A fresh cluster with PgBouncer in transaction mode (pool size 10) in front."""
    with pgbouncer_in_front(pool_size=POOL_SIZE) as running:
        yield running


def pooled_env(bouncer, redis, log_dir) -> dict[str, str]:
    """The environment docs/deploy.md gives behind PgBouncer: requests pooled, LISTEN direct."""
    env = stack_env(bouncer, redis, log_dir)  # DATABASE_URL: through PgBouncer
    env.update(
        RUNSTATE_DB_POOLER="transaction",
        RUNSTATE_DB_PREPARE_THRESHOLD="off",
        RUNSTATE_LISTEN_DATABASE_URL=bouncer.server.url() + f"?application_name={LISTEN_APP_NAME}",
        # More connections per API process than PgBouncer has for all of them together.
        RUNSTATE_DB_POOL_SIZE="20",
        # Keys are cached for an hour: only a notification makes an API process forget one.
        RUNSTATE_PROCESS_CACHE_S="3600",
    )
    return env


def create_key(env, project: str = PROJECT) -> str:
    """Create an API key of ``project`` with the database ``env`` names; return it."""
    return manage(env, "create_api_key", "--project", project, "--permissions", PERMISSIONS).strip().splitlines()[-1]


@pytest.fixture(scope="module")
def stack(bouncer, throwaway_redis, tmp_path_factory):  # noqa: F811 - pytest fixture
    """Migrate through PgBouncer; run two API processes, two Celery workers and beat through it."""
    started = time.monotonic()
    log_dir = tmp_path_factory.mktemp("pgbouncer")
    env = pooled_env(bouncer, throwaway_redis, log_dir)
    manage(env, "migrate", "--noinput")
    ports = {name: free_port() for name in API_PROCESSES}
    commands = {
        **{
            name: [
                *(sys.executable, "-m", "uvicorn", "runstate_project.asgi:application"),
                *("--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"),
            ]
            for name, port in ports.items()
        },
        **{
            name: [
                *(sys.executable, "-m", "celery", "-A", "runstate_project", "worker", "--pool=threads"),
                *("--concurrency=4", "--include=tests.workers.celery_tasks", "--loglevel=INFO"),
                *("--without-gossip", "--without-mingle", "-n", f"{name}@%h"),
            ]
            for name in WORKERS
        },
        "beat": beat_command(log_dir),
    }
    built = Stack(
        pg=bouncer.server,  # the test's own SQL goes to PostgreSQL directly
        redis=throwaway_redis,
        url=f"http://127.0.0.1:{ports['api-a']}",
        key=create_key(env),
        log_dir=log_dir,
        env=env,
    )
    built.urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    try:
        for name, command in commands.items():
            with open(log_dir / f"{name}.log", "wb") as log:
                built.processes[name] = subprocess.Popen(
                    command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )

        def ready() -> bool:
            built.assert_processes_alive()
            try:
                return all(httpx.get(f"{url}/v1/readyz", timeout=5).status_code == 200 for url in built.urls.values())
            except httpx.TransportError:
                return False

        wait_until(ready, waits=2, what="both API processes to be ready")
        with built.client() as client:
            for name in (BOUND_MAILBOX, PLAIN_MAILBOX):
                assert client.put(f"/v1/mailboxes/{name}", json={"mode": "WORK"}).status_code in (200, 201)
        print(f"\nthe stack behind PgBouncer was up in {time.monotonic() - started:.1f} s")
        yield built
    finally:
        stop_process_groups(built.processes.values())


def client_of(stack: Stack, name: str, key: str | None = None, timeout_s: float = 30) -> httpx.Client:
    return httpx.Client(
        base_url=stack.urls[name], headers={"Authorization": f"Bearer {key or stack.key}"}, timeout=timeout_s
    )


def new_run(client: httpx.Client, **body) -> dict:
    response = client.post("/v1/runs", json=body)
    assert response.status_code == 201, response.text
    return response.json()


def submit(client: httpx.Client, run_id: str, count: int, mailbox: str = PLAIN_MAILBOX, **input_) -> list[str]:
    ids = []
    for i in range(count):
        response = client.post(f"/v1/mailboxes/{mailbox}/tasks", json={"runId": run_id, "input": {"i": i, **input_}})
        assert response.status_code == 201, response.text
        ids.append(response.json()["id"])
    return ids


def claim(client: httpx.Client, run_id: str, max_: int = 10, wait_ms: int = 0) -> list[dict]:
    body = {"runId": run_id, "workerId": "pgbouncer-test", "max": max_, "waitMs": wait_ms}
    response = client.post(f"/v1/mailboxes/{PLAIN_MAILBOX}/claims", json=body)
    assert response.status_code == 200, response.text
    return response.json()["claims"]


def test_requests_are_pooled_and_listen_is_direct(stack, bouncer):
    """PostgreSQL sees at most PgBouncer's pool for the requests; every LISTEN session is a direct one."""
    with client_of(stack, "api-a") as a, client_of(stack, "api-b") as b:
        run = new_run(a, name="pooled")
        # Enough requests at once, on both processes, to want more than 10 connections.
        threads = [threading.Thread(target=submit, args=(client, run["id"], 5)) for client in (a, b) for _ in range(6)]
        peak = 0
        for thread in threads:
            thread.start()
        while any(thread.is_alive() for thread in threads):
            peak = max(peak, bouncer.server_connections())
            time.sleep(0.05)
        for thread in threads:
            thread.join()
    print(f"\nPgBouncer's server connections to the database at most: {peak} (pool size {POOL_SIZE})")
    assert 0 < peak <= POOL_SIZE
    assert stack.sql("SELECT count(*) FROM coordination_task WHERE run_id = %s::uuid", run["id"])[0][0] == 60
    listening = stack.sql(
        "SELECT application_name, count(*) FROM pg_stat_activity WHERE query LIKE 'LISTEN %%' GROUP BY 1"
    )
    # One direct session per API process, worker and beat at most (a process without a loop
    # of its own listens for its caches too), and none through PgBouncer.
    assert [name for name, _ in listening] == [LISTEN_APP_NAME], listening
    assert listening[0][1] >= len(API_PROCESSES), listening


def test_submit_claim_complete_across_both_api_processes(stack):
    with client_of(stack, "api-a") as a, client_of(stack, "api-b") as b:
        run = new_run(a, name="submit-claim-complete")
        ids = submit(a, run["id"], 20)
        done = set()
        while len(done) < len(ids):
            claims = claim(b, run["id"], max_=7, wait_ms=1000)
            assert claims, f"nothing to claim with {len(ids) - len(done)} tasks left"
            for index, item in enumerate(claims):
                completer = a if index % 2 else b
                response = completer.post(
                    f"/v1/claims/{item['claimId']}/complete", json={"outcome": item["task"]["id"]}
                )
                assert response.status_code == 200, response.text
                done.add(item["task"]["id"])
        assert done == set(ids)
        result = a.get(f"/v1/tasks/{ids[0]}/result").json()
    assert result["state"] == "SUCCEEDED" and result["outcome"] == ids[0], result
    assert dict(stack.states("coordination_task", ids)) == dict.fromkeys(ids, "SUCCEEDED")


def test_a_long_poll_and_an_event_stream_are_woken_by_the_other_process(stack):
    with client_of(stack, "api-a") as a, client_of(stack, "api-b") as b:
        run = new_run(a, name="woken")
        (task_id,) = submit(b, run["id"], 1)
        answers: dict[str, object] = {}
        stream_open = threading.Event()

        def long_poll() -> None:
            with client_of(stack, "api-a") as waiter:
                answers["wait"] = waiter.get(f"/v1/tasks/{task_id}/result", params={"timeoutMs": 25_000})

        def event_stream() -> None:
            seen = []
            with client_of(stack, "api-a") as reader:
                with reader.stream("GET", "/v1/events/stream", params={"runId": run["id"]}) as response:
                    answers["stream_status"] = response.status_code
                    stream_open.set()
                    for line in response.iter_lines():
                        if line.startswith("data:"):
                            event = json.loads(line.removeprefix("data:"))
                            seen.append(event["type"])
                            if event["type"] == "task.succeeded":
                                break
            answers["stream"] = seen

        threads = [threading.Thread(target=long_poll), threading.Thread(target=event_stream)]
        for thread in threads:
            thread.start()
        assert stream_open.wait(30), "the event stream did not open"
        (item,) = claim(b, run["id"], max_=1)
        started = time.monotonic()
        assert b.post(f"/v1/claims/{item['claimId']}/complete", json={"outcome": "woken"}).status_code == 200
        for thread in threads:
            thread.join(40)
        print(
            f"\nthe long-poll and the stream on api-a ended {time.monotonic() - started:.2f} s after api-b's complete"
        )
    wait = answers["wait"]
    assert wait.status_code == 200 and wait.json()["state"] == "SUCCEEDED", wait.text
    assert wait.json()["outcome"] == "woken"
    assert answers["stream_status"] == 200
    assert answers["stream"][-1] == "task.succeeded", answers["stream"]
    assert "task.claimed" in answers["stream"], answers["stream"]


def test_a_notification_from_a_pooled_transaction_reaches_every_api_process(stack, bouncer):
    """Both API processes cache a key for an hour; a revoke committed through PgBouncer is refused by both at once."""
    key = create_key(stack.env)
    clients = {name: client_of(stack, name, key=key) for name in API_PROCESSES}
    try:
        for client in clients.values():
            assert client.get("/v1/runs").status_code == 200  # cached now
        assert bouncer.revoke_key(key) == 1
        for name, client in clients.items():
            wait_until(
                lambda client=client: client.get("/v1/runs").status_code == 401,
                what=f"{name} to refuse the revoked key",
            )
    finally:
        for client in clients.values():
            client.close()


def test_bound_work_is_done_by_the_celery_workers(stack):
    with client_of(stack, "api-b") as b:
        run = new_run(b, name="bound")
        ids = submit(b, run["id"], 12, mailbox=BOUND_MAILBOX, log=str(stack.log_dir / "bulk.log"))

    def all_done() -> bool:
        return set(stack.states("coordination_task", ids).values()) == {"SUCCEEDED"}

    wait_until(all_done, interval_s=0.2, what="the workers to do the bound tasks")


def test_a_cancel_cascades_through_the_subtree(stack):
    with client_of(stack, "api-a") as a, client_of(stack, "api-b") as b:
        root = new_run(a, name="cancel-root")
        child = b.post(f"/v1/runs/{root['id']}/children", json={"name": "cancel-child"})
        assert child.status_code == 201, child.text
        child = child.json()
        pending = submit(a, child["id"], 3) + submit(b, root["id"], 2)
        (held,) = claim(b, child["id"], max_=1)
        response = a.post(f"/v1/runs/{root['id']}/cancel", json={"reason": "behind pgbouncer"})
        assert response.status_code == 200, response.text
        assert response.json()["storedState"] == "CANCELLED"
        child_now = b.get(f"/v1/runs/{child['id']}").json()
        assert (child_now["effective"], child_now["inactiveReason"], child_now["inactiveRunId"]) == (
            "INACTIVE",
            "CANCELLED",
            root["id"],
        )
        refused = b.post(f"/v1/mailboxes/{PLAIN_MAILBOX}/tasks", json={"runId": child["id"], "input": {}})
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "SCOPE_CANCELLED", refused.text
        late = a.post(f"/v1/claims/{held['claimId']}/complete", json={"outcome": "late"})
        assert late.status_code == 409, late.text
    states = stack.states("coordination_task", pending)
    assert set(states.values()) == {"CANCELLED"}, states


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        ({"RUNSTATE_DB_PREPARE_THRESHOLD": "1"}, "runstate.E002"),
        ({"RUNSTATE_LISTEN_DATABASE_URL": ""}, "runstate.E003"),
    ],
    ids=["prepared-statements", "listen-through-the-pooler"],
)
def test_a_process_refuses_to_start_on_a_configuration_that_breaks_behind_the_pooler(stack, change, refusal, tmp_path):
    """The API and a Celery worker exit at start with the check's message; ``manage.py check`` fails with it."""
    env = {**stack.env, **change, "RUNSTATE_VAR_DIR": str(tmp_path)}
    port = free_port()
    commands = {
        "api": [sys.executable, "-m", "uvicorn", "runstate_project.asgi:application", "--port", str(port)],
        "worker": [sys.executable, "-m", "celery", "-A", "runstate_project", "worker", "--pool=solo"],
        "check": [sys.executable, "manage.py", "check"],
    }
    processes = {
        name: subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        for name, command in commands.items()
    }
    try:
        outputs = {
            name: process.communicate(timeout=90)[0].decode(errors="replace") for name, process in processes.items()
        }
    finally:
        stop_process_groups(processes.values())
    for name, process in processes.items():
        assert process.returncode not in (0, None), f"{name} started:\n{outputs[name][-3000:]}"
        assert refusal in outputs[name], f"{name}:\n{outputs[name][-3000:]}"
