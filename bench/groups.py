"""Group decisions: 100 concurrent verdicts on one group, and 1,000 concurrent waits.

Prints p50/p99 verdict latency (service layer and HTTP), checks there is exactly one
finalize, the time from the deciding verdict's return until a cursor reader sees
``group.finalized``, and the release latency of 1,000 concurrent ``GET /groups/{id}/wait`` and
of 1,000 concurrent ``GET /barriers/{id}/wait`` through two API processes (p50/p99 from the
deciding commit to each answer; target p99 under 100 ms). Run: ``.venv/bin/python -m bench.groups``.

``--json PATH`` writes the figures: ``verdict_p99_ms_service``, ``verdict_p99_ms_http``,
``finalized_count`` (``group.finalized`` events per verdict group: 1 is right; see
``json_figures``), ``group_wait_p99_ms`` and ``barrier_wait_p99_ms``, and
``group_wait_server_cpu_ms_per_answer`` / ``barrier_wait_server_cpu_ms_per_answer`` (the two
servers' CPU from just before the decision to the last answer, per released wait: the figure
another process's load moves least) and ``group_wait_park_cpu_ms_per_wait`` /
``barrier_wait_park_cpu_ms_per_wait`` (their CPU to take the waits in: each wait's first
read and parking, until the servers go quiet). ``--no-waiters``
measures the verdicts only, ``--no-verdicts`` the waiters only.
"""

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from bench.harness.env import setup_django
from bench.harness.meters import process_tree_seconds, wait_idle
from bench.harness.report import write_json
from bench.harness.servers import UvicornServer
from bench.harness.threads import percentile

PY_SPY = str(Path(sys.executable).with_name("py-spy"))


def make_group(members: int, threshold: int):
    """A group with ``members`` succeeded members awaiting verdicts."""
    from coordination.services.claims import claim_complete, task_claim
    from coordination.services.groups import group_create, group_submit
    from coordination.services.keys import project_ensure
    from coordination.services.mailboxes import mailbox_ensure

    project = project_ensure(name=f"bench-groups-{uuid.uuid4().hex[:8]}")
    mailbox, _ = mailbox_ensure(project_id=project.id, name="reviews", mode="WORK")
    group = group_create(project_id=project.id, mailbox_name="reviews", condition="N_ACCEPTED", threshold=threshold)
    tasks = [group_submit(project_id=project.id, group_id=group.id, input={"i": i})[0] for i in range(members)]
    for claim in task_claim(project_id=project.id, mailbox=mailbox, run_id=group.scope_id, max_claims=100):
        claim_complete(project_id=project.id, claim_id=claim.claim_id, outcome={"ok": True})
    return project, group, tasks


def concurrently(calls):
    """Run the callables in threads released together; return (results, seconds each)."""
    from django.db import connection

    gate = threading.Barrier(len(calls))
    results, latencies = [None] * len(calls), [0.0] * len(calls)

    def run(index, call):
        try:
            gate.wait()
            started = time.perf_counter()
            results[index] = call()
            latencies[index] = time.perf_counter() - started
        except Exception as exc:  # noqa: BLE001 - reported by the caller
            results[index] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, latencies


def seen_by_reader(project_id, group_id, timeout_s: float = 30.0) -> float:
    """Poll the event cursor until ``group.finalized`` of the group shows; return when (perf_counter)."""
    from coordination.reads.selectors import Visibility, event_list

    visibility, cursor = Visibility(project_id=project_id), None
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        events, cursor = event_list(visibility, after=cursor, types=["group.finalized"], limit=100)
        if any(e.subject_id == str(group_id) for e in events):
            return time.perf_counter()
        time.sleep(0.001)
    raise RuntimeError("group.finalized never became visible")


def service_verdicts(members: int, threshold: int) -> dict:
    from coordination.domain.states import Verdict
    from coordination.models import Event
    from coordination.services.groups import group_verdict

    project, group, tasks = make_group(members, threshold)
    calls = [
        lambda t=t: group_verdict(project_id=project.id, group_id=group.id, task_id=t.id, verdict=Verdict.ACCEPTED)
        for t in tasks
    ]
    results, latencies = concurrently(calls)
    deciding_end = time.perf_counter()
    failures = [r for r in results if isinstance(r, Exception)]
    if failures:
        print(f"  {len(failures)} verdicts failed, e.g. {failures[0]!r}")
    results = [r for r in results if not isinstance(r, Exception)]
    seen = seen_by_reader(project.id, group.id)
    finalized = Event.objects.filter(type="group.finalized", subject_id=str(group.id)).count()
    late = sum(r.member.late for r in results)
    print(
        f"service layer: {members} concurrent verdicts, threshold {threshold}: finalized {finalized}x, "
        f"{members - late} counted, {late} late; verdict latency p50 {percentile(latencies, 0.5) * 1000:.1f} ms, "
        f"p99 {percentile(latencies, 0.99) * 1000:.1f} ms; decision visible to a cursor reader "
        f"{max(0.0, seen - deciding_end) * 1000:.1f} ms after the last verdict returned"
    )
    assert finalized == 1
    return {"verdict_p99_ms_service": percentile(latencies, 0.99) * 1000, "finalized_service": finalized}


def http_verdicts(server: UvicornServer, key: str, members: int, threshold: int) -> dict:
    import httpx

    from coordination.models import Event

    project, group, tasks = make_group(members, threshold)
    clients = [httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key[project.id]}"}) for _ in tasks]
    try:
        calls = [
            lambda c=c, t=t: c.post(f"/v1/groups/{group.id}/members/{t.id}/accept").status_code
            for c, t in zip(clients, tasks, strict=True)
        ]
        statuses, latencies = concurrently(calls)
        statuses = [s if isinstance(s, int) else type(s).__name__ for s in statuses]
    finally:
        for client in clients:
            client.close()
    finalized = Event.objects.filter(type="group.finalized", subject_id=str(group.id)).count()
    print(
        f"HTTP: {members} concurrent verdicts: statuses {sorted(set(statuses), key=str)}, finalized {finalized}x; "
        f"latency p50 {percentile(latencies, 0.5) * 1000:.1f} ms, p99 {percentile(latencies, 0.99) * 1000:.1f} ms"
    )
    return {"verdict_p99_ms_http": percentile(latencies, 0.99) * 1000, "finalized_http": finalized}


async def _get_once(host: str, port: int, path: str, token: str) -> tuple[int, bytes, float]:
    """One HTTP/1.1 GET on its own connection; return (status, body, perf_counter when it was read).

    A bare asyncio client: 1,000 answers arriving together must be timed when they arrive,
    not after a heavier client library has parsed the ones before them.
    """
    reader, writer = await asyncio.open_connection(host, port)
    try:
        headers = f"Host: {host}\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n"
        writer.write(f"GET {path} HTTP/1.1\r\n{headers}\r\n".encode())
        head = await reader.readuntil(b"\r\n\r\n")
        length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
        if length is not None:
            body = await reader.readexactly(int(length.group(1)))
        else:  # chunked, and the server closes the connection after it
            raw, body = await reader.read(), b""
            while raw:
                size_line, _, raw = raw.partition(b"\r\n")
                size = int(size_line, 16)
                if size == 0:
                    break
                body, raw = body + raw[:size], raw[size + 2 :]
        return int(head.split(b" ", 2)[1]), body, time.perf_counter()
    finally:
        writer.close()


async def _waiters(
    servers: list[UvicornServer], token: str, path: str, count: int, decided, decide, profile_to=None
) -> tuple[list[float], list[int], float, float]:
    """Park ``count`` GETs of ``path`` over ``servers`` (round robin), then ``decide()``; return
    each decided answer's delay after the deciding commit (s), every status, the CPU seconds
    the servers used to take the waits in (from the first until they went quiet: each wait's
    first read and parking), and from just before the decision to the last answer. With
    ``profile_to`` (a path per server), py-spy records each server from just before the
    decision for 6 s (``--nonblocking``: it never pauses them).
    """
    addresses = [("127.0.0.1", server.port) for server in servers]
    pids = [server.process.pid for server in servers]
    done_at: list[float] = []
    statuses: list[int] = []

    async def wait_one(index: int):
        host, port = addresses[index % len(addresses)]
        try:
            status, body, at = await _get_once(host, int(port), path, token)
        except (OSError, asyncio.IncompleteReadError, AttributeError):
            statuses.append(0)
            return
        statuses.append(status)
        if status == 200 and decided(json.loads(body)):
            done_at.append(at)

    # A key in use is in each process's cache, which is what the hot path serves (issue 27). A
    # new key's first request records its use, so each process forgets it, and a later one
    # caches it again: warm every process first, so that the waits measure a key in use.
    for host, port in addresses:
        for _ in range(3):
            await _get_once(host, int(port), path.replace("timeoutMs=30000", "timeoutMs=0"), token)
            await asyncio.sleep(0.2)
    cpu_start = sum(process_tree_seconds(pid) for pid in pids)
    tasks = [asyncio.create_task(wait_one(i)) for i in range(count)]
    # Let every waiter connect and park: the servers go idle once each has read once.
    await asyncio.sleep(2)
    parking_cpu = await asyncio.get_running_loop().run_in_executor(None, wait_idle, pids) - cpu_start
    profilers = [
        subprocess.Popen(
            [PY_SPY, "record", "--nonblocking", "-r", "250", "-f", "raw", "-d", "6", "-p", str(pid), "-o", out],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for pid, out in zip(pids, profile_to or [], strict=False)
    ]
    if profilers:
        await asyncio.sleep(1)
    early = sum(task.done() for task in tasks)
    if early:
        print(f"  {early} waits were answered before the decision")
    cpu_before = sum(process_tree_seconds(pid) for pid in pids)
    decided_at = await asyncio.get_running_loop().run_in_executor(None, decide)
    await asyncio.gather(*tasks)
    cpu = sum(process_tree_seconds(pid) for pid in pids) - cpu_before
    for profiler in profilers:
        await asyncio.get_running_loop().run_in_executor(None, profiler.wait)
    return [t - decided_at for t in done_at], statuses, parking_cpu, cpu


def _report(
    what: str, count: int, release: list[float], statuses: list[int], parking_cpu_s: float, cpu_s: float
) -> tuple[float, float, float]:
    """Print the release figures; return p99 (ms) and the servers' CPU per parked and per released wait (ms)."""
    errors = {s: statuses.count(s) for s in set(statuses) if s != 200}
    p99 = percentile(release, 0.99) * 1000
    cpu_per_wait = parking_cpu_s * 1000 / count
    cpu_per_answer = cpu_s * 1000 / max(len(release), 1)
    print(
        f"HTTP: {count} concurrent {what} over two API processes: {len(release)} released by the decision, "
        f"other answers {errors or 'none'}; release latency after the commit "
        f"p50 {percentile(release, 0.5) * 1000:.0f} ms, p99 {p99:.0f} ms, "
        f"max {max(release, default=0) * 1000:.0f} ms (target p99 < 100 ms); the servers' CPU to take "
        f"the waits in {parking_cpu_s * 1000:.0f} ms ({cpu_per_wait:.2f} ms per wait), from the decision "
        f"to the last answer {cpu_s * 1000:.0f} ms ({cpu_per_answer:.2f} ms per answer)"
    )
    return p99, cpu_per_wait, cpu_per_answer


def _release(
    servers, token: str, what: str, path: str, count: int, decided, change, profile
) -> tuple[float, float, float]:
    """Park ``count`` waits of ``path``, release them with ``change()`` (committed on return).

    Return p99 (ms) and the servers' CPU per parked and per released wait (ms).
    """
    from django.db import connection

    def decide() -> float:
        try:
            change()
            return time.perf_counter()
        finally:
            connection.close()

    profile_to = [f"{profile}-{what}-{i}.raw" for i in range(len(servers))] if profile else None
    release, statuses, parking_cpu_s, cpu_s = asyncio.run(
        _waiters(servers, token, path, count, decided, decide, profile_to)
    )
    return _report(f"{what} waits", count, release, statuses, parking_cpu_s, cpu_s)


def http_waiters(
    servers: list[UvicornServer], key: dict, count: int, profile: str | None = None
) -> tuple[float, float, float]:
    """1,000 ``GET /v1/groups/{id}/wait`` over the servers, released by one verdict; return p99 and CPU (ms)."""
    from coordination.domain.states import Verdict
    from coordination.services.groups import group_verdict

    project, group, tasks = make_group(1, 1)
    return _release(
        servers,
        key[project.id],
        "group",
        f"/v1/groups/{group.id}/wait?timeoutMs=30000",
        count,
        lambda body: body["state"] == "FINALIZED",
        lambda: group_verdict(project_id=project.id, group_id=group.id, task_id=tasks[0].id, verdict=Verdict.ACCEPTED),
        profile,
    )


def http_barrier_waiters(
    servers: list[UvicornServer], key: dict, count: int, profile: str | None = None
) -> tuple[float, float, float]:
    """1,000 ``GET /v1/barriers/{id}/wait`` over the servers, released by the one arrival; return p99 and CPU (ms)."""
    from coordination.services.barriers import barrier_arrive, barrier_create
    from coordination.services.keys import project_ensure
    from coordination.services.runs import run_create

    project = project_ensure(name=f"bench-barriers-{uuid.uuid4().hex[:8]}")
    run = run_create(project_id=project.id)
    barrier = barrier_create(project_id=project.id, run_id=run.id, target=1)
    return _release(
        servers,
        key[project.id],
        "barrier",
        f"/v1/barriers/{barrier.id}/wait?timeoutMs=30000",
        count,
        lambda body: body["state"] == "RELEASED",
        lambda: barrier_arrive(project_id=project.id, barrier_id=barrier.id, key="the-one"),
        profile,
    )


def waiter_servers() -> list[UvicornServer]:
    """Two API processes on two ports (each its own LISTEN connection and pool of 10)."""
    os.environ.setdefault("RUNSTATE_DB_POOL_SIZE", "10")
    servers = [UvicornServer(), UvicornServer()]
    servers[1].log_path = servers[1].log_path.with_name("bench-uvicorn-2.log")
    return servers


class KeyRing(dict):
    """An API key per project, created on first use."""

    def __missing__(self, project_id):
        from coordination.services.keys import ALL_PERMISSIONS, api_key_create

        self[project_id] = api_key_create(project_id=project_id, permissions=list(ALL_PERMISSIONS)).plaintext
        return self[project_id]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--verdicts", type=int, default=100)
    parser.add_argument("--threshold", type=int, default=50)
    parser.add_argument("--waiters", type=int, default=1000)
    parser.add_argument("--no-waiters", action="store_true", help="measure the verdicts only")
    parser.add_argument("--no-verdicts", action="store_true", help="measure the waiters only")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    parser.add_argument("--profile", metavar="PREFIX", help="py-spy the servers around each release (PREFIX-*.raw)")
    args = parser.parse_args()
    setup_django()
    verdicts: dict = {}
    waits: dict[str, tuple[float, float, float]] = {}
    keys = KeyRing()
    if not args.no_verdicts:
        verdicts = service_verdicts(args.verdicts, args.threshold)
        with UvicornServer() as server:
            verdicts |= http_verdicts(server, keys, args.verdicts, args.threshold)
    if not args.no_waiters:
        first, second = waiter_servers()
        with first, second:
            for what, measure in (("group", http_waiters), ("barrier", http_barrier_waiters)):
                waits[what] = measure([first, second], keys, args.waiters, args.profile)
    if args.json:
        write_json(args.json, json_figures(verdicts, waits))
        print(f"figures written to {args.json}")


def json_figures(verdicts: dict, waits: dict[str, tuple[float, float, float]]) -> dict:
    """Return what ``--json`` writes: the verdict figures, then per kind of wait its p99 and CPU figures.

    ``finalized_count`` is how many ``group.finalized`` events each verdict group has (1 is
    right); when the groups disagree, the count furthest from 1, so a double or a missing
    finalize anywhere shows. ``waits`` maps ``group``/``barrier`` to (p99 ms, park CPU ms per
    wait, server CPU ms per answer).
    """
    figures = dict(verdicts)
    counts = [verdicts[key] for key in ("finalized_service", "finalized_http") if key in verdicts]
    if counts:
        figures["finalized_count"] = max(counts, key=lambda count: abs(count - 1))
    for what, (p99, cpu_per_wait, cpu_per_answer) in waits.items():
        figures[f"{what}_wait_p99_ms"] = round(p99, 1)
        figures[f"{what}_wait_park_cpu_ms_per_wait"] = round(cpu_per_wait, 3)
        figures[f"{what}_wait_server_cpu_ms_per_answer"] = round(cpu_per_answer, 3)
    return figures


if __name__ == "__main__":
    main()
