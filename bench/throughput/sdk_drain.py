"""The SDK measure: the real ``consume`` loop draining a backlog submitted with ``submit_many``."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.harness.env import truncate_coordination_tables
from bench.harness.fixtures import MAILBOX, http_fixture, verification_text, verify_run
from bench.harness.meters import CpuMeter
from bench.harness.servers import UvicornServer


@dataclass
class SdkDrain:
    """The SDK's ``consume`` loop draining a backlog submitted with ``submit_many`` (``sdk_consume_drain``)."""

    tasks: int
    concurrency: int
    drain_rate: float
    cpu: CpuMeter = field(repr=False)  # over the submit and the drain
    verification: dict[str, Any]

    def summary(self) -> str:
        return (
            f"consume (concurrency {self.concurrency}) drained {self.drain_rate:.0f} tasks/s; "
            f"over submit_many and drain: {self.cpu.summary()}, {self.cpu.per_task_ms(self.tasks)}; "
            f"{verification_text(self.verification, self.tasks)}"
        )


def run_sdk_drain(server: UvicornServer, tasks: int, concurrency: int) -> SdkDrain:
    """``sdk_consume_drain`` against ``server`` with a fresh key, metered and verified."""
    from django.db import connection

    truncate_coordination_tables()
    _, key = http_fixture("sdk-consume")
    connection.close()
    verification: dict[str, Any] = {}

    def verify(run_id: uuid.UUID, expected: int) -> dict[str, Any]:
        verification.update(verify_run(run_id, expected))
        connection.close()
        return verification

    with CpuMeter(server.process.pid) as cpu:
        rate = sdk_consume_drain(server.url, key, tasks=tasks, concurrency=concurrency, mailbox=MAILBOX, verify=verify)
    return SdkDrain(tasks, concurrency, rate, cpu, verification)


def sdk_consume_drain(
    base_url: str,
    api_key: str,
    *,
    tasks: int = 2_000,
    concurrency: int = 8,
    mailbox: str = "bench-sdk",
    timeout_s: float = 600.0,
    verify: Callable[[uuid.UUID, int], dict[str, Any]] | None = None,
) -> float:
    """Return the tasks/s of the real ``consume`` loop draining a backlog; self-contained.

    In a fresh run on ``mailbox`` (a WORK mailbox, ensured) of the server at ``base_url``,
    ``tasks`` no-op tasks are submitted with ``submit_many`` (1,000 a request) before the
    clock starts. Then one ``AsyncRunstate`` worker (``concurrency`` async handlers that
    return at once; completions buffered and renewals batched, as shipped) drains them: the
    time runs from the start of the loop until its summary has recorded every task as
    completed. Raises ``RuntimeError`` if a task failed or was lost, or the backlog did not
    drain within ``timeout_s``. ``verify`` (e.g. ``verify_run``) is called with the run id
    and ``tasks`` afterwards; a result without ``ok`` raises too.
    """
    import asyncio

    from runstate import AsyncRunstate

    async def drain() -> tuple[str, float]:
        async with AsyncRunstate(base_url=base_url, api_key=api_key, timeout=60) as rs:
            await rs.mailboxes.ensure(mailbox, mode="WORK")
            run = await rs.scopes.create(name=f"bench sdk consume c={concurrency}")
            await run.tasks.submit_many(mailbox, [{"input": {"i": i}} for i in range(tasks)])

            async def handler(ctx: Any) -> None:
                return None

            worker = run.worker(mailbox, handler, concurrency=concurrency, handle_signals=False)
            started = time.perf_counter()
            running = asyncio.create_task(worker.run())
            while worker.summary.completed < tasks:
                summary = worker.summary
                if running.done() or summary.failed or summary.lost or time.perf_counter() > started + timeout_s:
                    worker.stop()
                    await asyncio.gather(running, return_exceptions=True)
                    raise RuntimeError(f"consume did not drain {tasks} tasks: {summary}")
                await asyncio.sleep(0.005)
            elapsed = time.perf_counter() - started
            worker.stop()
            await running
            return run.id, elapsed

    run_id, elapsed = asyncio.run(drain())
    if verify is not None:
        verification = verify(uuid.UUID(run_id), tasks)
        if not verification.get("ok"):
            raise RuntimeError(f"consume drained, but the run does not verify: {verification}")
    return tasks / elapsed
