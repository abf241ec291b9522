"""Hypothesis settings shared by the suite's state machines.

Each machine names how many examples a run tries. ``RUNSTATE_MACHINE_EXAMPLES=N`` makes every
machine try N instead, for a deeper search than a CI run affords (each run draws new
examples, so the runs add up); a failure prints the steps to replay it.
"""

import os

from hypothesis import HealthCheck, Phase, settings

EXAMPLES_ENV = "RUNSTATE_MACHINE_EXAMPLES"


def machine_settings(*, max_examples: int, steps: int) -> settings:
    """Settings for a ``RuleBasedStateMachine`` over the real services and database."""
    return settings(
        max_examples=int(os.environ.get(EXAMPLES_ENV) or max_examples),
        stateful_step_count=steps,
        deadline=None,
        # No "explain" phase: its line tracing makes shrinking a failure several times slower.
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
