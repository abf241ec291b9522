"""The worked example of docs/limits.md runs as written against the service, and what it prints is true.

It runs on both databases: the service it talks to is a uvicorn process on the test database
(SQLite, the default, included), and the example itself only speaks HTTP. Besides the run as
a reader would make it (the cancel after 2 s), the example is run with the cancel forced
while its agents are still being created: a hook prepended to the code lets the first agent's
run be created (or lets that agent get as far as holding a GPU), then cancels the job before
any other agent's create is sent. Whatever the timing, every agent ends with the job's code,
every GPU is released (none left to expire) and nothing stays reserved.
"""

import re
import subprocess
import sys

import pytest

from coordination.domain.states import PoolLeaseState
from coordination.models import Budget, BudgetReservation, Event, Pool, PoolLease, Run
from tests.sdk.conftest import ROOT

pytestmark = pytest.mark.django_db(transaction=True)

MARKER = "<!-- worked-example: tests/sdk/test_limits_example.py runs this block as written -->"

# Prepended to the example: the first agent's run is created (with WHEN = "holding", that
# agent also takes a request and acquires a GPU), then the job is cancelled; every other
# agent's create is sent only once that cancel is answered. Deterministic: no sleep, no race.
CANCEL_WHILE_CREATING = """
import asyncio as _asyncio

from runstate._async.pools import AsyncPoolAcquire as _Acquire
from runstate._async.runs import AsyncScope as _Scope

WHEN = {when!r}
_create_child, _enter_pool = _Scope.child, _Acquire.__aenter__
_hook = {{"job": None, "cancelled": None}}


async def _cancel_the_job():
    await _hook["job"].cancel(reason="cancelled while the agents are being created")
    _hook["cancelled"].set()


async def _child(self, **kwargs):
    if _hook["cancelled"] is not None:  # not the first agent: wait for the cancel
        await _hook["cancelled"].wait()
        return await _create_child(self, **kwargs)
    _hook["job"], _hook["cancelled"] = self, _asyncio.Event()
    me = await _create_child(self, **kwargs)
    if WHEN == "created":
        await _cancel_the_job()
    return me


async def _acquire(self):
    lease = await _enter_pool(self)
    if WHEN == "holding" and not _hook["cancelled"].is_set():
        await _cancel_the_job()
    return lease


_Scope.child, _Acquire.__aenter__ = _child, _acquire
"""


def worked_example() -> str:
    text = (ROOT / "docs" / "limits.md").read_text()
    after = text.split(MARKER, 1)[1]
    match = re.match(r"\s*```python\n(.*?)```", after, flags=re.S)
    assert match, "the worked example's code block follows its marker"
    return match.group(1)


def pool_ledger(pool: Pool) -> int:
    """Replay the pool's events (written under the pool's lock, so in commit order); return the most units held."""
    held: dict[str, int] = {}
    most = 0
    for event in Event.objects.filter(type__startswith="pool.").order_by("id"):
        if event.data.get("pool") != pool.name:
            continue
        if event.type == "pool.acquired":
            held[event.subject_id] = event.data["units"]
        elif event.type in ("pool.released", "pool.expired"):
            held.pop(event.subject_id, None)
        most = max(most, sum(held.values()))
    return most


def run_example(code: str) -> int:
    """Run ``code`` as a user would; check what it prints and what it left; return the calls made."""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr

    lines = done.stdout.splitlines()
    calls = int(lines[0].removeprefix("calls: "))
    assert lines[1] == "stopped with: ['SCOPE_CANCELLED']"
    # Every call made was committed at its real cost, nothing stays reserved, no GPU stays held.
    assert lines[2] == f"spent ${calls * 30_000 / 1e6:.2f}, reserved 0, GPUs in use 0"

    budget = Budget.objects.get(name="usd")
    assert (budget.spent, budget.reserved) == (calls * 30_000, 0)
    assert budget.spent <= budget.limit
    gpu = Pool.objects.get(name="gpu")
    assert pool_ledger(gpu) <= 4
    # The cancel answered every agent, and every GPU granted was handed back before the
    # program ended: released, not left to expire. No reservation is open.
    assert set(PoolLease.objects.filter(pool=gpu).values_list("state", flat=True)) <= {
        PoolLeaseState.RELEASED,
        PoolLeaseState.CANCELLED,
    }
    assert not BudgetReservation.objects.filter(state="RESERVED").exists()
    assert BudgetReservation.objects.filter(state="COMMITTED").count() == calls
    return calls


def test_twenty_agents_share_four_gpus_a_quota_and_a_budget_until_one_cancel_stops_them_all(sdk):
    # As a reader runs it: how many calls, and how many agents were created before the
    # cancel, is the machine's timing (on SQLite some agents may not be created yet); what
    # run_example checks holds whatever they are.
    run_example(worked_example())

    assert 1 <= Run.objects.filter(name__startswith="agent-").count() <= 20


@pytest.mark.parametrize("when", ["created", "holding"])
def test_a_cancel_while_the_agents_are_being_created_stops_them_all_and_holds_nothing(sdk, when):
    calls = run_example(CANCEL_WHILE_CREATING.format(when=when) + worked_example())

    assert calls == 0  # the first agent's next step came after the cancel
    # The cancel landed after the first agent's run was created and before any other's.
    assert Run.objects.filter(name__startswith="agent-").count() == 1
    leases = list(PoolLease.objects.values_list("state", flat=True))
    if when == "holding":
        # The first agent held a GPU when the cancel came, and handed it back on its way out.
        assert leases == [PoolLeaseState.RELEASED]
        job = Run.objects.get(name="swarm")
        cancelled = Event.objects.filter(type="run.cancelled", subject_id=str(job.id)).order_by("id").first()
        assert Event.objects.filter(type="pool.released", id__gt=cancelled.id).exists()
    else:
        assert leases == []
