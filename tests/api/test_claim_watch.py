"""``GET /v1/claims/watch``: what stops a worker's claims, pushed to it (issue 38).

First the events: every change that stops a claim its worker did not end itself names the
claim (``claimId``) and the worker (``heldBy``), on the single statements and on the careful
path alike; a worker's own complete, fail or release names nobody. Then the watch: it sends a
worker those events and no other worker's, opens with a frame whose id is its cursor, and a
watch resumed with the last id it received misses nothing.
"""

import asyncio
from datetime import timedelta

import pytest
from django.db import connection
from django.test import AsyncClient
from django.utils import timezone

from coordination.api.longpoll import db
from coordination.api.waits import waits_held
from coordination.domain.states import GroupCondition, Permission, Verdict
from coordination.models import Event, Run, Task
from coordination.services.claims import claim_complete, claim_fail, claim_release, task_claim
from coordination.services.groups import group_create, group_submit, group_verdict
from coordination.services.keys import api_key_create
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.runs import run_cancel, run_create, run_sweep_deadline
from coordination.services.sweeps import tasks_settle_expired_leases
from coordination.services.tasks import task_cancel, task_submit
from tests.conftest import err
from tests.operator.test_event_stream import Frames

# The watch reads through other connections: the data must be committed.
pytestmark = pytest.mark.django_db(transaction=True)

WATCH = "/v1/claims/watch"


@pytest.fixture(params=["single statements", "careful path"])
def paths(request, settings):
    """Each case on both paths that write these events: PostgreSQL's single statements and the ORM's."""
    if request.param == "careful path":
        settings.RUNSTATE_FAST_PATHS = False
    elif connection.vendor != "postgresql":
        pytest.skip("SQLite has the careful path only")
    return request.param


@pytest.fixture
def jobs(project):
    return mailbox_ensure(project_id=project.id, name="jobs", mode="WORK", max_attempts=2)[0]


def submit(project, mailbox, run, n=1, **kwargs):
    return [
        task_submit(project_id=project.id, mailbox=mailbox, run_id=run.id, input={"n": i}, **kwargs)[0]
        for i in range(n)
    ]


def claim(project, mailbox, run, worker, n=1):
    return task_claim(project_id=project.id, mailbox=mailbox, run_id=run.id, worker_id=worker, max_claims=n)


def naming(task) -> list[tuple[str, dict]]:
    """The events of ``task`` that name a held claim: ``(type, {heldBy, claimId})``."""
    events = Event.objects.filter(subject_id=str(task.id), data__has_key="heldBy").order_by("txid", "id")
    return [(e.type, {"heldBy": e.data["heldBy"], "claimId": e.data["claimId"]}) for e in events]


def held(worker, claim_):
    return {"heldBy": worker, "claimId": claim_.claim_id}


# The events ------------------------------------------------------------------------------


def test_a_task_cancel_names_the_claim_it_asks_to_stop(project, jobs, paths):
    run = run_create(project_id=project.id)
    tasks = submit(project, jobs, run, 2)
    (claimed,) = claim(project, jobs, run, "w1")
    running = claimed.task
    (queued,) = [task for task in tasks if task.id != running.id]
    task_cancel(project_id=project.id, task_id=running.id, reason="user")
    task_cancel(project_id=project.id, task_id=queued.id, reason="user")
    assert naming(running) == [("task.cancellation_requested", held("w1", claimed))]
    assert naming(queued) == []  # nobody held it
    event = Event.objects.get(subject_id=str(running.id), type="task.cancellation_requested")
    assert event.data["reason"] == "user"


def test_a_run_cancel_names_every_claim_it_ends_and_its_worker(project, jobs, paths):
    run = run_create(project_id=project.id)
    child = run_create(project_id=project.id, parent_id=run.id)
    submit(project, jobs, run, 2)
    (queued,) = submit(project, jobs, child, 1)
    claims = claim(project, jobs, run, "w1") + claim(project, jobs, run, "w2")
    run_cancel(project_id=project.id, run_id=run.id, reason="enough")
    for worker, held_claim in zip(["w1", "w2"], claims, strict=True):
        assert naming(held_claim.task) == [("task.cancelled", held(worker, held_claim))]
        data = Event.objects.get(subject_id=str(held_claim.task.id), type="task.cancelled").data
        assert (data["reason"], data["cause"]) == ("enough", "run_cancelled")
    assert naming(queued) == []
    assert Event.objects.get(subject_id=str(queued.id), type="task.cancelled").data.keys() == {"reason", "cause"}


def test_a_run_deadline_names_the_claims_it_expires(project, jobs, paths):
    run = run_create(project_id=project.id, deadline=timezone.now() + timedelta(hours=1))
    submit(project, jobs, run, 1)
    (held_claim,) = claim(project, jobs, run, "w1")
    past = timezone.now() - timedelta(seconds=1)
    Run.objects.filter(id=run.id).update(deadline=past)
    Task.objects.filter(run_id=run.id).update(run_deadline=past)
    assert run_sweep_deadline(run_id=run.id)
    assert naming(held_claim.task) == [("task.expired", held("w1", held_claim))]


def test_a_group_decided_names_the_losers_claims(project, jobs, paths):
    group = group_create(project_id=project.id, mailbox_name="jobs", condition=GroupCondition.FIRST_ACCEPTED)
    for i in range(2):
        group_submit(project_id=project.id, group_id=group.id, input={"n": i})
    gate = Run.objects.get(id=group.scope_id)
    winner, loser = claim(project, jobs, gate, "w1", n=2)
    claim_complete(project_id=project.id, claim_id=winner.claim_id, outcome={"ok": True})
    group_verdict(project_id=project.id, group_id=group.id, task_id=winner.task.id, verdict=Verdict.ACCEPTED)
    assert naming(loser.task) == [("task.cancelled", held("w1", loser))]
    assert naming(winner.task) == []


def expire(task, **fields):
    Task.objects.filter(id=task.id).update(lease_expires_at=timezone.now() - timedelta(seconds=1), **fields)


@pytest.mark.parametrize(
    ("attempts_left", "cancel_first", "expected"),
    [(True, False, "task.requeued"), (False, False, "task.failed"), (True, True, "task.cancelled")],
)
def test_a_lease_that_ran_out_names_the_claim_it_took(project, jobs, attempts_left, cancel_first, expected):
    run = run_create(project_id=project.id)
    (task,) = submit(project, jobs, run, 1, max_attempts=2 if attempts_left else 1)
    (held_claim,) = claim(project, jobs, run, "w1")
    if cancel_first:
        task_cancel(project_id=project.id, task_id=task.id, grace_ms=0)
    expire(task)
    assert tasks_settle_expired_leases() == 1
    assert naming(task)[-1] == (expected, held("w1", held_claim))


@pytest.mark.parametrize("end", ["complete", "fail", "release"])
def test_a_claim_the_worker_ended_itself_names_nobody(project, jobs, paths, end):
    run = run_create(project_id=project.id)
    (task,) = submit(project, jobs, run, 1)
    (held_claim,) = claim(project, jobs, run, "w1")
    if end == "complete":
        claim_complete(project_id=project.id, claim_id=held_claim.claim_id, outcome={})
    elif end == "fail":
        claim_fail(project_id=project.id, claim_id=held_claim.claim_id, error="bad")
    else:
        claim_release(project_id=project.id, claim_id=held_claim.claim_id)
    assert naming(task) == []


# The watch -------------------------------------------------------------------------------


def key_of(project, permissions=(Permission.COORDINATION_WRITE,), **kwargs) -> str:
    return api_key_create(project_id=project.id, permissions=list(permissions), **kwargs).plaintext


async def open_watch(key: str, worker: str, **headers) -> Frames:
    response = await AsyncClient().get(
        f"{WATCH}?workerId={worker}", headers={"Authorization": f"Bearer {key}", **headers}
    )
    assert response.status_code == 200, response.content
    assert response["Content-Type"] == "text/event-stream"
    return Frames(response)


def test_a_watch_opens_with_its_cursor_then_sends_its_workers_claims_only(project, jobs):
    key = key_of(project)
    run = run_create(project_id=project.id)
    submit(project, jobs, run, 2)
    (mine,) = claim(project, jobs, run, "w1")
    (theirs,) = claim(project, jobs, run, "w2")

    async def scenario():
        frames = await open_watch(key, "w1")
        try:
            ready = await frames.next()
            # Another worker's cancel first: the watch of w1 must skip it.
            await db(task_cancel, project_id=project.id, task_id=theirs.task.id)
            await db(task_cancel, project_id=project.id, task_id=mine.task.id, reason="stop")
            return ready, await frames.next()
        finally:
            await frames.close()

    ready, pushed = asyncio.run(scenario())
    assert ready["event"] == "watch.ready"
    assert ready["data"] == {"workerId": "w1", "after": ready["id"]}
    assert pushed["event"] == "task.cancellation_requested"
    assert pushed["data"]["subjectId"] == str(mine.task.id)
    assert pushed["data"]["data"] == {"reason": "stop", "graceMs": None, **held("w1", mine)}
    assert pushed["id"] == pushed["data"]["id"] != ready["id"]


def test_a_watch_resumed_with_its_last_id_misses_nothing(project, jobs):
    key = key_of(project)
    run = run_create(project_id=project.id)
    submit(project, jobs, run, 3)
    claims = claim(project, jobs, run, "w1", n=3)

    async def first_connection():
        frames = await open_watch(key, "w1")
        try:
            ready = await frames.next()
            await db(task_cancel, project_id=project.id, task_id=claims[0].task.id)
            return ready, await frames.next()
        finally:
            await frames.close()

    ready, first = asyncio.run(first_connection())
    assert summary(first) == ("task.cancellation_requested", claims[0].claim_id)
    # Away: two cancels while nobody watches (one a run cancel ending both claims left).
    task_cancel(project_id=project.id, task_id=claims[1].task.id)
    run_cancel(project_id=project.id, run_id=run.id)

    async def resumed(last_id, count):
        frames = await open_watch(key, "w1", **{"Last-Event-ID": last_id})
        try:
            ready_again = await frames.next()
            return ready_again, [await frames.next() for _ in range(count)]
        finally:
            await frames.close()

    ready_again, missed = asyncio.run(resumed(first["id"], 4))
    assert ready_again["id"] == first["id"]
    assert summary(missed[0]) == ("task.cancellation_requested", claims[1].claim_id)
    assert sorted(map(summary, missed[1:])) == [("task.cancelled", c.claim_id) for c in sorted_claims(claims)]
    # Resumed from the ready frame's id (nothing received after it): the first cancel too.
    again, from_ready = asyncio.run(resumed(ready["id"], 5))
    assert again["id"] == ready["id"]
    assert [summary(f) for f in from_ready[:2]] == [
        ("task.cancellation_requested", claims[0].claim_id),
        ("task.cancellation_requested", claims[1].claim_id),
    ]
    assert sorted(map(summary, from_ready[2:])) == sorted(map(summary, missed[1:]))


def summary(frame) -> tuple[str, str]:
    return frame["event"], frame["data"]["data"]["claimId"]


def sorted_claims(claims):
    return sorted(claims, key=lambda c: c.claim_id)


def test_a_watch_of_a_key_bound_to_a_run_sees_its_subtree_only(project, jobs):
    outside, inside = run_create(project_id=project.id), run_create(project_id=project.id)
    key = key_of(project, run_id=inside.id)
    submit(project, jobs, outside, 1)
    submit(project, jobs, inside, 1)
    (out_claim,) = claim(project, jobs, outside, "w1")
    (in_claim,) = claim(project, jobs, inside, "w1")

    async def scenario():
        frames = await open_watch(key, "w1")
        try:
            await frames.next()
            await db(run_cancel, project_id=project.id, run_id=outside.id)
            await db(run_cancel, project_id=project.id, run_id=inside.id)
            return await frames.next()
        finally:
            await frames.close()

    pushed = asyncio.run(scenario())
    assert summary(pushed) == ("task.cancelled", in_claim.claim_id) != ("task.cancelled", out_claim.claim_id)


def test_a_watch_refuses_bad_input_with_the_envelope(project, api):
    writer, reader = key_of(project), key_of(project, permissions=(Permission.COORDINATION_READ,))

    async def get(key, path, **headers):
        return await AsyncClient().get(path, headers={"Authorization": f"Bearer {key}", **headers})

    async def scenario():
        return (
            await get(writer, WATCH),
            await get(writer, f"{WATCH}?workerId=" + "w" * 201),
            await get(writer, f"{WATCH}?workerId=w1", **{"Last-Event-ID": "nope"}),
            await get(writer, f"{WATCH}?workerId=w1&after=1-x"),
            await get(reader, f"{WATCH}?workerId=w1"),
        )

    missing, too_long, bad_header, bad_after, read_only = asyncio.run(scenario())
    assert "workerId" in err(missing, 400, "VALIDATION_ERROR")["details"]
    assert "workerId" in err(too_long, 400, "VALIDATION_ERROR")["details"]
    err(bad_header, 400, "VALIDATION_ERROR")
    assert "after" in err(bad_after, 400, "VALIDATION_ERROR")["details"]
    err(read_only, 403, "PERMISSION_DENIED")


def test_a_watch_counts_among_the_keys_waits(project, settings):
    settings.RUNSTATE_MAX_WAITS_PER_KEY = 1
    issued = api_key_create(project_id=project.id, permissions=[Permission.COORDINATION_WRITE])

    async def scenario():
        first = await open_watch(issued.plaintext, "w1")
        try:
            await first.next()
            held = waits_held(api_key_id=issued.api_key.id)
            headers = {"Authorization": f"Bearer {issued.plaintext}"}
            return held, await AsyncClient().get(f"{WATCH}?workerId=w2", headers=headers)
        finally:
            await first.close()

    held, refused = asyncio.run(scenario())
    assert held == 1
    assert err(refused, 429, "RATE_LIMITED")["details"] == {"maxWaitsPerKey": 1}
