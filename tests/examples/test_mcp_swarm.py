"""``examples/mcp_swarm`` end to end: scripted MCP agents plan, review, judge and cancel, against the live API."""

import subprocess
import sys

import pytest

from coordination.models import Task, TaskGroup
from tests.mcp.conftest import child_env
from tests.operator.live import ROOT
from tests.sdk.conftest import sdk, sdk_server  # noqa: F401 - fixtures

pytestmark = pytest.mark.django_db(transaction=True)


def test_mcp_agents_decide_the_group_and_a_cancel_stops_the_rest(sdk):  # noqa: F811
    env = child_env(RUNSTATE_URL=sdk.url, RUNSTATE_API_KEY=sdk.api_key)
    env.pop("RUNSTATE_SCOPE_ID", None)
    done = subprocess.run(
        [sys.executable, "-m", "examples.mcp_swarm"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    printed = done.stdout + done.stderr
    assert done.returncode == 0, printed
    assert "group FINALIZED: SUCCESS (threshold_reached)" in printed, printed
    assert "planner: cancelled run" in printed, printed
    group = TaskGroup.objects.get()
    members = list(group.members.select_related("task"))
    assert len(members) == 6
    assert sum(1 for m in members if m.verdict == "ACCEPTED") == 2
    # Nothing of the swarm is left to pick up: the decision and the cancel stopped the rest.
    assert not Task.objects.filter(state__in=["QUEUED", "RUNNING", "CANCELLATION_REQUESTED"]).exists()
