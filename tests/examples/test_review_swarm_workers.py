"""``examples/review_swarm_workers`` end to end, as its README runs it: ``runstate worker`` processes draft.

``scripts/start --no-worker`` starts the API alone on the suite's database (no Celery);
``.venv/bin/python -m examples.review_swarm_workers`` submits the swarm and prints the group's
run id; two ``runstate worker`` processes, started with that id as ``RUNSTATE_SCOPE_ID``,
write the drafts. The test checks what the example claims: the fifth acceptance decides the
group, the drafts were written by those workers, and the workers exit on their own once the
decision cancels the group's run.
"""

import re

import pytest

from coordination.models import Run, TaskGroup
from tests.examples.live import SWARM_WAITS, finish, readme_commands, shell, started
from tests.operator.live import ROOT
from tests.processes import stop_process_groups
from tests.waiting import wait_until

START = "scripts/start --no-worker"
REVIEW = ".venv/bin/python -m examples.review_swarm_workers"
WORKER = (
    ".venv/bin/runstate worker examples.review_swarm_workers.handlers:draft "
    "--mailbox worker-drafts --scope $RUNSTATE_SCOPE_ID --concurrency 4"
)
WORKERS = 2
EXAMPLE_README = ROOT / "examples" / "review_swarm_workers" / "README.md"

pytestmark = pytest.mark.django_db(transaction=True)


def test_readmes_run_these_commands():
    for readme in (readme_commands(), EXAMPLE_README.read_text()):
        for command in (START, REVIEW, WORKER):
            assert command in readme, command


def wait_for_run_id(output, reviewer) -> str:
    """Return the group's run id once the reviewer prints the line to export."""

    def run_id() -> str | None:
        found = re.search(r"export RUNSTATE_SCOPE_ID=(\S+)", output.read_text(errors="replace"))
        return found.group(1) if found else None

    wait_until(
        lambda: run_id() or reviewer.poll() is not None,
        what="the reviewer to print its run id",
        interval_s=0.1,
        waits=SWARM_WAITS,
        explain=lambda: output.read_text(errors="replace"),
    )
    found = run_id()
    assert found, output.read_text(errors="replace")  # the reviewer exited without one
    return found


def test_review_swarm_runstate_workers_draft_and_exit_once_the_group_decides(tmp_path):
    with started(START, tmp_path) as service:
        output = tmp_path / "review.out"
        reviewer = shell(REVIEW, service.env(), output)
        run_id = wait_for_run_id(output, reviewer)

        key = (service.var_dir / "dev-api-key").read_text().strip()
        env = service.env(RUNSTATE_API_KEY=key, RUNSTATE_SCOPE_ID=run_id)
        logs = [tmp_path / f"worker{n}.log" for n in range(WORKERS)]
        workers = [shell(WORKER, env, log) for log in logs]
        try:
            printed = finish(reviewer, output)
            assert reviewer.returncode == 0, printed + service.log()
            # The decision cancelled the group's run: each worker is refused and stops by itself.
            worker_logs = [finish(worker, log, waits=1) for worker, log in zip(workers, logs, strict=True)]
        finally:
            stop_process_groups(workers, grace_s=10)
        assert [worker.returncode for worker in workers] == [0] * WORKERS, worker_logs
        assert all("refuses work (SCOPE_CANCELLED)" in log for log in worker_logs), worker_logs

        assert "group FINALIZED: SUCCESS (threshold_reached)" in printed
        assert re.search(r"  5 accepted; cancelled in the deciding transaction", printed), printed
        assert len(re.findall(r"  accepted ", printed)) == 5, printed

        group = TaskGroup.objects.get()
        assert str(group.scope_id) == run_id
        assert (group.state, group.outcome, group.outcome_reason) == ("FINALIZED", "SUCCESS", "threshold_reached")
        members = list(group.members.select_related("task"))
        assert len(members) == 12
        assert sum(1 for m in members if m.verdict == "ACCEPTED") == 5
        assert {m.task.state for m in members} <= {"SUCCEEDED", "CANCELLED"}, [m.task.state for m in members]
        assert Run.objects.get(id=group.scope_id).stored_state == "CANCELLED"
        # Every written draft was recorded by one of the two workers (one log line per task).
        written = [str(m.task.id) for m in members if m.task.state == "SUCCEEDED"]
        assert len(written) >= 5
        everything = "\n".join(worker_logs)
        for task_id in written:
            assert re.search(rf"task {task_id} attempt \d+: returned -> SUCCEEDED", everything), (task_id, everything)
        # The drafts being written when the group decided: each worker noticed (the claim was lost,
        # or the result arrived too late), and a handler that stopped early was one of them.
        mid_run = {str(m.task.id) for m in members if m.task.state == "CANCELLED" and m.task.started_at}
        for task_id in mid_run:
            assert re.search(rf"task {task_id}(: claim lost| attempt \d+: (result not recorded|lost) )", everything), (
                everything
            )
        stopped = set(re.findall(r"draft (\S+) \(angle \d+\) stopped after", everything))
        assert stopped <= mid_run, (stopped, mid_run)
        assert f"{len(mid_run)} drafts mid-run" in printed, printed
