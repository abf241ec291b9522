"""``runstate worker``, ``status`` and ``cancel`` against the live service (see tests/sdk/test_cli.py)."""

import json
import os

import pytest

from coordination.models import Run, Task
from runstate import Runstate
from tests.sdk.test_cli import command, prepare, read_line, run_command, stop

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]


@pytest.mark.parametrize("handler", ["echo", "finish_in_one_second"])
def test_a_task_completes_through_the_worker_command(sdk, handler):
    run_id, (first, second) = prepare(f"cli-done-{handler.replace('_', '-')}", inputs=({"n": 1}, {"n": 2}))
    process = command(
        "worker",
        f"tests.sdk.cli_handlers:{handler}",
        "--mailbox",
        f"cli-done-{handler.replace('_', '-')}",
        "--scope",
        run_id,
        "--concurrency",
        "2",
        env=dict(os.environ, RUNSTATE_URL=sdk.url, RUNSTATE_API_KEY=sdk.api_key, PYTHONUNBUFFERED="1"),
    )
    try:
        started = {read_line(process), read_line(process)}
        assert started == {f"started {first}", f"started {second}"}
        with Runstate() as rs:
            tasks = [rs.tasks.get(task_id).result(timeout_ms=30_000) for task_id in (first, second)]
    finally:
        code, err = stop(process)
    assert code == 0, err
    assert [task["state"] for task in tasks] == ["SUCCEEDED", "SUCCEEDED"]
    if handler == "echo":
        # A plain function runs with the sync client's context: its signal is a threading.Event.
        assert [task["outcome"] for task in tasks] == [
            {"echo": {"n": 1}, "thread_event": True},
            {"echo": {"n": 2}, "thread_event": True},
        ]
    else:
        assert tasks[0]["outcome"] == {"finished": True}
    # One log line per task: its id, what became of it, how long it took.
    for task_id in (first, second):
        lines = [line for line in err.splitlines() if task_id in line]
        assert len(lines) == 1, err
        assert "attempt 1: returned -> SUCCEEDED in " in lines[0]
        assert lines[0].rstrip().endswith(" s")
    assert "worker stopped: ConsumeSummary(completed=2" in err


@pytest.mark.parametrize("handler", ["hang", "hang_sync"])
def test_sigterm_releases_a_task_that_outlives_the_grace_period(sdk, handler):
    mailbox = f"cli-grace-{handler.replace('_', '-')}"
    run_id, (task_id,) = prepare(mailbox)
    process = command(
        "worker",
        f"tests.sdk.cli_handlers:{handler}",
        "--mailbox",
        mailbox,
        "--grace-s",
        "0.5",
        env=dict(
            os.environ,
            RUNSTATE_URL=sdk.url,
            RUNSTATE_API_KEY=sdk.api_key,
            RUNSTATE_SCOPE_ID=run_id,
            PYTHONUNBUFFERED="1",
        ),
    )
    assert read_line(process) == f"started {task_id}"
    code, err = stop(process)
    assert code == 0, err
    task = Task.objects.get(id=task_id)
    assert task.state == "QUEUED"  # released at once, not after the 30 s lease
    assert task.attempts == 1
    assert f"task {task_id} attempt 1: released (stopping)" in err


def test_sigterm_lets_a_task_finish_within_the_grace_period(sdk):
    run_id, (task_id,) = prepare("cli-grace-finish")
    process = command(
        "worker",
        "tests.sdk.cli_handlers:finish_in_one_second",
        "--mailbox",
        "cli-grace-finish",
        "--scope",
        run_id,
        "--grace-s",
        "30",
        env=dict(os.environ, RUNSTATE_URL=sdk.url, RUNSTATE_API_KEY=sdk.api_key, PYTHONUNBUFFERED="1"),
    )
    assert read_line(process) == f"started {task_id}"
    code, err = stop(process)
    assert code == 0, err
    task = Task.objects.get(id=task_id)
    assert task.state == "SUCCEEDED"
    assert task.outcome == {"finished": True}


def test_status_shows_the_run_its_children_and_its_groups(sdk):
    with Runstate() as rs:
        rs.mailboxes.ensure("cli-status", mode="WORK")
        run = rs.scopes.create(name="parent")
        child = run.child(name="kid")
        grandchild = child.child(name="grandkid")
        group = run.groups.create(mailbox="cli-status", condition="ALL_TERMINAL", parent_scope_id=run.id)
        group.submit({"n": 1})
        grandchild.cancel(reason="not needed")

    code, out, err = run_command("status", run.id, "--json")
    assert code == 0, err
    tree = json.loads(out)
    assert tree["id"] == run.id and tree["name"] == "parent"
    assert [g["id"] for g in tree["groups"]] == [group.id]
    assert len(tree["groups"][0]["members"]) == 1
    assert [c["id"] for c in tree["children"]] == [child.id]
    assert [g["id"] for g in tree["children"][0]["children"]] == [grandchild.id]
    assert tree["children"][0]["children"][0]["storedState"] == "CANCELLED"

    code, out, err = run_command("status", run.id)
    assert code == 0, err
    assert out.splitlines()[0].startswith(f"run {run.id} 'parent'  ACTIVE")
    assert f"group {group.id} ALL_TERMINAL" in out
    assert f"run {child.id} 'kid'" in out
    assert f"run {grandchild.id} 'grandkid'  CANCELLED reason='not needed'" in out


def test_cancel_cancels_the_run_and_prints_api_errors_as_code_and_message(sdk):
    with Runstate() as rs:
        run = rs.scopes.create()
        done = rs.scopes.create()
        done.complete()

    code, out, err = run_command("cancel", run.id, "--reason", "operator said so")
    assert code == 0, err
    assert out.strip() == f"run {run.id}  CANCELLED reason='operator said so'"
    stored = Run.objects.get(id=run.id)
    assert stored.stored_state == "CANCELLED" and stored.cancel_reason == "operator said so"

    code, out, err = run_command("cancel", done.id)
    assert code == 1
    assert err.startswith("SCOPE_COMPLETED: ")
    code, out, err = run_command("status", "no-such-run")
    assert code == 1
    assert err.startswith("NOT_FOUND: ")


def test_a_worker_on_a_missing_mailbox_prints_the_refusal_and_exits_1(sdk):
    with Runstate() as rs:
        run = rs.scopes.create()
    code, _, err = run_command(
        "worker", "tests.sdk.cli_handlers:echo", "--mailbox", "no-such-mailbox", "--scope", run.id
    )
    assert code == 1
    assert err.splitlines()[-1].startswith("NOT_FOUND: ")


def test_a_worker_whose_run_is_cancelled_stops_with_status_0(sdk):
    run_id, _ = prepare("cli-run-cancelled", inputs=())
    process = command(
        "worker",
        "tests.sdk.cli_handlers:echo",
        "--mailbox",
        "cli-run-cancelled",
        "--scope",
        run_id,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    try:
        with Runstate() as rs:
            rs.scope(run_id).cancel(reason="done here")
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, err
    assert "stop_reason='SCOPE_CANCELLED'" in err


@pytest.mark.parametrize(
    ("handler", "states"),
    [("message_echo", ["COMPLETED"] * 3), ("message_reject_odd", ["COMPLETED", "DEAD_LETTERED", "COMPLETED"])],
)
def test_the_queue_worker_runs_the_message_loop_and_stops_on_sigterm(sdk, handler, states):
    mailbox = f"cli-queue-{handler.replace('_', '-')}"
    with Runstate() as rs:
        rs.mailboxes.ensure(mailbox, mode="QUEUE")
        run = rs.scopes.create(name=mailbox)
        sent = [run.messages.send(mailbox, {"n": n}) for n in (0, 1, 2)]
    process = command(
        "worker",
        f"tests.sdk.cli_handlers:{handler}",
        "--mailbox",
        mailbox,
        "--scope",
        run.id,
        "--queue",
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    try:
        received = {read_line(process) for _ in sent}
    finally:
        code, err = stop(process)
    assert received == {f"received {n} attempt 1" for n in (0, 1, 2)}
    assert code == 0, err
    with Runstate() as rs:
        scope = rs.scope(run.id)
        assert [scope.messages.retrieve(message["id"])["state"] for message in sent] == states
    rejected = states.count("DEAD_LETTERED")
    assert f"worker stopped: MessageSummary(completed={3 - rejected}, retried=0, rejected={rejected}" in err
