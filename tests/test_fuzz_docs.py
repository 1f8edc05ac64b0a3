"""The fuzzing documents show `run_script` as what it is, a coroutine function: every example
that calls it awaits it, and the self-contained one in docs/invariants.md §14 runs."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = ("README.md", "docs/invariants.md")


def python_blocks(document: str) -> list[str]:
    text = (ROOT / document).read_text(encoding="utf-8")
    return re.findall(r"^```python\n(.*?)^```$", text, re.MULTILINE | re.DOTALL)


def calls_of(tree: ast.AST, name: str) -> list[ast.Call]:
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name | ast.Attribute)
        and (node.func.id if isinstance(node.func, ast.Name) else node.func.attr) == name
    ]


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_example_calling_run_script_awaits_it(document: str) -> None:
    trees = [ast.parse(block) for block in python_blocks(document)]
    calls = [call for tree in trees for call in calls_of(tree, "run_script")]
    assert calls, f"{document} shows no example of run_script: add one that awaits it"
    awaited = {
        id(node.value) for tree in trees for node in ast.walk(tree) if isinstance(node, ast.Await)
    }
    bare = [ast.unparse(call) for call in calls if id(call) not in awaited]
    assert bare == [], f"{document} calls run_script without awaiting it: {bare}"


def test_the_invariants_documents_example_runs() -> None:
    (example,) = [block for block in python_blocks("docs/invariants.md") if "run_script" in block]
    namespace: dict[str, Any] = {}
    exec(compile(example, "docs/invariants.md", "exec"), namespace)
    tests = [
        value for name, value in namespace.items() if name.startswith("test_") and callable(value)
    ]
    assert len(tests) == 1
    test: Callable[[], None] = settings(max_examples=10, database=None)(tests[0])
    test()
