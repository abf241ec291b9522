"""``@runstate_task`` in this process: binding, submit, validation, dispatch after commit, the runtime.

The Celery message itself is exercised by ``test_decorator_live.py`` with a real worker;
here the dispatch is observed as the after-commit callback it registers, and the runtime
(``workers.runtime.execute``, what the worker runs for a delivery) is called directly.
"""

import asyncio
import functools
from types import SimpleNamespace

import pytest
from django.core.exceptions import ImproperlyConfigured

from coordination.domain import exceptions
from coordination.models import Event, Mailbox, Task
from coordination.services.claims import claim_fail, task_claim_by_id
from coordination.services.dispatch import _send_wakes
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.runs import run_cancel, run_create
from coordination.services.tasks import task_submit
from tests.conftest import make_client
from workers import TaskCancelled, runstate_task
from workers.dispatch import send_work
from workers.registry import registry
from workers.runtime import execute

pytestmark = pytest.mark.django_db

PROJECT = "celery-unit"
TITLE_SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string", "minLength": 1}, "words": {"type": "integer", "minimum": 1}},
    "required": ["title"],
}


@runstate_task(mailbox="unit-summaries", project=PROJECT, lease_ttl=20, max_attempts=4, input_schema=TITLE_SCHEMA)
def summarize(ctx, title: str, words: int = 10):
    """Summarize a title."""
    return {"summary": title[:words], "attempt": ctx.attempt}


@runstate_task(mailbox="unit-any", project=PROJECT, max_attempts=3, retry_delay=2)
def takes_anything(ctx, **input):
    if input.get("fail"):
        raise ValueError(f"bad {input['fail']}")
    if input.get("unserializable"):
        return {1, 2}
    if input.get("cancel_check"):
        ctx.check()  # the signal is not set: nothing happens
        raise TaskCancelled("raised by hand")
    return sorted(input)


@runstate_task(mailbox="unit-async", project=PROJECT)
async def sleeps_async(ctx, seconds: float):
    await asyncio.sleep(seconds)
    return {"task": str(ctx.task_id), "run": str(ctx.run_id)}


class Manuscript:
    """A stand-in for a pydantic model: anything with ``model_validate`` works."""

    @classmethod
    def model_validate(cls, value):
        if not isinstance(value, dict) or not isinstance(value.get("pages"), int):
            raise ValueError("pages must be an integer")
        return cls()


@runstate_task(mailbox="unit-model", project=PROJECT, input_model=Manuscript)
def proofread(ctx, pages: int):
    return pages


@pytest.fixture(autouse=True)
def _fresh_ids():
    for task in registry:
        task.forget_ids()


@pytest.fixture
def run():
    return run_create(project_id=summarize.project_id)


def dispatches(callbacks) -> list:
    return [cb for cb in callbacks if isinstance(cb, functools.partial) and cb.func is send_work]


# Binding and submitting ------------------------------------------------------------------


def test_the_decorated_function_is_a_celery_task_bound_to_its_mailbox():
    assert summarize.name == "tests.workers.test_decorator.summarize"
    assert summarize.celery_task.name == summarize.name
    assert summarize.__doc__ == "Summarize a title."
    # Calling the object runs the function itself, here with a context of our own.
    assert summarize(SimpleNamespace(attempt=7), title="abc", words=2) == {"summary": "ab", "attempt": 7}
    assert summarize.key == (PROJECT, "unit-summaries")
    assert summarize in list(registry)


def test_one_decorated_task_per_mailbox():
    with pytest.raises(ImproperlyConfigured):

        @runstate_task(mailbox="unit-summaries", project=PROJECT)
        def another(ctx):  # pragma: no cover - never bound
            pass


@pytest.mark.parametrize(
    "options",
    [{"mailbox": "bad name"}, {"mailbox": "unit-x", "lease_ttl": 0.01}, {"mailbox": "unit-x", "max_attempts": 0}],
)
def test_bad_decorator_arguments_fail_at_import(options):
    with pytest.raises(ImproperlyConfigured):
        runstate_task(project=PROJECT, **options)(lambda ctx: None)
    assert ("celery-unit", "unit-x") not in {task.key for task in registry}


def test_the_mailbox_is_ensured_lazily_with_the_decorator_settings(run):
    mailbox = Mailbox.objects.get(project_id=summarize.project_id, name="unit-summaries")
    assert (mailbox.mode, mailbox.lease_ttl_ms, mailbox.max_attempts) == ("WORK", 20_000, 4)


def test_submit_creates_the_task_and_dispatches_after_commit(run, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks() as callbacks:
        task = summarize.submit(run.id, {"title": "Runstate"}, key="k1", priority=3)
    assert (task.state, task.priority, task.key, task.max_attempts) == ("QUEUED", 3, "k1", 4)
    (sent,) = dispatches(callbacks)
    assert sent.args[:2] == (summarize, task.id)
    # An idempotent resubmit returns the task and, while it is still queued, sends its message
    # again: the client resubmits because it missed the first answer, and the first message can
    # have been lost with it (the commit landed, then the primary died before the API sent it).
    with django_capture_on_commit_callbacks() as callbacks:
        again = summarize.submit(run, {"title": "Runstate"}, key="k1")
    assert again.id == task.id
    (resent,) = dispatches(callbacks)
    assert resent.args[:2] == (summarize, task.id)
    # Once claimed, a resubmit sends nothing: the task is no longer waiting for a worker.
    task_claim_by_id(project_id=run.project_id, task_id=task.id)
    with django_capture_on_commit_callbacks() as callbacks:
        assert summarize.submit(run, {"title": "Runstate"}, key="k1").id == task.id
    assert not dispatches(callbacks)


def test_a_resubmit_whose_first_message_was_lost_is_sent_again_through_the_api(run, django_capture_on_commit_callbacks):
    summarize.ids()
    api = make_client(run.project)
    body = {"runId": str(run.id), "input": {"title": "x"}, "key": "lost-answer"}
    # The first submit commits, but its message is never sent (the callback is not run).
    with django_capture_on_commit_callbacks(execute=False):
        first = api.post("/v1/mailboxes/unit-summaries/tasks", body, format="json")
    assert first.status_code == 201, first.content
    with django_capture_on_commit_callbacks() as callbacks:
        again = api.post("/v1/mailboxes/unit-summaries/tasks", body, format="json")
    assert (again.status_code, again.json()["id"]) == (200, first.json()["id"]), again.content
    (sent,) = dispatches(callbacks)
    assert str(sent.args[1]) == first.json()["id"]


def test_a_batch_submit_publishes_its_messages_in_one_go_after_commit(run, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks() as callbacks:
        tasks = summarize.submit_many(run.id, [{"title": f"t{i}"} for i in range(5)])
    assert [t.state for t in tasks] == ["QUEUED"] * 5
    # One after-commit callback sends every message, one per task, through one producer (on
    # SQLite, where each task is inserted on its own, the others collect the wake-ups first).
    (batch,) = [cb for cb in callbacks if isinstance(cb, functools.partial) and cb.func is _send_wakes]
    assert not dispatches(callbacks)
    for callback in callbacks:
        if callback is not batch:
            callback()
    (wakes,) = batch.args
    assert [wake.args[:2] for wake in wakes] == [(summarize, t.id) for t in tasks]
    with pytest.raises(exceptions.ValidationFailed):
        summarize.submit_many(run.id, [{"title": "ok"}, {"title": ""}])
    assert Task.objects.filter(run=run).count() == 5


def test_a_submit_to_an_unbound_mailbox_sends_nothing(run, django_capture_on_commit_callbacks):
    plain, _ = mailbox_ensure(project_id=run.project_id, name="unit-plain", mode="WORK")
    with django_capture_on_commit_callbacks() as callbacks:
        task_submit(project_id=run.project_id, mailbox=plain, run_id=run.id, input={})
    assert not dispatches(callbacks)


def test_an_api_submit_to_a_bound_mailbox_is_dispatched(run, django_capture_on_commit_callbacks):
    summarize.ids()
    api = make_client(run.project)
    with django_capture_on_commit_callbacks() as callbacks:
        response = api.post(
            "/v1/mailboxes/unit-summaries/tasks", {"runId": str(run.id), "input": {"title": "x"}}, format="json"
        )
    assert response.status_code == 201, response.content
    (sent,) = dispatches(callbacks)
    assert str(sent.args[1]) == response.json()["id"]


def test_a_retry_is_dispatched_for_when_it_is_due(run, django_capture_on_commit_callbacks):
    task = summarize.submit(run.id, {"title": "x"})
    claim = task_claim_by_id(project_id=run.project_id, task_id=task.id)
    with django_capture_on_commit_callbacks() as callbacks:
        claim_fail(project_id=run.project_id, claim_id=claim.claim_id, error="e", retry=True, retry_delay_ms=5000)
    (sent,) = dispatches(callbacks)
    task.refresh_from_db()
    assert sent.args == (summarize, task.id, task.available_at)


# Validation at submit --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("input", "problem"),
    [({}, "'title' is a required property"), ({"title": "t", "words": 0}, "words: 0 is less than the minimum of 1")],
)
def test_input_is_validated_against_the_schema_and_nothing_is_created(run, input, problem):
    with pytest.raises(exceptions.ValidationFailed) as refused:
        summarize.submit(run.id, input)
    assert problem in refused.value.details["input"]
    assert not Task.objects.filter(run=run).exists()
    assert not Event.objects.filter(type="task.submitted", run_id=run.id).exists()


def test_an_api_submit_with_bad_input_is_a_clear_400(run):
    summarize.ids()
    api = make_client(run.project)
    response = api.post("/v1/mailboxes/unit-summaries/tasks", {"runId": str(run.id), "input": {}}, format="json")
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "VALIDATION_ERROR"
    assert "'title' is a required property" in error["details"]["input"]
    assert not Task.objects.filter(run=run).exists()


def test_group_members_are_validated_too(run):
    summarize.ids()
    api = make_client(run.project)
    group = api.post("/v1/groups", {"mailbox": "unit-summaries", "condition": "ALL_TERMINAL"}, format="json").json()
    response = api.post(f"/v1/groups/{group['id']}/members", {"input": {"title": ""}}, format="json")
    assert response.status_code == 400
    assert "title" in response.json()["error"]["details"]["input"]
    ok = api.post(f"/v1/groups/{group['id']}/members", {"input": {"title": "fine"}}, format="json")
    assert ok.status_code == 201


def test_a_group_member_resubmitted_while_queued_is_sent_again(run, django_capture_on_commit_callbacks):
    summarize.ids()
    api = make_client(run.project)
    group = api.post("/v1/groups", {"mailbox": "unit-summaries", "condition": "ALL_TERMINAL"}, format="json").json()
    member = {"input": {"title": "fine"}, "key": "m1"}
    with django_capture_on_commit_callbacks(execute=False):
        first = api.post(f"/v1/groups/{group['id']}/members", member, format="json")
    assert first.status_code == 201, first.content
    with django_capture_on_commit_callbacks() as callbacks:
        again = api.post(f"/v1/groups/{group['id']}/members", member, format="json")
    assert (again.status_code, again.json()["id"]) == (200, first.json()["id"]), again.content
    (sent,) = dispatches(callbacks)
    assert str(sent.args[1]) == first.json()["id"]


def test_input_is_validated_by_a_model(run):
    with pytest.raises(exceptions.ValidationFailed) as refused:
        proofread.submit(run.id, {"pages": "many"})
    assert refused.value.details["input"] == "pages must be an integer"
    assert proofread.submit(run.id, {"pages": 3}).state == "QUEUED"


def test_input_keys_become_keyword_arguments_the_handler_declares():
    assert summarize.kwargs_for({"title": "t", "other": 1}) == {"title": "t"}
    assert takes_anything.kwargs_for({"a": 1, "b": 2}) == {"a": 1, "b": 2}
    assert summarize.kwargs_for(["not", "a", "dict"]) == {}


def test_retry_delay_doubles_per_attempt_up_to_the_cap():
    assert [takes_anything.retry_delay_ms(attempt) for attempt in (1, 2, 3)] == [2000, 4000, 8000]
    assert takes_anything.retry_delay_ms(20) == 300_000


# The runtime: one delivery --------------------------------------------------------------


def test_a_delivery_claims_runs_and_completes(run):
    task = summarize.submit(run.id, {"title": "Coordination", "words": 5})
    assert execute(summarize, str(task.id)) == "SUCCEEDED"
    task.refresh_from_db()
    assert (task.state, task.attempts, task.outcome) == ("SUCCEEDED", 1, {"summary": "Coord", "attempt": 1})
    assert task.worker_id  # host/pid/thread
    # A second delivery of the same message does nothing.
    assert execute(summarize, str(task.id)) == "not_claimable"
    assert Event.objects.filter(type="task.succeeded", subject_id=str(task.id)).count() == 1


def test_an_exception_records_a_failure_retried_with_backoff(run):
    task = takes_anything.submit(run.id, {"fail": "input"})
    assert execute(takes_anything, str(task.id)) == "QUEUED"
    task.refresh_from_db()
    assert task.error["code"] == "handler_error"
    assert (task.error["type"], task.error["message"]) == ("ValueError", "bad input")
    assert "Traceback" in task.error["traceback"]
    assert 1.5 < (task.available_at - task.created_at).total_seconds() < 5
    # Not due yet: a delivery now claims nothing.
    assert execute(takes_anything, str(task.id)) == "not_claimable"


def test_an_outcome_that_is_not_json_fails_without_retry(run):
    task = takes_anything.submit(run.id, {"unserializable": True})
    assert execute(takes_anything, str(task.id)) == "FAILED"
    task.refresh_from_db()
    assert (task.state, task.error["code"], task.attempts) == ("FAILED", "outcome_not_json", 1)


def test_task_cancelled_raised_without_a_request_is_a_failure(run):
    task = takes_anything.submit(run.id, {"cancel_check": True})
    assert execute(takes_anything, str(task.id)) == "QUEUED"
    assert Task.objects.get(id=task.id).error["type"] == "TaskCancelled"


def test_an_async_handler_runs_to_completion(run):
    task = sleeps_async.submit(run.id, {"seconds": 0.01})
    assert execute(sleeps_async, str(task.id)) == "SUCCEEDED"
    assert Task.objects.get(id=task.id).outcome == {"task": str(task.id), "run": str(run.id)}


def test_a_delivery_for_a_cancelled_run_records_nothing(run):
    task = summarize.submit(run.id, {"title": "x"})
    run_cancel(run_id=run.id, project_id=run.project_id)
    assert execute(summarize, str(task.id)) == "SCOPE_CANCELLED"
    task.refresh_from_db()
    assert (task.state, task.attempts) == ("CANCELLED", 0)


def test_a_message_naming_a_task_of_another_mailbox_is_ignored(run):
    task = summarize.submit(run.id, {"title": "x"})
    assert execute(takes_anything, str(task.id)) == "not_found"
    assert Task.objects.get(id=task.id).state == "QUEUED"
