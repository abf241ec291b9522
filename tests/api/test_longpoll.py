"""Long-polls: result, claim waitMs, and the NOTIFY hub that wakes them."""

import asyncio
import threading
import time
import uuid

import pytest
from django.db import connection, transaction

from coordination.models import Project
from coordination.plumbing.notify import hub
from coordination.services.claims import claim_complete, task_claim
from coordination.services.events import event_record
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.runs import run_create
from coordination.services.tasks import task_submit

# The waits read through other connections: the data must be committed.
pytestmark = pytest.mark.django_db(transaction=True)


def later(delay_s, fn):
    """Run ``fn`` in a thread after ``delay_s``; return the thread."""

    def target():
        try:
            time.sleep(delay_s)
            fn()
        finally:
            connection.close()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def setup(project):
    mailbox, _ = mailbox_ensure(project_id=project.id, name="jobs", mode="WORK")
    run = run_create(project_id=project.id)
    return project, mailbox, run


def test_result_waits_until_the_task_is_terminal(api, setup):
    project, mailbox, run = setup
    task, _ = task_submit(project_id=project.id, mailbox=mailbox, run_id=run.id, input={})
    (claim,) = task_claim(project_id=project.id, mailbox=mailbox, run_id=run.id)
    worker = later(0.3, lambda: claim_complete(project_id=project.id, claim_id=claim.claim_id, outcome={"v": 42}))
    response = api.get(f"/v1/tasks/{task.id}/result?timeoutMs=20000")
    worker.join()
    assert response.status_code == 200
    assert response.json()["state"] == "SUCCEEDED"
    assert response.json()["outcome"] == {"v": 42}


def test_result_times_out_with_the_current_state(api, setup):
    project, mailbox, run = setup
    task, _ = task_submit(project_id=project.id, mailbox=mailbox, run_id=run.id, input={})
    response = api.get(f"/v1/tasks/{task.id}/result?timeoutMs=200")
    assert response.status_code == 200 and response.json()["state"] == "QUEUED"


def test_result_of_a_terminal_task_answers_at_once_and_timeouts_are_clamped(api, setup):
    project, mailbox, run = setup
    task, _ = task_submit(project_id=project.id, mailbox=mailbox, run_id=run.id, input={})
    (claim,) = task_claim(project_id=project.id, mailbox=mailbox, run_id=run.id)
    claim_complete(project_id=project.id, claim_id=claim.claim_id, outcome=None)
    response = api.get(f"/v1/tasks/{task.id}/result?timeoutMs=999999999")
    assert response.status_code == 200 and response.json()["state"] == "SUCCEEDED"
    bad = api.get(f"/v1/tasks/{task.id}/result?timeoutMs=-1")
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "VALIDATION_ERROR"


def test_claim_wait_returns_the_task_submitted_meanwhile(api, setup):
    project, mailbox, run = setup
    submitter = later(0.3, lambda: task_submit(project_id=project.id, mailbox=mailbox, run_id=run.id, input={"n": 7}))
    response = api.post("/v1/mailboxes/jobs/claims", {"runId": str(run.id), "waitMs": 20000}, format="json")
    submitter.join()
    assert response.status_code == 200
    claims = response.json()["claims"]
    assert len(claims) == 1 and claims[0]["task"]["input"] == {"n": 7}


def test_claim_wait_is_refused_when_the_run_is_cancelled_meanwhile(api, setup):
    from coordination.services.runs import run_cancel

    project, _, run = setup
    canceller = later(0.3, lambda: run_cancel(run_id=run.id, project_id=project.id))
    response = api.post("/v1/mailboxes/jobs/claims", {"runId": str(run.id), "waitMs": 20000}, format="json")
    canceller.join()
    assert response.status_code == 409 and response.json()["error"]["code"] == "SCOPE_CANCELLED"


@pytest.mark.postgres_only
def test_a_committed_event_wakes_its_waiter_through_notify(project):
    """The hub wakes a waiter on commit, not on a recheck: the wait reports a wake-up."""
    run = run_create(project_id=project.id)
    subject = uuid.uuid4()

    async def scenario():
        waiter = hub.subscribe([subject])
        try:
            await hub.ready()

            def write():
                with transaction.atomic():
                    event_record(project_id=project.id, type="test.ping", run=run, subject_id=subject)

            writer = later(0.1, write)
            woken = await waiter.wait(30)
            await asyncio.get_running_loop().run_in_executor(None, writer.join)
            return woken
        finally:
            hub.unsubscribe(waiter)

    assert asyncio.run(scenario()) is True


@pytest.mark.postgres_only
def test_a_rolled_back_event_wakes_nobody(project):
    run = run_create(project_id=project.id)
    subject = uuid.uuid4()

    async def scenario():
        waiter = hub.subscribe([subject])
        try:
            await hub.ready()
            # The listener wakes everyone once when it connects, and run_create's own
            # notification may still be on its way: let those arrive, then start clean.
            await asyncio.sleep(0.5)
            waiter.event.clear()

            def write_and_roll_back():
                try:
                    with transaction.atomic():
                        event_record(project_id=project.id, type="test.ping", run=run, subject_id=subject)
                        raise RuntimeError("roll back")
                except RuntimeError:
                    pass

            writer = later(0, write_and_roll_back)
            await asyncio.get_running_loop().run_in_executor(None, writer.join)
            return await waiter.wait(0.5)
        finally:
            hub.unsubscribe(waiter)

    assert asyncio.run(scenario()) is False
    assert Project.objects.filter(id=project.id).exists()


def test_event_list_waits_for_the_next_event(api, setup):
    project, _, run = setup
    cursor = api.get("/v1/events").json()["nextCursor"]
    creator = later(0.3, lambda: run_create(project_id=project.id, parent_id=run.id, name="late"))
    response = api.get(f"/v1/events?after={cursor}&waitMs=20000&runId={run.id}")
    creator.join()
    assert response.status_code == 200
    events = response.json()["events"]
    assert [(e["type"], e["data"]["name"]) for e in events] == [("run.created", "late")]
    assert response.json()["nextCursor"] == events[-1]["id"]


def test_a_recheck_runs_on_its_request_thread_even_when_the_default_executor_is_full():
    """A long-poll's re-read never waits for the event loop's shared default executor.

    Django answers every 4xx through that executor while the request still holds its pooled
    connection; rechecks queued there behind an exhausted pool deadlocked the whole process.
    """
    from asgiref.sync import ThreadSensitiveContext

    from coordination.api.longpoll import db, in_request

    async def scenario():
        loop = asyncio.get_running_loop()
        release = threading.Event()
        # Occupy every thread of the default executor (at most 32) and queue more behind them.
        blockers = [loop.run_in_executor(None, release.wait) for _ in range(64)]
        try:
            async with ThreadSensitiveContext():
                request_thread = await in_request(threading.get_ident)
                recheck_thread = await asyncio.wait_for(db(threading.get_ident), timeout=60)
        finally:
            release.set()
            await asyncio.gather(*blockers)
        return request_thread, recheck_thread

    request_thread, recheck_thread = asyncio.run(scenario())
    assert recheck_thread == request_thread
