"""Claims that wait (``waitMs`` above 0) on the hot path answer exactly what the DRF view answers.

The harness of ``tests/api/test_hot_path.py`` and ``test_hot_waits.py``: each request goes
through the real ASGI application with the hot path on and off, on identical fresh state, and
status, body and headers must be equal; ``hot.SERVED`` shows that the hot path answered. A
claim woken by a submit is compared the same way; waiting claimers racing submits (a real
thread on its own connection) take every task exactly once; a waiter whose client leaves
leaves nothing behind, and a claim that committed while its client was leaving goes back to
the queue rather than staying held until its lease runs out.
"""

import asyncio
import json
import random
import threading
import uuid

import pytest

from coordination.api import hot, longpoll, waits
from coordination.api.hot import db as hot_db
from coordination.domain.states import TaskState
from coordination.models import Event, Mailbox, Task
from coordination.plumbing import metrics
from coordination.services.runs import run_cancel
from coordination.services.tasks import task_submit
from tests.api.test_hot_path import (
    answered,
    api_process,  # noqa: F401 - the fixture
    claims,
    fresh_state,
    normalized,
)
from tests.api.test_hot_waits import _key_id, app_client, leaving_client, refused_while_one_waits
from tests.api.test_process_cache import caches_on
from tests.concurrency.util import run_closing
from tests.operator.live import asgi_http_scope
from tests.waiting import until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres_only]


def waiting(state, wait_ms=5000, **body):
    """A claim of the state's run that may wait ``wait_ms``."""
    return claims(state, {"runId": state.run_id, "waitMs": wait_ms, **body})


def drained(state):
    """Claim the state's two queued tasks at once (no wait): the queue is empty after."""
    return claims(state, {"runId": state.run_id, "max": 5})


def _cancelled(state):
    """The state's run cancelled (its run still cached as running): a claim is refused."""
    run_cancel(project_id=_project_id(state), run_id=uuid.UUID(state.run_id))
    return [waiting(state)]


async def post(client, sent: tuple):
    """POST a request built as ``(path, body, headers)``."""
    path, body, headers = sent
    return await client.post(path, content=body, headers=headers)


def _project_id(state):
    return Task.objects.get(id=state.task_id).project_id


CASES = {
    "claim that may wait, tasks queued": lambda s: [waiting(s)],
    "claim that may wait, two": lambda s: [waiting(s, max=2, workerId="w9", leaseTtlMs=5000)],
    "claim that may wait, the wait runs out": lambda s: [drained(s), waiting(s, wait_ms=50)],
    "claim that may wait, waitMs past 30 s (clamped)": lambda s: [waiting(s, wait_ms=30_001)],
    "claim that may wait, negative waitMs": lambda s: [waiting(s, wait_ms=-1)],
    "claim that may wait, waitMs not a number": lambda s: [waiting(s, wait_ms="soon")],
    "claim that may wait, waitMs a fraction": lambda s: [waiting(s, wait_ms=1.5)],
    "claim that may wait, the run cancelled": _cancelled,
    "claim that may wait, bound key": lambda s: [claims(s, {"runId": s.run_id, "waitMs": 50}, key=s.bound_key)],
    "claim that may wait, foreign key": lambda s: [claims(s, {"runId": s.run_id, "waitMs": 50}, key=s.foreign_key)],
}
# How many of each case's requests the hot path answers itself (the rest: the view).
SERVED_BY_HOT = {
    "claim that may wait, tasks queued": 1,
    "claim that may wait, two": 1,
    "claim that may wait, the wait runs out": 2,
    "claim that may wait, waitMs past 30 s (clamped)": 1,
    "claim that may wait, the run cancelled": 1,  # SCOPE_CANCELLED from the careful path, in a thread hop
}


@pytest.mark.parametrize("case", list(CASES))
def test_claims_that_wait_on_the_hot_path_answer_what_drf_answers(api_process, case):  # noqa: F811
    hot_answers, hot_served = answered(api_process, True, CASES[case])
    drf_answers, drf_served = answered(api_process, False, CASES[case])
    assert hot_answers == drf_answers
    assert drf_served == 0
    assert hot_served == SERVED_BY_HOT.get(case, 0), "the hot path did not answer what it serves"


def test_the_run_cancelled_is_refused_alike(api_process):  # noqa: F811
    hot_answers, _ = answered(api_process, True, _cancelled)
    assert hot_answers[0][0] == 409
    assert json.loads(hot_answers[0][1])["error"]["code"] == "SCOPE_CANCELLED"


def test_rate_limited_claims_that_wait_are_answered_alike(api_process):  # noqa: F811
    api_process.RUNSTATE_RATE_LIMIT = "2/min"

    def build(state):
        return [waiting(state), waiting(state), waiting(state)]

    hot_answers, hot_served = answered(api_process, True, build)
    drf_answers, _ = answered(api_process, False, build)
    assert [status for status, _, _ in hot_answers] == [200, 200, 429]
    assert hot_answers == drf_answers
    assert hot_served == 3


def _parked() -> float:
    return metrics.WAITERS_PARKED._value.get()


def _served() -> int:
    return hot.SERVED["ClaimTasks"]


def woken_by_a_submit(settings, hot_on: bool) -> tuple[list[tuple], int]:
    """Park a claim on an empty queue, submit a task (in a thread), and return its answer and the hot path's count."""
    settings.RUNSTATE_HOT_PATH = hot_on
    caches_on(settings)
    state = fresh_state()
    mailbox = Mailbox.objects.get(project_id=_project_id(state), name="work")
    path, body, headers = waiting(state, wait_ms=20_000)
    parked = _parked()

    async def run():
        async with app_client() as client:
            first = await post(client, drained(state))
            served = _served()
            sent = asyncio.ensure_future(client.post(path, content=body, headers=headers))
            await until(lambda: _parked() == parked + 1 or sent.done(), what="the claim parked")
            assert not sent.done(), sent.result()
            await longpoll.db(
                task_submit, project_id=mailbox.project_id, mailbox=mailbox, run_id=uuid.UUID(state.run_id), input=7
            )
            return [first, await sent], _served() - served

    answers, served = asyncio.run(run())
    assert _parked() == parked
    return normalized(answers), served


def test_a_claim_woken_by_a_submit_is_answered_alike(api_process):  # noqa: F811
    hot_answers, hot_served = woken_by_a_submit(api_process, True)
    drf_answers, drf_served = woken_by_a_submit(api_process, False)
    assert hot_answers == drf_answers
    assert (hot_served, drf_served) == (1, 0)
    [claim] = json.loads(hot_answers[1][1])["claims"]
    assert claim["task"]["input"] == 7


def test_the_waits_cap_is_the_views_for_claims(api_process):  # noqa: F811
    """A key holding ``RUNSTATE_MAX_WAITS_PER_KEY`` waits is refused one more claim that may wait, by either path."""
    api_process.RUNSTATE_MAX_WAITS_PER_KEY = 1

    def refused(hot_on: bool) -> tuple:
        api_process.RUNSTATE_HOT_PATH = hot_on
        caches_on(api_process)
        state = fresh_state()
        path, body, headers = waiting(state, wait_ms=20_000)

        async def run():
            async with app_client() as client:
                await post(client, drained(state))
                return await refused_while_one_waits(lambda: client.post(path, content=body, headers=headers))

        return normalized([asyncio.run(run())])[0]

    hot_answer, drf_answer = refused(True), refused(False)
    assert hot_answer == drf_answer
    assert hot_answer[0] == 429
    assert json.loads(hot_answer[1])["error"]["code"] == "RATE_LIMITED"


@pytest.mark.parametrize("round_", range(3))
def test_waiting_claimers_racing_submits_take_every_task_exactly_once(api_process, round_):  # noqa: F811
    """Twelve claimers wait (hot path, and the view by an uncached key); a thread submits 30 tasks meanwhile."""
    from tests.api.test_hot_waits import fresh_wait_state

    state = fresh_wait_state()
    base, rng = state.base, random.Random(round_)
    mailbox = Mailbox.objects.get(project_id=state.project_id, name="work")
    run_id = uuid.UUID(base.run_id)
    claimers, tasks = 12, 30
    keys = [base.key, base.key, state.uncached_key]  # a third through the view, on the same watch
    submitted: list[uuid.UUID] = []
    errors: list[BaseException] = []

    def submit_all():
        for n in range(tasks):
            submitted.append(task_submit(project_id=state.project_id, mailbox=mailbox, run_id=run_id, input=n)[0].id)
            if rng.random() < 0.3:
                threading.Event().wait(rng.random() / 50)

    async def run():
        taken: list[dict] = []
        async with app_client() as client:
            drained_answer = await post(client, drained(base))
            before = {claim["task"]["id"] for claim in drained_answer.json()["claims"]}

            async def claimer(n: int):
                headers = {"Authorization": f"Bearer {keys[n % len(keys)]}", "Content-Type": "application/json"}
                body = json.dumps({"runId": base.run_id, "waitMs": 2000, "max": 1 + n % 3, "workerId": f"w{n}"})
                deadline = asyncio.get_running_loop().time() + 60
                while len(taken) < tasks and asyncio.get_running_loop().time() < deadline:
                    answer = await client.post("/v1/mailboxes/work/claims", content=body, headers=headers)
                    assert answer.status_code == 200, answer.text
                    taken.extend(answer.json()["claims"])

            thread = threading.Thread(target=run_closing(submit_all, errors))
            waiters = [asyncio.ensure_future(claimer(n)) for n in range(claimers)]
            await asyncio.sleep(0.05)
            thread.start()
            await asyncio.gather(*waiters)
            await asyncio.to_thread(thread.join)
        return taken, before

    served = _served()
    taken, before = asyncio.run(run())
    assert errors == []
    ids = [uuid.UUID(claim["task"]["id"]) for claim in taken]
    assert len(ids) == len(set(ids)) == tasks  # each claimed once, none lost
    assert set(ids) == set(submitted)
    assert not before & {str(i) for i in ids}
    held = Task.objects.filter(id__in=submitted)
    assert {task.state for task in held} == {TaskState.RUNNING}
    assert {task.attempts for task in held} == {1}
    assert Event.objects.filter(type="task.claimed", subject_id__in=submitted).count() == tasks
    assert _served() > served  # the hot path answered claims
    for key in set(keys):
        assert waits.waits_held(api_key_id=_key_id(key)) == 0


def _claim_scope(state, wait_ms: int) -> tuple[dict, bytes]:
    body = json.dumps({"runId": state.run_id, "waitMs": wait_ms, "workerId": "leaving"}).encode()
    scope = asgi_http_scope(
        "/v1/mailboxes/work/claims",
        "",
        [
            (b"authorization", f"Bearer {state.key}".encode()),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
    )
    scope["method"] = "POST"
    return scope, body


def test_a_waiting_claim_whose_client_leaves_leaves_nothing_behind(api_process):  # noqa: F811
    state = fresh_state()
    api_key_id = _key_id(state.key)
    served = _served()

    async def run():
        from runstate_project.asgi import application

        async with app_client() as client:
            await post(client, drained(state))
        await (await hot_db.pool()).wait(timeout=30)
        parked = _parked()
        scope, body = _claim_scope(state, 20_000)
        receive, send, sent, gone = leaving_client(body)
        try:
            app = asyncio.create_task(application(scope, receive, send))
            await until(lambda: _parked() == parked + 1, what="the claim parked")
            assert longpoll.watches() and waits.waits_held(api_key_id=api_key_id) == 1
            gone.set()
            await asyncio.wait_for(app, 30)
            return sent, dict(longpoll.watches()), _parked() - parked
        finally:
            await hot_db.close()

    drain_served = 1
    sent, watches, still_parked = asyncio.run(run())
    assert sent == []  # nothing answered to a client that left
    assert watches == {}
    assert still_parked == 0
    assert waits.waits_held(api_key_id=api_key_id) == 0
    assert _served() == served + drain_served  # the wait was cancelled, not answered
    assert not Task.objects.filter(worker_id="leaving").exists()


def test_a_claim_committed_while_its_client_leaves_goes_back_to_the_queue(api_process, monkeypatch):  # noqa: F811
    """The claim statement commits, the client leaves before the answer is sent: the task is released, not held."""
    state = fresh_state()
    fetch = hot_db.fetch
    committed, proceed = asyncio.Event, asyncio.Event
    events: dict = {}

    async def slow_claim(statement, params, **kwargs):
        rows = await fetch(statement, params, **kwargs)
        if params.get("worker_id") == "leaving":  # the claim statement of the client that leaves
            events["committed"].set()
            await events["proceed"].wait()
        return rows

    monkeypatch.setattr(hot_db, "fetch", slow_claim)

    async def run():
        from runstate_project.asgi import application

        events["committed"], events["proceed"] = committed(), proceed()
        await (await hot_db.pool()).wait(timeout=30)
        scope, body = _claim_scope(state, 20_000)
        receive, send, sent, gone = leaving_client(body)
        try:
            app = asyncio.create_task(application(scope, receive, send))
            await asyncio.wait_for(events["committed"].wait(), 30)
            gone.set()  # the client leaves: the answer is cancelled while the claim is in flight
            await asyncio.sleep(0.05)
            assert not app.done()  # it waits for the claim in flight to hand it back
            events["proceed"].set()
            await asyncio.wait_for(app, 30)
            return sent
        finally:
            await hot_db.close()

    sent = asyncio.run(run())
    assert sent == []
    [claimed] = Event.objects.filter(type="task.claimed", data__workerId="leaving")
    task = Task.objects.get(id=claimed.subject_id)
    assert task.state == TaskState.QUEUED  # handed back, claimable at once
    requeued = Event.objects.filter(type="task.requeued", subject_id=task.id).order_by("-id").first()
    assert requeued is not None and requeued.data["cause"] == "released"
