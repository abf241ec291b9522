"""No SQL names a state by hand: state names are rendered from ``coordination.domain.states``.

A statement writes a state as ``sql.literal(TaskState.RUNNING)`` or ``sql.in_list(TASK_HELD)``
(still a literal in the SQL, so partial indexes match even in generic plans), never as
``'RUNNING'`` typed into the text: the enum stays the one definition of every name. This scans
every string in ``coordination/`` (docstrings aside; migrations are frozen history) for a
quoted state name.
"""

import ast
from pathlib import Path

import pytest
from django.db import models

from coordination.domain import states
from coordination.services import sql

ROOT = Path(__file__).resolve().parents[3] / "coordination"

STATE_NAMES = sorted(
    {
        str(value)
        for enum in vars(states).values()
        if isinstance(enum, type) and issubclass(enum, models.TextChoices)
        for value in enum
        if str(value).isupper()
    }
)


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def quoted_states(source: str) -> list[tuple[int, str]]:
    """Return ``(line, name)`` for every state name quoted by hand in a string of ``source``."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            found += [(node.lineno, name) for name in STATE_NAMES if f"'{name}'" in node.value]
    return found


def test_no_service_sql_quotes_a_state_name():
    offenders = [
        f"{path.relative_to(ROOT.parent)}:{line}: '{name}'"
        for path in sorted(ROOT.rglob("*.py"))
        if "migrations" not in path.parts
        for line, name in quoted_states(path.read_text())
    ]
    assert not offenders, "render state names with coordination.services.sql.literal / in_list:\n" + "\n".join(
        offenders
    )


def test_the_scan_finds_a_quoted_state_in_sql_and_in_an_f_string():
    assert quoted_states("SQL = \"UPDATE t SET state = 'RUNNING'\"") == [(1, "RUNNING")]
    assert quoted_states("SQL = f\"WHERE {x}.state IN ('QUEUED')\"") == [(1, "QUEUED")]
    assert quoted_states('SQL = f"SET state = {sql.literal(TaskState.RUNNING)}"') == []
    assert quoted_states('def f():\n    """Writes \'RUNNING\'."""') == []


def test_literal_and_in_list_render_state_names():
    assert sql.literal(states.TaskState.RUNNING) == "'RUNNING'"
    assert sql.in_list(states.TASK_HELD) == "('CANCELLATION_REQUESTED', 'RUNNING')"
    with pytest.raises(ValueError):
        sql.literal("x'; DROP TABLE coordination_task; --")
