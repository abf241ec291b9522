"""Cancel fan-out: a run with 1,000 children x 100 queued tasks, cancelled in one call.

Prints the cancel's wall time and rows per second, and checks that zero tasks are claimable
once the cancel has committed. Run: ``.venv/bin/python -m bench.cancel [--children N] [--tasks N]``.
"""

import argparse
import statistics
import time
import uuid

from bench.harness.env import setup_django


def build(children: int, tasks_per_child: int):
    """Create the run tree and its queued tasks (bulk inserts: this is set-up, not measured)."""
    from django.db import transaction
    from django.utils import timezone

    from coordination.models import Run, Task
    from coordination.services.keys import project_ensure
    from coordination.services.mailboxes import mailbox_ensure
    from coordination.services.runs import run_create

    project = project_ensure(name=f"bench-cancel-{uuid.uuid4().hex[:8]}")
    mailbox, _ = mailbox_ensure(project_id=project.id, name="fanout", mode="WORK")
    root = run_create(project_id=project.id, child_limit=children)
    now = timezone.now()
    with transaction.atomic():
        kids = [
            Run(project_id=project.id, parent_id=root.id, depth=1, created_at=now, child_limit=1000)
            for _ in range(children)
        ]
        for kid in kids:
            kid.path = Run.path_for(kid.id, root.path)
        Run.objects.bulk_create(kids, batch_size=1000)
        Run.objects.filter(id=root.id).update(child_count=children)
        rows = [
            Task(
                project_id=project.id,
                mailbox=mailbox,
                run_id=kid.id,
                run_path=kid.path,
                input={"i": i},
                max_attempts=3,
                created_at=now,
                available_at=now,
            )
            for kid in kids
            for i in range(tasks_per_child)
        ]
        Task.objects.bulk_create(rows, batch_size=5000)
    return project, mailbox, root, kids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--children", type=int, default=1000)
    parser.add_argument("--tasks", type=int, default=100, help="queued tasks per child")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    setup_django()

    from coordination.domain import exceptions
    from coordination.models import Event, Task
    from coordination.services.claims import task_claim
    from coordination.services.runs import run_cancel

    seconds = []
    for round_no in range(1, args.rounds + 1):
        project, mailbox, root, kids = build(args.children, args.tasks)
        total = args.children * args.tasks
        started = time.perf_counter()
        run_cancel(run_id=root.id, project_id=project.id, reason="bench")
        elapsed = time.perf_counter() - started
        seconds.append(elapsed)
        claimable = Task.objects.filter(run_path__startswith=root.path, state="QUEUED").count()
        refused = 0
        for kid in kids[:20]:
            try:
                task_claim(project_id=project.id, mailbox=mailbox, run_id=kid.id)
            except exceptions.ScopeCancelled:
                refused += 1
        events = Event.objects.filter(project_id=project.id, type="task.cancelled").count()
        print(
            f"round {round_no}: cancelled {total} tasks under {args.children} runs in {elapsed:.2f} s "
            f"({total / elapsed:,.0f} tasks/s); queued afterwards: {claimable}; "
            f"claims refused: {refused}/20; task.cancelled events: {events}"
        )
        assert claimable == 0 and refused == 20 and events == total
    print(f"cancel time: median {statistics.median(seconds):.2f} s over {len(seconds)} round(s)")


if __name__ == "__main__":
    main()
