"""The admin of task groups: progress at a glance, members and verdicts, close through the service."""

import re
import uuid
from datetime import timedelta

import pytest
from django.contrib import messages
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from coordination.admin import groups as groups_admin
from coordination.domain import exceptions
from coordination.domain.states import GroupCondition, GroupOutcome, GroupState, MailboxMode, TaskState, Verdict
from coordination.models import Event, Run, Task, TaskGroup
from coordination.services.claims import claim_complete, task_claim
from coordination.services.groups import group_close, group_create, group_submit, group_verdict
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.runs import run_create

GROUPS = reverse("admin:coordination_taskgroup_changelist")


def change_url(obj):
    return reverse(f"admin:coordination_{obj._meta.model_name}_change", args=[obj.pk])


def messages_of(response):
    return [(message.level, message.message) for message in response.context["messages"]]


def post_action(client, changelist, action, objects):
    return client.post(
        changelist, {"action": action, "_selected_action": [str(obj.pk) for obj in objects]}, follow=True
    )


def text_of(html):
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html)).strip()


def cell(html, group, field):
    """Return the text of ``field``'s column in ``group``'s changelist row."""
    row = re.search(rf"<tr>(?:(?!</tr>).)*{group.id}.*?</tr>", html, re.S).group(0)
    return text_of(re.search(rf'<td class="field-{field}">(.*?)</td>', row, re.S).group(1))


def member_rows(html):
    """Return the members table of a change page as lists of cell texts, without its header."""
    table = re.search(r'<table class="group-members">.*?<tbody>(.*?)</tbody>', html, re.S).group(1)
    return [
        [text_of(cell) for cell in re.findall(r"<td>(.*?)</td>", row, re.S)]
        for row in re.findall(r"<tr>(.*?)</tr>", table, re.S)
    ]


@pytest.fixture
def work(project):
    mailbox, _ = mailbox_ensure(project_id=project.id, name="reviews", mode=MailboxMode.WORK)
    return mailbox


@pytest.fixture
def create(project, work):
    def create(condition=GroupCondition.N_ACCEPTED, **fields):
        if condition == GroupCondition.N_ACCEPTED:
            fields.setdefault("threshold", 1)
        return group_create(project_id=project.id, mailbox_name=work.name, condition=condition, **fields)

    return create


@pytest.fixture
def submit(project):
    def submit(group, key):
        task, _, _ = group_submit(project_id=project.id, group_id=group.id, input={"draft": key}, key=key)
        return task

    return submit


@pytest.fixture
def succeed(project, work):
    """Claim every queued member of the group on its gate and complete them."""

    def succeed(group):
        claims = task_claim(project_id=project.id, mailbox=work, run_id=group.scope_id, max_claims=100)
        return [claim_complete(project_id=project.id, claim_id=claim.claim_id, outcome={}) for claim in claims]

    return succeed


@pytest.fixture
def verdict(project):
    def verdict(group, task, value):
        return group_verdict(project_id=project.id, group_id=group.id, task_id=task.id, verdict=value)

    return verdict


# Changelist and change page --------------------------------------------------------------


def test_changelist_and_change_page_show_members_verdicts_and_a_late_one(
    admin_client, project, create, submit, succeed, verdict
):
    parent = run_create(project_id=project.id, name="review round")
    group = create(threshold=1, name="drafts", parent_scope_id=parent.id)
    first, second = submit(group, "a"), submit(group, "b")
    succeed(group)
    waiting = submit(group, "c")
    verdict(group, first, Verdict.ACCEPTED)  # the threshold: finalizes SUCCESS, cancels "c"
    late = verdict(group, second, Verdict.REJECTED).member

    listing = admin_client.get(GROUPS)
    page = admin_client.get(change_url(group))

    assert late.late is True
    assert listing.status_code == 200
    html = listing.content.decode()
    assert [row.id for row in listing.context["cl"].result_list] == [group.id]
    assert cell(html, group, "state") == GroupState.FINALIZED.label
    assert cell(html, group, "outcome") == GroupOutcome.SUCCESS.label
    assert cell(html, group, "outcome_reason") == "threshold_reached"
    assert cell(html, group, "member_count") == "3"
    assert cell(html, group, "progress") == "1/1"
    assert page.status_code == 200
    assert page.context["title"].startswith("View")
    content = page.content.decode()
    group.refresh_from_db()
    text = text_of(content)
    assert "SUCCESS (threshold_reached)" in text
    assert change_url(group.scope) in content  # the gate run
    assert change_url(parent) in content  # the parent run
    rows = member_rows(content)
    assert [row[1:5] for row in rows] == [
        ["a", TaskState.SUCCEEDED, Verdict.ACCEPTED, "no"],
        ["b", TaskState.SUCCEEDED, Verdict.REJECTED, "late"],
        ["c", TaskState.CANCELLED, "-", "no"],
    ]
    assert [row[0] for row in rows] == [str(first.id), str(second.id), str(waiting.id)]
    for task in (first, second, waiting):
        assert change_url(task) in content
    assert rows[0][5] != "-" and rows[1][5] != "-" and rows[2][5] == "-"  # verdict times
    assert admin_client.post(change_url(group), {"state": "OPEN"}).status_code == 403
    assert TaskGroup.objects.get(id=group.id).state == GroupState.FINALIZED


def test_change_page_of_an_open_group_without_members(admin_client, create):
    group = create(GroupCondition.ALL_TERMINAL, expected_members=4)

    page = admin_client.get(change_url(group))

    assert page.status_code == 200
    text = text_of(page.content.decode())
    assert "— (undecided)" in text
    assert "none (the gate is a root run)" in text
    assert "Expected members: 4" in text.replace(" :", ":")
    assert change_url(group.scope) in page.content.decode()


def test_groups_cannot_be_added_or_deleted_in_the_admin(admin_client, create):
    group = create()

    assert admin_client.get(reverse("admin:coordination_taskgroup_add")).status_code == 403
    assert admin_client.get(reverse("admin:coordination_taskgroup_delete", args=[group.pk])).status_code == 403
    assert TaskGroup.objects.filter(pk=group.pk).exists()


def test_progress_counts_accepted_against_threshold_or_members(admin_client, create, submit, succeed, verdict):
    n_accepted = create(threshold=2, name="two of three")
    for key in "abc":
        submit(n_accepted, key)
    first, *_ = succeed(n_accepted)
    verdict(n_accepted, first, Verdict.ACCEPTED)

    all_terminal = create(GroupCondition.ALL_TERMINAL, name="all")
    for key in "ab":
        submit(all_terminal, key)
    judged, _ = succeed(all_terminal)
    verdict(all_terminal, judged, Verdict.ACCEPTED)

    first_accepted = create(GroupCondition.FIRST_ACCEPTED, name="first")
    for key in "abc":
        submit(first_accepted, key)

    late_accept = create(threshold=1, name="late")
    winner, runner_up = submit(late_accept, "a"), submit(late_accept, "b")
    succeed(late_accept)
    verdict(late_accept, winner, Verdict.ACCEPTED)
    verdict(late_accept, runner_up, Verdict.ACCEPTED)  # recorded late: did not count

    html = admin_client.get(GROUPS).content.decode()

    assert cell(html, n_accepted, "progress") == "1/2"
    assert cell(html, all_terminal, "progress") == "1/2"
    assert cell(html, first_accepted, "progress") == "0/3"
    assert cell(html, late_accept, "progress") == "1/1 (+1 late)"


def test_filters_and_search(admin_client, project, other_project, create, submit, succeed, verdict):
    decided = create(threshold=1, name="decided")
    verdict(decided, succeed_one(submit, succeed, decided), Verdict.ACCEPTED)
    waiting = create(GroupCondition.FIRST_ACCEPTED, name="waiting")
    mailbox_ensure(project_id=other_project.id, name="reviews", mode=MailboxMode.WORK)
    foreign = group_create(
        project_id=other_project.id, mailbox_name="reviews", condition=GroupCondition.ALL_TERMINAL, name="foreign"
    )

    def listed(query):
        return {group.id for group in admin_client.get(GROUPS, query).context["cl"].result_list}

    assert listed({"state__exact": "FINALIZED"}) == {decided.id}
    assert listed({"condition__exact": "FIRST_ACCEPTED"}) == {waiting.id}
    assert listed({"outcome__exact": "SUCCESS"}) == {decided.id}
    assert listed({"project__id__exact": str(other_project.pk)}) == {foreign.id}
    assert listed({"q": str(waiting.id)}) == {waiting.id}
    assert listed({"q": "wait"}) == {waiting.id}
    assert listed({"q": str(uuid.uuid4())}) == set()


def succeed_one(submit, succeed, group):
    submit(group, "only")
    [task] = succeed(group)
    return task


def test_changelist_costs_the_same_queries_for_more_groups(admin_client, create, submit, succeed, verdict):
    def make(number):
        group = create(threshold=2, name=f"group-{number}")
        first, _ = submit(group, "a"), submit(group, "b")
        succeed(group)
        verdict(group, first, Verdict.ACCEPTED)

    def queries():
        with CaptureQueriesContext(connection) as captured:
            response = admin_client.get(GROUPS)
        assert response.status_code == 200
        return len(captured), len(response.context["cl"].result_list)

    make(0)
    few, listed = queries()
    for number in range(1, 5):
        make(number)
    many, listed_many = queries()

    assert (listed, listed_many) == (1, 5)
    assert many == few


# Close -----------------------------------------------------------------------------------


def test_close_action_seals_or_finalizes_as_the_rules_say(admin_client, create, submit):
    empty = create(GroupCondition.ALL_TERMINAL, name="empty")
    pending = create(threshold=1, name="pending")
    submit(pending, "a")  # still acceptable: the closed group waits for its verdict

    response = post_action(admin_client, GROUPS, "close_selected", [empty, pending])

    empty.refresh_from_db()
    pending.refresh_from_db()
    assert (empty.state, empty.outcome, empty.outcome_reason) == (
        GroupState.FINALIZED,
        GroupOutcome.FAILURE,
        "all_terminal",
    )
    assert (pending.state, pending.outcome, pending.closed_at is not None) == (GroupState.SEALED, None, True)
    for group in (empty, pending):
        assert Event.objects.filter(type="group.closed", subject_id=str(group.id)).count() == 1
    assert Event.objects.filter(type="group.finalized", subject_id=str(empty.id)).count() == 1
    assert messages_of(response) == [
        (
            messages.SUCCESS,
            f"Closed 2 groups: empty {empty.id}: FINALIZED FAILURE (all_terminal); pending {pending.id}: SEALED.",
        )
    ]


def test_close_action_leaves_closed_groups_and_reports_errors(
    admin_client, project, create, submit, succeed, verdict, monkeypatch
):
    decided = create(threshold=1, name="decided")
    verdict(decided, succeed_one(submit, succeed, decided), Verdict.ACCEPTED)
    sealed = create(threshold=1, name="sealed")
    submit(sealed, "a")
    group_close(project_id=project.id, group_id=sealed.id)
    broken = create(GroupCondition.FIRST_ACCEPTED, name="broken")

    def closing(*, project_id, group_id):
        if group_id == broken.id:
            raise exceptions.GroupFinalized(groupId=str(group_id))
        return group_close(project_id=project_id, group_id=group_id)

    monkeypatch.setattr(groups_admin, "group_close", closing)

    response = post_action(admin_client, GROUPS, "close_selected", [decided, sealed, broken])

    assert Event.objects.filter(type="group.closed").count() == 1  # the one closed before, by the service
    assert TaskGroup.objects.get(id=broken.id).state == GroupState.OPEN
    [(info, unchanged), (error, failed)] = messages_of(response)
    assert (info, error) == (messages.INFO, messages.ERROR)
    assert unchanged == (
        f"Left 2 groups as they were (closed already): decided {decided.id}: FINALIZED SUCCESS (threshold_reached); "
        f"sealed {sealed.id}: SEALED."
    )
    assert failed.startswith(f"Could not close 1 group: broken {broken.id}: GROUP_FINALIZED")


def test_a_group_past_its_deadline_is_shown_due_and_the_close_action_decides_it(admin_client, create, submit):
    group = create(GroupCondition.FIRST_ACCEPTED, name="late", deadline=timezone.now() + timedelta(hours=1))
    task = submit(group, "a")
    past = timezone.now() - timedelta(seconds=1)
    # The clock moving on, as the API tests do it: no service sets a deadline in the past.
    TaskGroup.objects.filter(id=group.id).update(deadline=past)
    Run.objects.filter(id=group.scope_id).update(deadline=past)
    Task.objects.filter(id=task.id).update(run_deadline=past)

    page = admin_client.get(change_url(group))

    assert "OPEN — due" in text_of(page.content.decode())
    assert TaskGroup.objects.get(id=group.id).state == GroupState.OPEN  # reading the page decides nothing

    response = post_action(admin_client, GROUPS, "close_selected", [group])

    group.refresh_from_db()
    assert (group.state, group.outcome, group.outcome_reason) == (
        GroupState.FINALIZED,
        GroupOutcome.FAILURE,
        "deadline",
    )
    assert Task.objects.get(id=task.id).state == TaskState.CANCELLED
    assert messages_of(response) == [
        (messages.SUCCESS, f"Closed 1 group: late {group.id}: FINALIZED FAILURE (deadline).")
    ]
