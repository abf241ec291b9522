"""The state machines' example counts: each machine's own, or ``RUNSTATE_MACHINE_EXAMPLES`` for a deeper run."""

import pytest

from tests.machines import EXAMPLES_ENV, machine_settings

pytestmark = pytest.mark.single_backend  # no database: the same on both


def test_a_machine_tries_its_own_count_unless_the_environment_asks_for_more(monkeypatch):
    monkeypatch.delenv(EXAMPLES_ENV, raising=False)
    assert machine_settings(max_examples=40, steps=30).max_examples == 40
    monkeypatch.setenv(EXAMPLES_ENV, "500")
    deeper = machine_settings(max_examples=40, steps=30)
    assert (deeper.max_examples, deeper.stateful_step_count) == (500, 30)
