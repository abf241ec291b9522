"""The pgqueuer measure: pgqueuer draining as many no-op jobs in the same run (bench/pgqueuer_peer.py)."""

from __future__ import annotations

from typing import Any

from bench.harness.env import db_params
from bench.harness.meters import QUIET, CpuMeter, process_tree_seconds, wait_for_quiet


def run_pgqueuer_peer(url: str, jobs: int, dequeuers: int, batch: int) -> Any:
    """Drain ``jobs`` pre-enqueued no-op jobs with pgqueuer (bench/pgqueuer_peer.py); return its DrainResult.

    Enqueueing and the dequeuers' connections come before the clock; the CPU of this
    process and of the dequeuers' PostgreSQL backends is measured over the drain.
    """
    from bench.pgqueuer_peer import DrainResult, PgqueuerPeer

    with PgqueuerPeer(db_params(url), dequeuers=dequeuers, batch=batch) as peer:
        peer.enqueue(jobs)
        pids = peer.connect()
        note = wait_for_quiet(**QUIET)
        before = {pid: process_tree_seconds(pid) for pid in pids}
        with CpuMeter() as cpu:
            seconds = peer.drain(jobs)
        cpu.backend_s = sum(process_tree_seconds(pid) - before[pid] for pid in pids)
        cpu.note = note
        verification = peer.verify(jobs)
    return DrainResult(
        jobs=jobs,
        dequeuers=dequeuers,
        batch=batch,
        seconds=seconds,
        verification=verification,
        first_job_s=peer.first_job_s,
        shutdown_s=peer.shutdown_s,
        cpu=cpu,
    )


def peer_lines(peer: Any, version: str) -> list[str]:
    """Return the pgqueuer peer's detail lines (rate, CPU, verification)."""
    from bench.pgqueuer_peer import verification_text as peer_verification_text

    return [
        f"pgqueuer {version}, {peer.dequeuers} dequeuers x batch {peer.batch}: drain {peer.rate:.0f} jobs/s "
        f"({peer.jobs} jobs in {peer.seconds:.2f} s, first job after {peer.first_job_s:.2f} s; "
        f"dequeuers' shutdown afterwards {peer.shutdown_s:.1f} s, not timed); {peer.cpu.note}; "
        f"{peer.cpu.per_task_ms(peer.jobs).replace('task', 'job')} (shutdown included)",
        peer_verification_text(peer.verification, peer.jobs),
    ]
