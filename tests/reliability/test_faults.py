"""Crash and pause faults in real worker processes: SIGKILL mid-run, SIGSTOP past the lease.

Real Celery workers (``@runstate_task``, Redis, beat for the sweeps) and real SDK consumer
processes (``consume`` against uvicorn) process 200-task runs while the test SIGKILLs a
worker that holds work three times at random points, restarting one after each kill. Every
task must end ``SUCCEEDED`` exactly once, and the ledger (every claim, renew, complete,
fail and side effect the workers made, recorded in their own processes) must be clean
against the database. A worker paused with SIGSTOP past its lease must, once resumed, be
answered ``LEASE_LOST`` while the database keeps the worker that took over. Two races in one
process complete the picture: a run cancelled while four threads claim and complete its
tasks accepts nothing after the cancel, and a group judged by four threads at once is
decided once.

The random points come from a seed printed at the start of each test (set
``RUNSTATE_FAULT_SEED`` to replay one). Nothing waits on a duration: every wait is a
condition with a timeout.
"""

import os
import random
import signal
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest
from django.utils import timezone

from coordination.domain import exceptions
from coordination.models import Event, Task, TaskGroup
from coordination.services.claims import claim_id_for
from coordination.services.groups import group_create
from coordination.services.keys import ALL_PERMISSIONS, api_key_create, project_ensure
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.runs import run_create
from tests.concurrency.util import run_in_threads
from tests.processes import answers_health, free_port
from tests.reliability import fault_tasks
from tests.reliability.ledger import Ledger, Services
from tests.sdk.conftest import server_env, wait_for_quiet_server
from tests.waiting import wait_until
from tests.workers.live import ROOT, TEST_BROKER_URL, beat_command, child_env, purge_broker
from workers.registry import registry

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]

TASKS = 200
KILLS = 3
LEASE_MS = 2000


# Processes -------------------------------------------------------------------------------


class Children:
    """Child processes, each in its own process group, logging to ``log_dir``."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.children: list[tuple[subprocess.Popen, object]] = []

    def start(self, name: str, command: list[str], env: dict) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}-{len(self.children)}.log", "wb")  # noqa: SIM115 - closed in stop()
        child = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.children.append((child, log))
        return child

    def kill(self, child: subprocess.Popen) -> None:
        """SIGKILL the child's process group and reap it."""
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(10)

    def terminate(self, child: subprocess.Popen, timeout_s: float = 15) -> None:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGCONT)
            os.killpg(child.pid, signal.SIGTERM)
        try:
            child.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()

    def stop(self) -> None:
        for child, _ in self.children:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGCONT)
                os.killpg(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for child, log in self.children:
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
            log.close()

    def logs(self) -> str:
        return "\n".join(
            f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}"
            for path in sorted(self.log_dir.glob("*.log"))
        )


@pytest.fixture
def children(tmp_path):
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    started = Children(log_dir)
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def ledger_dir(tmp_path) -> Path:
    path = tmp_path / "ledgers"
    path.mkdir()
    return path


def merged(ledger: Ledger, ledger_dir: Path) -> Ledger:
    """Return the test's own entries plus every child process's."""
    return Ledger().merge(ledger, Ledger.load(*sorted(ledger_dir.glob("*.jsonl"))))


@pytest.fixture
def rng(request):
    seed = int(os.environ.get("RUNSTATE_FAULT_SEED") or random.SystemRandom().randrange(2**32))
    print(f"{request.node.name}: RUNSTATE_FAULT_SEED={seed}")
    request.node.user_properties.append(("seed", seed))
    generator = random.Random(seed)
    generator.seed_value = seed
    return generator


def holder_pids(run, pids: list[int]) -> set[int]:
    """Return which of ``pids`` hold a running task of ``run`` (worker ids name the process id)."""
    held = set()
    for worker_id in Task.objects.filter(run=run, state="RUNNING").values_list("worker_id", flat=True):
        parts = set(worker_id.replace(":", "/").split("/"))
        held |= {pid for pid in pids if str(pid) in parts}
    return held


def handler_seconds(rng) -> float:
    """Mostly short handlers; one in ten outlives a few lease renewals."""
    return rng.uniform(0.8, 1.5) if rng.random() < 0.1 else rng.uniform(0.02, 0.25)


def count(run, state: str) -> int:
    return Task.objects.filter(run=run, state=state).count()


def inject_kills(rng, run, children: Children, alive: list[subprocess.Popen], restart, *, what: str) -> dict:
    """SIGKILL a worker that holds work at ``KILLS`` random points of the run, restarting one after each.

    Return the tasks each kill left running, by task id, with the attempt the dead worker held.
    """
    points = sorted(rng.sample(range(10, TASKS - 30), KILLS))
    interrupted: dict[uuid.UUID, int] = {}
    for point in points:

        def holding_worker(point=point):
            if count(run, "SUCCEEDED") < point:
                return None
            held = holder_pids(run, [child.pid for child in alive])
            return sorted(held) or None

        pids = wait_until(holding_worker, waits=2, interval_s=0.02, what=f"{what}: {point} successes, work held")
        chosen = rng.choice(pids)
        victim = next(child for child in alive if child.pid == chosen)
        children.kill(victim)
        alive.remove(victim)
        for task_id, attempts, worker_id in Task.objects.filter(run=run, state="RUNNING").values_list(
            "id", "attempts", "worker_id"
        ):
            if str(victim.pid) in set(worker_id.replace(":", "/").split("/")):
                interrupted[task_id] = attempts
        print(f"{what}: killed {victim.pid} after {point} successes; {len(interrupted)} interrupted so far")
        # Restart at once or a little later: the survivors and sweeps carry on meanwhile.
        if rng.random() < 0.5:
            time.sleep(rng.uniform(0.1, 1.0))
        alive.append(restart())
    return interrupted


def task_history(task_id) -> list[tuple]:
    """Return ``task_id``'s events, oldest first, for a failure's message."""
    return list(Event.objects.filter(subject_id=str(task_id)).order_by("id").values_list("type", "data", "created_at"))


def assert_exactly_once(run, ledger: Ledger, report, interrupted: dict, seed: int) -> int:
    """Every task of ``run`` succeeded once, by its last attempt, with the outcome that attempt returned.

    Each task a kill left running either finished by the dead worker's completion (on the wire
    when it died) or went back to the queue under the dead attempt: taken over once its lease
    expired or, when the claim's answer never reached the worker, handed back by the server
    (a claim request whose client went away hands back what it claimed: ``api/hot``'s
    ``abandon``). Return how many were taken over after their lease expired.
    """
    rows = list(Task.objects.filter(run=run).values("id", "state", "attempts", "outcome"))
    assert len(rows) == TASKS
    assert {row["state"] for row in rows} == {"SUCCEEDED"}, f"seed {seed}"
    assert sorted(row["outcome"]["i"] for row in rows) == list(range(TASKS))
    assert all(row["outcome"]["attempt"] == row["attempts"] for row in rows)
    succeeded = Event.objects.filter(run_id=run.id, type="task.succeeded")
    assert succeeded.count() == TASKS
    assert succeeded.values("subject_id").distinct().count() == TASKS
    # Each task's side effect was done under its succeeding claim (effects_once, in the report).
    assert report.counts["effects"] >= TASKS
    by_id = {row["id"]: row for row in rows}
    # The claims some worker was answered with (each worker records its claims' answers).
    delivered = {
        claim_id for entry in ledger.entries if entry.op == "claim" and entry.ok for claim_id in entry.claim_ids
    }
    taken_over = 0
    for task_id, dead_attempt in interrupted.items():
        if by_id[task_id]["attempts"] == dead_attempt:
            # Its completion was on the wire when the worker died, and the server committed it.
            assert by_id[task_id]["outcome"]["attempt"] == dead_attempt, f"seed {seed}: {task_id}"
            continue
        requeue = Event.objects.filter(
            subject_id=str(task_id), type="task.requeued", data__attempt=dead_attempt
        ).values_list("data", flat=True)
        cause = requeue[0]["cause"] if requeue else None
        handed_back = cause == "released" and claim_id_for(task_id, dead_attempt) not in delivered
        assert cause == "lease_expired" or handed_back, (
            f"seed {seed}: {task_id}, held at attempt {dead_attempt} by a killed worker, went back to the queue "
            f"neither by its lease expiring nor as a claim never delivered; its events: {task_history(task_id)}"
        )
        taken_over += cause == "lease_expired"
    assert taken_over >= 1, f"seed {seed}: no kill interrupted work that had to be taken over"
    return taken_over


# Celery workers --------------------------------------------------------------------------


@contextmanager
def dispatching_to(url: str):
    """Send this process's Celery messages (submits' wake-ups) to ``url``, the live workers' broker."""
    from kombu import Connection

    from runstate_project.celery import app

    def fresh_pools():
        app._pool = None
        app.amqp._producer_pool = None

    saved = app.conf.broker_write_url
    fresh_pools()
    app.conf.broker_write_url = url
    assert app.connection_for_write().as_uri() == Connection(url).as_uri()
    try:
        yield
    finally:
        fresh_pools()
        app.conf.broker_write_url = saved


@pytest.fixture
def celery_broker():
    purge_broker()
    for task in registry:
        task.forget_ids()  # the database was flushed since another test cached them
    with dispatching_to(TEST_BROKER_URL):
        yield


def celery_worker_command() -> list[str]:
    return [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "runstate_project",
        "worker",
        "--pool=threads",
        "--concurrency=4",
        "--include=tests.reliability.fault_tasks",
        "--loglevel=INFO",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
    ]


def test_celery_workers_sigkilled_three_times_finish_200_tasks_exactly_once(
    celery_broker, children, ledger_dir, rng, tmp_path
):
    env = child_env(**{fault_tasks.LEDGER_DIR_ENV: str(ledger_dir), "RUNSTATE_REWAKE_AFTER_S": "3"})
    ledger = Ledger(source="test")
    run = run_create(project_id=fault_tasks.bulk.project_id, name="faults-celery")
    children.start("beat", beat_command(tmp_path), env)
    alive = [children.start("worker", celery_worker_command(), env) for _ in range(2)]
    for i in range(TASKS):
        with ledger.op("submit", run_id=run.id) as call:
            task = fault_tasks.bulk.submit(run.id, {"i": i, "seconds": handler_seconds(rng)})
            call.done(task_id=task.id)

    try:
        interrupted = inject_kills(
            rng, run, children, alive, lambda: children.start("worker", celery_worker_command(), env), what="celery"
        )
        wait_until(lambda: count(run, "SUCCEEDED") == TASKS, waits=2, what="every task to succeed")
    except AssertionError:
        print(children.logs())
        raise
    for child in alive:
        children.terminate(child)

    book = merged(ledger, ledger_dir)
    report = book.assert_clean(run.project_id, drained_runs=[run.id])
    print(f"celery: {report.describe()}")
    taken_over = assert_exactly_once(run, book, report, interrupted, rng.seed_value)
    assert report.counts["takeovers"] >= taken_over
    print(f"celery: {KILLS} kills, {len(interrupted)} tasks left running, {taken_over} taken over")
    assert report.counts["claims_handed_out"] >= TASKS + taken_over


# SDK consumers ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def faults_server(django_db_setup, tmp_path_factory):
    """One uvicorn on the test database for this module, with a small connection pool."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("faults-server") / "uvicorn.log"
    command = [sys.executable, "-m", "uvicorn", "runstate_project.asgi:application", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--log-level", "warning"]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            env=server_env(RUNSTATE_DB_POOL_SIZE="5"),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"

    def healthy():
        assert process.poll() is None, log_path.read_text(errors="replace")
        return answers_health(url)

    try:
        wait_until(healthy, what="uvicorn to answer")
        yield url
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


class SdkRun:
    """A project, a key, a WORK mailbox with short leases and a run, for consumer processes."""

    def __init__(self, url: str, name: str) -> None:
        self.project = project_ensure(name="faults-sdk")
        key = api_key_create(project_id=self.project.id, permissions=list(ALL_PERMISSIONS), name="faults")
        self.mailbox, _ = mailbox_ensure(
            project_id=self.project.id, name=name, mode="WORK", lease_ttl_ms=LEASE_MS, max_attempts=10
        )
        self.run = run_create(project_id=self.project.id, name=name)
        self.env = server_env(RUNSTATE_URL=url, RUNSTATE_API_KEY=key.plaintext, RUNSTATE_SCOPE_ID=str(self.run.id))

    def consumer(self, children: Children, ledger_dir: Path, concurrency: int) -> subprocess.Popen:
        command = [sys.executable, "-m", "tests.reliability.fault_consumer", self.mailbox.name, str(ledger_dir)]
        return children.start("consumer", command + [str(concurrency), str(LEASE_MS)], self.env)


@pytest.fixture
def sdk_run(faults_server, transactional_db):
    yield lambda name: SdkRun(faults_server, name)
    wait_for_quiet_server()


def test_sdk_consumers_sigkilled_three_times_finish_200_tasks_exactly_once(sdk_run, children, ledger_dir, rng):
    setup = sdk_run("faults-sdk-bulk")
    ledger = Ledger(source="test")
    ops = Services(ledger, setup.project.id)
    for i in range(TASKS):
        ops.submit(setup.mailbox, setup.run.id, {"i": i, "seconds": handler_seconds(rng)})
    alive = [setup.consumer(children, ledger_dir, 4) for _ in range(2)]

    try:
        interrupted = inject_kills(
            rng, setup.run, children, alive, lambda: setup.consumer(children, ledger_dir, 4), what="sdk"
        )
        wait_until(lambda: count(setup.run, "SUCCEEDED") == TASKS, waits=2, what="every task to succeed")
    except AssertionError:
        print(children.logs())
        raise
    for child in alive:
        children.terminate(child)

    book = merged(ledger, ledger_dir)
    report = book.assert_clean(setup.project.id, drained_runs=[setup.run.id])
    print(f"sdk: {report.describe()}")
    taken_over = assert_exactly_once(setup.run, book, report, interrupted, rng.seed_value)
    assert report.counts["takeovers"] >= taken_over
    print(f"sdk: {KILLS} kills, {len(interrupted)} tasks left running, {taken_over} taken over")


def test_a_consumer_paused_past_its_lease_is_fenced_off_when_it_resumes(sdk_run, children, ledger_dir, tmp_path):
    """SIGSTOP the holder; another consumer takes the task over and completes it; SIGCONT: LEASE_LOST."""
    setup = sdk_run("faults-sdk-pause")
    ledger = Ledger(source="test")
    ops = Services(ledger, setup.project.id)
    hold_log = tmp_path / "hold.log"
    task = ops.submit(setup.mailbox, setup.run.id, {"i": 0, "hold_log": str(hold_log)})
    paused = setup.consumer(children, ledger_dir, 1)
    wait_until(lambda: hold_log.exists() and hold_log.read_text().strip(), what="the handler to hold")
    assert hold_log.read_text().split() == ["holding", str(task.id), str(paused.pid)]

    os.killpg(paused.pid, signal.SIGSTOP)
    stale = claim_id_for(task.id, 1)

    def lease_expired():
        row = Task.objects.get(id=task.id)
        return row.state == "RUNNING" and row.attempts == 1 and row.lease_expires_at < timezone.now()

    wait_until(lease_expired, what="the paused consumer's lease to run out")
    taker = setup.consumer(children, ledger_dir, 1)
    wait_until(lambda: count(setup.run, "SUCCEEDED") == 1, what="the other consumer to take over")
    row = Task.objects.get(id=task.id)
    assert (row.attempts, row.outcome["attempt"], row.outcome["pid"]) == (2, 2, taker.pid)

    os.killpg(paused.pid, signal.SIGCONT)
    paused_ledger = ledger_dir / f"consumer-{paused.pid}.jsonl"

    def fenced_off():
        return [
            entry
            for entry in Ledger.load(paused_ledger).entries
            if entry.claim_id == stale and entry.op in ("renew", "complete") and entry.code == "LEASE_LOST"
        ]

    (refusal, *_) = wait_until(fenced_off, what="the resumed consumer to hear LEASE_LOST")
    # The stale claim changes nothing through the services either.
    with pytest.raises(exceptions.LeaseLost):
        ops.complete(stale, {"late": True})
    with pytest.raises(exceptions.LeaseLost):
        ops.renew(stale)
    for child in (paused, taker):
        children.terminate(child)

    row = Task.objects.get(id=task.id)
    assert (row.state, row.attempts, row.outcome["pid"]) == ("SUCCEEDED", 2, taker.pid)
    book = merged(ledger, ledger_dir)
    takeover = next(e for e in book.entries if e.op == "claim" and e.ok and claim_id_for(task.id, 2) in e.claim_ids)
    assert refusal.ended_ns > takeover.ended_ns
    assert not [e for e in book.entries if e.claim_id == stale and e.ok and e.started_ns > takeover.ended_ns]
    report = book.assert_clean(setup.project.id, drained_runs=[setup.run.id])
    print(f"pause: {refusal.op} of {stale} answered LEASE_LOST after the takeover; {report.describe()}")
    assert report.counts["takeovers"] == 1


def test_a_celery_worker_paused_past_its_lease_is_fenced_off_when_it_resumes(
    celery_broker, children, ledger_dir, tmp_path
):
    """SIGSTOP the worker holding the task; the lease sweep hands it to the other worker; SIGCONT: LEASE_LOST."""
    env = child_env(**{fault_tasks.LEDGER_DIR_ENV: str(ledger_dir)})
    ledger = Ledger(source="test")
    ops = Services(ledger, fault_tasks.hold.project_id)
    run = run_create(project_id=fault_tasks.hold.project_id, name="faults-celery-pause")
    children.start("beat", beat_command(tmp_path), env)
    workers = [children.start("worker", celery_worker_command(), env) for _ in range(2)]
    hold_log = tmp_path / "hold.log"
    with ledger.op("submit", run_id=run.id) as call:
        task = fault_tasks.hold.submit(run.id, {"hold_log": str(hold_log)})
        call.done(task_id=task.id)
    wait_until(lambda: hold_log.exists() and hold_log.read_text().strip(), what="the handler to hold")
    holding_pid = int(hold_log.read_text().split()[2])
    (paused,) = [child for child in workers if child.pid == holding_pid]
    (taker,) = [child for child in workers if child is not paused]

    os.killpg(paused.pid, signal.SIGSTOP)
    stale = claim_id_for(task.id, 1)
    wait_until(lambda: count(run, "SUCCEEDED") == 1, what="the sweep and the other worker to take over")
    row = Task.objects.get(id=task.id)
    assert (row.attempts, row.outcome["attempt"], row.outcome["pid"]) == (2, 2, taker.pid)
    requeue = Event.objects.get(subject_id=str(task.id), type="task.requeued")
    assert requeue.data["cause"] == "lease_expired"

    os.killpg(paused.pid, signal.SIGCONT)
    paused_ledger = ledger_dir / f"celery-{paused.pid}.jsonl"

    def fenced_off():
        return [
            entry
            for entry in Ledger.load(paused_ledger).entries
            if entry.claim_id == stale and entry.op in ("renew", "complete") and entry.code == "LEASE_LOST"
        ]

    (refusal, *_) = wait_until(fenced_off, what="the resumed worker to hear LEASE_LOST")
    with pytest.raises(exceptions.LeaseLost):
        ops.complete(stale, {"late": True})
    for child in workers:
        children.terminate(child)

    row = Task.objects.get(id=task.id)
    assert (row.state, row.attempts, row.outcome["pid"]) == ("SUCCEEDED", 2, taker.pid)
    book = merged(ledger, ledger_dir)
    takeover = next(e for e in book.entries if e.op == "claim" and e.ok and claim_id_for(task.id, 2) in e.claim_ids)
    assert refusal.ended_ns > takeover.ended_ns
    assert not [e for e in book.entries if e.claim_id == stale and e.ok and e.started_ns > takeover.ended_ns]
    report = book.assert_clean(run.project_id, drained_runs=[run.id])
    print(f"celery pause: {refusal.op} of {stale} answered LEASE_LOST after the takeover; {report.describe()}")
    assert report.counts["takeovers"] == 1


# Races in one process: threads on their own connections ----------------------------------


class RaceSetup:
    """A project with a WORK mailbox and a ledger whose service calls several threads share."""

    def __init__(self) -> None:
        self.project = project_ensure(name="faults-race")
        self.ledger = Ledger(source="threads")
        self.ops = Services(self.ledger, self.project.id)
        self.mailbox, _ = mailbox_ensure(project_id=self.project.id, name="faults-race", mode="WORK")

    def completes(self) -> int:
        return sum(1 for entry in self.ledger.snapshot() if entry.op == "complete" and entry.ok)


def test_a_run_cancelled_while_four_threads_claim_and_complete_accepts_nothing_after_the_cancel(rng):
    race = RaceSetup()
    ops = race.ops
    run = run_create(project_id=race.project.id, name="faults-cancel-race")
    child = run_create(project_id=race.project.id, parent_id=run.id)
    for i in range(120):
        ops.submit(race.mailbox, child.id if i % 2 else run.id, {"i": i})
    cancel_after = rng.randint(10, 80)
    seeds = [rng.randrange(2**32) for _ in range(4)]

    def worker(run_id, seed):
        local = random.Random(seed)
        while True:
            try:
                claims = ops.claim(race.mailbox, run_id, max_claims=2)
            except exceptions.ScopeCancelled:
                return
            for claim in claims:
                time.sleep(local.uniform(0, 0.005))  # hold the claim a moment, so the cancel lands mid-work
                try:
                    if local.random() < 0.3:
                        ops.renew(claim.claim_id)
                    ops.complete(claim.claim_id, {"i": claim.task.input["i"]})
                except (exceptions.ScopeCancelled, exceptions.LeaseLost):
                    pass

    def canceller():
        wait_until(lambda: race.completes() >= cancel_after, interval_s=0.002, what="completions")
        ops.cancel_run(run.id, reason="race")

    runs = [run.id, run.id, child.id, child.id]
    run_in_threads([lambda s=s, r=r: worker(r, s) for s, r in zip(seeds, runs, strict=True)] + [canceller])

    report = race.ledger.assert_clean(race.project.id, drained_runs=[run.id])
    states = set(Task.objects.filter(project_id=race.project.id).values_list("state", flat=True))
    assert states <= {"SUCCEEDED", "CANCELLED"}
    refused = [e for e in race.ledger.entries if e.code == "SCOPE_CANCELLED"]
    assert len(refused) >= 4  # every worker was refused its next claim
    print(
        f"cancel race: cancelled after {cancel_after} completions; {report.counts['tasks_SUCCEEDED']} succeeded, "
        f"{report.counts['tasks_CANCELLED']} cancelled, {len(refused)} refusals; {report.describe()}"
    )


def test_a_group_decided_while_four_threads_complete_and_judge_its_members_is_decided_once(rng):
    race = RaceSetup()
    ops = race.ops
    group = group_create(
        project_id=race.project.id, mailbox_name="faults-race", condition="N_ACCEPTED", threshold=3, expected_members=12
    )
    for i in range(12):
        ops.group_submit(group.id, {"i": i})
    seeds = [rng.randrange(2**32) for _ in range(4)]

    def worker(seed):
        local = random.Random(seed)
        while True:
            try:
                claims = ops.claim(race.mailbox, group.scope_id)
            except exceptions.ScopeCancelled:
                return  # the group finalized and cancelled its gate
            for claim in claims:
                try:
                    ops.complete(claim.claim_id, {"i": claim.task.input["i"]})
                    verdict = "ACCEPTED" if local.random() < 0.6 else "REJECTED"
                    ops.verdict(group.id, claim.task.id, verdict)
                except (exceptions.ScopeCancelled, exceptions.LeaseLost):
                    pass

    run_in_threads([lambda s=s: worker(s) for s in seeds])

    decided = TaskGroup.objects.get(id=group.id)
    race.ledger.record(
        "group_decision", ok=True, group_id=group.id, outcome=decided.outcome, reason=decided.outcome_reason
    )
    report = race.ledger.assert_clean(race.project.id, drained_runs=[group.scope_id])
    assert decided.state == "FINALIZED"
    assert Event.objects.filter(type="group.finalized", subject_id=str(group.id)).count() == 1
    told = {e.data["outcome"] for e in race.ledger.entries if e.op == "verdict" and e.ok and "outcome" in e.data}
    assert told <= {decided.outcome}
    print(f"group race: {decided.outcome}/{decided.outcome_reason}; {report.describe()}")
