"""The run state's layout: values below the run state, the run state below what drives it.

The values the machines return and a snapshot holds (events, effects, results, the ledger,
the snapshot and its JSON form) name nothing above them, counting imports made only for type
checking: a value module that imports the run state closes a circle through the effects.
"""

from __future__ import annotations

import ast
from pathlib import Path

import toolloop_fsm

PACKAGE_DIR = Path(toolloop_fsm.__file__).parent

#: the values: what flows in and out of the machines and what a snapshot holds
VALUE_MODULES = (
    "toolloop_fsm.events",
    "toolloop_fsm.effects",
    "toolloop_fsm.result",
    "toolloop_fsm.ledger",
    "toolloop_fsm.snapshot",
)
#: the run state and what reads or drives it: above every value
ABOVE_VALUES = (
    "toolloop_fsm.turn",
    "toolloop_fsm.snapshot_capture",
    "toolloop_fsm.machine",
    "toolloop_fsm.generation",
    "toolloop_fsm.runner",
    "toolloop_fsm.states",
    "toolloop_fsm.guards",
    "toolloop_fsm.pump",
)


def _module_file(module: str) -> Path | None:
    rel = Path(*module.split(".")[1:])
    if not rel.parts:
        return PACKAGE_DIR / "__init__.py"
    for candidate in (PACKAGE_DIR / rel.with_suffix(".py"), PACKAGE_DIR / rel / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def _imported(module: str) -> set[str]:
    """The package's modules ``module`` imports, at import time or for type checking."""
    file = _module_file(module)
    if file is None:
        return set()
    found: set[str] = set()
    for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            found.update(name for name in [node.module, *names] if _module_file(name))
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("toolloop_"))
    return {name for name in found if name.startswith("toolloop_fsm")}


def _chains_from(start: str) -> dict[str, list[str]]:
    chains = {start: [start]}
    queue = [start]
    while queue:
        here = queue.pop()
        for module in _imported(here):
            if module not in chains:
                chains[module] = [*chains[here], module]
                queue.append(module)
    return chains


def test_the_values_a_machine_returns_import_nothing_of_the_run_state_or_above() -> None:
    bad = [
        " -> ".join(chain)
        for start in VALUE_MODULES
        for module, chain in _chains_from(start).items()
        if any(module == above or module.startswith(above + ".") for above in ABOVE_VALUES)
    ]
    assert not bad, "\n".join(bad)
    assert all(_module_file(module) for module in VALUE_MODULES)
