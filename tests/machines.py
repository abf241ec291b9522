"""Hypothesis settings shared by the suite's state machines."""

from hypothesis import HealthCheck, Phase, settings


def machine_settings(*, max_examples: int, steps: int) -> settings:
    """Settings for a ``RuleBasedStateMachine`` over the real services and database."""
    return settings(
        max_examples=max_examples,
        stateful_step_count=steps,
        deadline=None,
        # No "explain" phase: its line tracing makes shrinking a failure several times slower.
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
