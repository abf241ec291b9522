"""A rule written once in every form it is used in: a Python test, a SQL condition, an ORM filter.

The fast paths render a rule into their single statement's ``WHERE``, the careful paths call
it on the row they locked, and queries filter with it, so the three can never say different
things. The claim and lease rules are in ``claims/leases.py``, a delivery's fence in
``messages.py``.
"""

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from django.db.models import Q


@dataclass(frozen=True)
class Clause:
    """One condition of a rule, in each form it is used in."""

    sql: str  # on the row ``{t}``; ``%(now)s`` is the statement's clock, ``{name}`` a value given to ``Rule.sql``
    holds: Callable[..., bool]  # (row, now, **values) -> bool
    q: Callable[[datetime], Q] | None = None  # now -> filter; None when no query uses the clause


class Rule:
    """A conjunction of clauses: callable on a model instance, rendered as SQL, or as an ORM filter."""

    def __init__(self, *clauses: Clause):
        self.clauses = clauses

    def __call__(self, row: object, now: datetime, **values) -> bool:
        """Tell whether the rule holds for ``row`` (a model instance) at ``now``."""
        return all(clause.holds(row, now, **values) for clause in self.clauses)

    def sql(self, alias: str = "t", **values: str) -> str:
        """Return the rule as a SQL condition on the row ``alias`` (``values``: SQL for each ``{name}``)."""
        return " AND ".join(f"({clause.sql.format(t=alias, **values)})" for clause in self.clauses)

    def q(self, now: datetime) -> Q:
        """Return the rule as an ORM filter (every clause must have one)."""
        condition = Q()
        for clause in self.clauses:
            condition &= clause.q(now)
        return condition
