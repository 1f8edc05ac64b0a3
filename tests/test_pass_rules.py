"""The rules of one provider pass that the machine and every shell share
(`toolloop_fsm.pass_rules`): which budget of a pass's stream deadline runs out, and when; when
buffered text is delivered. Each rule lives there once: the machine, the in-process pump and
the Temporal worker ask it rather than keep their own copy (the machine's per-chunk handler
inlines the flush rule, and a test here keeps it to the rule)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import toolloop_fsm
from tests.test_machine_structure import _imports
from tests.test_machine_structure import _violations
from toolloop_fsm.effects import Deliver
from toolloop_fsm.events import DeadlineKind
from toolloop_fsm.events import TextDelta
from toolloop_fsm.host import TurnRequest
from toolloop_fsm.machine import ToolLoopMachine
from toolloop_fsm.pass_rules import flush_due
from toolloop_fsm.pass_rules import phase_budget
from toolloop_fsm.pass_rules import stream_budget_due
from toolloop_fsm.policy import LoopPolicy

PACKAGE = Path(toolloop_fsm.__file__).parent


def _due(
    now: float, answered_at: float | None, *, total: float | None = 900.0
) -> tuple[DeadlineKind, float]:
    return stream_budget_due(
        now,
        begun=100.0,
        answered_at=answered_at,
        first_seconds=300.0,
        inactivity_seconds=120.0,
        total_seconds=total,
    )


def test_a_pass_with_no_chunk_yet_runs_on_its_first_token_budget() -> None:
    assert _due(150.0, None) == (DeadlineKind.FIRST_TOKEN, 400.0)
    assert phase_budget(answered=False) is DeadlineKind.FIRST_TOKEN


def test_after_its_first_chunk_a_pass_runs_on_its_inactivity_budget_from_the_last_one() -> None:
    assert _due(500.0, 450.0) == (DeadlineKind.INACTIVITY, 570.0)
    assert phase_budget(answered=True) is DeadlineKind.INACTIVITY


def test_the_pass_duration_runs_out_first_when_it_is_due_no_later() -> None:
    # inactivity would be due at 1,020; the pass's 900 s are up at 1,000
    assert _due(950.0, 900.0) == (DeadlineKind.PASS_DURATION, 1000.0)
    # a tie is the pass's duration
    assert _due(950.0, 880.0) == (DeadlineKind.PASS_DURATION, 1000.0)


def test_a_spent_pass_duration_is_what_ran_out_however_steadily_it_streams() -> None:
    # seen after both its budgets were due: the pass's duration is the one that ran out
    assert _due(2000.0, 100.0) == (DeadlineKind.PASS_DURATION, 1000.0)
    assert _due(2000.0, None) == (DeadlineKind.PASS_DURATION, 1000.0)


def test_a_pass_without_a_total_budget_never_runs_out_of_it() -> None:
    assert _due(1e9, None, total=None) == (DeadlineKind.FIRST_TOKEN, 400.0)


def test_text_is_delivered_mid_stream_once_the_flush_size_is_buffered() -> None:
    assert not flush_due(199, 200)
    assert flush_due(200, 200)
    assert flush_due(201, 200)


@pytest.mark.parametrize("flush_chars", [1, 5, 8])
def test_the_machine_delivers_mid_stream_exactly_when_the_flush_rule_says(flush_chars: int) -> None:
    """The machine's chunk handler inlines `flush_due` (a call per chunk was a tenth of a
    turn's CPU, bench_tool_loop.py): this keeps the copy to the rule."""
    machine = ToolLoopMachine(LoopPolicy(delivery_flush_chars=flush_chars), tools=[])
    machine.start(TurnRequest([{"role": "user", "content": "hi"}]), now=0.0)
    buffered = 0
    for piece in ["ab", "c", "defg", "h", "ijklmnop", "q"]:
        buffered += len(piece)
        effects = machine.feed(TextDelta(piece), now=1.0)
        delivered = [effect for effect in effects if isinstance(effect, Deliver)]
        assert bool(delivered) == flush_due(buffered, flush_chars), (piece, buffered)
        if delivered:
            buffered = 0


def test_the_pass_rules_import_nothing_of_io() -> None:
    path = PACKAGE / "pass_rules.py"
    bad = [v for module, names in _imports(path) for v in _violations(module, names)]
    assert not bad, bad


@pytest.mark.parametrize(
    ("module", "rule"),
    [
        ("machine.py", "phase_budget"),
        ("pump/deadlines.py", "stream_budget_due"),
        ("temporal/_worker.py", "stream_budget_due"),
        ("temporal/_worker.py", "flush_due"),
    ],
)
def test_every_place_that_times_a_pass_asks_the_shared_rules(module: str, rule: str) -> None:
    tree = ast.parse((PACKAGE / module).read_text(encoding="utf-8"))
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "toolloop_fsm.pass_rules"
        for alias in node.names
    }
    called = {
        node.func.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    }
    assert rule in imported and rule in called
