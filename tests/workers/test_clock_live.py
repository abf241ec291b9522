"""The clock with a real Celery worker and beat on a real broker (no eager mode).

Nothing here touches the objects through a request: timers fire, deadlines expire work and
leases are taken over by the worker and beat alone.
"""

import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pytest

from coordination.models import Event, Task, Timer
from coordination.services.claims import task_claim
from coordination.services.groups import group_create, group_submit
from coordination.services.keys import project_ensure
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.runs import run_create
from coordination.services.tasks import task_submit
from coordination.services.timers import timer_create
from tests.waiting import wait_until
from tests.workers.live import ROOT, beat_command, child_env, processes, purge_broker, worker_command

# Beat registers its periodic sweeps when it starts, so a flushed test database is fine.
pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def clock(tmp_path):
    """A worker and beat, as `scripts/start` runs them."""
    purge_broker()
    with processes(worker_command(), beat_command(tmp_path), log_dir=tmp_path) as children:
        yield children


@pytest.fixture
def project():
    return project_ensure(name="clock")


def test_a_timer_fires_with_no_waiter(clock, project):
    run = run_create(project_id=project.id)
    timer = timer_create(project_id=project.id, run_id=run.id, after_seconds=1)
    fired = wait_until(lambda: Timer.objects.filter(id=timer.id, state="FIRED").first(), what="the timer to fire")
    assert fired.fired_at >= fired.fire_at
    assert Event.objects.filter(type="timer.fired", subject_id=str(timer.id)).count() == 1


def test_a_run_deadline_expires_its_work_and_fails_its_group(clock, project):
    jobs, _ = mailbox_ensure(project_id=project.id, name="jobs", mode="WORK")
    run = run_create(project_id=project.id, deadline=datetime.now(UTC) + timedelta(seconds=2))
    tasks = [task_submit(project_id=project.id, mailbox=jobs, run_id=run.id, input={"i": i})[0] for i in range(3)]
    group = group_create(
        project_id=project.id, mailbox_name="jobs", condition="N_ACCEPTED", threshold=1, parent_scope_id=run.id
    )
    member, _, _ = group_submit(project_id=project.id, group_id=group.id, input={})
    wait_until(
        lambda: Task.objects.filter(id__in=[t.id for t in tasks], state="EXPIRED").count() == 3,
        what="the queued tasks to expire",
    )
    group.refresh_from_db()
    assert (group.state, group.outcome, group.outcome_reason) == ("FINALIZED", "FAILURE", "deadline")
    assert Task.objects.get(id=member.id).state == "CANCELLED"


def test_a_worker_that_stops_renewing_has_its_task_taken_over(clock, project):
    jobs, _ = mailbox_ensure(project_id=project.id, name="jobs", mode="WORK")
    run = run_create(project_id=project.id)
    task, _ = task_submit(project_id=project.id, mailbox=jobs, run_id=run.id, input={})
    (stale,) = task_claim(project_id=project.id, mailbox=jobs, run_id=run.id, worker_id="crashed", lease_ttl_ms=500)
    # The crashed worker never renews; the lease sweep puts the task back on its own.
    wait_until(lambda: Task.objects.filter(id=task.id, state="QUEUED").exists(), what="the lease sweep")
    assert Event.objects.filter(type="task.requeued", subject_id=str(task.id)).first().data["cause"] == "lease_expired"
    (fresh,) = task_claim(project_id=project.id, mailbox=jobs, run_id=run.id, worker_id="healthy")
    assert (fresh.task.id, fresh.attempt) == (task.id, stale.attempt + 1)


SWEEPER = """
import django
django.setup()
from coordination.services.timers import timers_fire_due
total = 0
while True:
    fired = timers_fire_due(batch_size=200)
    if not fired:
        break
    total += fired
print(total)
"""


def test_two_sweep_processes_over_5000_due_timers_fire_each_once(project):
    run = run_create(project_id=project.id)
    due = datetime.now(UTC) - timedelta(seconds=1)
    Timer.objects.bulk_create(
        Timer(project_id=project.id, run=run, run_path=run.path, fire_at=due) for _ in range(5000)
    )
    sweepers = [
        subprocess.Popen([sys.executable, "-c", SWEEPER], cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    counts = [int(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in sweepers]
    assert all(p.returncode == 0 for p in sweepers)
    assert sum(counts) == 5000, counts
    assert Timer.objects.filter(run=run, state="FIRED").count() == 5000
    fired_events = Event.objects.filter(type="timer.fired", run_id=run.id)
    assert fired_events.count() == 5000
    assert fired_events.values("subject_id").distinct().count() == 5000
