"""Shared limits under contention: pool acquire + release, and quota takes, against pgbench -N.

Two scenarios through the HTTP API (two uvicorn processes, as ``scripts/start`` runs them on
two cores), each for ``--seconds``:

- **pool**: ``--contenders`` (32) clients loop ``POST /v1/pools/{name}/leases`` (waiting up
  to 30 s, the long-poll cap) then ``POST /v1/pool-leases/{id}/release`` on a pool of
  ``--capacity`` (8). The figure is completed acquire + release pairs per second. Every
  grant and release is checked afterwards from the events: at no point were more than
  ``capacity`` units held.
- **quota**: ``--takers`` (16) clients loop ``POST /v1/quotas/{name}/take`` on a bucket too
  large to run dry, so every take is granted; the figure is takes per second.

Each figure is printed beside ``pgbench -N`` TPS with as many clients, measured in the same
run on the same server (the peer every runstate benchmark uses). Issue 19 sets no target yet.
``--json PATH`` writes ``pool_pairs_per_s``, ``quota_takes_per_s``, ``pgbench_tps_pool``,
``pgbench_tps_quota``, ``pool_ratio``, ``quota_ratio``, ``pool_max_in_use`` and
``pool_capacity``; ``--record`` appends a section to ``docs/benchmarks.md``.

Run: ``.venv/bin/python -m bench.limits`` (PostgreSQL at ``DATABASE_URL``, default the
``runstate_bench`` database; ``pgbench`` on ``PATH`` or under ``/usr/lib/postgresql``).
"""

import argparse
import asyncio
import os
import sys
import time
from dataclasses import dataclass

from bench.harness.env import RECORD_PATH, git_revision, setup_django
from bench.harness.fixtures import http_fixture
from bench.harness.pgbench import find_pgbench, pgbench_init, pgbench_run
from bench.harness.report import write_json
from bench.harness.servers import UvicornServer, checked

POOL = "bench-gpu"
QUOTA = "bench-provider"


@dataclass
class Scenario:
    """What one scenario did in its window."""

    name: str
    clients: int
    operations: int
    seconds: float
    errors: dict[str, int]

    @property
    def per_s(self) -> float:
        return self.operations / self.seconds if self.seconds else 0.0


async def _loop_clients(url: str, headers: dict[str, str], clients: int, seconds: float, one_round) -> Scenario:
    """Run ``clients`` coroutines, each with its own connection, calling ``one_round`` until time is up."""
    import httpx

    errors: dict[str, int] = {}
    done = [0]
    deadline = time.perf_counter() + seconds

    async def client_loop() -> None:
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60, limits=limits) as client:
            while time.perf_counter() < deadline:
                error = await one_round(client)
                if error is None:
                    done[0] += 1
                else:
                    errors[error] = errors.get(error, 0) + 1

    started = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(clients)))
    return Scenario(name="", clients=clients, operations=done[0], seconds=time.perf_counter() - started, errors=errors)


def _error_code(response) -> str:
    try:
        return response.json().get("error", {}).get("code") or str(response.status_code)
    except ValueError:
        return str(response.status_code)


def run_pool(server: UvicornServer, contenders: int, capacity: int, seconds: float) -> tuple[Scenario, str, dict]:
    """Contenders acquire and release one unit each round; return the scenario, project id and ledger."""
    import httpx

    project, key = http_fixture("limits-pool")
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as client:
        checked(client.put(f"/v1/pools/{POOL}", json={"capacity": capacity}))
        run_id = checked(client.post("/v1/runs", json={"name": "bench pool"}))["id"]

    async def one_round(client) -> str | None:
        body = {"runId": run_id, "units": 1, "waitMs": 30_000}
        acquired = await client.post(f"/v1/pools/{POOL}/leases", json=body)
        if acquired.status_code != 201:
            return _error_code(acquired)
        released = await client.post(f"/v1/pool-leases/{acquired.json()['leaseId']}/release", json={})
        return None if released.status_code == 200 else _error_code(released)

    scenario = asyncio.run(_loop_clients(server.url, headers, contenders, seconds, one_round))
    scenario.name = "pool"
    return scenario, project.id, pool_ledger(project.id, capacity)


def pool_ledger(project_id, capacity: int) -> dict:
    """Replay the pool's events in commit order; return the most units ever held and the counts."""
    from coordination.models import Event

    held: dict[str, int] = {}
    in_use = max_in_use = 0
    counts = {"pool.acquired": 0, "pool.released": 0, "pool.expired": 0}
    events = Event.objects.filter(project_id=project_id, type__in=list(counts)).order_by("id")
    for event in events.values("type", "subject_id", "data").iterator():
        counts[event["type"]] += 1
        units = int((event["data"] or {}).get("units", 1))
        if event["type"] == "pool.acquired":
            held[event["subject_id"]] = units
            in_use += units
        elif event["subject_id"] in held:
            in_use -= held.pop(event["subject_id"])
        max_in_use = max(max_in_use, in_use)
    return {"max_in_use": max_in_use, "capacity": capacity, "held_at_end": in_use, **counts}


def run_quota(server: UvicornServer, takers: int, seconds: float) -> Scenario:
    """Takers take one token each round from a bucket too large to run dry."""
    import httpx

    _, key = http_fixture("limits-quota")
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as client:
        checked(client.put(f"/v1/quotas/{QUOTA}", json={"limit": 1_000_000_000, "periodMs": 1000}))
        run_id = checked(client.post("/v1/runs", json={"name": "bench quota"}))["id"]

    async def one_round(client) -> str | None:
        taken = await client.post(f"/v1/quotas/{QUOTA}/take", json={"runId": run_id, "amount": 1})
        return None if taken.status_code == 200 else _error_code(taken)

    scenario = asyncio.run(_loop_clients(server.url, headers, takers, seconds, one_round))
    scenario.name = "quota"
    return scenario


def record(lines: list[str]) -> None:
    """Append the section to docs/benchmarks.md."""
    with RECORD_PATH.open("a") as out:
        out.write("\n" + "\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contenders", type=int, default=32)
    parser.add_argument("--capacity", type=int, default=8)
    parser.add_argument("--takers", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--pgbench-seconds", type=int, default=10)
    parser.add_argument("--pgbench-scale", type=int, default=10)
    parser.add_argument("--http-processes", type=int, default=2)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args(argv)

    setup_django()
    pgbench = find_pgbench()
    if pgbench is None:
        print("pgbench not found (PATH or /usr/lib/postgresql/*/bin)", file=sys.stderr)
        return 1
    url = os.environ["DATABASE_URL"]
    pgbench_init(pgbench, url, args.pgbench_scale)

    with UvicornServer(processes=args.http_processes) as server:
        pool, _, ledger = run_pool(server, args.contenders, args.capacity, args.seconds)
        quota = run_quota(server, args.takers, args.seconds)
    pg_pool = pgbench_run(pgbench, url, args.contenders, args.pgbench_seconds)
    pg_quota = pgbench_run(pgbench, url, args.takers, args.pgbench_seconds)

    pool_ratio = pool.per_s / pg_pool.tps
    quota_ratio = quota.per_s / pg_quota.tps
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        f"### Shared limits (`bench/limits.py`), {when}, revision {git_revision()}",
        "",
        f"HTTP, {args.http_processes} uvicorn processes; pgbench -N with as many clients, same run.",
        "",
        "| scenario | clients | figure | pgbench -N TPS | ratio | errors |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
        f"| pool acquire + release, capacity {args.capacity} | {pool.clients} | {pool.per_s:,.0f} pairs/s "
        f"| {pg_pool.tps:,.0f} | {pool_ratio:.2f} × | {pool.errors or 'none'} |",
        f"| quota take | {quota.clients} | {quota.per_s:,.0f} takes/s | {pg_quota.tps:,.0f} | {quota_ratio:.2f} × "
        f"| {quota.errors or 'none'} |",
        "",
        f"Pool ledger from the events: at most {ledger['max_in_use']} of {ledger['capacity']} units held at once; "
        f"{ledger['pool.acquired']} acquired, {ledger['pool.released']} released, {ledger['pool.expired']} expired, "
        f"{ledger['held_at_end']} held at the end.",
        "",
        pg_pool.summary(),
        "",
        pg_quota.summary(),
    ]
    print("\n".join(lines))
    ok = ledger["max_in_use"] <= args.capacity and ledger["held_at_end"] == 0
    if not ok:
        print(f"LEDGER VIOLATION: {ledger}", file=sys.stderr)
    if args.json:
        write_json(args.json, json_figures(pool.per_s, quota.per_s, pg_pool.tps, pg_quota.tps, ledger))
    if args.record:
        record(lines)
    return 0 if ok else 1


def json_figures(
    pool_per_s: float, quota_per_s: float, pgbench_pool: float, pgbench_quota: float, ledger: dict
) -> dict:
    """Return what ``--json`` writes: each rate beside ``pgbench -N`` with as many clients, and the pool's ledger."""
    return {
        "pool_pairs_per_s": pool_per_s,
        "quota_takes_per_s": quota_per_s,
        "pgbench_tps_pool": pgbench_pool,
        "pgbench_tps_quota": pgbench_quota,
        "pool_ratio": pool_per_s / pgbench_pool,
        "quota_ratio": quota_per_s / pgbench_quota,
        "pool_max_in_use": ledger["max_in_use"],
        "pool_capacity": ledger["capacity"],
    }


if __name__ == "__main__":
    sys.exit(main())
