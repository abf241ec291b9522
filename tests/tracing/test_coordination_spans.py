"""Coordination's own spans: a group's finalize, a barrier's release, a timer's firing, a pool or quota wait.

The first ones call the services (spans recorded in memory by the ``spans`` fixture); the waits
run through the API in this process (httpx's ASGI transport), under a span of the caller's.
"""

import asyncio
from datetime import timedelta

import pytest
from django.utils import timezone
from opentelemetry import trace

from coordination.domain.states import MailboxMode
from coordination.models import Timer
from coordination.services.barriers import barrier_arrive, barrier_create
from coordination.services.groups import group_close, group_create
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.runs import run_create
from coordination.services.timers import timer_create, timer_fire, timers_fire_due
from tests.tracing.conftest import by_name, one, request_of
from tests.tracing.test_work_trace import client


@pytest.fixture
def run(project):
    return run_create(project_id=project.id, name="coordination")


@pytest.mark.django_db
def test_a_groups_finalize_is_a_span_with_its_outcome(spans, project, run):
    mailbox_ensure(project_id=project.id, name="work", mode=MailboxMode.WORK)
    group = group_create(project_id=project.id, mailbox_name="work", condition="ALL_TERMINAL", parent_scope_id=run.id)
    assert by_name(spans.get_finished_spans(), "finalize group") == []
    group_close(project_id=project.id, group_id=group.id)  # closed with no member: decided at once
    finalize = one(spans.get_finished_spans(), "finalize group")
    assert finalize.attributes["messaging.system"] == "runstate"
    assert finalize.attributes["runstate.group_id"] == str(group.id)
    assert finalize.attributes["runstate.run_id"] == str(group.scope_id)
    assert finalize.attributes["runstate.outcome"] == "FAILURE"
    assert finalize.attributes["runstate.reason"] == "all_terminal"


@pytest.mark.django_db
def test_the_arrival_that_releases_a_barrier_is_its_span(spans, project, run):
    barrier = barrier_create(project_id=project.id, run_id=run.id, target=2)
    barrier_arrive(project_id=project.id, barrier_id=barrier.id, key="a")
    assert by_name(spans.get_finished_spans(), "release barrier") == []
    barrier_arrive(project_id=project.id, barrier_id=barrier.id, key="b")
    release = one(spans.get_finished_spans(), "release barrier")
    assert release.attributes["runstate.barrier_id"] == str(barrier.id)
    assert release.attributes["runstate.run_id"] == str(run.id)
    assert release.attributes["runstate.arrivals"] == 2
    assert release.attributes["runstate.key"] == "b"


@pytest.mark.django_db
def test_every_timer_firing_is_a_span_and_a_sweep_that_fired_some_is_one(spans, project, run):
    at_once = timer_create(project_id=project.id, run_id=run.id, after_seconds=0)  # due already: fired by the create
    woken = timer_create(project_id=project.id, run_id=run.id, after_seconds=3600)
    swept = [timer_create(project_id=project.id, run_id=run.id, after_seconds=3600) for _ in range(2)]
    past = timezone.now() - timedelta(seconds=1)
    Timer.objects.filter(id__in=[woken.id, *(timer.id for timer in swept)]).update(fire_at=past)
    timer_fire(timer_id=woken.id)
    fired = by_name(spans.get_finished_spans(), "fire timer")
    assert [(span.attributes["runstate.timer_id"], span.attributes["runstate.state"]) for span in fired] == [
        (str(at_once.id), "FIRED"),
        (str(woken.id), "FIRED"),
    ]
    assert timers_fire_due() == 2
    assert one(spans.get_finished_spans(), "fire timers").attributes["runstate.timers"] == 2
    assert timers_fire_due() == 0  # an empty sweep leaves no span
    assert len(by_name(spans.get_finished_spans(), "fire timers")) == 1


@pytest.mark.django_db(transaction=True)
def test_a_pool_acquire_that_waits_is_a_span_under_the_callers(spans, api_key):
    async def scenario():
        async with client(api_key) as rs:
            await rs.pools.put("traced-gpu", capacity=1)
            run = await rs.scopes.create(name="pool")
            first = await rs.pools.acquire("traced-gpu", run_id=run.id)

            async def second():
                return await rs.pools.acquire("traced-gpu", run_id=run.id, wait_ms=20_000)

            with trace.get_tracer("test").start_as_current_span("the waiter") as waiter:
                waiting = asyncio.create_task(second())
            while (await rs.pools.retrieve("traced-gpu"))["waiting"] < 1:
                await asyncio.sleep(0.05)
            await first.release()
            granted = await asyncio.wait_for(waiting, 30)
            await granted.release()
            return run.id, waiter.get_span_context()

    run_id, waiter = asyncio.run(scenario())
    finished = spans.get_finished_spans()
    wait = one(finished, "wait pool traced-gpu")
    assert request_of(finished, wait).parent.span_id == waiter.span_id
    assert wait.context.trace_id == waiter.trace_id
    assert wait.attributes["runstate.pool"] == "traced-gpu"
    assert wait.attributes["runstate.run_id"] == run_id
    assert wait.attributes["runstate.units"] == 1
    assert wait.attributes["runstate.granted"] is True


@pytest.mark.django_db(transaction=True)
def test_a_quota_take_that_waits_for_its_refill_is_a_span_under_the_callers(spans, api_key):
    async def scenario():
        async with client(api_key) as rs:
            await rs.quotas.put("traced-tokens", limit=1, period_ms=3000)
            run = await rs.scopes.create(name="quota")
            await rs.quotas.take("traced-tokens", run_id=run.id)
            with trace.get_tracer("test").start_as_current_span("the taker") as taker:
                taken = await rs.quotas.take("traced-tokens", run_id=run.id, wait_ms=20_000)
            return run.id, taker.get_span_context(), taken

    run_id, taker, taken = asyncio.run(scenario())
    assert taken["granted"] is True
    finished = spans.get_finished_spans()
    wait = one(finished, "wait quota traced-tokens")
    assert request_of(finished, wait).parent.span_id == taker.span_id
    assert wait.attributes["runstate.quota"] == "traced-tokens"
    assert wait.attributes["runstate.run_id"] == run_id
    assert wait.attributes["runstate.amount"] == 1
    assert wait.attributes["runstate.granted"] is True
