"""The admin of mailboxes, tasks and queue deliveries: depth at a glance, changes through the services."""

import re
import time
import uuid

import pytest
from django.contrib import messages
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from coordination.admin import work as work_admin
from coordination.domain import exceptions
from coordination.domain.states import MailboxMode, MessageState, TaskState
from coordination.models import Event, Mailbox, Message, Task
from coordination.services.claims import claim_complete, task_claim
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.runs import run_cancel, run_create
from coordination.services.tasks import task_cancel, task_submit

MAILBOXES = reverse("admin:coordination_mailbox_changelist")
TASKS = reverse("admin:coordination_task_changelist")
MESSAGES = reverse("admin:coordination_message_changelist")
REASON = "cancelled by admin in admin"


def change_url(obj):
    return reverse(f"admin:coordination_{obj._meta.model_name}_change", args=[obj.pk])


def messages_of(response):
    return [(message.level, message.message) for message in response.context["messages"]]


def post_action(client, changelist, action, objects, **extra):
    return client.post(
        changelist, {"action": action, "_selected_action": [str(obj.pk) for obj in objects], **extra}, follow=True
    )


def depth_cell(html, mailbox):
    """Return the text of the depth column of ``mailbox``'s changelist row."""
    row = re.search(rf"<tr>(?:(?!</tr>).)*>{re.escape(mailbox.name)}</a>.*?</tr>", html, re.S).group(0)
    cell = re.search(r'<td class="field-depth">(.*?)</td>', row, re.S).group(1)
    return re.sub(r"<[^>]+>", "", cell)


def make_message(mailbox, run, state=MessageState.QUEUED, **fields):
    # No send/receive service exists yet: the admin only reads messages, so rows made here
    # stand in for what those services will write.
    return Message.objects.create(
        project_id=mailbox.project_id, mailbox=mailbox, run=run, run_path=run.path, state=state, **fields
    )


@pytest.fixture
def run(project):
    return run_create(project_id=project.id, name="batch")


@pytest.fixture
def work(project):
    mailbox, _ = mailbox_ensure(project_id=project.id, name="work", mode=MailboxMode.WORK)
    return mailbox


@pytest.fixture
def submit(project, work, run):
    def submit(**fields):
        task, _ = task_submit(project_id=project.id, mailbox=work, run_id=run.id, input={}, **fields)
        return task

    return submit


@pytest.fixture
def claim(project, work, run):
    def claim():
        [claimed] = task_claim(project_id=project.id, mailbox=work, run_id=run.id, worker_id="w1")
        return claimed

    return claim


# Mailboxes -------------------------------------------------------------------------------


def test_mailbox_changelist_counts_tasks_by_state_and_shows_the_oldest_queued(admin_client, submit, claim, work):
    for _ in range(4):
        submit()
    claim()

    response = admin_client.get(MAILBOXES)

    assert response.status_code == 200
    html = response.content.decode()
    assert depth_cell(html, work) == "QUEUED 3 · RUNNING 1 · CANCELLATION_REQUESTED 0"
    assert f"{TASKS}?mailbox__id__exact={work.pk}&amp;state__exact=QUEUED" in html
    assert "0\xa0minutes" in re.search(r'<td class="field-oldest_queued">(.*?)</td>', html, re.S).group(1)


def test_mailbox_changelist_counts_messages_of_a_queue_mailbox(admin_client, project, run):
    queue, _ = mailbox_ensure(project_id=project.id, name="inbox", mode=MailboxMode.QUEUE)
    make_message(queue, run)
    make_message(queue, run, MessageState.IN_FLIGHT)
    make_message(queue, run, MessageState.DEAD_LETTERED, dead_letter_reason="bad input")
    make_message(queue, run, MessageState.DEAD_LETTERED, dead_letter_reason="bad input")
    make_message(queue, run, MessageState.COMPLETED)

    html = admin_client.get(MAILBOXES).content.decode()

    assert depth_cell(html, queue) == "QUEUED 1 · IN_FLIGHT 1 · DEAD_LETTERED 2"


def test_mailbox_changelist_costs_the_same_queries_for_more_mailboxes(admin_client, project, run):
    def ensure_pair(number):
        work, _ = mailbox_ensure(project_id=project.id, name=f"work-{number}", mode=MailboxMode.WORK)
        queue, _ = mailbox_ensure(project_id=project.id, name=f"queue-{number}", mode=MailboxMode.QUEUE)
        task_submit(project_id=project.id, mailbox=work, run_id=run.id, input={})
        make_message(queue, run)

    def queries():
        with CaptureQueriesContext(connection) as captured:
            response = admin_client.get(MAILBOXES)
        assert response.status_code == 200
        return len(captured), len(response.context["cl"].result_list)

    ensure_pair(0)
    few, listed = queries()
    for number in range(1, 5):
        ensure_pair(number)
    many, listed_many = queries()

    assert (listed, listed_many) == (2, 10)
    assert many == few


def test_mailbox_change_page_shows_the_depth_table_and_edits_the_settings_only(
    admin_client, project, submit, claim, work
):
    for _ in range(3):
        submit()
    claim()
    url = change_url(work)

    page = admin_client.get(url)
    response = admin_client.post(url, {"lease_ttl_ms": "5000", "max_attempts": "7", "name": "renamed", "mode": "QUEUE"})

    assert page.status_code == 200
    assert list(page.context["adminform"].form.fields) == ["lease_ttl_ms", "max_attempts"]
    table = re.search(r"field-depth_table.*?(<table>.*?</table>)", page.content.decode(), re.S).group(1)
    assert re.sub(r"<[^>]+>", " ", table).split() == ["state", "tasks", "QUEUED", "2", "RUNNING", "1"] + [
        "CANCELLATION_REQUESTED",
        "0",
    ]
    assert response.status_code == 302
    work.refresh_from_db()
    assert (work.lease_ttl_ms, work.max_attempts, work.name, work.mode) == (5000, 7, "work", MailboxMode.WORK)


def test_mailbox_change_form_refuses_settings_the_api_would_refuse(admin_client, work):
    response = admin_client.post(change_url(work), {"lease_ttl_ms": "10", "max_attempts": "0"})

    assert response.status_code == 200
    assert set(response.context["adminform"].form.errors) == {"lease_ttl_ms", "max_attempts"}
    work.refresh_from_db()
    assert (work.lease_ttl_ms, work.max_attempts) == (30_000, 3)


def test_mailboxes_cannot_be_added_or_deleted_in_the_admin(admin_client, work):
    assert admin_client.get(reverse("admin:coordination_mailbox_add")).status_code == 403
    assert admin_client.get(reverse("admin:coordination_mailbox_delete", args=[work.pk])).status_code == 403
    assert Mailbox.objects.filter(pk=work.pk).exists()


def test_mailbox_filters_and_search(admin_client, project, other_project, work):
    queue, _ = mailbox_ensure(project_id=project.id, name="inbox", mode=MailboxMode.QUEUE)
    foreign, _ = mailbox_ensure(project_id=other_project.id, name="work", mode=MailboxMode.WORK)

    def listed(query):
        return {mailbox.id for mailbox in admin_client.get(MAILBOXES, query).context["cl"].result_list}

    assert listed({"mode__exact": "QUEUE"}) == {queue.id}
    assert listed({"project__id__exact": str(other_project.pk)}) == {foreign.id}
    assert listed({"q": "inb"}) == {queue.id}


# Tasks -----------------------------------------------------------------------------------


def test_task_changelist_and_change_page_render_read_only(admin_client, submit, claim, run):
    submit()
    running = claim().task
    queued = submit(key="report-1")

    listing = admin_client.get(TASKS)
    page = admin_client.get(change_url(running))

    assert listing.status_code == 200
    html = listing.content.decode()
    assert change_url(run) in html  # the run column links to the run
    assert "1/3" in html  # attempts/maxAttempts of the running task
    assert [task.id for task in listing.context["cl"].result_list] == [queued.id, running.id]  # newest first
    assert page.status_code == 200
    assert page.context["title"].startswith("View")
    assert f"c_{running.id.hex}_1" in page.content.decode()  # the current claim
    assert admin_client.post(change_url(running), {"state": "SUCCEEDED"}).status_code == 403
    assert Task.objects.get(id=running.id).state == TaskState.RUNNING


def test_tasks_cannot_be_added_or_deleted_in_the_admin(admin_client, submit):
    task = submit()

    assert admin_client.get(reverse("admin:coordination_task_add")).status_code == 403
    assert admin_client.get(reverse("admin:coordination_task_delete", args=[task.pk])).status_code == 403


def test_task_search_matches_an_exact_id_or_key(admin_client, submit):
    first = submit(key="invoice-7")
    second = submit(key="invoice-70")

    def found(term):
        return [task.id for task in admin_client.get(TASKS, {"q": term}).context["cl"].result_list]

    assert found(str(second.id)) == [second.id]
    assert found("invoice-7") == [first.id]
    assert found("invoice") == []
    assert found(str(uuid.uuid4())) == []


def test_task_filters_by_state_project_and_offers_only_work_mailboxes(
    admin_client, project, other_project, submit, claim, work
):
    submit()
    running = claim().task
    submit()
    other_work, _ = mailbox_ensure(project_id=project.id, name="work-2", mode=MailboxMode.WORK)
    mailbox_ensure(project_id=project.id, name="inbox", mode=MailboxMode.QUEUE)

    response = admin_client.get(TASKS, {"state__exact": "RUNNING", "mailbox__id__exact": str(work.pk)})

    assert [task.id for task in response.context["cl"].result_list] == [running.id]
    mailbox_filter = next(spec for spec in response.context["cl"].filter_specs if spec.field_path == "mailbox")
    assert [pk for pk, _ in mailbox_filter.lookup_choices] == [work.pk, other_work.pk]
    assert admin_client.get(TASKS, {"project__id__exact": str(project.pk)}).context["cl"].result_count == 2
    assert admin_client.get(TASKS, {"project__id__exact": str(other_project.pk)}).context["cl"].result_count == 0


def test_cancel_action_cancels_a_queued_task_and_asks_a_running_one_to_stop(admin_client, submit, claim):
    submit()
    running = claim().task
    queued = submit()

    response = post_action(admin_client, TASKS, "cancel_selected", [queued, running], apply="1")

    queued.refresh_from_db()
    running.refresh_from_db()
    assert (queued.state, queued.cancel_reason) == (TaskState.CANCELLED, REASON)
    assert (running.state, running.cancel_reason) == (TaskState.CANCELLATION_REQUESTED, REASON)
    events = Event.objects.filter(subject_id__in=[str(queued.id), str(running.id)]).exclude(
        type__in=["task.submitted", "task.claimed"]
    )
    assert {(event.type, event.subject_id, event.data["reason"]) for event in events} == {
        ("task.cancelled", str(queued.id), REASON),
        ("task.cancellation_requested", str(running.id), REASON),
    }
    assert messages_of(response) == [
        (messages.SUCCESS, f"Cancelled 1 task (they were queued): {queued}."),
        (
            messages.SUCCESS,
            f"Asked 1 task to stop (running: the worker learns it at its next renewal): {running}.",
        ),
    ]


def test_cancel_action_leaves_finished_tasks_unchanged(admin_client, project, submit, claim):
    submit()
    claimed = claim()
    done = claim_complete(project_id=project.id, claim_id=claimed.claim_id, outcome={})

    response = post_action(admin_client, TASKS, "cancel_selected", [done], apply="1")

    assert Task.objects.get(id=done.id).state == TaskState.SUCCEEDED
    assert not Event.objects.filter(subject_id=str(done.id), type__startswith="task.cancel").exists()
    [(level, text)] = messages_of(response)
    assert level == messages.INFO
    assert text.startswith("Left 1 task unchanged")


def test_release_action_puts_a_running_task_back_and_its_old_claim_is_lost(admin_client, project, submit, claim):
    submit()
    claimed = claim()
    queued = submit()

    response = post_action(admin_client, TASKS, "release_selected", [claimed.task, queued])

    task = Task.objects.get(id=claimed.task.id)
    assert (task.state, task.worker_id, task.lease_expires_at) == (TaskState.QUEUED, "", None)
    assert Event.objects.filter(subject_id=str(task.id), type="task.requeued", data__cause="released").count() == 1
    with pytest.raises(exceptions.LeaseLost):
        claim_complete(project_id=project.id, claim_id=claimed.claim_id, outcome={})
    assert Task.objects.get(id=task.id).state == TaskState.QUEUED
    assert messages_of(response) == [
        (
            messages.SUCCESS,
            f"Released 1 task back to the queue (their old claims are LEASE_LOST from now on): {task}.",
        ),
        (messages.INFO, f"Skipped 1 task not running: {Task.objects.get(id=queued.id)}."),
    ]


def test_release_action_ends_a_task_that_was_asked_to_stop(admin_client, project, submit, claim):
    submit()
    claimed = claim()
    task_cancel(project_id=project.id, task_id=claimed.task.id, reason="enough")

    post_action(admin_client, TASKS, "release_selected", [claimed.task])

    assert Task.objects.get(id=claimed.task.id).state == TaskState.CANCELLED


def test_release_action_reports_a_claim_taken_over_since_the_page_was_read(
    admin_client, project, work, run, submit, monkeypatch
):
    submit()
    [first] = task_claim(project_id=project.id, mailbox=work, run_id=run.id, lease_ttl_ms=100)
    as_selected = Task.objects.get(id=first.task.id)  # what the admin read: attempt 1
    time.sleep(0.2)
    [second] = task_claim(project_id=project.id, mailbox=work, run_id=run.id)  # crash takeover
    monkeypatch.setattr(work_admin, "_tasks_of", lambda queryset: [as_selected])

    response = post_action(admin_client, TASKS, "release_selected", [as_selected])

    assert second.attempt == 2
    task = Task.objects.get(id=first.task.id)
    assert (task.state, task.attempts) == (TaskState.RUNNING, 2)  # the new claim keeps it
    [(level, text)] = messages_of(response)
    assert level == messages.ERROR
    assert "LEASE_LOST" in text


def test_task_changelist_costs_the_same_queries_for_more_tasks(admin_client, project, submit):
    submit()

    def queries():
        with CaptureQueriesContext(connection) as captured:
            assert admin_client.get(TASKS).status_code == 200
        return len(captured)

    few = queries()
    for number in range(5):
        other_run = run_create(project_id=project.id, name=f"run-{number}")
        mailbox, _ = mailbox_ensure(project_id=project.id, name=f"work-{number}", mode=MailboxMode.WORK)
        task_submit(project_id=project.id, mailbox=mailbox, run_id=other_run.id, input={})

    assert queries() == few


# Queue deliveries ------------------------------------------------------------------------


def test_message_admin_lists_and_shows_deliveries_read_only(admin_client, project, run):
    queue, _ = mailbox_ensure(project_id=project.id, name="inbox", mode=MailboxMode.QUEUE)
    dead = make_message(queue, run, MessageState.DEAD_LETTERED, key="m-1", dead_letter_reason="bad input")
    make_message(queue, run)

    listing = admin_client.get(MESSAGES)
    by_id = admin_client.get(MESSAGES, {"q": str(dead.id)})
    by_key = admin_client.get(MESSAGES, {"q": "m-1"})
    dead_only = admin_client.get(MESSAGES, {"state__exact": "DEAD_LETTERED"})
    page = admin_client.get(change_url(dead))

    assert listing.status_code == 200
    assert "bad input" in listing.content.decode()
    assert change_url(run) in listing.content.decode()
    assert [message.id for message in by_id.context["cl"].result_list] == [dead.id]
    assert [message.id for message in by_key.context["cl"].result_list] == [dead.id]
    assert [message.id for message in dead_only.context["cl"].result_list] == [dead.id]
    assert page.status_code == 200
    assert page.context["title"].startswith("View")
    assert admin_client.post(change_url(dead), {"state": "QUEUED"}).status_code == 403
    assert admin_client.get(reverse("admin:coordination_message_add")).status_code == 403
    assert admin_client.get(reverse("admin:coordination_message_delete", args=[dead.pk])).status_code == 403
    assert Message.objects.get(id=dead.id).state == MessageState.DEAD_LETTERED


def test_rerun_action_reruns_finished_tasks_and_says_why_others_were_refused(admin_client, project, submit, claim):
    submit()
    claimed = claim()
    done = claim_complete(project_id=project.id, claim_id=claimed.claim_id, outcome={})
    queued = submit()

    response = post_action(admin_client, TASKS, "rerun_selected", [done, queued])

    [rerun] = Task.objects.filter(rerun_of=done)
    assert (rerun.state, rerun.mailbox_id, rerun.run_id, rerun.input) == (
        TaskState.QUEUED,
        done.mailbox_id,
        done.run_id,
        done.input,
    )
    assert not Task.objects.filter(rerun_of=queued).exists()
    queued = Task.objects.get(id=queued.id)
    assert messages_of(response) == [
        (
            messages.SUCCESS,
            f"Rerun 1 task (each as a new queued task in the same mailbox and run): {Task.objects.get(id=done.id)} "
            f"as {rerun.id}.",
        ),
        (messages.ERROR, f"Could not rerun 1 task: {queued}: INVALID_STATE (Only a finished task can be rerun.)."),
    ]


def test_rerun_action_under_a_cancelled_run_is_refused_with_its_code(admin_client, project, run, submit):
    cancelled = task_cancel(project_id=project.id, task_id=submit().id)
    run_cancel(project_id=project.id, run_id=run.id)

    response = post_action(admin_client, TASKS, "rerun_selected", [cancelled])

    assert not Task.objects.filter(rerun_of=cancelled).exists()
    [(level, text)] = messages_of(response)
    assert level == messages.ERROR and "SCOPE_CANCELLED" in text


def test_task_page_links_a_rerun_to_its_source(admin_client, project, submit):
    cancelled = task_cancel(project_id=project.id, task_id=submit().id)
    post_action(admin_client, TASKS, "rerun_selected", [cancelled])
    [rerun] = Task.objects.filter(rerun_of=cancelled)

    response = admin_client.get(change_url(rerun))

    assert response.status_code == 200
    assert str(cancelled.id) in response.content.decode()
