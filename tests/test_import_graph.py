"""The module graph of the project's own packages has no circle, and every module has its room (issue 40).

import-linter's contracts (``pyproject.toml``, checked by ``lint-imports``) say which room
may import which; this test says what no contract can across rooms: no module reaches itself
again through its imports, whether made at the top of a module, inside a function or under
``TYPE_CHECKING``. It reads files only, through ``grimp`` (import-linter's graph library).
"""

from pathlib import Path

import grimp
import pytest

# No database: the graph is built from the source files (a second run proves nothing more).
pytestmark = pytest.mark.single_backend

PACKAGES = ("coordination", "workers", "runstate", "runstate_project", "bench")
ROOT = Path(__file__).resolve().parents[1]


def circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Return the graph's strongly connected components of more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph.modules):
        if root in index:
            continue
        # Tarjan's algorithm, iterative: (module, the imports still to visit).
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            module, pending = work[-1]
            imported = next(pending, None)
            if imported is not None:
                if imported not in index:
                    index[imported] = low[imported] = counter
                    counter += 1
                    stack.append(imported)
                    on_stack.add(imported)
                    work.append((imported, iter(sorted(graph.find_modules_directly_imported_by(imported)))))
                elif imported in on_stack:
                    low[module] = min(low[module], index[imported])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[module])
            if low[module] == index[module]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == module:
                        break
                if len(component) > 1 or module in graph.find_modules_directly_imported_by(module):
                    found.append(sorted(component))
    return found


def describe(graph: grimp.ImportGraph, component: list[str]) -> str:
    """Return a circle's imports, one per line with the lines that make them."""
    members = set(component)
    lines = []
    for importer in component:
        for imported in sorted(graph.find_modules_directly_imported_by(importer) & members):
            details = graph.get_import_details(importer=importer, imported=imported)
            at = ", ".join(str(detail["line_number"]) for detail in details)
            lines.append(f"  {importer} -> {imported} (line {at})")
    return "\n".join(lines)


def test_no_module_of_the_project_imports_itself_back():
    graph = grimp.build_graph(*PACKAGES)
    found = circles(graph)
    report = "\n\n".join(describe(graph, component) for component in found)
    assert not found, f"import circles (break each at its root, docs/internals.md 'Import rules'):\n{report}"


def test_the_search_finds_circles_of_every_length():
    """The search above can fail: it reports a two-module circle, a longer one, and a self-import."""
    graph = grimp.ImportGraph()
    edges = [
        ("a.one", "a.two"),
        ("a.two", "a.one"),  # two modules
        ("b.one", "b.two"),
        ("b.two", "b.three"),
        ("b.three", "b.one"),  # three
        ("c.self", "c.self"),  # one
        ("d.top", "d.bottom"),  # no circle
        ("a.one", "d.top"),
    ]
    for importer, imported in edges:
        graph.add_import(importer=importer, imported=imported, line_number=1, line_contents=f"import {imported}")
    assert sorted(circles(graph)) == [["a.one", "a.two"], ["b.one", "b.three", "b.two"], ["c.self"]]
    assert "a.one -> a.two (line 1)" in describe(graph, ["a.one", "a.two"])


def test_the_top_of_coordination_holds_only_its_rooms():
    """Beside its packages, ``coordination/`` keeps only what Django looks for there (docs/internals.md, the map)."""
    django_looks_for = {"__init__.py", "apps.py"}
    loose = {path.name for path in (ROOT / "coordination").glob("*.py")}
    assert loose == django_looks_for, f"move these into a room: {sorted(loose - django_looks_for)}"
