"""The runtime dependencies pyproject.toml declares are the ones the library imports."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: the module a distribution is imported as, where the two names differ
IMPORTED_AS = {"httpx-sse": "httpx_sse"}


def _imported_top_modules() -> set[str]:
    modules: set[str] = set()
    for source in (ROOT / "toolloop_fsm").rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                modules.update(alias.name.partition(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.partition(".")[0])
    return modules


def _distribution(requirement: str) -> str:
    found = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert found is not None, requirement
    return found.group(0).lower()


def test_every_runtime_dependency_is_imported_by_the_library() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    imported = _imported_top_modules()
    unused = [
        name
        for name in map(_distribution, project["dependencies"])
        if IMPORTED_AS.get(name, name.replace("-", "_")) not in imported
    ]
    assert not unused, (
        f"pyproject.toml makes {unused} a runtime dependency, but toolloop_fsm never imports "
        "it: move it to the extra that needs it (the test extra, for what only tests use)"
    )
