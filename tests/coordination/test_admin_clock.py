"""The admin of barriers and timers, and the periodic sweeps seen through django-celery-beat's admin."""

import re
import uuid
from datetime import timedelta

import pytest
from django.contrib import messages
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from coordination.domain.states import BarrierState, TimerState
from coordination.models import Barrier, Event, Timer
from coordination.services.barriers import barrier_arrive, barrier_create, barrier_next_epoch
from coordination.services.runs import run_cancel, run_create
from coordination.services.timers import timer_create
from workers.schedule import PERIODIC_SWEEPS

BARRIERS = reverse("admin:coordination_barrier_changelist")
TIMERS = reverse("admin:coordination_timer_changelist")
PERIODIC_TASKS = reverse("admin:django_celery_beat_periodictask_changelist")
SWEEPS = {name for name, *_ in PERIODIC_SWEEPS}


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


def cell(html, obj, field):
    """Return the text of ``field``'s column in ``obj``'s changelist row."""
    row = re.search(rf"<tr>(?:(?!</tr>).)*{obj.id}.*?</tr>", html, re.S).group(0)
    return text_of(re.search(rf'<t[dh] class="field-{field}[ "][^>]*>(.*?)</t[dh]>', row, re.S).group(1))


def arrival_rows(html):
    """Return the arrivals table of a barrier's change page as [key, time] cell texts."""
    table = re.search(r'<table class="barrier-arrivals">.*?<tbody>(.*?)</tbody>', html, re.S).group(1)
    return [
        [text_of(cell) for cell in re.findall(r"<td>(.*?)</td>", row, re.S)]
        for row in re.findall(r"<tr>(.*?)</tr>", table, re.S)
    ]


def listed(client, changelist, query):
    return {obj.id for obj in client.get(changelist, query).context["cl"].result_list}


@pytest.fixture
def run(project):
    return run_create(project_id=project.id, name="clocked")


@pytest.fixture
def barrier(project, run):
    def barrier(target=3, name="gate", run=run):
        return barrier_create(project_id=run.project_id, run_id=run.id, target=target, name=name)

    return barrier


@pytest.fixture
def arrive(project):
    def arrive(barrier, *keys):
        for key in keys:
            barrier = barrier_arrive(project_id=barrier.project_id, barrier_id=barrier.id, key=key)
        return barrier

    return arrive


@pytest.fixture
def timer(run):
    def timer(run=run, **when):
        return timer_create(project_id=run.project_id, run_id=run.id, **when)

    return timer


def make_due(timer, seconds_ago=5):
    """Move an armed timer's due time into the past, as the clock would (no service does it)."""
    Timer.objects.filter(id=timer.id).update(fire_at=timezone.now() - timedelta(seconds=seconds_ago))


# Barriers --------------------------------------------------------------------------------


def test_barrier_changelist_and_change_page_show_progress_and_the_arrivals(admin_client, run, barrier, arrive):
    waiting = arrive(barrier(target=3, name="gate"), "alpha", "beta")
    released = arrive(barrier(target=1, name="solo"), "only")

    listing = admin_client.get(BARRIERS)
    page = admin_client.get(change_url(waiting))

    assert listing.status_code == 200
    html = listing.content.decode()
    assert [row.id for row in listing.context["cl"].result_list] == [released.id, waiting.id]
    assert cell(html, waiting, "name") == "gate"
    assert cell(html, waiting, "run_link") == str(run)
    assert change_url(run) in html
    assert cell(html, waiting, "target") == "3"
    assert cell(html, waiting, "epoch") == "1"
    assert cell(html, waiting, "progress") == "2/3"
    assert cell(html, waiting, "state") == BarrierState.WAITING.label
    assert cell(html, waiting, "released_at") == "-"
    assert cell(html, released, "progress") == "1/1"
    assert cell(html, released, "state") == BarrierState.RELEASED.label
    assert cell(html, released, "released_at") != "-"
    assert page.status_code == 200
    assert page.context["title"].startswith("View")
    content = page.content.decode()
    rows = arrival_rows(content)
    assert [row[0] for row in rows] == ["alpha", "beta"]
    assert all(row[1] not in ("", "-") for row in rows)
    assert change_url(run) in content


def test_barrier_change_page_lists_the_current_epoch_only(admin_client, project, barrier, arrive):
    gate = arrive(barrier(target=2), "first", "second")
    barrier_next_epoch(project_id=project.id, barrier_id=gate.id)
    gate = arrive(Barrier.objects.get(id=gate.id), "third")

    content = admin_client.get(change_url(gate)).content.decode()

    assert [row[0] for row in arrival_rows(content)] == ["third"]
    assert "1/2" in text_of(content)

    barrier_next_epoch(project_id=project.id, barrier_id=arrive(gate, "fourth").id)
    content = admin_client.get(change_url(gate)).content.decode()

    assert "none yet in epoch 3" in text_of(content)


def test_barrier_change_page_reads_the_arrivals_in_one_query(admin_client, barrier, arrive):
    few = arrive(barrier(target=10, name="few"), "a")
    many = arrive(barrier(target=10, name="many"), *"abcdefg")

    def queries(gate):
        with CaptureQueriesContext(connection) as captured:
            assert admin_client.get(change_url(gate)).status_code == 200
        return len(captured), len([q for q in captured if "barrierarrival" in q["sql"]])

    assert queries(few) == queries(many)
    assert queries(many)[1] == 1


def test_barriers_cannot_be_added_changed_or_deleted_in_the_admin(admin_client, barrier):
    gate = barrier()

    assert admin_client.get(reverse("admin:coordination_barrier_add")).status_code == 403
    assert admin_client.get(reverse("admin:coordination_barrier_delete", args=[gate.pk])).status_code == 403
    assert admin_client.post(change_url(gate), {"state": "RELEASED", "target": "1"}).status_code == 403
    gate.refresh_from_db()
    assert (gate.state, gate.target) == (BarrierState.WAITING, 3)


def test_barrier_filters_and_search(admin_client, other_project, barrier, arrive):
    released = arrive(barrier(target=1, name="released"), "a")
    waiting = barrier(name="waiting")
    foreign = barrier(name="foreign", run=run_create(project_id=other_project.id))

    assert listed(admin_client, BARRIERS, {"state__exact": "RELEASED"}) == {released.id}
    assert listed(admin_client, BARRIERS, {"project__id__exact": str(other_project.pk)}) == {foreign.id}
    assert listed(admin_client, BARRIERS, {"q": str(waiting.id)}) == {waiting.id}
    assert listed(admin_client, BARRIERS, {"q": "wait"}) == {waiting.id}
    assert listed(admin_client, BARRIERS, {"q": str(uuid.uuid4())}) == set()


def test_barrier_changelist_costs_the_same_queries_for_more_barriers(admin_client, project, barrier, arrive):
    def queries():
        with CaptureQueriesContext(connection) as captured:
            response = admin_client.get(BARRIERS)
        assert response.status_code == 200
        return len(captured), len(response.context["cl"].result_list)

    arrive(barrier(name="b0"), "a")
    few, listed_few = queries()
    for number in range(1, 5):
        arrive(barrier(name=f"b{number}", run=run_create(project_id=project.id)), "a", "b")
    many, listed_many = queries()

    assert (listed_few, listed_many) == (1, 5)
    assert many == few


# Timers ----------------------------------------------------------------------------------


def test_timer_changelist_and_change_page_show_due_time_and_lateness(admin_client, run, timer):
    armed = timer(after_seconds=3600)
    fired = timer(at=timezone.now() - timedelta(seconds=2))
    overdue = timer(after_seconds=3600)
    make_due(overdue)

    listing = admin_client.get(TIMERS)
    page = admin_client.get(change_url(fired))

    assert listing.status_code == 200
    html = listing.content.decode()
    assert {row.id for row in listing.context["cl"].result_list} == {armed.id, fired.id, overdue.id}
    assert cell(html, armed, "run_link") == str(run)
    assert change_url(run) in html
    assert cell(html, armed, "state") == TimerState.ARMED.label
    assert cell(html, fired, "state") == TimerState.FIRED.label
    assert cell(html, armed, "lateness") == "-"
    assert cell(html, armed, "fired_at") == "-"
    assert "due" not in cell(html, armed, "due")
    assert cell(html, overdue, "due").endswith("— due, not fired yet")
    fired.refresh_from_db()
    late = int((fired.fired_at - fired.fire_at).total_seconds() * 1000)
    assert late >= 2000
    assert cell(html, fired, "lateness") == f"{late} ms"
    assert cell(html, fired, "acknowledged_at") == "-"
    assert page.status_code == 200
    assert page.context["title"].startswith("View")
    text = text_of(page.content.decode())
    assert f"{late} ms" in text
    assert change_url(run) in page.content.decode()


def test_timers_cannot_be_added_changed_or_deleted_in_the_admin(admin_client, timer):
    armed = timer(after_seconds=3600)

    assert admin_client.get(reverse("admin:coordination_timer_add")).status_code == 403
    assert admin_client.get(reverse("admin:coordination_timer_delete", args=[armed.pk])).status_code == 403
    assert admin_client.post(change_url(armed), {"state": "FIRED"}).status_code == 403
    assert Timer.objects.get(id=armed.id).state == TimerState.ARMED


def test_timer_filters_and_search(admin_client, other_project, timer):
    armed = timer(after_seconds=3600)
    fired = timer(at=timezone.now() - timedelta(seconds=1))
    foreign = timer(run=run_create(project_id=other_project.id), after_seconds=60)

    assert listed(admin_client, TIMERS, {"state__exact": "FIRED"}) == {fired.id}
    assert listed(admin_client, TIMERS, {"state__exact": "ARMED"}) == {armed.id, foreign.id}
    assert listed(admin_client, TIMERS, {"project__id__exact": str(other_project.pk)}) == {foreign.id}
    assert listed(admin_client, TIMERS, {"q": str(armed.id)}) == {armed.id}
    assert listed(admin_client, TIMERS, {"q": f"  {fired.id} "}) == {fired.id}
    assert listed(admin_client, TIMERS, {"q": str(armed.id)[:8]}) == set()  # exact ids only
    assert listed(admin_client, TIMERS, {"q": str(uuid.uuid4())}) == set()


def test_timer_changelist_costs_the_same_queries_for_more_timers(admin_client, project, timer):
    def queries():
        with CaptureQueriesContext(connection) as captured:
            response = admin_client.get(TIMERS)
        assert response.status_code == 200
        return len(captured), len(response.context["cl"].result_list)

    timer(at=timezone.now() - timedelta(seconds=1))
    few, listed_few = queries()
    for number in range(4):
        run = run_create(project_id=project.id, name=f"r{number}")
        timer(run=run, after_seconds=60 + number)
        timer(run=run, at=timezone.now() - timedelta(seconds=1))
    many, listed_many = queries()

    assert (listed_few, listed_many) == (1, 9)
    assert many == few


# Cancel ----------------------------------------------------------------------------------


def test_cancel_action_disarms_an_armed_timer_and_reports_a_fired_one(admin_client, timer):
    armed = timer(after_seconds=3600)
    fired = timer(at=timezone.now() - timedelta(seconds=1))

    response = post_action(admin_client, TIMERS, "cancel_selected", [armed, fired])

    armed.refresh_from_db()
    fired.refresh_from_db()
    assert armed.state == TimerState.CANCELLED
    assert fired.state == TimerState.FIRED
    assert Event.objects.filter(type="timer.cancelled", subject_id=str(armed.id)).count() == 1
    assert not Event.objects.filter(type="timer.cancelled", subject_id=str(fired.id)).exists()
    assert messages_of(response) == [
        (messages.SUCCESS, f"Cancelled 1 timer: timer {armed.id}."),
        (messages.ERROR, f"Could not cancel 1 timer: timer {fired.id}: TIMER_FIRED (The timer has already fired.)."),
    ]


def test_cancel_action_leaves_a_cancelled_timer_as_it_was(admin_client, project, run, timer):
    armed = timer(after_seconds=3600)
    run_cancel(project_id=project.id, run_id=run.id)  # cancels the run's armed timers

    response = post_action(admin_client, TIMERS, "cancel_selected", [armed])

    assert Timer.objects.get(id=armed.id).state == TimerState.CANCELLED
    assert Event.objects.filter(type="timer.cancelled", subject_id=str(armed.id)).count() == 1  # the run's
    assert messages_of(response) == [
        (messages.INFO, f"Left 1 timer as they were (cancelled already): timer {armed.id}.")
    ]


# Fire ------------------------------------------------------------------------------------


def test_fire_action_fires_a_due_timer_and_leaves_one_not_due_armed(admin_client, timer):
    due = timer(after_seconds=3600)
    make_due(due, seconds_ago=3)
    not_due = timer(after_seconds=3600)

    response = post_action(admin_client, TIMERS, "fire_due_selected", [due, not_due])

    due.refresh_from_db()
    not_due.refresh_from_db()
    assert due.state == TimerState.FIRED
    assert due.fired_at is not None
    assert not_due.state == TimerState.ARMED
    assert not_due.fired_at is None
    assert Event.objects.filter(type="timer.fired", subject_id=str(due.id)).count() == 1
    assert not Event.objects.filter(type="timer.fired", subject_id=str(not_due.id)).exists()
    [(success, fired), (warning, waiting)] = messages_of(response)
    assert (success, warning) == (messages.SUCCESS, messages.WARNING)
    late = int((due.fired_at - due.fire_at).total_seconds() * 1000)
    assert fired == f"Fired 1 timer: timer {due.id} ({late} ms late)."
    assert waiting.startswith(f"Did not fire 1 timer not due yet: timer {not_due.id} (due ")


def test_fire_action_leaves_fired_and_cancelled_timers_and_keeps_the_deadline_rule(admin_client, project, timer):
    fired = timer(at=timezone.now() - timedelta(seconds=1))
    cancelled = timer(after_seconds=3600)
    post_action(admin_client, TIMERS, "cancel_selected", [cancelled])
    deadline = timezone.now() + timedelta(hours=1)
    bounded = run_create(project_id=project.id, deadline=deadline)
    past_deadline = timer(run=bounded, after_seconds=7200)  # due after its run's deadline
    make_due(past_deadline)
    Timer.objects.filter(id=past_deadline.id).update(run_deadline=timezone.now() - timedelta(seconds=10))
    fired_at = Timer.objects.get(id=fired.id).fired_at

    response = post_action(admin_client, TIMERS, "fire_due_selected", [fired, cancelled, past_deadline])

    assert Timer.objects.get(id=fired.id).fired_at == fired_at
    assert Timer.objects.get(id=cancelled.id).state == TimerState.CANCELLED
    assert Timer.objects.get(id=past_deadline.id).state == TimerState.CANCELLED
    assert Event.objects.filter(type="timer.fired").count() == 1  # the one fired at creation
    assert messages_of(response) == [
        (
            messages.WARNING,
            f"Cancelled 1 timer instead of firing them (due at or after their run's deadline): "
            f"timer {past_deadline.id}.",
        ),
        (
            messages.INFO,
            f"Left 2 timers as they were (not armed): timer {fired.id}: FIRED; timer {cancelled.id}: CANCELLED.",
        ),
    ]


# Periodic sweeps -------------------------------------------------------------------------


def test_the_periodic_sweeps_are_listed_in_the_celery_beat_admin(admin_client):
    response = admin_client.get(PERIODIC_TASKS)

    assert response.status_code == 200
    names = {task.name for task in response.context["cl"].result_list}
    assert {name for name in names if name.startswith("runstate: ")} == SWEEPS
    html = response.content.decode()
    for name in SWEEPS:
        assert name in html
