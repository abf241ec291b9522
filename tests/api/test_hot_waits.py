"""The waits on the hot path (coordination/api/hot/waits.py) answer exactly what their DRF views answer.

The harness of ``tests/api/test_hot_path.py``: each request goes through the real ASGI
application once with the hot path on and once off, on fresh state built the same way (a
project and its cached keys, a running task, groups, barriers and timers in each state), and
status, body and headers must be equal once ids and times are replaced by placeholders.
``hot.SERVED`` shows the hot path answered. Waits decided while waiting are compared the
same way, with a waiter through DRF parked on the same watch as the hot path's (they share
one rendering); waiters racing a decision each get it once; a waiter whose client leaves
leaves nothing behind.
"""

import asyncio
import contextlib
import json
import random
import re
import uuid
from dataclasses import dataclass
from datetime import timedelta

import httpx
import pytest
from django.utils import timezone

from coordination.api import hot, longpoll, waits
from coordination.api.hot import db as hot_db
from coordination.domain.states import Permission, Verdict
from coordination.models import Event, Run, Task, TaskGroup
from coordination.plumbing import metrics
from coordination.reads import selectors
from coordination.reads.selectors import Visibility
from coordination.services.barriers import barrier_arrive, barrier_create
from coordination.services.claims import claim_complete, task_claim
from coordination.services.groups import group_create, group_submit, group_verdict
from coordination.services.keys import api_key_create
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.runs import run_cancel, run_create
from coordination.services.tasks import task_submit
from coordination.services.timers import timer_create
from tests.api.test_hot_path import (
    WRITE,
    State,
    _cached_key,
    answered,
    api_process,  # noqa: F401 - the fixture
    complete,
    fresh_state,
    normalized,
    request,
)
from tests.api.test_process_cache import caches_on
from tests.api.test_wait_render_once import undecided_group
from tests.concurrency.test_coalesced_waits import asgi_request
from tests.waiting import until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres_only]


@dataclass
class WaitState:
    """``test_hot_path.State`` and the objects waited on."""

    base: State
    project_id: uuid.UUID
    uncached_key: str  # the same project's, not in the process cache yet: its requests take the DRF path
    open_group: str
    open_member: str
    decided_group: str
    due_group: str
    gate_inactive_group: str
    busy_group: str
    waiting_barrier: str
    released_barrier: str
    cancelled_barrier: str
    armed_timer: str
    fired_timer: str


def fresh_wait_state() -> WaitState:
    """Build ``fresh_state()`` and, in its project, groups, barriers and timers in each state a wait meets."""
    base = fresh_state()
    run = Run.objects.select_related("project").get(id=base.run_id)
    project = run.project
    open_group, open_member = undecided_group(project)
    decided_group, decided_member = undecided_group(project)
    group_verdict(project_id=project.id, group_id=decided_group.id, task_id=decided_member.id, verdict=Verdict.ACCEPTED)
    due_group, _ = undecided_group(project)
    # Its deadline passed a moment ago (as if time went by): the wait's first read finalizes it.
    TaskGroup.objects.filter(id=due_group.id).update(deadline=timezone.now() - timedelta(seconds=1))
    # Below a run whose deadline passed (as if time went by): its gate is inactive, so it is due.
    parent = run_create(project_id=project.id, deadline=timezone.now() + timedelta(hours=1))
    gate_inactive = group_create(
        project_id=project.id, mailbox_name="reviews", condition="N_ACCEPTED", threshold=1, parent_scope_id=parent.id
    )
    Run.objects.filter(id=parent.id).update(deadline=timezone.now() - timedelta(seconds=1))
    busy = _busy_group(project)
    waiting = barrier_create(project_id=project.id, run_id=run.id, target=2)
    released = barrier_create(project_id=project.id, run_id=run.id, target=1)
    barrier_arrive(project_id=project.id, barrier_id=released.id, key="a")
    child = run_create(project_id=project.id, parent_id=run.id)
    cancelled = barrier_create(project_id=project.id, run_id=child.id, target=2)
    run_cancel(project_id=project.id, run_id=child.id)
    armed = timer_create(project_id=project.id, run_id=run.id, after_seconds=3600)
    fired = timer_create(project_id=project.id, run_id=run.id, at=timezone.now() - timedelta(seconds=1))
    return WaitState(
        base=base,
        project_id=project.id,
        uncached_key=api_key_create(project_id=project.id, permissions=WRITE).plaintext,
        open_group=str(open_group.id),
        open_member=str(open_member.id),
        decided_group=str(decided_group.id),
        due_group=str(due_group.id),
        gate_inactive_group=str(gate_inactive.id),
        busy_group=str(busy.id),
        waiting_barrier=str(waiting.id),
        released_barrier=str(released.id),
        cancelled_barrier=str(cancelled.id),
        armed_timer=str(armed.id),
        fired_timer=str(fired.id),
    )


def _busy_group(project):
    """An open group needing two accepts: four keyed members, two queued, one accepted, one rejected."""
    mailbox, _ = mailbox_ensure(project_id=project.id, name="reviews", mode="WORK")
    busy = group_create(project_id=project.id, mailbox_name="reviews", condition="N_ACCEPTED", threshold=2)
    members = [group_submit(project_id=project.id, group_id=busy.id, input={"n": n}, key=f"k{n}")[0] for n in range(4)]
    for claim in task_claim(project_id=project.id, mailbox=mailbox, run_id=busy.scope_id, max_claims=2):
        claim_complete(project_id=project.id, claim_id=claim.claim_id, outcome={"n": 1})
    done = [task for task in members if Task.objects.get(id=task.id).state == "SUCCEEDED"]
    group_verdict(project_id=project.id, group_id=busy.id, task_id=done[0].id, verdict=Verdict.ACCEPTED)
    group_verdict(project_id=project.id, group_id=busy.id, task_id=done[1].id, verdict=Verdict.REJECTED)
    assert TaskGroup.objects.get(id=busy.id).state == "OPEN"
    return busy


def get(path: str, key: str | None, **kwargs) -> tuple:
    """A GET without a body: ``(path, None, headers, "GET")``."""
    return (*request(path, None, key, **kwargs), "GET")


def result(s: WaitState, query="?timeoutMs=30", key=None, task_id=None, **kwargs):
    return get(f"/v1/tasks/{task_id or s.base.task_id}/result{query}", key or s.base.key, **kwargs)


def group(s: WaitState, group_id: str, query="?timeoutMs=30", key=None):
    return get(f"/v1/groups/{group_id}/wait{query}", key or s.base.key)


def barrier(s: WaitState, barrier_id: str, query="?timeoutMs=30", key=None):
    return get(f"/v1/barriers/{barrier_id}/wait{query}", key or s.base.key)


def timer(s: WaitState, timer_id: str, query="?timeoutMs=30", key=None):
    return request(f"/v1/timers/{timer_id}/wait{query}", None, key or s.base.key)


UNKNOWN = str(uuid.UUID(int=7))

CASES = {
    "task result, decided before": lambda s: [complete(s.base), result(s, "?timeoutMs=5000")],
    "task result, timeout": lambda s: [result(s)],
    "task result, no wait": lambda s: [result(s, "")],
    "task result, timeoutMs 0": lambda s: [result(s, "?timeoutMs=0")],
    "task result, a parameter twice": lambda s: [result(s, "?timeoutMs=nonsense&timeoutMs=10")],
    "task result, read-only key": lambda s: [result(s, key=s.base.read_only_key)],
    "task result, accept json": lambda s: [result(s, accept="application/json")],
    "task result, accept html": lambda s: [result(s, accept="text/html")],
    "task result, negative timeout": lambda s: [result(s, "?timeoutMs=-1")],
    "task result, timeout not a number": lambda s: [result(s, "?timeoutMs=soon")],
    "task result, unknown parameter": lambda s: [result(s, "?timeoutMs=10&bogus=1")],
    "task result, unknown task": lambda s: [result(s, task_id=UNKNOWN)],
    "task result, malformed id": lambda s: [result(s, task_id="nonsense")],
    "task result, foreign key": lambda s: [result(s, key=s.base.foreign_key)],
    "task result, bound key": lambda s: [result(s, key=s.base.bound_key)],
    "task result, without a key": lambda s: [get(f"/v1/tasks/{s.base.task_id}/result", None)],
    "task result, a wrong key": lambda s: [result(s, auth="Bearer rs_000000000000_nope")],
    "task result, uncached key": lambda s: [result(s, key=s.uncached_key)],
    "task result, POST": lambda s: [request(f"/v1/tasks/{s.base.task_id}/result", None, s.base.key)],
    "group wait, decided before": lambda s: [group(s, s.decided_group, "?timeoutMs=5000")],
    "group wait, timeout": lambda s: [group(s, s.open_group)],
    "group wait, no wait": lambda s: [group(s, s.open_group, "")],
    "group wait, past its deadline": lambda s: [group(s, s.due_group, "?timeoutMs=5000")],
    "group wait, its gate inactive": lambda s: [group(s, s.gate_inactive_group, "?timeoutMs=5000")],
    "group wait, members in every state (timeout)": lambda s: [group(s, s.busy_group)],
    "group wait, unknown group": lambda s: [group(s, UNKNOWN)],
    "group wait, foreign key": lambda s: [group(s, s.open_group, key=s.base.foreign_key)],
    "group wait, bound key": lambda s: [group(s, s.open_group, key=s.base.bound_key)],
    "group wait, invalid timeout": lambda s: [group(s, s.open_group, "?timeoutMs=1.5")],
    "group wait, with a body": lambda s: [(*request(f"/v1/groups/{s.decided_group}/wait", b"{}", s.base.key), "GET")],
    "barrier wait, released before": lambda s: [barrier(s, s.released_barrier, "?timeoutMs=5000")],
    "barrier wait, timeout": lambda s: [barrier(s, s.waiting_barrier)],
    "barrier wait, cancelled": lambda s: [barrier(s, s.cancelled_barrier, "?timeoutMs=5000")],
    "barrier wait, unknown barrier": lambda s: [barrier(s, UNKNOWN)],
    "barrier wait, foreign key": lambda s: [barrier(s, s.waiting_barrier, key=s.base.foreign_key)],
    "barrier wait, bound key": lambda s: [barrier(s, s.waiting_barrier, key=s.base.bound_key)],
    "barrier wait, negative timeout": lambda s: [barrier(s, s.waiting_barrier, "?timeoutMs=-5")],
    "timer wait, armed (timeout)": lambda s: [timer(s, s.armed_timer)],
    "timer wait, fired (acknowledged by the view), then again": lambda s: [
        timer(s, s.fired_timer),
        timer(s, s.fired_timer, "?timeoutMs=5000"),
    ],
    "timer wait, unknown timer": lambda s: [timer(s, UNKNOWN)],
    "timer wait, read-only key": lambda s: [timer(s, s.armed_timer, key=s.base.read_only_key)],
    "timer wait, bound key": lambda s: [timer(s, s.armed_timer, key=s.base.bound_key)],
    "timer wait, foreign key": lambda s: [timer(s, s.armed_timer, key=s.base.foreign_key)],
    "timer wait, GET": lambda s: [get(f"/v1/timers/{s.armed_timer}/wait", s.base.key)],
    "timer wait, with a body": lambda s: [request(f"/v1/timers/{s.armed_timer}/wait", b"{}", s.base.key)],
}

# How many of each case's requests the hot path answers itself (the rest: the view).
SERVED_BY_HOT = {
    "task result, decided before": 2,  # the complete, then the wait
    "task result, timeout": 1,
    "task result, no wait": 1,
    "task result, timeoutMs 0": 1,
    "task result, a parameter twice": 1,  # the last value, as the view reads it
    "task result, read-only key": 1,
    "task result, accept json": 1,
    "group wait, decided before": 1,
    "group wait, timeout": 1,
    "group wait, no wait": 1,
    "group wait, members in every state (timeout)": 1,
    "barrier wait, released before": 1,
    "barrier wait, timeout": 1,
    "barrier wait, cancelled": 1,  # BARRIER_CANCELLED from the hot path
    "timer wait, armed (timeout)": 1,
    "timer wait, fired (acknowledged by the view), then again": 1,  # the second: acknowledged already
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_hot_path_waits_answer_what_drf_answers(api_process, case):  # noqa: F811
    hot_answers, hot_served = answered(api_process, True, CASES[case], fresh_wait_state)
    drf_answers, drf_served = answered(api_process, False, CASES[case], fresh_wait_state)
    assert hot_answers == drf_answers
    assert drf_served == 0
    assert hot_served == SERVED_BY_HOT.get(case, 0), "the hot path did not answer what it serves"


def test_rate_limited_waits_are_answered_alike(api_process):  # noqa: F811
    api_process.RUNSTATE_RATE_LIMIT = "2/min"

    def build(s):
        return [group(s, s.decided_group), barrier(s, s.released_barrier), result(s, "?timeoutMs=0")]

    hot_answers, hot_served = answered(api_process, True, build, fresh_wait_state)
    drf_answers, _ = answered(api_process, False, build, fresh_wait_state)
    assert [status for status, _, _ in hot_answers] == [200, 200, 429]
    assert hot_answers == drf_answers
    assert hot_served == 3


def _served() -> int:
    """Return how many requests the hot path has answered itself in this process."""
    return sum(n for name, n in hot.SERVED.items() if name not in ("declined", "careful"))


@contextlib.asynccontextmanager
async def app_client():
    """An HTTP client of the ASGI application on this loop, the hot pool open (closed after)."""
    from runstate_project.asgi import application

    await (await hot_db.pool()).wait(timeout=30)
    try:
        transport = httpx.ASGITransport(app=application)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=60) as client:
            yield client
    finally:
        await hot_db.close()


def _parked() -> float:
    return metrics.WAITERS_PARKED._value.get()


def _rendered(wait: str) -> float:
    return metrics.WAIT_ANSWERS_RENDERED.labels(wait)._value.get()


# Each wait decided while its waiters wait: (label, the waiters' request, what decides it, in a thread).
def _task_decided(s: WaitState):
    return (
        "task",
        result(s, "?timeoutMs=20000"),
        lambda: claim_complete(project_id=s.project_id, claim_id=s.base.claim_id, outcome={"ok": True}),
    )


def _group_decided(s: WaitState):
    return (
        "group",
        group(s, s.open_group, "?timeoutMs=20000"),
        lambda: group_verdict(
            project_id=s.project_id, group_id=s.open_group, task_id=s.open_member, verdict=Verdict.ACCEPTED
        ),
    )


def _barrier_decided(s: WaitState):
    def arrive_twice():
        barrier_arrive(project_id=s.project_id, barrier_id=s.waiting_barrier, key="a")
        barrier_arrive(project_id=s.project_id, barrier_id=s.waiting_barrier, key="b")

    return "barrier", barrier(s, s.waiting_barrier, "?timeoutMs=20000"), arrive_twice


def _barrier_cancelled(s: WaitState):
    return (
        "barrier",
        barrier(s, s.waiting_barrier, "?timeoutMs=20000"),
        lambda: run_cancel(project_id=s.project_id, run_id=uuid.UUID(s.base.run_id)),
    )


def _timer_fires(s: WaitState):
    # Due in a few seconds: the watch re-reads when it is due, and its read acknowledges it.
    soon = timer_create(project_id=s.project_id, run_id=uuid.UUID(s.base.run_id), after_seconds=5)
    return "timer", timer(s, str(soon.id), "?timeoutMs=20000"), None


WHILE_WAITING = {
    "task": _task_decided,
    "group": _group_decided,
    "barrier released": _barrier_decided,
    "barrier cancelled": _barrier_cancelled,
    "timer": _timer_fires,
}


def answered_while_waiting(settings, hot_on: bool, scenario) -> tuple[list[tuple], int, float]:
    """Park three waiters (two by a cached key, one by a key the cache does not know), decide, answer them.

    Return the answers (normalized), how many the hot path served and how many renderings the
    decision cost.
    """
    settings.RUNSTATE_HOT_PATH = hot_on
    caches_on(settings)
    state = fresh_wait_state()
    label, (path, body, headers, *method), decide = scenario(state)
    other = dict(headers, Authorization=f"Bearer {state.uncached_key}")
    method = method[0] if method else "POST"
    served = _served()
    parked, rendered = _parked(), _rendered(label)

    async def run():
        async with app_client() as client:
            sent = [
                asyncio.ensure_future(client.request(method, path, content=body, headers=each))
                for each in (headers, headers, other)
            ]
            await until(lambda: _parked() == parked + 3 or any(s.done() for s in sent), what="three waiters parked")
            assert not any(s.done() for s in sent), [s.result() for s in sent if s.done()]
            if decide is not None:
                await longpoll.db(decide)
            return await asyncio.gather(*sent)

    answers = asyncio.run(run())
    assert _parked() == parked
    served = _served() - served
    return normalized(answers), served, _rendered(label) - rendered


@pytest.mark.parametrize("scenario", list(WHILE_WAITING))
def test_waits_decided_while_waiting_are_answered_alike_and_rendered_once(api_process, scenario):  # noqa: F811
    hot_answers, hot_served, hot_rendered = answered_while_waiting(api_process, True, WHILE_WAITING[scenario])
    drf_answers, drf_served, drf_rendered = answered_while_waiting(api_process, False, WHILE_WAITING[scenario])
    assert hot_answers == drf_answers
    statuses = {status for status, _, _ in hot_answers}
    assert statuses == ({409} if scenario == "barrier cancelled" else {200})
    # The three waiters got the same bytes (the uncached key's through DRF, on the same watch).
    assert len({body for _, body, _ in hot_answers}) == 1
    assert (hot_served, drf_served) == (2, 0)
    # One rendering of the decision, shared by the hot path's waiters and the view's.
    assert (hot_rendered, drf_rendered) == ((0, 0) if scenario == "barrier cancelled" else (1, 1))


def test_the_waits_cap_is_the_views(api_process):  # noqa: F811
    """A key holding ``RUNSTATE_MAX_WAITS_PER_KEY`` waits is refused one more, by either path."""
    api_process.RUNSTATE_MAX_WAITS_PER_KEY = 1

    def refused(hot_on: bool) -> tuple:
        api_process.RUNSTATE_HOT_PATH = hot_on
        caches_on(api_process)
        state = fresh_wait_state()
        path, _, headers, _ = group(state, state.open_group, "?timeoutMs=20000")

        async def run():
            async with app_client() as client:
                return await refused_while_one_waits(lambda: client.get(path, headers=headers))

        return normalized([asyncio.run(run())])[0]

    hot_answer, drf_answer = refused(True), refused(False)
    assert hot_answer == drf_answer
    assert hot_answer[0] == 429
    assert json.loads(hot_answer[1])["error"]["code"] == "RATE_LIMITED"


async def refused_while_one_waits(send):
    """Park one wait sent by ``send()``, then return the answer to a second one (the first is cancelled).

    The first is awaited to its end once cancelled: what its cancellation does (giving back its
    place, a claim it may hold) needs the hot pool, which the caller closes next. Closed first,
    a pool reopened by that clean-up was left behind, its workers retrying a connection forever.
    """
    parked = _parked()
    first = asyncio.ensure_future(send())
    await until(lambda: _parked() == parked + 1, what="the first wait parked")
    second = await send()
    first.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await first
    return second


def test_a_hot_waiter_whose_client_leaves_leaves_nothing_behind(api_process):  # noqa: F811
    state = fresh_wait_state()
    path = f"/v1/groups/{state.open_group}/wait"
    before = hot.SERVED["GroupWait"]
    api_key_id = _key_id(state.base.key)

    async def run():
        await (await hot_db.pool()).wait(timeout=30)
        parked = _parked()
        try:
            app, gone, sent = asgi_request(path, "timeoutMs=20000", state.base.key)
            await until(lambda: _parked() == parked + 1, what="the waiter parked")
            assert longpoll.watches() and waits.waits_held(api_key_id=api_key_id) == 1
            gone.set()
            await asyncio.wait_for(app, 30)
            return sent, longpoll.watches(), _parked() - parked
        finally:
            await hot_db.close()

    sent, watches, still_parked = asyncio.run(run())
    assert sent == []  # nothing answered to a client that left
    assert watches == {}
    assert still_parked == 0
    assert waits.waits_held(api_key_id=api_key_id) == 0
    assert hot.SERVED["GroupWait"] == before  # the wait was cancelled, not answered


def leaving_client(body: bytes):
    """Return an ASGI client's ``receive`` and ``send``, what was sent to it, and the event that makes it leave."""
    gone = asyncio.Event()
    pending = [{"type": "http.request", "body": body, "more_body": False}]
    sent = []

    async def receive():
        if pending:
            return pending.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    return receive, send, sent, gone


def _key_id(plaintext: str):
    from coordination.models import ApiKey

    return ApiKey.objects.get(prefix=plaintext.split("_")[1]).id


@pytest.mark.parametrize("round_", range(3))
def test_waiters_racing_a_decision_each_get_it_once(api_process, round_):  # noqa: F811
    """Waiters arrive before, during and after the deciding verdict (in a thread): each gets the decision once."""
    state = fresh_wait_state()
    waiters, rng = 30, random.Random(round_)
    keys = [state.base.key, _cached_key_of(state), state.uncached_key]
    path = f"/v1/groups/{state.open_group}/wait?timeoutMs=20000"
    decide_after = rng.randrange(waiters)

    async def run():
        async with app_client() as client:
            sent, deciding = [], None
            for n in range(waiters):
                if n == decide_after:
                    deciding = asyncio.ensure_future(
                        longpoll.db(
                            group_verdict,
                            project_id=state.project_id,
                            group_id=state.open_group,
                            task_id=state.open_member,
                            verdict=Verdict.ACCEPTED,
                        )
                    )
                headers = {"Authorization": f"Bearer {keys[n % len(keys)]}"}
                sent.append(asyncio.ensure_future(client.get(path, headers=headers)))
                await asyncio.sleep(rng.random() / 100)
            await deciding
            return await asyncio.gather(*sent)

    parked = _parked()
    answers = asyncio.run(run())
    assert [answer.status_code for answer in answers] == [200] * waiters
    assert {answer.json()["state"] for answer in answers} == {"FINALIZED"}
    assert len({answer.content for answer in answers}) == 1
    assert Event.objects.filter(type="group.finalized", subject_id=state.open_group).count() == 1
    assert _parked() == parked
    for key in keys:
        assert waits.waits_held(api_key_id=_key_id(key)) == 0


def _cached_key_of(state: WaitState) -> str:
    """Another cached key of the state's project (its waiters share the watch of the first key's)."""
    from coordination.models import Project

    return _cached_key(Project.objects.get(id=state.project_id), permissions=[Permission.COORDINATION_READ])


def test_the_hot_path_steps_aside_while_the_process_traces(api_process):  # noqa: F811
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    from tests.tracing.conftest import reset_tracing_globals

    reset_tracing_globals()
    trace.set_tracer_provider(TracerProvider())
    try:
        answers, served = answered(api_process, True, CASES["group wait, decided before"], fresh_wait_state)
    finally:
        reset_tracing_globals()
    assert [status for status, _, _ in answers] == [200]
    assert served == 0


# The event long-poll: GET /v1/events (waitMs). Its cursors ("<txid>-<id>"), and the times and
# lateness in its events' data, differ between two fresh states by construction, as ids do.
_EVENT_VALUES = [
    (re.compile(rb'"\d+-\d+"'), b'"<cursor>"'),
    (re.compile(rb"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?\+00:00"), b"<time>"),
    (re.compile(rb'"lateMs":\d+'), b'"lateMs":<ms>'),
]
_PAST_THE_END = "9223372036854775807-0"


def cursors_hidden(answers: list[tuple]) -> list[tuple]:
    """Return normalized answers with the event values that differ by construction replaced."""
    hidden = []
    for status, body, headers in answers:
        for pattern, placeholder in _EVENT_VALUES:
            body = pattern.sub(placeholder, body)
        hidden.append((status, body, headers))
    return hidden


def page(s: WaitState, query: str = "", key=None):
    return get(f"/v1/events{query}", key or s.base.key)


EVENT_CASES = {
    "events": lambda s: [page(s)],
    "events, some types": lambda s: [page(s, "?types=task.submitted,barrier.created&limit=3")],
    "events, after the start": lambda s: [page(s, "?after=0-0&limit=2")],
    "events of a run": lambda s: [page(s, f"?runId={s.base.run_id}&limit=5")],
    "events, nothing new (timeout)": lambda s: [page(s, f"?after={_PAST_THE_END}&waitMs=30")],
    "events, a foreign key": lambda s: [page(s, key=s.base.foreign_key)],
    "events, a read-only key": lambda s: [page(s, "?limit=1", key=s.base.read_only_key)],
    "events, malformed cursor": lambda s: [page(s, "?after=nonsense")],
    "events, malformed cursor and waitMs": lambda s: [page(s, "?after=1-x&waitMs=1000")],
    "events, unknown run": lambda s: [page(s, f"?runId={UNKNOWN}")],
    "events, foreign run": lambda s: [page(s, f"?runId={s.base.foreign_run_id}")],
    "events, limit 0": lambda s: [page(s, "?limit=0")],
    "events, negative waitMs": lambda s: [page(s, "?waitMs=-1")],
    "events, bound key": lambda s: [page(s, key=s.base.bound_key)],
    "events, uncached key": lambda s: [page(s, key=s.uncached_key)],
}
EVENTS_SERVED_BY_HOT = {
    "events": 1,
    "events, some types": 1,
    "events, after the start": 1,
    "events of a run": 1,
    "events, nothing new (timeout)": 1,
    "events, a foreign key": 1,
    "events, a read-only key": 1,
    "events, malformed cursor": 1,  # VALIDATION_ERROR from the hot path
    "events, malformed cursor and waitMs": 1,
}


@pytest.mark.parametrize("case", list(EVENT_CASES))
def test_the_hot_event_long_poll_answers_what_drf_answers(api_process, case):  # noqa: F811
    hot_answers, hot_served = answered(api_process, True, EVENT_CASES[case], fresh_wait_state)
    drf_answers, drf_served = answered(api_process, False, EVENT_CASES[case], fresh_wait_state)
    assert cursors_hidden(hot_answers) == cursors_hidden(drf_answers)
    assert drf_served == 0
    assert hot_served == EVENTS_SERVED_BY_HOT.get(case, 0), "the hot path did not answer what it serves"


def events_while_waiting(settings, hot_on: bool) -> tuple[list[tuple], int]:
    """Two readers wait at the head of the log (a cached key's, an uncached key's); a submit wakes them."""
    settings.RUNSTATE_HOT_PATH = hot_on
    caches_on(settings)
    state = fresh_wait_state()
    visibility = Visibility(project_id=state.project_id)
    path = f"/v1/events?after={selectors.event_head(visibility)}&waitMs=20000&types=task.submitted"
    run = Run.objects.get(id=state.base.run_id)
    mailbox = mailbox_ensure(project_id=state.project_id, name="work", mode="WORK")[0]
    served = _served()
    parked = _parked()

    async def run_():
        async with app_client() as client:
            sent = [
                asyncio.ensure_future(client.get(path, headers={"Authorization": f"Bearer {key}"}))
                for key in (state.base.key, state.uncached_key)
            ]
            await until(lambda: _parked() == parked + 2 or any(s.done() for s in sent), what="two readers parked")
            assert not any(s.done() for s in sent), [s.result() for s in sent if s.done()]
            await longpoll.db(
                task_submit, project_id=state.project_id, mailbox=mailbox, run_id=run.id, input={"new": 1}
            )
            return await asyncio.gather(*sent)

    answers = asyncio.run(run_())
    served = _served() - served
    return cursors_hidden(normalized(answers)), served


def test_an_event_long_poll_woken_by_an_event_is_answered_alike(api_process):  # noqa: F811
    hot_answers, hot_served = events_while_waiting(api_process, True)
    drf_answers, drf_served = events_while_waiting(api_process, False)
    assert hot_answers == drf_answers
    assert (hot_served, drf_served) == (1, 0)
    assert {status for status, _, _ in hot_answers} == {200}
    # Each reader got the one new event.
    assert [[e["type"] for e in json.loads(body)["events"]] for _, body, _ in hot_answers] == [["task.submitted"]] * 2


def test_waiters_joining_before_the_first_read_is_sent_share_it(api_process, monkeypatch):  # noqa: F811
    """Twenty waits on one group that join while the first read waits for a connection cost one statement."""
    api_process.RUNSTATE_HOT_POOL_SIZE = 1
    monkeypatch.setattr(hot_db, "READY_GRACE_S", 30.0)  # the connection is held on purpose below
    state = fresh_wait_state()
    statements = []
    fetch = hot_db.fetch

    async def counted(statement, params, **kwargs):
        statements.append(statement)
        return await fetch(statement, params, **kwargs)

    monkeypatch.setattr(hot_db, "fetch", counted)
    path = f"/v1/groups/{state.open_group}/wait?timeoutMs=1"
    headers = {"Authorization": f"Bearer {state.base.key}"}

    async def run():
        async with app_client() as client:
            async with (await hot_db.pool()).connection():  # the pool's only connection, held
                sent = [asyncio.ensure_future(client.get(path, headers=headers)) for _ in range(20)]
                members = lambda: sum(w.members for w in longpoll.watches().values())  # noqa: E731
                await until(lambda: members() == 20, what="twenty waiters joined")
            return await asyncio.gather(*sent)

    served = hot.SERVED["GroupWait"]
    answers = asyncio.run(run())
    assert [answer.status_code for answer in answers] == [200] * 20
    assert {answer.json()["state"] for answer in answers} == {"OPEN"}
    assert hot.SERVED["GroupWait"] == served + 20
    assert statements == [selectors.GROUP_WAIT_SQL]
