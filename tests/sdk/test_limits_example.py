"""The worked example of docs/limits.md runs as written against the service, and what it prints is true."""

import re
import subprocess
import sys

import pytest

from coordination.models import Budget, BudgetReservation, Event, Pool, PoolLease
from tests.sdk.conftest import ROOT

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]

MARKER = "<!-- worked-example: tests/sdk/test_limits_example.py runs this block as written -->"


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


def test_twenty_agents_share_four_gpus_a_quota_and_a_budget_until_one_cancel_stops_them_all(sdk):
    done = subprocess.run(
        [sys.executable, "-c", worked_example()], cwd=ROOT, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr

    lines = done.stdout.splitlines()
    calls = int(lines[0].removeprefix("calls: "))
    assert calls > 0
    assert lines[1] == "stopped with: ['SCOPE_CANCELLED']"
    # Every call made was committed at its real cost, nothing stays reserved, no GPU stays held.
    assert lines[2] == f"spent ${calls * 30_000 / 1e6:.2f}, reserved 0, GPUs in use 0"

    budget = Budget.objects.get(name="usd")
    assert (budget.spent, budget.reserved) == (calls * 30_000, 0)
    assert budget.spent <= budget.limit
    gpu = Pool.objects.get(name="gpu")
    assert 0 < pool_ledger(gpu) <= 4
    # The cancel answered every agent: no lease is held or waiting, no reservation is open.
    assert not PoolLease.objects.filter(pool=gpu, state__in=["HELD", "WAITING"]).exists()
    assert not BudgetReservation.objects.filter(state="RESERVED").exists()
    assert BudgetReservation.objects.filter(state="COMMITTED").count() == calls
