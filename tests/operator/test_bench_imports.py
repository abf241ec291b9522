"""The benchmarks and the servers they share with the tests import nothing from ``tests/``.

A benchmark runs from a checkout without its test suite's fixtures or pytest's state; what
both need (PgBouncer in front of a server, free ports) lives in ``devservers/``.
"""

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.single_backend

ROOT = Path(__file__).resolve().parents[2]


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """Return ``(line, module)`` for every import in ``path``, function-local ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def test_bench_and_devservers_import_nothing_from_tests():
    files = sorted([*(ROOT / "bench").rglob("*.py"), *(ROOT / "devservers").rglob("*.py")])
    assert any(path.name == "pooler.py" for path in files)  # the one that did
    offending = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in files
        for line, module in imported_modules(path)
        if module == "tests" or module.startswith("tests.")
    ]
    assert offending == []


def test_the_check_sees_a_function_local_import(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("def f():\n    from tests.clusters import PgBouncer\n    import tests.processes\n")
    assert imported_modules(planted) == [(2, "tests.clusters"), (3, "tests.processes")]


def test_every_benchmark_module_imports():
    """The split (issue 40) left no name behind: each module of bench/ imports on its own.

    ``bench.celery.tasks`` (and ``__main__``, which imports it) set Django up and register a
    Celery task in the importing process; the command-line test below runs them apart.
    """
    names = sorted(
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for path in (ROOT / "bench").rglob("*.py")
    )
    importable = [name for name in names if not name.endswith("__main__") and name != "bench.celery.tasks"]
    assert {"bench.harness.meters", "bench.throughput.cli", "bench.celery.figures"} <= set(importable)
    for name in importable:
        importlib.import_module(name)


@pytest.mark.parametrize("benchmark", ["bench.throughput", "bench.celery"])
def test_a_benchmark_package_runs_as_a_module(benchmark):
    """``python -m bench.throughput`` and ``python -m bench.celery`` still parse their command lines."""
    env = {**os.environ, "DATABASE_URL": "postgres://127.0.0.1:1/runstate_bench_never_used"}
    done = subprocess.run(
        [sys.executable, "-m", benchmark, "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert f"python -m {benchmark}" in done.stdout
