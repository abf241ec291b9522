"""``@runstate_task`` in real Celery worker processes on Redis against the test PostgreSQL.

No eager mode, nothing mocked: this process submits (services or HTTP), the message goes
through Redis after commit, a ``celery worker`` started with ``--include
tests.workers.celery_tasks`` claims by id and records, and beat runs the sweeps. Handlers
write their steps to a log file, so executions are counted apart from recorded completions.
"""

import os
import random
import signal
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime

import pytest
import redis
from django.conf import settings
from django.utils import timezone

from coordination.domain import exceptions
from coordination.domain.states import TASK_TERMINAL
from coordination.models import Event, Project, Task, TaskGroup
from coordination.services.claims import claim_complete, claim_id_for, claim_renew
from coordination.services.runs import run_cancel, run_create
from tests.conftest import make_client
from tests.processes import stop_process_groups
from tests.waiting import wait_until
from tests.workers import celery_tasks as ct
from tests.workers.celery_tasks import read_notes
from tests.workers.live import ROOT, beat_command, child_env
from workers.dispatch import send_work
from workers.registry import registry

BROKER_URL = settings.CELERY_BROKER_URL

# Beat registers the periodic sweeps when it starts, so a flushed test database is fine.
pytestmark = [
    pytest.mark.postgres_only,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        not BROKER_URL.startswith("redis://"),
        reason="needs CELERY_BROKER_URL on Redis: the worker must consume what this process dispatches",
    ),
]


def worker_command(concurrency: int, pool: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "runstate_project",
        "worker",
        f"--pool={pool}",
        f"--concurrency={concurrency}",
        "--include=tests.workers.celery_tasks",
        "--loglevel=INFO",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
    ]


class Cluster:
    """Worker and beat processes, each its own process group, on the broker this process dispatches to."""

    def __init__(self, log_dir):
        self.log_dir = log_dir
        self.children: list[tuple[subprocess.Popen, object]] = []

    def start(self, command: list[str], **env) -> subprocess.Popen:
        log = open(self.log_dir / f"proc{len(self.children)}.log", "wb")  # noqa: SIM115 - closed in stop()
        child = subprocess.Popen(
            command,
            cwd=ROOT,
            env=child_env(CELERY_BROKER_URL=BROKER_URL, **env),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.children.append((child, log))
        return child

    def worker(self, *, concurrency: int = 4, pool: str = "prefork", **env) -> subprocess.Popen:
        return self.start(worker_command(concurrency, pool), **env)

    def beat(self) -> subprocess.Popen:
        return self.start(beat_command(self.log_dir))

    def kill(self, child: subprocess.Popen) -> None:
        """SIGKILL the child's whole process group (main process and pool processes alike)."""
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(10)

    def stop(self) -> None:
        stop_process_groups(child for child, _ in self.children)
        for _, log in self.children:
            log.close()


@pytest.fixture
def cluster(tmp_path):
    redis.Redis.from_url(BROKER_URL).flushdb()
    started = Cluster(tmp_path)
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(autouse=True)
def _fresh_ids():
    """Each test starts on a flushed database: forget the project and mailbox ids cached in this process."""
    for task in registry:
        task.forget_ids()


@pytest.fixture
def log(tmp_path) -> str:
    return str(tmp_path / "effects.log")


@pytest.fixture
def run():
    return run_create(project_id=ct.bulk.project_id, name="live")


def states(run) -> dict:
    return dict(Task.objects.filter(run=run).values_list("id", "state"))


def count(run, state: str) -> int:
    return Task.objects.filter(run=run, state=state).count()


def started(log: str, word: str = "start") -> dict[str, list[str]]:
    """Return the log lines with ``word`` by task id."""
    return {parts[1]: parts for parts in read_notes(log) if parts[0] == word}


def test_200_decorated_tasks_are_completed_exactly_once_by_a_4_process_worker(cluster, run, log):
    cluster.worker(concurrency=4, pool="prefork")
    # Half one by one, half as one batch (its 100 messages published in one go after commit).
    tasks = [ct.bulk.submit(run.id, {"i": i, "log": log}) for i in range(100)]
    tasks += ct.bulk.submit_many(run.id, [{"i": i, "log": log} for i in range(100, 200)])
    # Duplicate deliveries are harmless: the claim decides. Send 40 messages a second time.
    for task in tasks[:40]:
        send_work(ct.bulk, task.id)

    wait_until(lambda: count(run, "SUCCEEDED") == 200, waits=2, what="200 tasks to succeed")
    broker = redis.Redis.from_url(BROKER_URL)
    wait_until(lambda: broker.llen("celery") == 0, what="the duplicates to be consumed")
    time.sleep(1)

    rows = Task.objects.filter(run=run)
    assert set(rows.values_list("state", "attempts")) == {("SUCCEEDED", 1)}
    assert sorted(outcome["i"] for outcome in rows.values_list("outcome", flat=True)) == list(range(200))
    for type in ("task.claimed", "task.succeeded"):
        events = Event.objects.filter(run_id=run.id, type=type)
        assert events.count() == 200, type
        assert events.values("subject_id").distinct().count() == 200, type
    executions = [parts for parts in read_notes(log) if parts[0] == "done"]
    assert len(executions) == 200
    assert {parts[1] for parts in executions} == {str(task.id) for task in tasks}


def test_cooperative_cancel_of_running_decorated_tasks(cluster, run, log, tmp_path):
    """Each handler hears the request within one heartbeat (0.5 s here) and ends as the rules say."""
    cluster.worker(concurrency=6, pool="prefork")
    cluster.beat()
    api = make_client(Project.objects.get(id=ct.cooperative.project_id))
    release = tmp_path / "release"
    ignoring = {"mode": "ignores", "log": log, "release": str(release)}
    cases = {
        "returns": ct.cooperative.submit(run.id, {"mode": "returns", "log": log}),
        "checks": ct.cooperative.submit(run.id, {"mode": "checks", "log": log}),
        # Attempts left, yet a failure after the request is final: FAILED, never retried.
        "raises": ct.cooperative.submit(run.id, {"mode": "raises", "log": log}, max_attempts=3),
        "ignores_grace": ct.cooperative.submit(run.id, ignoring, key="grace"),
        "ignores_lease": ct.cooperative.submit(run.id, ignoring, key="lease"),
        "async": ct.cooperative_async.submit(run.id, {"log": log}),
    }
    ids = {name: str(task.id) for name, task in cases.items()}
    wait_until(
        lambda: set(ids.values()) <= set(started(log)) and count(run, "RUNNING") == len(cases),
        what="every handler to run",
    )

    for name, task_id in ids.items():
        body = {"reason": "no longer wanted"} | ({"graceMs": 500} if name == "ignores_grace" else {})
        response = api.post(f"/v1/tasks/{task_id}/cancel", body, format="json")
        assert response.status_code == 200, response.content
        assert response.json()["state"] == "CANCELLATION_REQUESTED"

    wait_until(lambda: all(state in TASK_TERMINAL for state in states(run).values()), what="every task to end")
    tasks = {name: Task.objects.get(id=task_id) for name, task_id in ids.items()}
    assert {name: task.state for name, task in tasks.items()} == {
        "returns": "CANCELLED",
        "checks": "CANCELLED",
        "raises": "FAILED",
        "ignores_grace": "CANCELLED",
        "ignores_lease": "CANCELLED",
        "async": "CANCELLED",
    }
    assert tasks["returns"].outcome == "stopped"
    assert tasks["raises"].error["message"] == "gave up after the cancel request"
    assert tasks["raises"].attempts == 1
    # The signal came within one heartbeat (a third of the 1.5 s lease) of the request.
    signals = started(log, "signal")
    for name in ("returns", "raises", "async"):
        heard = datetime.fromtimestamp(float(signals[ids[name]][2]), UTC)
        assert (heard - tasks[name].cancel_requested_at).total_seconds() < 0.5 + 0.7, name
    # Handlers that ignore the request: the server records CANCELLED once the grace (0.5 s)
    # or the lease (1.5 s after the last renewal; the heartbeat stops renewing) is over,
    # while the handlers carry on.
    assert not started(log, "returned")
    for name in ("ignores_grace", "ignores_lease"):
        task = tasks[name]
        assert (task.finished_at - task.cancel_requested_at).total_seconds() < 5, name
        cancelled = Event.objects.get(type="task.cancelled", subject_id=ids[name])
        assert cancelled.data["cause"] == "cancellation_finalized"
    # When they finally return, nothing more is recorded.
    release.touch()
    wait_until(
        lambda: {ids["ignores_grace"], ids["ignores_lease"]} <= set(started(log, "returned")),
        what="the ignoring handlers to return",
    )
    time.sleep(0.5)
    for name in ("ignores_grace", "ignores_lease"):
        task = Task.objects.get(id=ids[name])
        assert (task.state, task.outcome) == ("CANCELLED", None)
    for task_id in ids.values():
        ends = Event.objects.filter(
            subject_id=task_id, type__in=["task.succeeded", "task.failed", "task.cancelled", "task.requeued"]
        )
        assert ends.count() == 1, task_id


def test_a_cancel_reaches_handlers_in_forked_pool_processes_long_before_their_renewal(cluster, run, log):
    """A ten-minute lease (renewed every 200 s): each prefork child's claim watch tells its handler."""
    cluster.worker(concurrency=3, pool="prefork")
    tasks = [ct.long_lease.submit(run.id, {"log": log, "seconds": 600}) for _ in range(3)]
    ids = {str(task.id) for task in tasks}
    wait_until(lambda: ids <= set(started(log)) and count(run, "RUNNING") == 3, what="three handlers to run")

    api = make_client(Project.objects.get(id=ct.long_lease.project_id))
    response = api.post(f"/v1/tasks/{tasks[0].id}/cancel", {"reason": "one"}, format="json")
    assert response.status_code == 200, response.content
    wait_until(lambda: Task.objects.get(id=tasks[0].id).state == "CANCELLED", what="the cancelled handler's record")
    run_cancel(project_id=run.project_id, run_id=run.id, reason="the rest")
    wait_until(lambda: len(started(log, "stopped")) == 3, what="every handler to hear its cancel")

    assert started(log, "stopped")[str(tasks[0].id)][3] == "None"  # asked to stop: it returned, CANCELLED
    assert {started(log, "stopped")[str(task.id)][3] for task in tasks[1:]} == {"SCOPE_CANCELLED"}
    assert not started(log, "finished")
    assert set(states(run).values()) == {"CANCELLED"}


def test_a_soft_time_limit_is_a_failure_and_an_exception_retries_after_a_delay(cluster, run, log):
    cluster.worker(concurrency=2, pool="prefork")
    overrun = ct.overrun.submit(run.id, {"log": log})
    flaky = ct.flaky.submit(run.id, {"log": log})
    wait_until(lambda: all(state in TASK_TERMINAL for state in states(run).values()), what="both tasks to end")

    overrun.refresh_from_db()
    assert overrun.state == "FAILED"
    assert overrun.error["code"] == "soft_time_limit_exceeded"
    assert "soft time limit (1 s)" in overrun.error["message"]
    assert overrun.lease_expires_at is None
    assert (overrun.finished_at - overrun.started_at).total_seconds() < 5

    flaky.refresh_from_db()
    assert (flaky.state, flaky.attempts, flaky.outcome) == ("SUCCEEDED", 2, {"attempt": 2})
    requeued = Event.objects.get(type="task.requeued", subject_id=str(flaky.id))
    assert requeued.data["cause"] == "retry"
    assert requeued.data["error"]["type"] == "ValueError"
    attempts = [float(parts[3]) for parts in read_notes(log) if parts[0] == "attempt"]
    assert len(attempts) == 2
    assert attempts[1] - attempts[0] >= 0.5  # retry_delay


def test_run_cancel_while_50_decorated_tasks_run_records_no_success_after_the_cancel(cluster, run, log):
    cluster.worker(concurrency=16, pool="threads")
    rng = random.Random()
    tasks = [ct.step.submit(run.id, {"log": log, "seconds": rng.uniform(0.3, 4.0)}) for _ in range(50)]
    wait_until(
        lambda: count(run, "SUCCEEDED") >= 5 and count(run, "RUNNING") >= 8,
        what="tasks both finished and running",
    )

    run_cancel(run_id=run.id, project_id=run.project_id, reason="stop")
    committed_at = timezone.now()
    snapshot = dict(Task.objects.filter(run=run).values_list("id", "state"))
    running_at_cancel = set(started(log)) - set(started(log, "finished"))

    # The cancel ended every unfinished task in its own transaction.
    assert set(snapshot.values()) <= {"SUCCEEDED", "CANCELLED"}
    assert "CANCELLED" in snapshot.values()
    # Running handlers hear it at their next heartbeat (the renewal is refused) and stop.
    wait_until(
        lambda: running_at_cancel <= set(started(log, "stopped")) | set(started(log, "finished")),
        what="running handlers to stop",
    )
    stopped = started(log, "stopped")
    assert stopped, "no handler observed the cancel"
    assert {parts[3] for parts in stopped.values()} == {"SCOPE_CANCELLED"}
    time.sleep(2)  # messages still queued are delivered and refused meanwhile

    run.refresh_from_db()
    rows = Task.objects.filter(run=run)
    assert dict(rows.values_list("id", "state")) == snapshot
    succeeded = rows.filter(state="SUCCEEDED")
    assert succeeded.count() + rows.filter(state="CANCELLED").count() == len(tasks)
    for task in succeeded:
        assert task.finished_at < committed_at
    # The cancel's cascade waited for each in-flight completion, so every success it let
    # stand was written before the run.cancelled event.
    cancelled_event = Event.objects.get(type="run.cancelled", subject_id=str(run.id))
    success_events = Event.objects.filter(run_id=run.id, type="task.succeeded")
    assert success_events.count() == succeeded.count()
    assert all(event.id < cancelled_event.id for event in success_events)
    assert all(task.finished_at <= run.ended_at for task in rows.filter(state="CANCELLED"))


def test_sigkill_of_the_worker_mid_run_then_a_restart_completes_every_task_exactly_once(cluster, run, log):
    """Interrupted tasks come back through the lease sweep (3 s lease); lost messages through the re-wake sweep."""
    worker_env = {"RUNSTATE_REWAKE_AFTER_S": "3"}
    cluster.beat()
    first = cluster.worker(concurrency=4, pool="prefork", **worker_env)
    rng = random.Random()
    tasks = [ct.crashy.submit(run.id, {"i": i, "log": log, "seconds": rng.uniform(0.2, 0.6)}) for i in range(100)]
    kill_after = rng.randint(5, 60)
    wait_until(
        lambda: count(run, "SUCCEEDED") >= kill_after and count(run, "RUNNING") >= 1,
        waits=2,
        what=f"{kill_after} successes with work in flight",
    )

    cluster.kill(first)
    interrupted = dict(Task.objects.filter(run=run, state="RUNNING").values_list("id", "attempts"))
    assert interrupted
    time.sleep(rng.uniform(0, 1.5))
    cluster.worker(concurrency=4, pool="prefork", **worker_env)
    wait_until(lambda: count(run, "SUCCEEDED") == 100, waits=2, what="every task to succeed")

    rows = {task.id: task for task in Task.objects.filter(run=run)}
    succeeded = Event.objects.filter(run_id=run.id, type="task.succeeded")
    assert succeeded.count() == 100
    assert succeeded.values("subject_id").distinct().count() == 100
    for task_id, stale_attempt in interrupted.items():
        task = rows[task_id]
        assert task.attempts > stale_attempt
        requeue = Event.objects.filter(type="task.requeued", subject_id=str(task_id)).first()
        assert requeue.data["cause"] == "lease_expired"
        # The stale attempt coming back late is fenced off.
        stale = claim_id_for(task_id, stale_attempt)
        with pytest.raises(exceptions.LeaseLost):
            claim_complete(project_id=run.project_id, claim_id=stale, outcome={"late": True})
        with pytest.raises(exceptions.LeaseLost):
            claim_renew(project_id=run.project_id, claim_id=stale)
        task.refresh_from_db()
        assert (task.state, task.outcome["i"]) == ("SUCCEEDED", rows[task_id].outcome["i"])
    # Executions (the handler's side effects) vs recorded completions: at least one
    # execution per task, a second one only where a kill interrupted the first attempt.
    done = {}
    for parts in read_notes(log):
        if parts[0] == "done":
            done.setdefault(parts[1], []).append(int(parts[2]))
    assert set(done) == {str(task.id) for task in tasks}
    for task_id, attempts in done.items():
        task = rows[uuid.UUID(task_id)]
        assert max(attempts) <= task.attempts
        if len(attempts) > 1:
            assert task.id in interrupted
    assert {task.attempts for task_id, task in rows.items() if task_id not in interrupted} <= {1, 2}


def test_a_group_executed_by_decorated_tasks_finalizes_and_cancels_its_losers_mid_run(cluster, log):
    cluster.worker(concurrency=4, pool="prefork")
    project = Project.objects.get(id=ct.draft.project_id)
    ct.draft.ids()  # the decorated task ensures its mailbox
    api = make_client(project)
    response = api.post(
        "/v1/groups",
        {"mailbox": "celery-live-drafts", "condition": "N_ACCEPTED", "threshold": 2, "expectedMembers": 6},
        format="json",
    )
    assert response.status_code == 201, response.content
    group_id = response.json()["id"]
    # Members submitted over HTTP are dispatched to Celery like any other bound submit.
    members = []
    for i, seconds in enumerate([0.2, 0.2, 60, 60, 60, 60]):
        response = api.post(
            f"/v1/groups/{group_id}/members", {"input": {"log": log, "seconds": seconds}, "key": f"d{i}"}, format="json"
        )
        assert response.status_code == 201, response.content
        members.append(response.json()["id"])
    fast, slow = members[:2], members[2:]
    gate = TaskGroup.objects.get(id=group_id).scope_id
    assert set(Task.objects.filter(id__in=members).values_list("run_id", flat=True)) == {gate}
    wait_until(
        lambda: (
            Task.objects.filter(id__in=fast, state="SUCCEEDED").count() == 2
            and Task.objects.filter(id__in=slow, state="RUNNING").count() >= 2
        ),
        what="the fast drafts to succeed while slow ones run",
    )

    # The sixth member closed the group (expectedMembers); one accepted member is not enough yet.
    assert api.post(f"/v1/groups/{group_id}/members/{fast[0]}/accept").json()["groupState"] == "SEALED"
    decided = api.post(f"/v1/groups/{group_id}/members/{fast[1]}/accept").json()
    assert (decided["groupState"], decided["outcome"], decided["outcomeReason"]) == (
        "FINALIZED",
        "SUCCESS",
        "threshold_reached",
    )
    running = set(started(log)) & set(slow)
    assert running
    losers = Task.objects.filter(id__in=slow)
    assert set(losers.values_list("state", "cancel_reason")) == {("CANCELLED", "group_threshold_reached")}

    # The running losers' handlers hear it at their next heartbeat and stop; queued ones never start.
    wait_until(lambda: running <= set(started(log, "stopped")), what="running losers to stop")
    time.sleep(1.5)
    assert set(started(log)) & set(slow) == running
    assert {parts[3] for parts in started(log, "stopped").values()} == {"SCOPE_CANCELLED"}
    assert set(losers.values_list("state", flat=True)) == {"CANCELLED"}
    assert not Event.objects.filter(type="task.succeeded", subject_id__in=slow).exists()
    assert Event.objects.filter(type="group.finalized", subject_id=group_id).count() == 1
