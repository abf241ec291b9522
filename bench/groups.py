"""Group decisions: 100 concurrent verdicts on one group, and 1,000 concurrent waits.

Prints p50/p99 verdict latency (service layer and HTTP), checks there is exactly one
finalize, the time from the deciding verdict's return until a cursor reader sees
``group.finalized``, and the p99 release latency of 1,000 concurrent ``GET /groups/{id}/wait``
after the decision (target: under 100 ms). Run: ``.venv/bin/python -m bench.groups``.

``--json PATH`` writes the figures: ``verdict_p99_ms_service``, ``verdict_p99_ms_http`` and
``finalized_count`` (``group.finalized`` events per verdict group: 1 is right; see
``verdict_figures``). ``--no-waiters`` measures the verdicts only.
"""

import argparse
import asyncio
import json
import threading
import time
import uuid

from bench.throughput import UvicornServer, percentile, setup_django


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
    from coordination.selectors import Visibility, event_list

    visibility, cursor = Visibility(project_id=project_id), None
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        events, cursor = event_list(visibility, after=cursor, types=["group.finalized"], limit=100)
        if any(e.subject_id == str(group_id) for e in events):
            return time.perf_counter()
        time.sleep(0.001)
    raise RuntimeError("group.finalized never became visible")


def service_verdicts(members: int, threshold: int) -> dict:
    from coordination.models import Event
    from coordination.services.groups import group_verdict
    from coordination.states import Verdict

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


async def _waiters(url: str, token: str, group_id, count: int, decide) -> tuple[list[float], list[int], float]:
    import httpx

    limits = httpx.Limits(max_connections=count + 10, max_keepalive_connections=count + 10)
    async with httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {token}"}, limits=limits, timeout=60
    ) as client:
        done_at: list[float] = []
        statuses: list[int] = []

        async def wait_one():
            try:
                response = await client.get(f"/v1/groups/{group_id}/wait?timeoutMs=30000")
                statuses.append(response.status_code)
                if response.status_code == 200 and response.json()["state"] == "FINALIZED":
                    done_at.append(time.perf_counter())
            except httpx.HTTPError:
                statuses.append(0)

        tasks = [asyncio.create_task(wait_one()) for _ in range(count)]
        await asyncio.sleep(5)  # let every waiter connect and park
        decided_at = await asyncio.get_running_loop().run_in_executor(None, decide)
        await asyncio.gather(*tasks)
        return [t - decided_at for t in done_at], statuses, decided_at


def http_waiters(server: UvicornServer, key: dict, count: int) -> None:
    from django.db import connection

    from coordination.services.groups import group_verdict
    from coordination.states import Verdict

    project, group, tasks = make_group(1, 1)

    def decide() -> float:
        try:
            group_verdict(project_id=project.id, group_id=group.id, task_id=tasks[0].id, verdict=Verdict.ACCEPTED)
            return time.perf_counter()
        finally:
            connection.close()

    release, statuses, _ = asyncio.run(_waiters(server.url, key[project.id], group.id, count, decide))
    errors = {s: statuses.count(s) for s in set(statuses) if s != 200}
    print(
        f"HTTP: {count} concurrent group waits: {len(release)} released by the decision, "
        f"other answers {errors or 'none'}; release latency after the commit "
        f"p50 {percentile(release, 0.5) * 1000:.0f} ms, p99 {percentile(release, 0.99) * 1000:.0f} ms, "
        f"max {max(release, default=0) * 1000:.0f} ms (target p99 < 100 ms)"
    )


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
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args()
    setup_django()
    figures = verdict_figures(service_verdicts(args.verdicts, args.threshold))
    keys = KeyRing()
    with UvicornServer() as server:
        figures = verdict_figures(figures | http_verdicts(server, keys, args.verdicts, args.threshold))
        if not args.no_waiters:
            http_waiters(server, keys, args.waiters)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=2)


def verdict_figures(figures: dict) -> dict:
    """Add ``finalized_count``: how many ``group.finalized`` events each verdict group has (1 is right).

    When the groups measured so far disagree, it is the count furthest from 1, so a double or
    a missing finalize anywhere shows.
    """
    counts = [figures[key] for key in ("finalized_service", "finalized_http") if key in figures]
    return figures | {"finalized_count": max(counts, key=lambda count: abs(count - 1))}


if __name__ == "__main__":
    main()
