"""The worker's narrow claim and completion (``claims.narrow``) answer as the operations do.

The worker claims by id and completes through ``task_claim_by_id_narrow`` and
``claim_complete_narrow`` (a raw psycopg cursor, only the columns it uses); the operations'
``task_claim_by_id`` and ``claim_complete`` stay the reference. The same sequence of cases
runs through both, on fresh rows each, and every answer and every row and event written
must be the same.
"""

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from coordination.domain import exceptions
from coordination.domain.states import TaskState
from coordination.models import Event, Task
from coordination.services import claims
from coordination.services.keys import project_ensure
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.runs import run_cancel, run_create
from coordination.services.tasks import task_cancel, task_submit
from tests.claim_ids import claim_named

pytestmark = pytest.mark.django_db(transaction=True)


def service_claim(**kwargs):
    claim = claims.task_claim_by_id(**kwargs)
    return claims.NarrowClaim.of(claim) if claim is not None else None


def service_complete(**kwargs):
    return claims.claim_complete(**kwargs).state


PATHS = {
    "services": (service_claim, service_complete),
    "worker": (claims.task_claim_by_id_narrow, claims.claim_complete_narrow),
}


def own_claim_id(task, data):
    """The event's data, its ``claimId`` (which names the task, fresh on each path) checked and made comparable."""
    if "claimId" in data:
        names_its_task, attempt = claim_named(task.id, data["claimId"])
        assert names_its_task
        data = {**data, "claimId": f"<its own, attempt {attempt}>"}
    return data


def answer(call, **kwargs):
    try:
        result = call(**kwargs)
    except exceptions.CoordinationError as refusal:
        return ("refused", refusal.code)
    if isinstance(result, claims.NarrowClaim):
        return ("claim", result.attempt, result.lease_ttl_ms, result.input, result.key)
    return result


def life(path: str, tag: str) -> list:
    """Run every case through ``path``; return its answers and what each task's row and events became."""
    claim_by_id, complete = PATHS[path]
    project = project_ensure(name=f"statements-{tag}")
    mailbox, _ = mailbox_ensure(project_id=project.id, name="jobs", mode="WORK", lease_ttl_ms=20_000)
    other, _ = mailbox_ensure(project_id=project.id, name="other", mode="WORK")
    run = run_create(project_id=project.id)
    now = timezone.now()

    def submit(box=mailbox, on=run, **fields):
        return task_submit(project_id=project.id, mailbox=box, run_id=on.id, input={"n": 1, "s": "é"}, **fields)[0]

    def claim(task, **kwargs):
        kwargs = {"worker_id": "w", "lease_ttl_ms": None, "mailbox_id": mailbox.id, **kwargs}
        return answer(claim_by_id, project_id=project.id, task_id=task.id, **kwargs)

    def done(task, attempt=1, outcome=None):
        claim_id = claims.claim_id_for(task.id, attempt)
        return answer(complete, project_id=project.id, claim_id=claim_id, outcome=outcome)

    answers, tasks = [], []
    queued = submit(key="k1")
    tasks.append(queued)
    answers += [claim(queued, lease_ttl_ms=5_000), claim(queued), done(queued, outcome={"ok": [1, 2]})]
    answers += [claim(queued), done(queued)]  # a duplicate delivery; a completion twice

    plain = submit()
    tasks.append(plain)
    answers += [claim(plain), done(plain, attempt=2)]  # the mailbox's lease; a stale attempt

    later = submit()
    tasks.append(later)
    Task.objects.filter(id=later.id).update(available_at=now + timedelta(minutes=5))
    answers.append(claim(later))

    expired = submit(expires_at=now + timedelta(minutes=5))
    tasks.append(expired)
    Task.objects.filter(id=expired.id).update(expires_at=now - timedelta(seconds=1))
    answers.append(claim(expired))

    taken = submit()
    tasks.append(taken)
    answers.append(claim(taken))
    Task.objects.filter(id=taken.id).update(lease_expires_at=now - timedelta(seconds=1))
    answers += [claim(taken, worker_id="b"), done(taken, attempt=1), done(taken, attempt=2)]

    asked = submit()
    tasks.append(asked)
    answers.append(claim(asked))
    task_cancel(project_id=project.id, task_id=asked.id)
    answers.append(done(asked))

    elsewhere = submit(box=other)
    tasks.append(elsewhere)
    answers.append(claim(elsewhere))

    cancelled_run = run_create(project_id=project.id)
    orphan = submit(on=cancelled_run)
    tasks.append(orphan)
    run_cancel(project_id=project.id, run_id=cancelled_run.id)
    Task.objects.filter(id=orphan.id).update(state=TaskState.QUEUED)  # as if the cascade had missed it
    answers.append(claim(orphan))

    rows = []
    for task in tasks:
        row = Task.objects.get(id=task.id)
        events = [
            (kind, own_claim_id(task, data))
            for kind, data in Event.objects.filter(subject_id=str(task.id)).order_by("id").values_list("type", "data")
        ]
        lease_ms = (
            round((row.lease_expires_at - row.last_renewed_at) / timedelta(milliseconds=1))
            if row.lease_expires_at and row.last_renewed_at
            else None
        )
        rows.append((row.state, row.attempts, row.worker_id, row.outcome, lease_ms, events))
    return [answers, rows]


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "careful"])
def test_the_worker_statements_answer_and_write_what_the_services_do(settings, fast):
    settings.RUNSTATE_FAST_PATHS = fast
    expected = life("services", "services")
    assert life("worker", "worker") == expected
    answers, _ = expected
    assert answers[:5] == [
        ("claim", 1, 5_000, {"n": 1, "s": "é"}, "k1"),
        None,
        "SUCCEEDED",
        None,
        ("refused", "LEASE_LOST"),
    ]
    assert answers[5] == ("claim", 1, 20_000, {"n": 1, "s": "é"}, None)
    assert "CANCELLED" in answers and ("refused", "SCOPE_CANCELLED") in answers


@pytest.mark.postgres_only
def test_the_worker_claim_and_completion_are_one_statement_each_on_the_connection_django_keeps():
    project = project_ensure(name="statements-one")
    mailbox, _ = mailbox_ensure(project_id=project.id, name="jobs", mode="WORK", lease_ttl_ms=20_000)
    run = run_create(project_id=project.id)
    task = task_submit(project_id=project.id, mailbox=mailbox, run_id=run.id, input={})[0]
    connection.ensure_connection()
    raw = connection.connection
    with CaptureQueriesContext(connection) as through_django:
        claim = claims.task_claim_by_id_narrow(
            project_id=project.id, task_id=task.id, worker_id="w", lease_ttl_ms=None, mailbox_id=mailbox.id
        )
        state = claims.claim_complete_narrow(project_id=project.id, claim_id=claim.claim_id, outcome=None)
    assert (claim.attempt, claim.lease_ttl_ms, state) == (1, 20_000, "SUCCEEDED")
    assert through_django.captured_queries == [], "the raw cursor bypasses Django's cursor wrapper"
    assert connection.connection is raw
    assert list(Event.objects.filter(subject_id=str(task.id)).values_list("type", flat=True).order_by("id")) == [
        "task.submitted",
        "task.claimed",
        "task.succeeded",
    ]
