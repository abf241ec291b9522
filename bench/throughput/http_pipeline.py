"""The HTTP measure: the service scenario through a running API server, W keep-alive clients.

Unbatched: one request per submit and per complete; batched: the batch endpoints.
"""

from __future__ import annotations

import time
import uuid

from bench.harness.env import truncate_coordination_tables
from bench.harness.fixtures import MAILBOX, http_fixture, verify_run
from bench.harness.meters import DatabaseMeter
from bench.harness.servers import UvicornServer, checked
from bench.harness.threads import run_threads
from bench.pooler import stats_per_task
from bench.throughput.scenario import ScenarioResult


def http_run(server: UvicornServer, label: str) -> tuple[dict[str, str], str]:
    """Create a fresh project, key, WORK mailbox and run over HTTP; return (headers, run id)."""
    import httpx

    _, key = http_fixture(label)
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as client:
        checked(client.put(f"/v1/mailboxes/{MAILBOX}", json={"mode": "WORK"}))
        run_id = checked(client.post("/v1/runs", json={"name": f"bench {label}"}))["id"]
    return headers, run_id


HTTP_MODES = ("unbatched", "batched")


def run_http_scenario(
    server: UvicornServer, tasks: int, workers: int, mode: str, sizes: tuple[int, int, int]
) -> ScenarioResult:
    """The service scenario through HTTP: W threads, one keep-alive ``httpx.Client`` each.

    *unbatched*: one ``POST /v1/mailboxes/{name}/tasks`` per task, claims of ``max`` = the
    claim size, one ``POST /v1/claims/{id}/complete`` per claim. *batched*: ``POST
    /v1/mailboxes/{name}/tasks/batch`` of the submit size, claims of the claim size, ``POST
    /v1/claims/complete`` of the complete size. ``sizes`` is (submit, claim, complete). On a
    server behind PgBouncer (``server.pooler``) the mode is labelled ``... pgbouncer``, and
    PgBouncer's CPU and its transactions and queries per task are measured too.
    """
    import httpx
    from django.db import connection

    submit_size, claim_size, complete_size = sizes if mode == "batched" else (1, sizes[1], 1)
    truncate_coordination_tables()
    headers, run_id = http_run(server, f"http-{mode}-w{workers}")
    connection.close()
    pooler_before = server.pooler.stats() if server.pooler else None

    def open_client(_index: int) -> httpx.Client:
        client = httpx.Client(base_url=server.url, headers=headers, timeout=60)
        checked(client.get("/v1/healthz"))  # open the keep-alive connection before the clock starts
        return client

    def submitter(index: int, client: httpx.Client) -> int:
        mine = list(range(index, tasks, workers))
        for start in range(0, len(mine), submit_size):
            chunk = mine[start : start + submit_size]
            if mode == "batched":
                body = {"runId": run_id, "tasks": [{"input": {"i": i}} for i in chunk]}
                checked(client.post(f"/v1/mailboxes/{MAILBOX}/tasks/batch", json=body))
            else:
                checked(client.post(f"/v1/mailboxes/{MAILBOX}/tasks", json={"runId": run_id, "input": {"i": chunk[0]}}))
        return 0

    def complete(client: httpx.Client, claims: list[dict], latencies: list[float]) -> None:
        if mode == "batched":
            for start in range(0, len(claims), complete_size):
                items = [
                    {"claimId": c["claimId"], "outcome": c["task"]["input"]}
                    for c in claims[start : start + complete_size]
                ]
                started = time.perf_counter()
                results = checked(client.post("/v1/claims/complete", json={"items": items}))["results"]
                latencies.append(time.perf_counter() - started)
                refused = [r for r in results if not r["ok"]]
                if refused:
                    raise RuntimeError(f"batch complete refused {len(refused)} items: {refused[:3]}")
            return
        for claim in claims:
            started = time.perf_counter()
            checked(client.post(f"/v1/claims/{claim['claimId']}/complete", json={"outcome": claim["task"]["input"]}))
            latencies.append(time.perf_counter() - started)

    def claimer(index: int, client: httpx.Client) -> tuple[list[float], list[float], int, int]:
        claim_lat, complete_lat, done, empty = [], [], 0, 0
        body = {"runId": run_id, "max": claim_size, "workerId": f"bench-http-{index}"}
        while True:
            started = time.perf_counter()
            claims = checked(client.post(f"/v1/mailboxes/{MAILBOX}/claims", json=body))["claims"]
            claim_lat.append(time.perf_counter() - started)
            if not claims:
                empty += 1
                break
            complete(client, claims, complete_lat)
            done += len(claims)
        return claim_lat[:-1], complete_lat, done, empty

    pids = {"server_pid": server.process.pid, "pooler_pid": server.pooler.pid if server.pooler else None}
    clients = {"setup": open_client, "teardown": httpx.Client.close}
    with DatabaseMeter() as database:
        submitted = run_threads(workers, submitter, **clients, **pids)
        drained = run_threads(workers, claimer, **clients, **pids)
    pooler = stats_per_task(pooler_before, server.pooler.stats(), tasks) if server.pooler else None
    verification = verify_run(uuid.UUID(run_id), tasks)
    connection.close()
    mode_name = f"http {mode}" + (" pgbouncer" if server.pooler else "")
    return ScenarioResult.from_phases(
        mode_name, workers, tasks, claim_size, submitted, drained, verification, database.figures, pooler
    )
