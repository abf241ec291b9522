"""One writer per status field (house style): a source scan over ``coordination/``.

``Task.state`` is written only by ``services/task_transitions.py``, ``Run.stored_state``
only by ``services/runs.py``, and each other aggregate's ``state`` only by its own service.
The scan finds every write: an assignment to ``<obj>.state`` (or ``.stored_state``), a
queryset ``update(state=...)``, a SQL ``SET state = ...`` (in an ``UPDATE`` of the table, or a
SET fragment with no table, which only a writing module may hold), and a
``subtree_rows_end(end, Model, ...)`` call, which ends ``Model``'s rows. It tells whose field
a write changes from the enum written (``TaskState.X``), else from the queryset's model or the
variable's name; a write it cannot attribute fails too. Migrations are left out: they are
frozen history.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3] / "coordination"

# The status field of each model, and the one module that writes it.
WRITERS = {
    "Task": "services/task_transitions.py",
    "Run": "services/runs.py",
    "Message": "services/messages.py",
    "TaskGroup": "services/groups.py",
    "Barrier": "services/barriers.py",
    "Timer": "services/timers.py",
    "Admission": "services/admissions.py",
    "PoolLease": "services/pools.py",
    "BudgetReservation": "services/budgets.py",
}
ENUMS = {
    "TaskState": "Task",
    "RunState": "Run",
    "MessageState": "Message",
    "GroupState": "TaskGroup",
    "BarrierState": "Barrier",
    "TimerState": "Timer",
    "AdmissionState": "Admission",
    "PoolLeaseState": "PoolLease",
    "ReservationState": "BudgetReservation",
}
TABLES = {f"coordination_{model.lower()}": model for model in WRITERS}
# What a variable that holds one instance is called, where the value written is not an enum member.
VARIABLES = {
    "task": "Task",
    "run": "Run",
    "message": "Message",
    "group": "TaskGroup",
    "barrier": "Barrier",
    "timer": "Timer",
    "admission": "Admission",
    "head": "Admission",
    "lease": "PoolLease",
    "waiter": "PoolLease",
    "reservation": "BudgetReservation",
}
# ``cascade.subtree_rows_end`` holds the generic ``state = %(final_state)s`` of the table its
# caller names; its calls are attributed to the model they pass.
GENERIC_FRAGMENTS = {"services/cascade.py"}

STATUS_FIELDS = ("state", "stored_state")
SQL_ASSIGNMENT = re.compile(r"(?:^\s*|\bSET\s+|,\s*)(?:state|stored_state)\s*=(?!=)", re.IGNORECASE)
SQL_UPDATE = re.compile(r"(?<!FOR )(?<!NO KEY )\bUPDATE\s+(?:ONLY\s+)?(\w+)", re.IGNORECASE)


def _enum_model(value: ast.AST) -> str | None:
    if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name):
        return ENUMS.get(value.value.id)
    return None


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute | ast.Call | ast.Subscript):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def writes(source: str) -> list[tuple[int, str]]:
    """Return ``(line, model)`` for every status write in ``source``.

    ``model`` is ``?`` when the scan cannot tell, ``SQL`` for a SET fragment with no table.
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, ast.Assign):
            targets = [
                t for target in node.targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])
            ]
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            if isinstance(target, ast.Attribute) and target.attr in STATUS_FIELDS:
                if target.attr == "stored_state":
                    model = "Run"
                else:
                    receiver = target.value.id if isinstance(target.value, ast.Name) else None
                    model = _enum_model(node.value) or VARIABLES.get(receiver) or "?"
                found.append((node.lineno, model))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "update":
                for keyword in node.keywords:
                    if keyword.arg in STATUS_FIELDS:
                        root = _root_name(node.func.value)
                        model = _enum_model(keyword.value) or (root if root in WRITERS else None) or "?"
                        found.append((node.lineno, "Run" if keyword.arg == "stored_state" else model))
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if name == "subtree_rows_end" and len(node.args) >= 2:
                found.append((node.lineno, getattr(node.args[1], "id", "?")))
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            for assignment in SQL_ASSIGNMENT.finditer(node.value):
                # The table is the UPDATE's the SET belongs to: the last one before it.
                tables = SQL_UPDATE.findall(node.value, 0, assignment.start())
                found.append((node.lineno, TABLES.get(tables[-1], "?") if tables else "SQL"))
    return found


def offenders(module: str, source: str) -> list[str]:
    """Return a line per write in ``source`` (the module ``module``, relative to ``coordination/``) made out of turn."""
    found = []
    for line, model in writes(source):
        if model == "SQL":
            allowed = module in WRITERS.values() or module in GENERIC_FRAGMENTS
        else:
            allowed = WRITERS.get(model) == module
        if not allowed:
            whose = f"{model}'s status" if model in WRITERS else "a status field it cannot attribute"
            found.append(f"coordination/{module}:{line}: writes {whose}")
    return found


def test_each_status_field_has_one_writing_module():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if "migrations" in path.parts:
            continue
        found += offenders(path.relative_to(ROOT).as_posix(), path.read_text())
    assert not found, "one writer per status field (STYLE.md):\n" + "\n".join(found)


def test_the_scan_finds_each_kind_of_write():
    planted = {
        "task.state = TaskState.FAILED": "Task",
        "t.state = TaskState.FAILED": "Task",
        "Task.objects.filter(id=1).update(state=final_state)": "Task",
        "rows.update(state=TaskState.EXPIRED)": "Task",
        "subtree_rows_end(end, Task, states=[])": "Task",
        'SQL = "UPDATE coordination_task t SET state = %(s)s WHERE id = 1"': "Task",
        'SQL = f"UPDATE coordination_task SET x = 1, state = {literal(TaskState.QUEUED)}"': "Task",
        "SET = \"state = 'x', finished_at = now()\"": "SQL",
        "obj.state = value": "?",
        "run.stored_state = state": "Run",
    }
    for source, model in planted.items():
        assert [found for _, found in writes(source)] == [model], source
        assert offenders("services/tasks.py", source), source
    assert not offenders("services/task_transitions.py", "task.state = TaskState.FAILED")
    assert writes('SQL = "SELECT 1 FROM coordination_task t WHERE t.state = %(s)s"') == []
