"""Mutation testing of the engine: seed one realistic single-point bug at a time into the
machines, their guards and states and the pump, and see whether the behavioural tests notice.

Each mutant is one small edit of one engine module (a flipped comparison, a dropped call, a
removed transition, ...; see `OPERATORS`). It is written into a scratch copy of the tree,
never into the checkout, and the behavioural tests that execute the mutated code run against
it with ``-x``: a failing test *kills* the mutant, a test that runs far past its recorded
time is a *timeout* (the bug hangs a turn, which a user notices too; a watchdog inside the
test run ends it at once), and a mutant every test passes *survives*.

The score is ``(killed + timeouts) / (mutants - equivalent)``. An equivalent mutant changes no
behaviour at all; each one is listed in `EQUIVALENT` with the reason, and is not run.

Only behavioural tests count: the structural tests (the machines' shape, the committed
diagrams, transition coverage) would notice a removed transition without any behaviour
being checked, so they are left out (`STRUCTURAL_FILES`, `STRUCTURAL_TESTS`).

Making a mutant cheap to test: one recording run (cached per content of the package and the
tests) traces which engine lines every behavioural test executes; a mutant then runs only
the tests that execute its lines (a test that never reaches the mutated code cannot tell the
difference), the quick turn-level cases first (`TEST_ORDER`). A mutant of code that runs at
import (a transition table, a constant, a default argument) runs every test that executes
any engine code. Tests that start a Python subprocess run for every mutant, last, since the
tracer cannot follow them.

Usage (from the repository root; `scripts/mutation.sh` runs it under ``nice``)::

    python scripts/mutation.py --list                      # count the mutants
    python scripts/mutation.py --sample 200 --seed 1 --report /tmp/mutation.json
    python scripts/mutation.py --show 'toolloop_fsm/guards/ceilings.py:15:11:comparison'
    python scripts/mutation.py --only 'toolloop_fsm/guards/ceilings.py:15:11:comparison'
    python scripts/mutation.py --retry /tmp/mutation.json  # rerun what survived last time
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import contextlib
import hashlib
import itertools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from attrs import evolve
from attrs import frozen

REPO = Path(__file__).resolve().parent.parent

#: The engine: what is mutated (files, or folders whose ``.py`` files are).
TARGETS: tuple[str, ...] = (
    "toolloop_fsm/guards",
    "toolloop_fsm/states",
    "toolloop_fsm/machine.py",
    "toolloop_fsm/generation.py",
    "toolloop_fsm/pump",
)

#: Structural tests: they check the machines' shape, not what a user sees.
STRUCTURAL_FILES: tuple[str, ...] = (
    "tests/test_machine_structure.py",
    "tests/test_diagrams.py",
    "tests/test_transition_coverage.py",
    "tests/test_transition_coverage_outer.py",
)
#: The structural checks inside tests/test_cli.py: the diagram command and its drift against
#: the committed diagrams (node id prefixes).
STRUCTURAL_TESTS: tuple[str, ...] = (
    "tests/test_cli.py::test_mermaid_diagram_equals_the_committed_file",
    "tests/test_cli.py::test_dot_diagram_written_to_a_file_equals_the_committed_file",
    "tests/test_cli.py::test_svg_without_graphviz_names_what_to_install",
    "tests/test_cli.py::test_highlight_",
    "tests/test_cli.py::test_json_that_is_not_a_trace_is_a_clean_error[diagram]",
)
#: The behavioural tests: everything under tests/ except the structural ones above.
BEHAVIOURAL_ARGS: tuple[str, ...] = (
    "tests",
    # the interop suite checks third-party servers, not the engine's rules, and each run of
    # it starts two servers: far too slow to repeat per mutant
    "--ignore=tests/interop",
    *(f"--ignore={path}" for path in STRUCTURAL_FILES),
    *(f"--deselect={prefix}" for prefix in STRUCTURAL_TESTS),
)
#: The order in which a mutant's tests run: the quick turn-level cases that kill most
#: mutants first, the property tests (ci profile) next, the rest after them.
TEST_ORDER: tuple[str, ...] = (
    "tests/test_inner_cases.py",
    "tests/test_conformance.py",
    "tests/test_outer_cases.py",
    "tests/test_inner_machine_events.py",
    "tests/test_outer_machine_events.py",
    "tests/test_inner_rules.py",
    "tests/test_outer_rules.py",
    "tests/test_properties_inner.py",
    "tests/test_properties_outer.py",
)
PYTEST_OPTIONS: tuple[str, ...] = ("-x", "-q", "-n", "0", "-p", "no:cacheprovider", "--no-header")


# --------------------------------------------------------------------------- mutants
@frozen
class Edit:
    """Replace bytes ``start:end`` of the file's UTF-8 text with ``text``."""

    start: int
    end: int
    text: bytes


@frozen
class Mutant:
    """One single-point bug in one engine file."""

    file: str  # relative to the repository root, with forward slashes
    line: int
    col: int
    operator: str
    original_line: str  # the first changed line, before and after (stripped)
    mutated_line: str
    scope: str  # the enclosing classes and functions, dotted ("" at module level)
    edits: tuple[Edit, ...]
    span: tuple[int, int]  # the lines whose execution a test must reach to see the bug
    module_level: bool  # runs at import: every behavioural test can see it

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}:{self.col}:{self.operator}"

    def apply(self, source: bytes) -> bytes:
        for edit in sorted(self.edits, key=lambda e: e.start, reverse=True):
            source = source[: edit.start] + edit.text + source[edit.end :]
        return source


@frozen
class Equivalent:
    """A mutant that changes no behaviour, and why (it is left out of the score). Named by
    where it is (file, enclosing function) and what it changes (operator, the line before and
    after), not by line number, so an edit elsewhere in the file leaves the entry valid."""

    file: str
    scope: str
    operator: str
    original_line: str
    mutated_line: str
    why: str

    def matches(self, mutant: Mutant) -> bool:
        return (
            mutant.file == self.file
            and mutant.scope == self.scope
            and mutant.operator == self.operator
            and mutant.original_line == self.original_line
            and mutant.mutated_line == self.mutated_line
        )


#: Mutants that change no behaviour a caller could observe, found by reading each survivor.
#: Keyed by file, enclosing function, operator and the line before and after (so an entry goes
#: stale, and is reported, when the code under it changes; tests/test_mutation_script.py).
_REFUSED_CALL_KEY = (
    "a refused call never starts, so it never gets a dispatch number: the ledger is written "
    "only when a started call finishes, and `finished_calls` names only calls with a "
    "dispatch number, so `dispatched` on a refusal is never read"
)
EQUIVALENT: tuple[Equivalent, ...] = (
    Equivalent(
        "toolloop_fsm/guards/attempts.py",
        "destination_unreachable",
        "drop_branch",
        "return True",
        "pass",
        "dead branch: `unreachable` is set only by `skip_unreachable`, whose transitions go "
        "straight to `finishing`; `judging_attempt` never sees it set",
    ),
    Equivalent(
        "toolloop_fsm/states/attempts.py",
        "ask_admission",
        "true_false",
        "state.admission_asked = True",
        "state.admission_asked = False",
        "admission is asked only while the credential source is the user's; an admitted turn "
        "switches it to shared and a refused or stopped one finishes, so the flag is never "
        "read again",
    ),
    Equivalent(
        "toolloop_fsm/states/build_result.py",
        "abandon_in_flight",
        "drop_call",
        "turn.armed.pop(DeadlineKind.SETTLE, None)",
        "pass",
        "the settle deadline has fired and the turn goes straight to its terminal state; no "
        "later step reads the armed deadlines",
    ),
    Equivalent(
        "toolloop_fsm/states/tool_dispatch.py",
        "refuse_truncated_call",
        "true_false",
        "success=False, reason=TRUNCATED_ARGUMENTS_REASON, dispatched=False",
        "success=False, reason=TRUNCATED_ARGUMENTS_REASON, dispatched=True",
        _REFUSED_CALL_KEY,
    ),
    Equivalent(
        "toolloop_fsm/states/tool_dispatch.py",
        "refuse_unparseable_call",
        "true_false",
        "dispatched=False,",
        "dispatched=True,",
        _REFUSED_CALL_KEY,
    ),
    Equivalent(
        "toolloop_fsm/states/tool_dispatch.py",
        "refuse_outside_allowlist",
        "true_false",
        "at_gate(turn).outcome = ToolOutcome(success=False, reason=reason, dispatched=False)",
        "at_gate(turn).outcome = ToolOutcome(success=False, reason=reason, dispatched=True)",
        _REFUSED_CALL_KEY,
    ),
    Equivalent(
        "toolloop_fsm/pump/inner.py",
        "EventPump.__init__",
        "true_false",
        "self._reading = False",
        "self._reading = True",
        "the first read starts in the same step as the turn (no await between `start` and "
        "the read setting the flag), so no callback can see the initial value",
    ),
    Equivalent(
        "toolloop_fsm/pump/inner.py",
        "EventPump._join_children",
        "drop_branch",
        "raise child.exception()  # type: ignore[misc]",
        "pass  # type: ignore[misc]",
        "no child can fail: the tool, delivery and host-call tasks turn every exception into "
        "an event, so there is never a child exception to raise",
    ),
    Equivalent(
        "toolloop_fsm/pump/inner.py",
        "EventPump._wind_down",
        "int_minus_one",
        "self._stream_generation += 1",
        "self._stream_generation += 0",
        "at wind-down no stream can be read any more: a finished turn already moved the "
        "generation on, and a failed or cancelled one has interrupted its read",
    ),
    Equivalent(
        "toolloop_fsm/pump/inner.py",
        "EventPump._wind_down",
        "int_plus_one",
        "self._stream_generation += 1",
        "self._stream_generation += 2",
        "the generation only ever grows and is only compared for equality with one a read "
        "captured earlier: a step of two makes every captured value stale just as one does",
    ),
    Equivalent(
        "toolloop_fsm/pump/deadlines.py",
        "Deadlines.clear",
        "drop_call",
        "self.timers.remove(entry)",
        "pass",
        "a cleared deadline's timer is cancelled first, so left in the list it never fires "
        "and is never found again (tokens are unique); the list is dropped at wind-down",
    ),
    Equivalent(
        "toolloop_fsm/pump/deadlines.py",
        "Deadlines.cancel_all",
        "drop_call",
        "self.timers.clear()",
        "pass",
        "the timers were just cancelled and the run is over; nothing reads the list again",
    ),
    Equivalent(
        "toolloop_fsm/pump/deadlines.py",
        "Deadlines._fired",
        "comparison",
        "if effect.first_seconds is not None:",
        "if effect.first_seconds is None:",
        "every rolling deadline is the pass's stream deadline (it has `first_seconds`); the "
        "machine reads a stream deadline after the first chunk as the inactivity deadline "
        "either way",
    ),
    Equivalent(
        "toolloop_fsm/pump/deadlines.py",
        "Deadlines._fired",
        "drop_call",
        "self.timers.remove(entry)",
        "pass",
        "a fired timer left in the list is never found again (tokens are unique) and a "
        "later clear of it cancels a handle that already ran",
    ),
    Equivalent(
        "toolloop_fsm/pump/outer.py",
        "GenerationPump.start_attempt",
        "reason_literal",
        'if inner.state != "ready":',
        "if inner.state != 'ready_x':",
        "the attempt's run starts before the unreachable watcher can fire (the report is "
        "checked before the attempt starts), so the inner machine is never still `ready`",
    ),
    Equivalent(
        "toolloop_fsm/states/delivery.py",
        "discard_buffer",
        "boolean_operator",
        "if draft is not None and turn.policy.drafting:",
        "if draft is not None or turn.policy.drafting:",
        "a draft exists whenever drafting is on; with the tool checkpoint alone the text "
        "discarded is written to the draft but read only with drafting on (the result's "
        "undelivered text, a resumed drafting turn)",
    ),
    Equivalent(
        "toolloop_fsm/pump/outer.py",
        "GenerationPump.start_attempt",
        "drop_call",
        "unreachable.cancel()",
        "pass",
        "`unreachable` is a bare future awaited only by the attempt's wait, which has "
        "returned, and the listener that could set it was removed the line before: left "
        "pending it has no callback and is dropped with the attempt",
    ),
    Equivalent(
        "toolloop_fsm/guards/attempts.py",
        "key_candidates",
        "drop_branch",
        "return []",
        "pass",
        "every caller passes a model of the chain: `next_model` iterates the chain's range and "
        "`state.model` is the running model's index; the bound is defensive",
    ),
    Equivalent(
        "toolloop_fsm/pump/inner.py",
        "EventPump._wind_down",
        "drop_call",
        "self._cancel_timers()",
        "pass",
        "`run`'s `finally` cancels every timer again once the children are joined; a timer "
        "that fires in between finds the pump finished (`feed` ignores it) or abandons a "
        "straggler the join would abandon, named once either way",
    ),
    Equivalent(
        "toolloop_fsm/pump/deliveries.py",
        "wait_bounded",
        "drop_branch",
        "expired.cancel()",
        "pass",
        "`expired` is a bare future only this wait awaited, and its timer was just "
        "cancelled: left pending it has no callback and is dropped on return",
    ),
    Equivalent(
        "toolloop_fsm/pump/redaction.py",
        "StreamMask._masked_chunk",
        "drop_branch",
        "return chunk",
        "pass",
        "a call with nothing masked falls through to the function's last line, which returns "
        "the chunk itself too (a call is none of the text kinds tested in between)",
    ),
    Equivalent(
        "toolloop_fsm/states/drafting.py",
        "_reject",
        "true_false",
        "dispatched=False,",
        "dispatched=True,",
        _REFUSED_CALL_KEY,
    ),
    Equivalent(
        "toolloop_fsm/states/delivery.py",
        "hold_text",
        "comparison",
        "elif room > 0:",
        "elif room >= 0:",
        "with no room left the slice keeps nothing and `if kept` holds nothing (the room is "
        "never negative: nothing is held past the ceiling)",
    ),
    Equivalent(
        "toolloop_fsm/pump/redaction.py",
        "StreamMask._let_through",
        "comparison",
        "if spans and spans[-1][1] > cut:",
        "if spans and spans[-1][1] >= cut:",
        "when the last span ends at the cut, the branch sets the cut to the value it has",
    ),
    Equivalent(
        "toolloop_fsm/pump/deadlines.py",
        "Deadlines.arm",
        "drop_branch",
        "self.last_activity = now",
        "pass",
        "the only rolling deadline is armed in the same batch as its `StartStream`, which "
        "already set the last activity to the same instant",
    ),
)

_COMPARISON_FLIPS: dict[type[ast.cmpop], tuple[type[ast.cmpop], str, str]] = {
    ast.Lt: (ast.LtE, r"<", "<="),
    ast.LtE: (ast.Lt, r"<=", "<"),
    ast.Gt: (ast.GtE, r">", ">="),
    ast.GtE: (ast.Gt, r">=", ">"),
    ast.Eq: (ast.NotEq, r"==", "!="),
    ast.NotEq: (ast.Eq, r"!=", "=="),
    ast.Is: (ast.IsNot, r"\bis\b", "is not"),
    ast.IsNot: (ast.Is, r"\bis\s+not\b", "is"),
    ast.In: (ast.NotIn, r"\bin\b", "not in"),
    ast.NotIn: (ast.In, r"\bnot\s+in\b", "in"),
}
#: Calls whose string arguments are names the code looks up, not values a user sees.
_NAME_CALLS = frozenset(
    {"getattr", "setattr", "hasattr", "_t", "transition", "compile_declaration"}
)
#: Module-level names whose strings are declarations (state names), not behaviour.
_DECLARATION_NAMES = frozenset(
    {"STATES", "FINAL_STATES", "TRANSIENT_STATES", "STREAM_STATES", "__slots__", "__all__"}
)
_IDENTIFIER = re.compile(r"[a-z][a-z0-9_]*\Z")

OPERATORS: dict[str, str] = {
    "comparison": "a comparison flipped: < <=, > >=, == !=, is / is not, in / not in",
    "boolean_operator": "`and` and `or` swapped",
    "drop_not": "a `not` removed",
    "int_plus_one": "an integer constant one too large",
    "int_minus_one": "an integer constant one too small",
    "true_false": "True and False swapped",
    "drop_call": "a statement that is a call (or an awaited call) removed",
    "negate_return": "a guard returns the opposite (`return x` -> `return not (x)`)",
    "drop_branch": "the body of an if / elif branch replaced by `pass`",
    "reason_literal": "a reason, kind or state literal misspelt",
    "drop_transition": "one transition removed from a machine's TRANSITIONS",
    "swap_transitions": "two neighbouring guarded transitions of one trigger tried in the "
    "other order",
}


class _Source:
    """A module's text as UTF-8 bytes, addressed the way `ast` addresses it."""

    def __init__(self, path: Path) -> None:
        self.data = path.read_bytes()
        self.lines = self.data.splitlines(keepends=True)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def offset(self, line: int, col: int) -> int:
        return self.starts[line - 1] + col

    def span(self, node: ast.AST) -> tuple[int, int]:
        return (
            self.offset(node.lineno, node.col_offset),  # type: ignore[attr-defined]
            self.offset(node.end_lineno, node.end_col_offset),  # type: ignore[attr-defined]
        )

    def text(self, start: int, end: int) -> bytes:
        return self.data[start:end]

    def line_text(self, line: int) -> str:
        return self.lines[line - 1].decode("utf-8").strip()


class _Site:
    """Where a node sits: its parents (innermost last), and whether it runs when a function
    is called (its body) rather than when the module is imported (a default argument, a
    decorator, a table)."""

    def __init__(self, parents: tuple[ast.AST, ...], in_function: bool) -> None:
        self.parents = parents
        self.in_function = in_function

    @property
    def parent(self) -> ast.AST | None:
        return self.parents[-1] if self.parents else None


_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _walk(tree: ast.Module) -> Iterator[tuple[ast.AST, _Site]]:
    """Every node that may be mutated, with its site; skips docstrings, annotations,
    assertions and `TYPE_CHECKING` blocks."""

    def visit(
        node: ast.AST, parents: tuple[ast.AST, ...], in_function: bool
    ) -> Iterator[tuple[ast.AST, _Site]]:
        yield node, _Site(parents, in_function)
        inner = (*parents, node)
        for name, value in ast.iter_fields(node):
            if name in ("annotation", "returns", "type_comment") or isinstance(node, ast.Assert):
                continue
            runs_in_call = in_function or (isinstance(node, _FUNCTIONS) and name == "body")
            children = value if isinstance(value, list) else [value]
            for index, child in enumerate(children):
                if not isinstance(child, ast.AST):
                    continue
                if name == "body" and index == 0 and _is_docstring(child):
                    continue
                if isinstance(child, ast.If) and _is_type_checking(child.test):
                    continue
                if isinstance(child, ast.Assign | ast.AnnAssign) and _declares_names(child):
                    continue
                yield from visit(child, inner, runs_in_call)

    yield from visit(tree, (), False)


def _is_docstring(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    )


def _is_type_checking(test: ast.expr) -> bool:
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"


def _declares_names(node: ast.Assign | ast.AnnAssign) -> bool:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return any(isinstance(t, ast.Name) and t.id in _DECLARATION_NAMES for t in targets)


def _call_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Name):
            return func.id
        if isinstance(func, ast.Attribute):
            return func.attr
    return None


def _strip_comments(text: str) -> str:
    return re.sub(r"#[^\n]*", "", text)


class _Enumerator:
    """Builds every mutant of one file (or only those on ``lines``)."""

    def __init__(self, root: Path, relative: str, lines: frozenset[int] | None = None) -> None:
        self.relative = relative
        self.lines = lines
        self.source = _Source(root / relative)
        self.tree = ast.parse(self.source.data)
        self.is_guard = relative.startswith("toolloop_fsm/guards/")
        self.mutants: list[Mutant] = []

    def run(self) -> list[Mutant]:
        for node, site in _walk(self.tree):
            self._node(node, site)
        self._transitions()
        return self.mutants

    # -- recording a mutant
    def _add(
        self,
        operator: str,
        node: ast.AST,
        site: _Site,
        edits: Sequence[Edit],
        span: tuple[int, int] | None = None,
    ) -> None:
        line = node.lineno  # type: ignore[attr-defined]
        if self.lines is not None and line not in self.lines:
            return
        col = node.col_offset  # type: ignore[attr-defined]
        mutated = Mutant(
            file=self.relative,
            line=line,
            col=col,
            operator=operator,
            original_line="",
            mutated_line="",
            scope=".".join(parent.name for parent in site.parents if isinstance(parent, _SCOPES)),
            edits=tuple(edits),
            span=span or (line, node.end_lineno),  # type: ignore[attr-defined]
            module_level=not site.in_function,
        )
        text = mutated.apply(self.source.data)
        try:
            ast.parse(text)
        except SyntaxError:
            return  # not a program: not a bug anyone could ship
        first = min(edit.start for edit in edits)
        changed_line = self.source.data.count(b"\n", 0, first) + 1
        new_lines = text.splitlines()
        mutated_line = (
            new_lines[changed_line - 1].decode("utf-8").strip()
            if changed_line <= len(new_lines)
            else ""
        )
        if operator == "drop_transition":
            mutated_line = "(the transition is gone)"
        self.mutants.append(
            evolve(
                mutated,
                original_line=self.source.line_text(changed_line),
                mutated_line=mutated_line,
            )
        )

    def _replace(self, node: ast.AST, text: str) -> list[Edit]:
        start, end = self.source.span(node)
        return [Edit(start, end, text.encode("utf-8"))]

    # -- the operators, by node
    def _node(self, node: ast.AST, site: _Site) -> None:
        if isinstance(node, ast.Compare):
            self._comparison(node, site)
        elif isinstance(node, ast.BoolOp):
            self._boolean_operator(node, site)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            start, _ = self.source.span(node)
            operand_start, _ = self.source.span(node.operand)
            self._add("drop_not", node, site, [Edit(start, operand_start, b"")])
        elif isinstance(node, ast.Constant):
            self._constant(node, site)
        elif isinstance(node, ast.Expr) and site.in_function:
            value = node.value.value if isinstance(node.value, ast.Await) else node.value
            if isinstance(value, ast.Call):
                self._add("drop_call", node, site, self._replace(node, "pass"))
        elif isinstance(node, ast.Return) and self.is_guard and node.value is not None:
            value = node.value
            if not (isinstance(value, ast.Constant) and isinstance(value.value, bool)):
                start, end = self.source.span(value)
                inner = self.source.text(start, end)
                self._add("negate_return", node, site, [Edit(start, end, b"not (" + inner + b")")])
        if isinstance(node, ast.If) and site.in_function:
            first, last = node.body[0], node.body[-1]
            start, _ = self.source.span(first)
            _, end = self.source.span(last)
            if not (len(node.body) == 1 and isinstance(first, ast.Pass)):
                self._add(
                    "drop_branch",
                    first,
                    site,
                    [Edit(start, end, b"pass")],
                    span=(first.lineno, last.end_lineno or last.lineno),
                )

    def _comparison(self, node: ast.Compare, site: _Site) -> None:
        left: ast.AST = node.left
        for op, right in zip(node.ops, node.comparators, strict=True):
            flip = _COMPARISON_FLIPS.get(type(op))
            if flip is not None:
                _, pattern, replacement = flip
                gap_start = self.source.span(left)[1]
                gap_end = self.source.span(right)[0]
                gap = self.source.text(gap_start, gap_end).decode("utf-8")
                found = list(re.finditer(pattern, _strip_comments(gap)))
                if len(found) == 1 and "#" not in gap:
                    match = found[0]
                    new_gap = gap[: match.start()] + replacement + gap[match.end() :]
                    self._add(
                        "comparison",
                        node,
                        site,
                        [Edit(gap_start, gap_end, new_gap.encode("utf-8"))],
                    )
            left = right

    def _boolean_operator(self, node: ast.BoolOp, site: _Site) -> None:
        word, other = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
        edits: list[Edit] = []
        for before, after in zip(node.values, node.values[1:], strict=False):
            gap_start = self.source.span(before)[1]
            gap_end = self.source.span(after)[0]
            gap = self.source.text(gap_start, gap_end).decode("utf-8")
            if "#" in gap:
                return
            new_gap, count = re.subn(rf"\b{word}\b", other, gap)
            if count != 1:
                return
            edits.append(Edit(gap_start, gap_end, new_gap.encode("utf-8")))
        self._add("boolean_operator", node, site, edits)

    def _constant(self, node: ast.Constant, site: _Site) -> None:
        value = node.value
        if isinstance(value, bool):
            self._add("true_false", node, site, self._replace(node, repr(not value)))
        elif isinstance(value, int):
            self._add("int_plus_one", node, site, self._replace(node, repr(value + 1)))
            if value > 0:
                self._add("int_minus_one", node, site, self._replace(node, repr(value - 1)))
        elif isinstance(value, str) and _IDENTIFIER.match(value) and self._is_reason(node, site):
            self._add("reason_literal", node, site, self._replace(node, repr(value + "_x")))

    def _is_reason(self, node: ast.Constant, site: _Site) -> bool:
        """A literal the code compares against or hands over as a value (a reason, a notice
        kind, a state name it checks), not a name it looks up. In a declared ending
        (``ends=(status, reason)``) the reason is one; the status names a final state."""
        parent = site.parent
        if isinstance(parent, ast.Tuple) and len(site.parents) > 1:
            holder = site.parents[-2]
            if isinstance(holder, ast.keyword) and holder.arg == "ends":
                return parent.elts.index(node) == 1
        for parent in reversed(site.parents):
            if isinstance(parent, ast.JoinedStr | ast.Subscript | ast.Dict):
                return False
            if isinstance(parent, ast.Compare):
                return True
            if isinstance(parent, ast.Call):
                return _call_name(parent) not in _NAME_CALLS
            if isinstance(parent, ast.stmt):
                return isinstance(parent, ast.Return | ast.Assign) and site.in_function
        return False

    # -- the transition tables
    def _transitions(self) -> None:
        for statement in self.tree.body:
            if not (
                isinstance(statement, ast.AnnAssign | ast.Assign)
                and isinstance(statement.value, ast.List)
            ):
                continue
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            if not any(isinstance(t, ast.Name) and t.id == "TRANSITIONS" for t in targets):
                continue
            self._table(statement.value)

    def _table(self, table: ast.List) -> None:
        site = _Site((), in_function=False)
        elements = table.elts
        for index, element in enumerate(elements):
            if not isinstance(element, ast.Call):
                continue  # a generated group (chunk triggers): not one transition
            start, _ = self.source.span(element)
            if index + 1 < len(elements):
                end = self.source.span(elements[index + 1])[0]
            else:
                end = self.source.span(element)[1]
            self._add("drop_transition", element, site, [Edit(start, end, b"")])
        for first, second in itertools.pairwise(elements):
            if not (isinstance(first, ast.Call) and isinstance(second, ast.Call)):
                continue
            if ast.dump(first.args[0]) != ast.dump(second.args[0]):
                continue  # another trigger
            if ast.dump(first.args[1]) != ast.dump(second.args[1]):
                continue  # another source state
            if not any(k.arg == "when" for k in first.keywords):
                continue
            a_start, a_end = self.source.span(first)
            b_start, b_end = self.source.span(second)
            self._add(
                "swap_transitions",
                first,
                site,
                [
                    Edit(a_start, a_end, self.source.text(b_start, b_end)),
                    Edit(b_start, b_end, self.source.text(a_start, a_end)),
                ],
            )


def target_files(root: Path) -> list[str]:
    files: list[str] = []
    for target in TARGETS:
        path = root / target
        found = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        files.extend(p.relative_to(root).as_posix() for p in found)
    return files


def enumerate_mutants(root: Path, lines: dict[str, frozenset[int]] | None = None) -> list[Mutant]:
    """Every mutant of the engine; with ``lines``, only those on the given lines of the given
    files (each is parsed to check it is a program, so the whole tree takes a while)."""
    mutants: list[Mutant] = []
    files = target_files(root) if lines is None else [f for f in target_files(root) if f in lines]
    for relative in files:
        mutants.extend(
            _Enumerator(root, relative, None if lines is None else lines[relative]).run()
        )
    # two operators can reach the same program: keep the first
    seen: set[tuple[str, bytes]] = set()
    unique: list[Mutant] = []
    sources: dict[str, bytes] = {}
    for mutant in mutants:
        source = sources.setdefault(mutant.file, (root / mutant.file).read_bytes())
        key = (mutant.file, mutant.apply(source))
        if key not in seen:
            seen.add(key)
            unique.append(mutant)
    # ids must name one mutant: number the rare second one on the same spot
    counts: dict[str, int] = {}
    named: list[Mutant] = []
    for mutant in unique:
        n = counts.get(mutant.id, 0)
        counts[mutant.id] = n + 1
        named.append(mutant if n == 0 else evolve(mutant, operator=f"{mutant.operator}#{n + 1}"))
    return named


def equivalence(mutant: Mutant) -> Equivalent | None:
    return next((entry for entry in EQUIVALENT if entry.matches(mutant)), None)


# --------------------------------------------------------------------------- the scratch tree
def tracked_files(root: Path) -> list[str]:
    """The checkout's files as the tests see them: tracked and new, not ignored."""
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout
    return sorted(
        {name for name in listing.decode("utf-8").split("\0") if name and (root / name).is_file()}
    )


def copy_tree(root: Path, scratch: Path) -> str:
    """Mirror the checkout into ``scratch`` (never the other way); returns a fingerprint of
    its content, which keys the cached line map."""
    digest = hashlib.sha256()
    wanted = tracked_files(root)
    for name in wanted:
        data = (root / name).read_bytes()
        if not name.startswith("scripts/"):  # this tool does not change what the tests do
            digest.update(name.encode("utf-8") + b"\0" + hashlib.sha256(data).digest())
        target = scratch / name
        if not target.is_file() or target.read_bytes() != data:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
    keep = set(wanted)
    for path in scratch.rglob("*"):
        relative = path.relative_to(scratch).as_posix()
        stale = path.is_file() and relative not in keep and not relative.startswith(".")
        if stale and "__pycache__" not in relative and not relative.endswith(".pyc"):
            path.unlink()
    return digest.hexdigest()


class Workspace:
    """One scratch copy of the tree; writes mutants into it and restores the original.

    Every write gets a new modification time, a whole second after the last one: Python's
    bytecode cache trusts a file's (whole-second) time and size, and a mutant of the same
    size written within the same second would otherwise be served from the cache.
    """

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self._stamp = 1_000_000_000

    def write(self, relative: str, data: bytes) -> None:
        path = self.scratch / relative
        path.write_bytes(data)
        self._stamp += 1
        os.utime(path, (self._stamp, self._stamp))

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("PYTHONDONTWRITEBYTECODE", None)  # reuse compiled tests and libraries
        env["PYTHONPYCACHEPREFIX"] = str(self.scratch / ".pycache")
        env["PYTHONPATH"] = str(self.scratch)
        env["HYPOTHESIS_PROFILE"] = "ci"
        return env


# --------------------------------------------------------------------------- the line map
@frozen
class LineMap:
    """Which behavioural tests execute which engine lines, and how long each test takes."""

    fingerprint: str
    tests: tuple[str, ...]
    durations: tuple[float, ...]
    spawns: frozenset[int]  # tests that start a Python subprocess
    lines: dict[str, dict[int, tuple[int, ...]]]

    def tests_reaching(self, mutant: Mutant) -> list[int]:
        found: set[int] = set(self.spawns)
        if mutant.module_level:
            # module data (a transition table, a constant) acts only through engine code:
            # every test that runs any engine line
            for lines in self.lines.values():
                for tests in lines.values():
                    found.update(tests)
            return sorted(found)
        hits = self.lines.get(mutant.file, {})
        for line in range(mutant.span[0], mutant.span[1] + 1):
            found.update(hits.get(line, ()))
        return sorted(found)

    def ordered(self, indices: list[int]) -> list[int]:
        def rank(index: int) -> tuple[int, int, float]:
            path = self.tests[index].split("::", 1)[0]
            position = TEST_ORDER.index(path) if path in TEST_ORDER else len(TEST_ORDER)
            return (index in self.spawns, position, self.durations[index])

        return sorted(indices, key=rank)

    def to_json(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "tests": list(self.tests),
            "durations": list(self.durations),
            "spawns": sorted(self.spawns),
            "lines": {
                file: {str(line): list(tests) for line, tests in lines.items()}
                for file, lines in self.lines.items()
            },
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LineMap:
        return cls(
            fingerprint=data["fingerprint"],
            tests=tuple(data["tests"]),
            durations=tuple(data["durations"]),
            spawns=frozenset(data["spawns"]),
            lines={
                file: {int(line): tuple(tests) for line, tests in lines.items()}
                for file, lines in data["lines"].items()
            },
        )


class LineRecorder:
    """A pytest plugin: traces the engine lines each test executes (setup and teardown
    included) and notes the tests that start a Python subprocess."""

    def __init__(self, root: Path, files: list[str]) -> None:
        self.by_path = {str(root / f): f for f in files}
        self.tests: list[str] = []
        self.durations: list[float] = []
        self.spawns: set[int] = set()
        self.lines: dict[str, dict[int, set[int]]] = {f: {} for f in files}
        self.failed: list[str] = []
        self._current: int | None = None

    def _global_trace(self, frame: FrameType, event: str, _arg: Any) -> Any:
        relative = self.by_path.get(frame.f_code.co_filename)
        if relative is None or self._current is None:
            return None
        lines = self.lines[relative]
        current = self._current

        def local_trace(frame: FrameType, event: str, _arg: Any) -> Any:
            if event == "line":
                lines.setdefault(frame.f_lineno, set()).add(current)
            return local_trace

        lines.setdefault(frame.f_lineno, set()).add(current)
        return local_trace

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: Any, nextitem: Any) -> Iterator[None]:
        self.tests.append(item.nodeid)
        self._current = len(self.tests) - 1
        sys.settrace(self._global_trace)
        threading.settrace(self._global_trace)
        started = time.perf_counter()
        try:
            yield
        finally:
            sys.settrace(None)
            threading.settrace(None)
            self.durations.append(time.perf_counter() - started)
            self._current = None

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.failed:
            self.failed.append(report.nodeid)

    def note_spawn(self) -> None:
        if self._current is not None:
            self.spawns.add(self._current)


def record_lines(scratch: Path, out: Path) -> int:
    """Run the behavioural tests once in this process (from the scratch tree) under the
    tracer, and write the line map to ``out``."""
    os.chdir(scratch)
    sys.path.insert(0, str(scratch))
    recorder = LineRecorder(scratch, target_files(scratch))
    original_init = subprocess.Popen.__init__

    def spawning_init(popen: Any, *args: Any, **kwargs: Any) -> None:
        recorder.note_spawn()
        original_init(popen, *args, **kwargs)

    subprocess.Popen.__init__ = spawning_init  # type: ignore[method-assign, assignment]
    try:
        code = pytest.main(
            ["-q", "-n", "0", "-p", "no:cacheprovider", *BEHAVIOURAL_ARGS], plugins=[recorder]
        )
    finally:
        subprocess.Popen.__init__ = original_init  # type: ignore[method-assign]
    if code != 0 or recorder.failed:
        print(f"the behavioural tests fail without any mutant: {recorder.failed}", file=sys.stderr)
        return 1
    line_map = LineMap(
        fingerprint="",
        tests=tuple(recorder.tests),
        durations=tuple(recorder.durations),
        spawns=frozenset(recorder.spawns),
        lines={
            file: {line: tuple(sorted(tests)) for line, tests in lines.items()}
            for file, lines in recorder.lines.items()
        },
    )
    out.write_text(json.dumps(line_map.to_json()), encoding="utf-8")
    return 0


def load_line_map(workspace: Workspace, fingerprint: str) -> LineMap:
    cache = workspace.scratch / ".mutation-lines.json"
    if cache.is_file():
        cached = LineMap.from_json(json.loads(cache.read_text(encoding="utf-8")))
        if cached.fingerprint == fingerprint:
            return cached
    print("recording which tests reach which engine lines (one traced run) ...", flush=True)
    started = time.monotonic()
    raw = workspace.scratch / ".mutation-lines.partial.json"
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--record-lines", str(raw)],
        cwd=workspace.scratch,
        env=workspace.env(),
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit("the recording run failed; fix the suite first")
    recorded = LineMap.from_json(json.loads(raw.read_text(encoding="utf-8")))
    line_map = evolve(recorded, fingerprint=fingerprint)
    cache.write_text(json.dumps(line_map.to_json()), encoding="utf-8")
    raw.unlink()
    print(f"  {len(line_map.tests)} tests in {time.monotonic() - started:.0f} s", flush=True)
    return line_map


# --------------------------------------------------------------------------- running mutants
@frozen
class Outcome:
    mutant: Mutant
    result: str  # killed | timeout | survived | equivalent | error
    seconds: float
    tests: int  # how many tests the mutant would face
    killed_by: str | None = None
    why: str | None = None


_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)


def run_mutant(
    mutant: Mutant, workspace: Workspace, line_map: LineMap, timeout_factor: float
) -> Outcome:
    entry = equivalence(mutant)
    if entry is not None:
        return Outcome(mutant, "equivalent", 0.0, 0, why=entry.why)
    indices = line_map.ordered(line_map.tests_reaching(mutant))
    if not indices:
        return Outcome(mutant, "survived", 0.0, 0, why="no behavioural test executes this line")
    original = (workspace.scratch / mutant.file).read_bytes()
    args_file = workspace.scratch / ".mutation-tests.txt"
    args_file.write_text("\n".join(line_map.tests[i] for i in indices) + "\n", encoding="utf-8")
    # each test's own limit, from its recorded (traced, so about twice the plain) time
    limits = {line_map.tests[i]: 10.0 + timeout_factor * line_map.durations[i] for i in indices}
    limits_file = workspace.scratch / ".mutation-limits.json"
    limits_file.write_text(json.dumps(limits), encoding="utf-8")
    env = workspace.env()
    env[_LIMITS_VARIABLE] = str(limits_file)
    scratch = workspace.scratch
    env["PYTHONPATH"] = os.pathsep.join([str(scratch), str(scratch / "scripts")])
    command = [sys.executable, "-m", "pytest", *PYTEST_OPTIONS, "-p", "mutation", f"@{args_file}"]
    started = time.monotonic()
    workspace.write(mutant.file, mutant.apply(original))
    try:
        proc = subprocess.Popen(
            command,
            cwd=workspace.scratch,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: whatever it leaves is ended
        )
        try:
            # a backstop for a hang outside any test (the watchdog ends one inside a test)
            output, _ = proc.communicate(timeout=60.0 + sum(limits.values()))
        except subprocess.TimeoutExpired:
            _end_group(proc.pid)
            proc.communicate()
            return Outcome(mutant, "timeout", time.monotonic() - started, len(indices))
        finally:
            _end_group(proc.pid)  # a test's subprocess outliving a watchdog exit
    finally:
        workspace.write(mutant.file, original)
    seconds = time.monotonic() - started
    text = output.decode("utf-8", "replace")
    if proc.returncode == 0:
        return Outcome(mutant, "survived", seconds, len(indices))
    if proc.returncode == _WATCHDOG_EXIT:
        hung = Path(f"{limits_file}.hung")
        killer = hung.read_text(encoding="utf-8").strip() if hung.is_file() else None
        hung.unlink(missing_ok=True)
        return Outcome(mutant, "timeout", seconds, len(indices), killed_by=killer)
    if proc.returncode in (1, 2):  # a test failed, or the mutant broke collection (import)
        failed = _FAILED.search(text)
        killer = failed.group(1) if failed else "collection (the module no longer imports)"
        return Outcome(mutant, "killed", seconds, len(indices), killed_by=killer)
    tail = "\n".join(text.strip().splitlines()[-5:])
    why = f"pytest exit {proc.returncode}: {tail}"
    return Outcome(mutant, "error", seconds, len(indices), why=why)


def _end_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


# --------------------------------------------------------------------------- the watchdog
# Loaded into each mutant's pytest run as the plugin ``-p mutation``: a test that runs far
# past its recorded time is taken as hung, and the run ends at once with `_WATCHDOG_EXIT`
# (raising instead would let Hypothesis shrink the hang, example by hanging example).
_LIMITS_VARIABLE = "TOOLLOOP_MUTATION_TEST_LIMITS"
_WATCHDOG_EXIT = 97
_limits_cache: dict[str, float] | None = None


def _test_limit(nodeid: str) -> float | None:
    global _limits_cache
    path = os.environ.get(_LIMITS_VARIABLE)
    if not path:
        return None
    if _limits_cache is None:
        _limits_cache = json.loads(Path(path).read_text(encoding="utf-8"))
    return _limits_cache.get(nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: Any, nextitem: Any) -> Iterator[None]:
    seconds = _test_limit(item.nodeid)
    if seconds is None:
        yield
        return

    def expire(_signum: int, _frame: FrameType | None) -> None:
        # pytest captures this test's output and would lose it: the name goes to a file
        hung = Path(os.environ[_LIMITS_VARIABLE] + ".hung")
        hung.write_text(f"{item.nodeid} ran past {seconds:.0f} s\n", encoding="utf-8")
        os._exit(_WATCHDOG_EXIT)

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@frozen
class Score:
    killed: int
    timeouts: int
    survived: int
    equivalent: int
    errors: int

    @property
    def counted(self) -> int:
        return self.killed + self.timeouts + self.survived

    @property
    def percent(self) -> float:
        return 100.0 * (self.killed + self.timeouts) / self.counted if self.counted else 100.0

    @classmethod
    def of(cls, outcomes: Sequence[Outcome]) -> Score:
        def count(result: str) -> int:
            return sum(1 for o in outcomes if o.result == result)

        results = ("killed", "timeout", "survived", "equivalent", "error")
        return cls(*(count(result) for result in results))

    def line(self) -> str:
        return (
            f"score {self.percent:.1f} %: {self.killed + self.timeouts} of {self.counted} "
            f"non-equivalent mutants killed ({self.killed} failed a test, {self.timeouts} timed "
            f"out), {self.survived} survived; {self.equivalent} equivalent, {self.errors} errors"
        )


def write_report(path: Path, outcomes: Sequence[Outcome], meta: dict[str, Any]) -> None:
    score = Score.of(outcomes)
    data = {
        **meta,
        "score": {
            "percent": round(score.percent, 1),
            "killed": score.killed,
            "timeouts": score.timeouts,
            "survived": score.survived,
            "equivalent": score.equivalent,
            "errors": score.errors,
        },
        "mutants": [
            {
                "id": o.mutant.id,
                "file": o.mutant.file,
                "line": o.mutant.line,
                "operator": o.mutant.operator,
                "diff": f"- {o.mutant.original_line}\n+ {o.mutant.mutated_line}",
                "result": o.result,
                "seconds": round(o.seconds, 2),
                "tests": o.tests,
                "killed_by": o.killed_by,
                "why": o.why,
            }
            for o in outcomes
        ],
    }
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------- command line
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scripts/mutation.py",
        description="Seed single-point bugs into the engine and run the behavioural tests.",
    )
    parser.add_argument("--list", action="store_true", help="count the mutants and exit")
    parser.add_argument("--sample", type=int, help="test a deterministic sample of N mutants")
    parser.add_argument("--seed", type=int, default=0, help="the sample's seed (default 0)")
    parser.add_argument("--only", nargs="+", metavar="ID", help="test just these mutant ids")
    parser.add_argument("--retry", type=Path, metavar="REPORT", help="rerun a report's survivors")
    parser.add_argument("--show", nargs="+", metavar="ID", help="print these mutants' diffs")
    parser.add_argument("--jobs", type=int, default=1, help="mutants tested at once (default 1)")
    parser.add_argument("--report", type=Path, help="write every mutant's outcome as JSON")
    parser.add_argument(
        "--scratch",
        type=Path,
        default=Path("/tmp/toolloop-mutation"),
        help="where the scratch copies of the tree live (default /tmp/toolloop-mutation)",
    )
    parser.add_argument(
        "--timeout-factor",
        type=float,
        default=3.0,
        help="a test's time limit under a mutant: 10 s + this times its traced, unmutated "
        "time (default 3)",
    )
    parser.add_argument("--record-lines", type=Path, help=argparse.SUPPRESS)
    return parser


def _select(mutants: list[Mutant], args: argparse.Namespace) -> list[Mutant]:
    by_id = {m.id: m for m in mutants}
    if args.only:
        unknown = [i for i in args.only if i not in by_id]
        if unknown:
            raise SystemExit(f"no such mutant: {', '.join(unknown)} (see --list)")
        return [by_id[i] for i in args.only]
    if args.retry:
        previous = json.loads(args.retry.read_text(encoding="utf-8"))
        wanted = [m["id"] for m in previous["mutants"] if m["result"] == "survived"]
        missing = [i for i in wanted if i not in by_id]
        if missing:
            print(f"gone since that report (the code changed): {', '.join(missing)}")
        return [by_id[i] for i in wanted if i in by_id]
    if args.sample is not None:
        if args.sample < 1:
            raise SystemExit("--sample must be at least 1")
        ordered = sorted(mutants, key=lambda m: m.id)
        return random.Random(args.seed).sample(ordered, min(args.sample, len(ordered)))
    return mutants


def _print_listing(mutants: list[Mutant]) -> None:
    by_file: dict[str, int] = {}
    by_operator: dict[str, int] = {}
    for mutant in mutants:
        by_file[mutant.file] = by_file.get(mutant.file, 0) + 1
        base = mutant.operator.split("#", 1)[0]
        by_operator[base] = by_operator.get(base, 0) + 1
    print(f"{len(mutants)} mutants")
    for name, count in sorted(by_file.items()):
        print(f"  {count:5d}  {name}")
    for name, count in sorted(by_operator.items()):
        print(f"  {count:5d}  {name}: {OPERATORS[name]}")
    stale = [e for e in EQUIVALENT if not any(e.matches(m) for m in mutants)]
    for entry in stale:
        print(
            f"stale EQUIVALENT entry (no such mutant now): {entry.file} "
            f"{entry.scope or '(module)'}: {entry.original_line}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.record_lines is not None:
        return record_lines(Path.cwd(), args.record_lines)
    if args.jobs < 1:
        raise SystemExit("--jobs must be at least 1")
    mutants = enumerate_mutants(REPO)
    if args.list:
        _print_listing(mutants)
        return 0
    chosen = _select(mutants, args)
    if args.show:
        by_id = {m.id: m for m in mutants}
        for mutant_id in args.show:
            mutant = by_id.get(mutant_id)
            if mutant is None:
                raise SystemExit(f"no such mutant: {mutant_id}")
            print(f"{mutant.id}\n- {mutant.original_line}\n+ {mutant.mutated_line}")
        return 0
    workspaces = []
    fingerprint = ""
    for job in range(args.jobs):
        scratch = args.scratch / f"tree-{job}"
        scratch.mkdir(parents=True, exist_ok=True)
        fingerprint = copy_tree(REPO, scratch)
        workspaces.append(Workspace(scratch))
    _check_imports_from(workspaces[0])
    line_map = load_line_map(workspaces[0], fingerprint)
    for workspace in workspaces[1:]:
        shutil.copyfile(
            workspaces[0].scratch / ".mutation-lines.json",
            workspace.scratch / ".mutation-lines.json",
        )
    print(f"{len(chosen)} of {len(mutants)} mutants, {args.jobs} job(s)", flush=True)
    started = time.monotonic()
    outcomes = _run_all(chosen, workspaces, line_map, args.timeout_factor)
    elapsed = time.monotonic() - started
    score = Score.of(outcomes)
    for outcome in outcomes:
        if outcome.result in ("survived", "error"):
            mutant = outcome.mutant
            print(f"{outcome.result.upper()} {mutant.id}  ({outcome.why or 'every test passed'})")
            print(f"    - {mutant.original_line}\n    + {mutant.mutated_line}")
    print(score.line())
    print(f"{len(outcomes)} mutants in {elapsed / 60:.1f} min")
    if args.report is not None:
        meta = {
            "date": time.strftime("%Y-%m-%d"),
            "sample": args.sample,
            "seed": args.seed,
            "mutants_total": len(mutants),
            "minutes": round(elapsed / 60, 1),
        }
        write_report(args.report, outcomes, meta)
    return 0 if score.survived == 0 and score.errors == 0 else 1


def _check_imports_from(workspace: Workspace) -> None:
    """The tests in the scratch tree must import the scratch copy, never an installed one."""
    proc = subprocess.run(
        [sys.executable, "-c", "import toolloop_fsm; print(toolloop_fsm.__file__)"],
        cwd=workspace.scratch,
        env=workspace.env(),
        capture_output=True,
        text=True,
        check=True,
    )
    found = Path(proc.stdout.strip()).resolve()
    if not found.is_relative_to(workspace.scratch.resolve()):
        raise SystemExit(f"the scratch tree imports {found}, not its own copy")


def _run_all(
    chosen: list[Mutant], workspaces: list[Workspace], line_map: LineMap, factor: float
) -> list[Outcome]:
    free = list(workspaces)
    lock = threading.Lock()
    done = 0

    def one(mutant: Mutant) -> Outcome:
        nonlocal done
        with lock:
            workspace = free.pop()
        try:
            outcome = run_mutant(mutant, workspace, line_map, factor)
        finally:
            with lock:
                free.append(workspace)
        with lock:
            done += 1
            print(
                f"[{done}/{len(chosen)}] {outcome.result:<10} {outcome.seconds:6.1f} s  "
                f"{mutant.id}  {outcome.killed_by or ''}",
                flush=True,
            )
        return outcome

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(workspaces)) as pool:
        return list(pool.map(one, chosen))


if __name__ == "__main__":
    sys.exit(main())
