"""Single-statement fast paths on PostgreSQL: the switch, and building models from their rows.

A fast path is one guarded SQL statement per transition (the fence in its ``WHERE``, its
event written by the same statement as a data-modifying CTE). When it touches no row, the
careful ORM path runs and decides the exact answer. SQLite always takes the careful path.
``RUNSTATE_FAST_PATHS = False`` turns the fast paths off (tests compare the two).
"""

from collections.abc import Iterable

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connection, models


def fast_paths_enabled() -> bool:
    """Tell whether the single-statement paths apply (PostgreSQL, not switched off)."""
    return connection.vendor == "postgresql" and getattr(settings, "RUNSTATE_FAST_PATHS", True)


def literal(state: str) -> str:
    """Return a state name of ``coordination.domain.states`` as a SQL string literal: ``'RUNNING'``.

    State names are written into statements as literals, never as parameters, so that even a
    generic plan of a prepared statement matches a partial index on them; and never quoted by
    hand, so that the enum stays their one definition (``tests/coordination/services/test_sql_literals.py``).
    """
    name = str(state)
    if not (name.isidentifier() and name.isupper()):
        raise ValueError(f"not a state name: {name!r}")
    return f"'{name}'"


def in_list(states: Iterable[str]) -> str:
    """Return state names as a parenthesized SQL list, in name order: ``('CANCELLATION_REQUESTED', 'RUNNING')``."""
    return f"({', '.join(literal(state) for state in sorted(states))})"


def columns(model: type[models.Model], alias: str) -> str:
    """Return ``alias.col, ...`` for every concrete column of ``model``, in field order."""
    return ", ".join(f"{alias}.{field.column}" for field in model._meta.concrete_fields)


def _converters(model: type[models.Model]) -> list[tuple[int, object]]:
    return [
        (index, field.from_db_value)
        for index, field in enumerate(model._meta.concrete_fields)
        if hasattr(field, "from_db_value")
    ]


def build(model: type[models.Model], row, converters) -> models.Model:
    """Build a ``model`` instance from ``row`` (its concrete columns, in field order)."""
    values = list(row)
    for index, convert in converters:
        values[index] = convert(values[index], None, connection)
    return model.from_db(DEFAULT_DB_ALIAS, None, values)


def build_row(row, *models_: type[models.Model]) -> list[models.Model]:
    """Build one instance of each of ``models_`` from ``row``: their concrete columns, one model after the other."""
    instances, start = [], 0
    for model in models_:
        width = len(model._meta.concrete_fields)
        instances.append(build(model, row[start : start + width], _converters(model)))
        start += width
    return instances


def fetch(sql: str, params: dict) -> list[tuple]:
    """Run one statement and return its rows."""
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall()


def fetch_models(model: type[models.Model], sql: str, params: dict, *, extra: int = 0) -> list[tuple]:
    """Run one statement whose rows start with ``model``'s columns; return ``(instance, *extra columns)``."""
    return models_from_rows(model, fetch(sql, params), extra=extra)


def models_from_rows(model: type[models.Model], rows, *, extra: int = 0) -> list[tuple]:
    """Return ``(instance, *extra columns)`` for rows that start with ``model``'s columns (from any cursor)."""
    converters = _converters(model)
    width = len(model._meta.concrete_fields)
    return [(build(model, row[:width], converters), *row[width : width + extra]) for row in rows]


def json_param(value: object) -> object:
    """Adapt a JSON field's value as the ORM does: ``None`` is SQL NULL, anything else ``jsonb``."""
    return None if value is None else connection.ops.adapt_json_value(value, None)
