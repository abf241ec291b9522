"""A cancel is never starved by the creators of work that keep arriving under its run.

PostgreSQL lets a ``FOR KEY SHARE`` locker join the share lockers already on a row even while
a ``FOR UPDATE`` waits there, so without the fair gate (``locking``'s module docstring) a
stream of claims, submits, takes or reservations held a cancel off for as long as it lasted.
With it, a creator that arrives while a cancel waits queues behind the cancel and is refused.
"""

import threading
from collections.abc import Callable

import pytest
from django.db import transaction

from coordination.domain import exceptions
from coordination.domain.states import RunState
from coordination.models import Run
from coordination.services.budgets import budget_create, reservation_create
from coordination.services.claims import task_claim
from coordination.services.keys import project_ensure
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.pools import pool_acquire, pool_put
from coordination.services.quotas import quota_put, quota_take
from coordination.services.runs import run_cancel, run_complete, run_create
from coordination.services.tasks import TaskSpec, task_submit, tasks_submit_many
from tests.concurrency.util import backend_pid, race_a_cancel, run_closing, waiting_on_a_lock
from tests.waiting import WAIT_S, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres_only]


@pytest.fixture(params=[True, False], ids=["fast", "careful"])
def fast_paths(request, settings):
    settings.RUNSTATE_FAST_PATHS = request.param
    return request.param


def creators(project) -> dict[str, Callable[[object], object]]:
    """Each way of creating work under a run, as ``create(run)``; ample resources, so only a cancel refuses."""
    mailbox, _ = mailbox_ensure(project_id=project.id, name="jobs", mode="WORK")
    quota_put(project_id=project.id, name="api", limit=1_000_000, period_ms=1000)
    pool_put(project_id=project.id, name="gpu", capacity=1_000_000)

    return {
        "submit": lambda run: task_submit(project_id=project.id, mailbox=mailbox, run_id=run.id, input={}),
        # Tasks to claim are queued by runs_under_a_budget; an empty claim still locks the chain.
        "claim": lambda run: task_claim(project_id=project.id, mailbox=mailbox, run_id=run.id),
        "quota take": lambda run: quota_take(project_id=project.id, run_id=run.id, name="api"),
        "pool acquire": lambda run: pool_acquire(project_id=project.id, name="gpu", run_id=run.id),
        "budget reservation": lambda run: reservation_create(
            project_id=project.id, run_id=run.id, budget="usd", amount=1
        ),
        "child run": lambda run: run_create(project_id=project.id, parent_id=run.id),
    }


def runs_under_a_budget(project):
    """A root and its child, a budget on the root and 200 tasks queued under the child."""
    root = run_create(project_id=project.id)
    child = run_create(project_id=project.id, parent_id=root.id)
    budget_create(project_id=project.id, run_id=root.id, name="usd", limit=10_000_000)
    mailbox, _ = mailbox_ensure(project_id=project.id, name="jobs", mode="WORK")
    tasks_submit_many(project_id=project.id, mailbox=mailbox, run_id=child.id, items=[TaskSpec(input={})] * 200)
    return root, child


@pytest.mark.parametrize("kind", ["submit", "claim", "quota take", "pool acquire", "budget reservation", "child run"])
@pytest.mark.parametrize("end", [run_cancel, run_complete], ids=["cancel", "complete"])
def test_a_creator_arriving_while_a_cancel_waits_queues_behind_it_and_is_refused(fast_paths, kind, end):
    project = project_ensure(name="fairness")
    create = creators(project)[kind]
    root, child = runs_under_a_budget(project)
    holding, let_go = threading.Event(), threading.Event()
    pids = {}
    outcome = {}

    def in_flight():
        # A creator already in: its transaction holds the chain while the cancel arrives.
        with transaction.atomic():
            create(child)
            holding.set()
            assert let_go.wait(WAIT_S)

    def ender():
        pids["ender"] = backend_pid()
        end(project_id=project.id, run_id=root.id)

    def late():
        pids["late"] = backend_pid()
        try:
            outcome["late"] = create(child)
        except exceptions.Conflict as exc:
            outcome["late"] = exc

    errors = []
    threads = [threading.Thread(target=run_closing(target, errors)) for target in (in_flight, ender, late)]
    try:
        threads[0].start()
        assert holding.wait(WAIT_S)
        threads[1].start()
        wait_until(
            lambda: "ender" in pids and waiting_on_a_lock(pids["ender"]),
            what="the end waits for the creator in",
            interval_s=0.01,
        )
        threads[2].start()
        # The late creator must queue behind the waiting end, not slip in beside the creator in.
        wait_until(
            lambda: "late" in outcome or ("late" in pids and waiting_on_a_lock(pids["late"])),
            what="the late creator finishes or waits",
            interval_s=0.01,
        )
        assert "late" not in outcome, f"the {kind} went ahead of a waiting run end"
    finally:
        let_go.set()
        for thread in threads:
            if thread.ident is not None:  # started
                thread.join(WAIT_S)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []  # the creator in and the end both committed
    expected = exceptions.ScopeCancelled if end is run_cancel else exceptions.ScopeCompleted
    assert isinstance(outcome["late"], expected)
    ended = RunState.CANCELLED if end is run_cancel else RunState.COMPLETED
    assert Run.objects.get(id=root.id).stored_state == ended


@pytest.mark.parametrize("kind", ["submit", "claim", "quota take", "budget reservation"])
def test_seven_back_to_back_creators_never_hold_off_a_cancel_5_rounds(fast_paths, kind):
    project = project_ensure(name="fairness")
    create = creators(project)[kind]
    for _ in range(5):
        root, child = runs_under_a_budget(project)
        race_a_cancel(
            lambda root=root: run_cancel(project_id=project.id, run_id=root.id), lambda child=child: create(child)
        )
