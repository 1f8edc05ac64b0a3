"""The mutation script's list of equivalent mutants names mutants that exist today.

An entry is keyed by file, line, operator and mutated line, so it goes stale when the code
under it moves; a stale entry silently stops excusing its mutant and the next measured score
is off. This test names every stale entry and where its mutated line is now.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def _mutation_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "mutation_script", ROOT / "scripts" / "mutation.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # attrs resolves the frozen classes' module by name
    spec.loader.exec_module(module)
    return module


def test_every_equivalent_entry_names_one_mutant_of_todays_tree() -> None:
    script = _mutation_script()
    missing = sorted({e.file for e in script.EQUIVALENT} - set(script.target_files(ROOT)))
    assert not missing, f"EQUIVALENT names files the script no longer mutates: {missing}"
    # only the lines that read as an entry's original line are mutated: the whole tree takes
    # a while (every mutant is parsed)
    wanted: dict[str, set[int]] = {}
    for entry in script.EQUIVALENT:
        lines = (ROOT / entry.file).read_text(encoding="utf-8").splitlines()
        wanted.setdefault(entry.file, set()).update(
            number for number, text in enumerate(lines, 1) if text.strip() == entry.original_line
        )
    mutants = script.enumerate_mutants(ROOT, {f: frozenset(n) for f, n in wanted.items()})
    stale = [
        f"{entry.file} {entry.scope or '(module)'} {entry.operator} {entry.original_line!r} -> "
        f"{entry.mutated_line!r}: {sum(map(entry.matches, mutants))} mutants match"
        for entry in script.EQUIVALENT
        if sum(map(entry.matches, mutants)) != 1
    ]
    assert not stale, "stale EQUIVALENT entries in scripts/mutation.py:\n" + "\n".join(stale)
