"""The cascade learns its steps from the aggregates, and runs them in the house lock order.

``services.cascade`` imports no aggregate (import-linter's ``services-acyclic`` contract):
each aggregate registers its step with ``@cascade_step`` and ``CASCADE_ORDER`` places it.
The order is the lock order of a cancel (groups, then tasks, then barriers and timers), so
it is pinned here, step by step.
"""

import pytest

from coordination.services import cascade
from coordination.services.admissions import admissions_end_subtree
from coordination.services.barriers import barriers_cancel_subtree
from coordination.services.cascade import CASCADE_ORDER, cascade_step, cascade_steps, subtree_end
from coordination.services.groups import groups_end_subtree, groups_reevaluate_after_subtree_end
from coordination.services.messages import messages_cancel_subtree
from coordination.services.pools import pools_cancel_subtree
from coordination.services.tasks import tasks_cancel_subtree
from coordination.services.timers import timers_cancel_subtree

# No database: the registry is plain Python (a second run proves nothing more).
pytestmark = pytest.mark.single_backend


def test_every_aggregates_step_runs_in_the_house_lock_order():
    assert cascade_steps() == (
        groups_end_subtree,  # groups gated in the subtree, and the groups of its members, first
        tasks_cancel_subtree,
        groups_reevaluate_after_subtree_end,  # the second half of the groups' step, after the tasks
        messages_cancel_subtree,
        barriers_cancel_subtree,
        timers_cancel_subtree,
        pools_cancel_subtree,
        admissions_end_subtree,  # last: frees the run's slot once its work is ended
    )


def test_subtree_end_applies_the_steps_one_after_another_in_that_order(monkeypatch):
    applied = []

    def recorder(name):
        return lambda end: applied.append((name, end))

    monkeypatch.setattr(cascade, "_registered", {name: recorder(name) for name in CASCADE_ORDER})
    end = object()
    subtree_end(end)
    assert applied == [(name, end) for name in CASCADE_ORDER]


def test_a_step_without_a_place_in_the_order_is_refused():
    def widgets_cancel_subtree(end):  # pragma: no cover - never registered
        pass

    with pytest.raises(ValueError, match="CASCADE_ORDER"):
        cascade_step(widgets_cancel_subtree)
    assert widgets_cancel_subtree not in cascade_steps()


def test_a_second_module_cannot_take_a_steps_place():
    def tasks_cancel_subtree(end):  # pragma: no cover - never registered
        pass

    with pytest.raises(ValueError, match="registered by coordination.services.tasks"):
        cascade_step(tasks_cancel_subtree)
    assert cascade_steps()[1].__module__ == "coordination.services.tasks"


def test_a_step_whose_module_never_loaded_fails_loudly_instead_of_being_skipped(monkeypatch):
    registered = dict(cascade._registered)
    del registered["timers_cancel_subtree"]
    monkeypatch.setattr(cascade, "_registered", registered)
    with pytest.raises(RuntimeError, match="timers_cancel_subtree"):
        subtree_end(object())
