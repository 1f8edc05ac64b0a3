"""No import circle among the package's modules (issue #23).

Every module of `toolloop_fsm` is parsed with `ast` (not imported): each ``import`` and
``from … import`` anywhere in it counts — at the top, under ``if TYPE_CHECKING:``, inside a
function — because an import that is deferred or typing-only still ties the two modules
together. ``from pkg import name`` is an edge to the module ``pkg.name`` when there is one,
else to ``pkg``. The implicit import of a module's parent packages is not an edge (every
module would then depend on the root, which imports the pumps).

A circle is a set of modules each reachable from the others (a strongly connected
component); it is reported with one path around it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from collections.abc import Mapping
from pathlib import Path

import toolloop_fsm

#: The circles known today, each as its sorted module names (none: the last one,
#: ``effects → snapshot → turn``, was broken by #23). A new one fails the suite.
KNOWN_CIRCLES: frozenset[tuple[str, ...]] = frozenset()

PACKAGE_DIR = Path(toolloop_fsm.__file__).parent


def package_modules(package_dir: Path) -> dict[str, Path]:
    """Every module of the package in ``package_dir``, by dotted name."""
    modules: dict[str, Path] = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The dotted names an import statement of ``module`` may name."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join([*base, node.module] if node.module else base)
    else:
        target = node.module or ""
    return [target] + [f"{target}.{alias.name}" for alias in node.names]


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module → the package's modules it imports, anywhere in its text."""
    modules = package_modules(package_dir)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            names = _imported(node, module, is_package)
            if isinstance(node, ast.Import):
                edges.update(name for name in names if name in modules)
                continue
            target, *members = names
            submodules = [name for name in members if name in modules]
            edges.update(submodules)
            if len(submodules) < len(members) and target in modules:
                edges.add(target)  # a name defined in ``target`` itself
        edges.discard(module)
        graph[module] = edges
    return graph


def circles(graph: Mapping[str, Iterable[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components of more than one module, each sorted (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[tuple[str, ...]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(tuple(sorted(component)))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def path_around(graph: Mapping[str, Iterable[str]], circle: tuple[str, ...]) -> str:
    """One path from the circle's first module back to itself, inside the circle."""
    members = set(circle)
    start = circle[0]
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for successor in sorted(graph[node]):
                if successor == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return " → ".join([*reversed(path), start])
                if successor in members and successor not in came_from and successor != start:
                    came_from[successor] = node
                    following.append(successor)
        frontier = following
    raise AssertionError(f"{circle} is not a circle")


def test_no_module_of_the_package_reaches_itself_through_its_imports() -> None:
    graph = import_graph(PACKAGE_DIR)
    new = [circle for circle in circles(graph) if circle not in KNOWN_CIRCLES]
    assert not new, "import circles: " + "; ".join(path_around(graph, c) for c in new)


def test_a_known_circle_that_is_gone_is_struck_from_the_known_list() -> None:
    found = set(circles(import_graph(PACKAGE_DIR)))
    gone = sorted(KNOWN_CIRCLES - found)
    assert not gone, f"no longer a circle, remove from KNOWN_CIRCLES: {gone}"


def test_typing_only_deferred_and_relative_imports_all_count(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n"
    )
    (package / "b.py").write_text("def later():\n    from pkg import c\n")
    (package / "c.py").write_text("from .sub import d\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "d.py").write_text("from ..a import thing\nimport pkg.sub\n")
    (package / "e.py").write_text("import pkg.a\n")
    graph = import_graph(package)
    assert graph["pkg.a"] == {"pkg.b"}
    assert graph["pkg.b"] == {"pkg.c"}
    assert graph["pkg.c"] == {"pkg.sub.d"}
    assert graph["pkg.sub.d"] == {"pkg.a", "pkg.sub"}
    (circle,) = circles(graph)
    assert circle == ("pkg.a", "pkg.b", "pkg.c", "pkg.sub.d")
    assert path_around(graph, circle) == "pkg.a → pkg.b → pkg.c → pkg.sub.d → pkg.a"


def test_the_graph_sees_the_package_s_deferred_imports() -> None:
    graph = import_graph(PACKAGE_DIR)
    assert "toolloop_fsm.reference" in graph["toolloop_fsm.runner"]  # inside a function
    assert "toolloop_fsm.testing.chains" in graph["toolloop_fsm.testing"]  # typing, __getattr__
