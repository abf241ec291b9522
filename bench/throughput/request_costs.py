"""The server's CPU per unbatched request of each kind, one request at a time from one client."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from bench.harness.env import truncate_coordination_tables
from bench.harness.fixtures import MAILBOX
from bench.harness.meters import CpuMeter
from bench.harness.servers import UvicornServer, checked
from bench.throughput.http_pipeline import http_run


@dataclass
class RequestCosts:
    """Server CPU per unbatched request of each kind, from one client sending them one at a time."""

    calls: int
    uvicorn_ms: dict[str, float]  # the uvicorn process tree (every worker process)
    postgres_ms: dict[str, float]  # the whole PostgreSQL server meanwhile
    pooler_ms: dict[str, float] | None = None  # PgBouncer, when the server's requests go through it
    wall_ms: dict[str, float] | None = None  # one request's time in the client, answer read

    def summary(self) -> str:
        parts = [
            f"{op} {self.uvicorn_ms[op]:.2f} ms uvicorn + {self.postgres_ms[op]:.2f} ms postgres"
            + (f" + {self.pooler_ms[op]:.2f} ms pgbouncer" if self.pooler_ms else "")
            + (f" (wall {self.wall_ms[op]:.2f} ms)" if self.wall_ms else "")
            for op in self.uvicorn_ms
        ]
        where = " through PgBouncer" if self.pooler_ms else ""
        return f"server CPU per request{where} ({self.calls} sequential requests of each kind): " + "; ".join(parts)


def measure_request_costs(server: UvicornServer, calls: int) -> RequestCosts:
    """Send ``calls`` submits, then ``calls`` claims of ``max`` 1, then their completes, one at a time.

    One client and no concurrency, so the server's CPU over each phase divided by the calls
    is what one request of that kind costs it (the machine's other load adds nothing to a
    process's own CPU time; it only stretches the wall clock).
    """
    import httpx
    from django.db import connection

    truncate_coordination_tables()
    headers, run_id = http_run(server, "http-costs")
    connection.close()
    uvicorn_ms: dict[str, float] = {}
    postgres_ms: dict[str, float] = {}
    pooler_ms: dict[str, float] = {}
    wall_ms: dict[str, float] = {}
    claims: list[dict] = []
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as client:
        for _ in range(20):  # warm every worker process: imports, pool, prepared statements
            checked(client.post(f"/v1/mailboxes/{MAILBOX}/tasks", json={"runId": run_id, "input": {}}))
        warm = checked(client.post(f"/v1/mailboxes/{MAILBOX}/claims", json={"runId": run_id, "max": 20}))["claims"]
        for claim in warm:
            checked(client.post(f"/v1/claims/{claim['claimId']}/complete", json={"outcome": 0}))

        def phase(op: str, request: Callable[[int], None]) -> None:
            with CpuMeter(server.process.pid, server.pooler.pid if server.pooler else None) as cpu:
                for i in range(calls):
                    request(i)
            wall_ms[op] = 1000 * cpu.wall_s / calls
            uvicorn_ms[op] = 1000 * cpu.server_s / calls
            postgres_ms[op] = 1000 * cpu.postgres_s / calls
            pooler_ms[op] = 1000 * cpu.pooler_s / calls

        submit_body = {"runId": run_id, "input": {"i": 0}}
        claim_body = {"runId": run_id, "max": 1}
        phase("submit", lambda i: checked(client.post(f"/v1/mailboxes/{MAILBOX}/tasks", json=submit_body)))
        phase(
            "claim",
            lambda i: claims.extend(checked(client.post(f"/v1/mailboxes/{MAILBOX}/claims", json=claim_body))["claims"]),
        )
        if len(claims) != calls:
            raise RuntimeError(f"expected {calls} claims, got {len(claims)}")
        phase(
            "complete",
            lambda i: checked(client.post(f"/v1/claims/{claims[i]['claimId']}/complete", json={"outcome": i})),
        )
    return RequestCosts(calls, uvicorn_ms, postgres_ms, pooler_ms if server.pooler else None, wall_ms)
