"""The runtime lock holds what a server, a worker and beat need, and nothing of development.

``requirements.txt`` is what a deployment installs (docs/deploy.md, "Installing");
``requirements-dev.txt`` adds the tests', linters' and benchmarks' tools and is constrained
by it. Checked here: the runtime lock names no development tool; both locks pin every
runtime package alike (version and hashes); and the runtime code, every module of the
service and the SDK imported under the project's settings, imports none of those tools.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.single_backend

ROOT = Path(__file__).resolve().parents[2]

# The distributions requirements-dev.in adds (and grimp, import-linter's graph), by their
# names in a lock, and the modules they are imported as.
DEV_TOOLS = {
    "pytest": "pytest",
    "pytest-django": "pytest_django",
    "pytest-timeout": "pytest_timeout",
    "hypothesis": "hypothesis",
    "schemathesis": "schemathesis",
    "ruff": "ruff",
    "import-linter": "importlinter",
    "grimp": "grimp",
    "playwright": "playwright",
    "mypy": "mypy",
    "pgqueuer": "pgqueuer",
}

_PIN = re.compile(r"^([A-Za-z0-9_.-]+)==(\S+)")


def pins(path: Path) -> dict[str, tuple[str, frozenset[str]]]:
    """Return ``{name: (version, hashes)}`` for every package a hashed lock pins (names normalized)."""
    found: dict[str, tuple[str, frozenset[str]]] = {}
    name = None
    for line in path.read_text().splitlines():
        match = _PIN.match(line)
        if match:
            name = re.sub(r"[-_.]+", "-", match.group(1)).lower()
            found[name] = (match.group(2), frozenset())
        elif name and "--hash=" in line:
            version, hashes = found[name]
            found[name] = (version, hashes | {line.split("--hash=", 1)[1].split()[0]})
        elif not line.startswith(" "):
            name = None
    return found


def test_the_runtime_lock_names_no_development_tool():
    runtime = pins(ROOT / "requirements.txt")
    assert {"django", "celery", "uvicorn", "psycopg", "django-celery-beat"} <= runtime.keys()
    assert sorted(DEV_TOOLS.keys() & runtime.keys()) == []
    assert all(hashes for _, hashes in runtime.values())  # hashed, as --require-hashes needs


def test_the_development_lock_adds_the_tools_and_pins_the_runtime_alike():
    runtime, dev = pins(ROOT / "requirements.txt"), pins(ROOT / "requirements-dev.txt")
    assert DEV_TOOLS.keys() <= dev.keys()
    assert {name: dev.get(name) for name in runtime} == runtime
    assert all(hashes for _, hashes in dev.values())
    dev_in = (ROOT / "requirements-dev.in").read_text().splitlines()
    assert "-r requirements.in" in dev_in and "-c requirements.txt" in dev_in


def test_the_checker_reads_a_lock_as_pip_does(tmp_path):
    lock = tmp_path / "lock.txt"
    lock.write_text(
        "# a comment\nDjango==6.0.10 \\\n    --hash=sha256:aa \\\n    --hash=sha256:bb\n"
        "    # via -r requirements.in\npydantic_core==2.50.5 \\\n    --hash=sha256:cc\n"
    )
    assert pins(lock) == {
        "django": ("6.0.10", frozenset({"sha256:aa", "sha256:bb"})),
        "pydantic-core": ("2.50.5", frozenset({"sha256:cc"})),
    }


# Every module of the service and the SDK, imported with the development tools made
# unimportable: what the runtime lock leaves out must not be needed to load them.
IMPORT_ALL = """
import importlib, importlib.abc, pkgutil, sys

BLOCKED = set(sys.argv[1].split(","))

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"{name} is a development tool", name=name)
        return None

sys.meta_path.insert(0, Blocker())
import django
django.setup()
count = 0
for package in ("runstate_project", "coordination", "workers", "runstate"):
    root = importlib.import_module(package)
    for info in pkgutil.walk_packages(root.__path__, package + "."):
        importlib.import_module(info.name)
        count += 1
print(count)
"""


def run_import_all(blocked) -> subprocess.CompletedProcess:
    """Import every module of the service and the SDK in a fresh interpreter, ``blocked`` unimportable."""
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "runstate_project.settings", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, ",".join(blocked)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_runtime_code_imports_no_development_tool():
    done = run_import_all(DEV_TOOLS.values())
    assert done.returncode == 0, done.stderr[-4000:]
    assert int(done.stdout.split()[-1]) > 100, done.stdout  # it walked the whole tree


def test_the_import_check_fails_on_a_blocked_module_the_code_needs():
    done = run_import_all(["prometheus_client"])  # a runtime dependency, blocked as if it were a tool
    assert done.returncode != 0
    assert "prometheus_client is a development tool" in done.stderr
