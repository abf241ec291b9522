"""Event streams to many readers: 200 SSE clients on ``/v1/events/stream`` over two API processes.

The readers (``--readers``, default 200) are split over two uvicorn processes on two ports
and run in two reader processes of their own (bare asyncio sockets, so that parsing 200
streams does not share a core with the writer). Once every stream has started, the writer
commits ``--rate`` events per second (default 1,000, in transactions of 10 every 10 ms) for
``--seconds`` (default 10), each carrying its sequence number and its write time. Every
reader checks that it received every sequence number once, in order, and times each frame
from the event's write (just before its commit) to its arrival.

Prints the p50/p99/max delivery delay over every frame of every reader, the gaps and the
duplicates; ``--json PATH`` writes ``sse_delivery_p99_ms``, ``sse_gaps`` and
``sse_duplicates``. Targets: p99 < 250 ms, no gap, no duplicate.
Run: ``.venv/bin/python -m bench.stream``.
"""

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import tempfile
import time
import uuid
from pathlib import Path

from bench.harness.env import setup_django
from bench.harness.report import write_json
from bench.harness.servers import UvicornServer
from bench.harness.threads import percentile

EVENT_TYPE = "bench.tick"


# Readers (in their own processes; no Django) ---------------------------------------------


class StreamState:
    """One reader's view: the next sequence number expected, gaps, duplicates, delays."""

    def __init__(self) -> None:
        self.next = 0
        self.gaps = 0
        self.duplicates = 0
        self.delays_ms: list[int] = []
        self.started = False


SEQ = re.compile(rb'"n":(\d+),"t":([0-9.]+)')


async def read_stream(host: str, port: int, path: str, token: str, state: StreamState, ready, stop_at) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    headers = f"Host: {host}\r\nAuthorization: Bearer {token}\r\nAccept: text/event-stream\r\n"
    writer.write(f"GET {path} HTTP/1.1\r\n{headers}\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    raw = b""  # chunked transfer encoding, not yet decoded
    body = b""  # decoded, not yet split into frames
    while time.time() < stop_at.value:
        try:
            data = await asyncio.wait_for(reader.read(262144), 1.0)
        except TimeoutError:
            continue
        if not data:
            break
        arrived = time.time()
        raw += data
        while True:
            end = raw.find(b"\r\n")
            if end < 0:
                break
            size = int(raw[:end], 16)
            if len(raw) < end + 2 + size + 2:
                break
            body += raw[end + 2 : end + 2 + size]
            raw = raw[end + 2 + size + 2 :]
        last = body.rfind(b"\n\n")
        if last < 0:
            continue
        frames, body = body[: last + 2], body[last + 2 :]
        if not state.started and b"retry:" in frames:
            state.started = True
            ready()
        for n_raw, t_raw in SEQ.findall(frames):
            n = int(n_raw)
            if n == state.next:
                state.next += 1
            elif n < state.next:
                state.duplicates += 1
            else:
                state.gaps += n - state.next
                state.next = n + 1
            state.delays_ms.append(int((arrived - float(t_raw)) * 1000))
    writer.close()


def reader_process(targets, token, path, out_path, started, stop_at) -> None:
    """Run one process's readers (``targets``: (host, port) per stream) until ``stop_at``; write results."""

    async def main():
        states = [StreamState() for _ in targets]

        def ready():
            with started.get_lock():
                started.value += 1

        await asyncio.gather(
            *(
                read_stream(host, port, path, token, state, ready, stop_at)
                for (host, port), state in zip(targets, states, strict=True)
            ),
            return_exceptions=True,
        )
        return states

    states = asyncio.run(main())
    Path(out_path).write_text(
        json.dumps(
            [{"next": s.next, "gaps": s.gaps, "duplicates": s.duplicates, "delays": s.delays_ms} for s in states]
        )
    )


# The writer and the run --------------------------------------------------------------------


def write_events(project, run, rate: int, seconds: float) -> int:
    """Commit ``rate`` events per second for ``seconds`` in transactions every 10 ms; return how many."""
    from django.db import transaction
    from django.utils import timezone

    from coordination.models import Event
    from coordination.services.events import events_record_many

    per_tick = max(1, rate // 100)
    ticks = int(seconds * 100)
    started = time.perf_counter()
    seq = 0
    for tick in range(ticks):
        delay = started + tick / 100 - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        now = time.time()
        with transaction.atomic():
            events_record_many(
                [
                    Event(
                        project_id=project.id,
                        type=EVENT_TYPE,
                        run_id=run.id,
                        run_path=run.path,
                        subject_id="",
                        data={"n": seq + i, "t": round(now, 6)},
                        created_at=timezone.now(),
                    )
                    for i in range(per_tick)
                ]
            )
        seq += per_tick
    late = time.perf_counter() - started - seconds
    print(f"writer: {seq} events in {seconds + max(late, 0):.2f} s ({seq / (seconds + max(late, 0)):.0f}/s)")
    return seq


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--readers", type=int, default=200)
    parser.add_argument("--rate", type=int, default=1000, help="events per second")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    args = parser.parse_args()
    setup_django()
    from coordination.services.keys import ALL_PERMISSIONS, api_key_create, project_ensure
    from coordination.services.runs import run_create

    project = project_ensure(name=f"bench-stream-{uuid.uuid4().hex[:8]}")
    token = api_key_create(project_id=project.id, permissions=list(ALL_PERMISSIONS)).plaintext
    run = run_create(project_id=project.id)
    path = f"/v1/events/stream?runId={run.id}&types={EVENT_TYPE}"

    os.environ.setdefault("RUNSTATE_DB_POOL_SIZE", "10")
    servers = [UvicornServer(), UvicornServer()]
    servers[1].log_path = servers[1].log_path.with_name("bench-uvicorn-2.log")
    context = multiprocessing.get_context("spawn")
    started = context.Value("i", 0)
    stop_at = context.Value("d", time.time() + 3600)
    with servers[0], servers[1], tempfile.TemporaryDirectory() as tmp:
        addresses = [("127.0.0.1", s.port) for s in servers]
        targets = [addresses[i % 2] for i in range(args.readers)]
        halves = [targets[0::2], targets[1::2]]
        outs = [Path(tmp) / f"readers-{i}.json" for i in range(2)]
        processes = [
            context.Process(target=reader_process, args=(half, token, path, str(out), started, stop_at))
            for half, out in zip(halves, outs, strict=True)
        ]
        for process in processes:
            process.start()
        deadline = time.time() + 120
        while started.value < args.readers:
            if time.time() > deadline:
                raise RuntimeError(f"only {started.value} of {args.readers} streams started")
            time.sleep(0.1)
        print(f"{args.readers} streams started over two API processes")
        total = write_events(project, run, args.rate, args.seconds)
        # Give the last frames time to arrive, then stop the readers.
        stop_at.value = time.time() + 10
        for process in processes:
            process.join(60)
        results = [state for out in outs for state in json.loads(out.read_text())]

    delays = [d for state in results for d in state["delays"]]
    short = [state["next"] for state in results if state["next"] < total]
    gaps = sum(state["gaps"] for state in results) + sum(total - n for n in short)
    duplicates = sum(state["duplicates"] for state in results)
    p99 = percentile(delays, 0.99)
    print(
        f"{len(results)} readers x {total} events: {len(delays)} frames; delivery delay after the write "
        f"p50 {percentile(delays, 0.5):.0f} ms, p99 {p99:.0f} ms, max {max(delays, default=0)} ms "
        f"(target p99 < 250 ms); gaps {gaps}, duplicates {duplicates}; "
        f"{len(short)} readers short of the last event"
    )
    if args.json:
        write_json(args.json, json_figures(p99, gaps, duplicates))
        print(f"figures written to {args.json}")


def json_figures(p99_ms: float, gaps: int, duplicates: int) -> dict:
    """Return what ``--json`` writes: the delivery delay's p99 (ms), and the events missed and repeated."""
    return {"sse_delivery_p99_ms": p99_ms, "sse_gaps": gaps, "sse_duplicates": duplicates}


if __name__ == "__main__":
    main()
