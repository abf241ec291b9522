"""The service-layer measure: submit, claim and complete through ``coordination.services``.

*unbatched* calls one function per task (``task_submit``, ``claim_complete``); *batched* the
``*_many`` ones. ``run_service_scenario`` submits with W threads, then drains with W.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from bench.harness.env import truncate_coordination_tables
from bench.harness.fixtures import service_fixture, verify_run
from bench.harness.meters import DatabaseMeter
from bench.harness.threads import run_threads
from bench.throughput.scenario import ScenarioResult

SERVICE_API = (
    "coordination.services.tasks: task_submit, tasks_submit_many, TaskSpec; "
    "coordination.services.claims: task_claim, claim_complete, claims_complete_many"
)


def service_api() -> SimpleNamespace:
    """Import the service functions the benchmark drives; stop with a clear message when they are missing."""
    try:
        from coordination.services.claims import claim_complete, claims_complete_many, task_claim
        from coordination.services.tasks import TaskSpec, task_submit, tasks_submit_many
    except ImportError as exc:
        raise SystemExit(
            f"error: bench.throughput drives the service layer through {SERVICE_API}, "
            f"and this checkout lacks part of it ({exc}).\n"
            "       Run it on a revision that has the batched services (issue 14)."
        ) from exc
    return SimpleNamespace(
        task_submit=task_submit,
        tasks_submit_many=tasks_submit_many,
        TaskSpec=TaskSpec,
        task_claim=task_claim,
        claim_complete=claim_complete,
        claims_complete_many=claims_complete_many,
    )


@dataclass(frozen=True)
class ServiceMode:
    """How the service layer is driven: tasks per submit call, claims per claim call, per complete call.

    A size of 1 uses the one-at-a-time function (``task_submit``, ``claim_complete``); more
    uses the batched one (``tasks_submit_many``, ``claims_complete_many``).
    """

    name: str
    submit_batch: int
    claim_max: int
    complete_batch: int

    @property
    def calls(self) -> list[tuple[str, int]]:
        """The submit, claim and complete call as named in the statements table, with the tasks per call."""
        many = lambda name, size: name if size == 1 else f"{name} many ({size})"  # noqa: E731
        return [
            (many("submit", self.submit_batch), self.submit_batch),
            (f"claim (max {self.claim_max})", self.claim_max),
            (many("complete", self.complete_batch), self.complete_batch),
        ]

    @property
    def sizes(self) -> str:
        return f"submit {self.submit_batch}, claim max {self.claim_max}, complete {self.complete_batch} per call"


class ServiceCalls:
    """One project, WORK mailbox and run, driven through the service layer the way ``mode`` says."""

    def __init__(self, label: str, mode: ServiceMode) -> None:
        self.api = service_api()
        self.mode = mode
        self.project, self.mailbox, self.run = service_fixture(label)

    def submit(self, numbers: list[int]) -> None:
        """Submit one task per number (input ``{"i": n}``), in calls of ``mode.submit_batch``."""
        where = {"project_id": self.project.id, "mailbox": self.mailbox, "run_id": self.run.id}
        size = self.mode.submit_batch
        for start in range(0, len(numbers), size):
            chunk = numbers[start : start + size]
            if size == 1:
                self.api.task_submit(**where, input={"i": chunk[0]})
            else:
                self.api.tasks_submit_many(**where, items=[self.api.TaskSpec(input={"i": i}) for i in chunk])

    def claim(self, worker_id: str = "w", max_claims: int | None = None) -> list[Any]:
        """One claim call of up to ``mode.claim_max`` tasks (or ``max_claims``)."""
        return self.api.task_claim(
            project_id=self.project.id,
            mailbox=self.mailbox,
            run_id=self.run.id,
            worker_id=worker_id,
            max_claims=max_claims or self.mode.claim_max,
        )

    def complete(self, claims: list[Any], latencies: list[float] | None = None) -> None:
        """Complete ``claims`` in calls of ``mode.complete_batch``; append each call's seconds to ``latencies``."""
        size = self.mode.complete_batch
        for start in range(0, len(claims), size):
            chunk = claims[start : start + size]
            started = time.perf_counter()
            if size == 1:
                self.api.claim_complete(
                    project_id=self.project.id, claim_id=chunk[0].claim_id, outcome={"i": chunk[0].task.input["i"]}
                )
            else:
                answers = self.api.claims_complete_many(
                    project_id=self.project.id, items=[(c.claim_id, {"i": c.task.input["i"]}) for c in chunk]
                )
                refused = [a for a in answers if isinstance(a, Exception)]
                if refused:
                    raise RuntimeError(f"claims_complete_many refused {len(refused)} of {len(chunk)}: {refused[0]!r}")
            if latencies is not None:
                latencies.append(time.perf_counter() - started)


ALL_MODES = ("unbatched", "batched")


def service_modes(args: argparse.Namespace, names: tuple[str, ...] | list[str] | None = None) -> list[ServiceMode]:
    """Return the modes ``--modes`` (or ``names``) asks for: unbatched (one call per task) and batched."""
    submit, claim, complete = args.batched_sizes
    known = {
        "unbatched": ServiceMode("unbatched", 1, args.batch, 1),
        "batched": ServiceMode("batched", submit, claim, complete),
    }
    return [known[name] for name in (names or args.mode_names)]


def run_service_scenario(tasks: int, workers: int, mode: ServiceMode) -> ScenarioResult:
    """Submit ``tasks`` with ``workers`` threads, then claim and complete them all with ``workers`` threads."""
    from django.db import connection

    truncate_coordination_tables()
    service = ServiceCalls(f"svc-{mode.name}-w{workers}", mode)
    connection.close()

    def submitter(index: int, _context) -> int:
        service.submit(list(range(index, tasks, workers)))
        return 0

    def claimer(index: int, _context) -> tuple[list[float], list[float], int, int]:
        claim_lat, complete_lat, done, empty = [], [], 0, 0
        worker_id = f"bench-{index}"
        while True:
            started = time.perf_counter()
            claims = service.claim(worker_id)
            claim_lat.append(time.perf_counter() - started)
            if not claims:
                empty += 1
                break
            service.complete(claims, complete_lat)
            done += len(claims)
        return claim_lat[:-1], complete_lat, done, empty

    def connect(_index: int) -> bool:
        connection.ensure_connection()
        return True

    connection.close()
    with DatabaseMeter(backends=False) as database:
        submitted = run_threads(workers, submitter, setup=connect)
        drained = run_threads(workers, claimer, setup=connect)
    verification = verify_run(service.run.id, tasks)
    connection.close()
    return ScenarioResult.from_phases(
        f"service {mode.name}", workers, tasks, mode.claim_max, submitted, drained, verification, database.figures
    )
