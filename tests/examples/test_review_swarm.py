"""``examples/review_swarm`` end to end, as the README runs it: Celery workers draft, the SDK reviewer judges.

``RUNSTATE_TASK_MODULES=examples.review_swarm.tasks scripts/start`` starts the API, a Celery
worker and beat on the suite's database; ``.venv/bin/python -m examples.review_swarm`` then
runs the reviewer over HTTP through the ``runstate`` SDK. The test checks what the example
claims: the fifth acceptance decides the group, the drafts were written by the Celery worker,
and nothing of the swarm is left queued or running.
"""

import re

import pytest

from coordination.models import Run, Task, TaskGroup
from tests.examples.live import finish, readme_commands, shell, started
from tests.operator.live import ROOT

START = "RUNSTATE_TASK_MODULES=examples.review_swarm.tasks scripts/start"
REVIEW = ".venv/bin/python -m examples.review_swarm"

# The service's processes use the test database through their own connections.
pytestmark = pytest.mark.django_db(transaction=True)


def test_readmes_run_these_commands():
    for readme in (readme_commands(), (ROOT / "examples" / "review_swarm" / "README.md").read_text()):
        assert START in readme
        assert REVIEW in readme


def test_review_swarm_celery_workers_draft_and_the_fifth_acceptance_decides(tmp_path):
    with started(START, tmp_path) as service:
        output = tmp_path / "review.out"
        reviewer = shell(REVIEW, service.env(), output)
        printed = finish(reviewer, output)
        assert reviewer.returncode == 0, printed + service.log()

        assert "a draft without an angle is refused: 400" in printed
        assert "group FINALIZED: SUCCESS (threshold_reached)" in printed
        assert re.search(r"^.*  5 accepted; cancelled in the deciding transaction", printed, re.M), printed
        assert len(re.findall(r"  accepted ", printed)) == 5, printed

        group = TaskGroup.objects.get()
        assert (group.state, group.outcome, group.outcome_reason) == ("FINALIZED", "SUCCESS", "threshold_reached")
        members = list(group.members.select_related("task"))
        assert len(members) == 12
        assert sum(1 for m in members if m.verdict == "ACCEPTED") == 5
        assert all(m.late is False for m in members if m.verdict)
        # Finalize cancelled the rest in the same transaction: nothing is left to pick up.
        assert {m.task.state for m in members} <= {"SUCCEEDED", "CANCELLED"}, [m.task.state for m in members]
        assert Run.objects.get(id=group.scope_id).stored_state == "CANCELLED"
        # The drafts were written by the service's Celery worker: its claims carry Celery's
        # hostname (a cancel clears the worker of a draft stopped mid-run, so look at the written ones).
        written = [m.task.worker_id for m in members if m.task.state == "SUCCEEDED"]
        assert len(written) >= 5
        assert all(worker.startswith("celery@") for worker in written), written
        # A handler that stopped early (tasks.py logs it at WARNING) was writing a draft the decision cancelled.
        mid_run = {str(m.task.id) for m in members if m.task.state == "CANCELLED" and m.task.started_at}
        worker_log = (service.var_dir / "log" / "worker.log").read_text(errors="replace")
        stopped = set(re.findall(r"draft (\S+) \(angle \d+\) stopped after", worker_log))
        assert stopped <= mid_run, (stopped, mid_run)
        assert f"{len(mid_run)} drafts mid-run" in printed, printed
        # The schema check's draft was refused: no task outside the group.
        assert Task.objects.count() == 12
