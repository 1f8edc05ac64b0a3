"""Every shell carries out its tier's effects through one table (`toolloop_fsm.effect_handlers`),
one handler per effect class, and one shell never reads another's private attributes: the
outer pump learns how an attempt ended from the small value the inner pump hands back."""

from __future__ import annotations

import ast
import asyncio
import typing
from pathlib import Path

import pytest

import toolloop_fsm
from toolloop_fsm.effect_handlers import INNER_EFFECTS
from toolloop_fsm.effect_handlers import OUTER_EFFECTS
from toolloop_fsm.effects import CancelReview
from toolloop_fsm.effects import CutStream
from toolloop_fsm.effects import StartAttempt
from toolloop_fsm.generation import GenerationTurnMachine
from toolloop_fsm.host import Channel
from toolloop_fsm.host import ToolRegistry
from toolloop_fsm.host import TurnRequest
from toolloop_fsm.policy import TurnPolicy
from toolloop_fsm.pump.inner import EventPump
from toolloop_fsm.pump.outer import GenerationPump
from toolloop_fsm.temporal._values import Catalogue
from toolloop_fsm.temporal._values import TurnInput
from toolloop_fsm.temporal._workflow import GenerationTurnWorkflow
from toolloop_fsm.temporal._workflow import _AttemptShell
from toolloop_fsm.temporal._workflow import _TurnShell

PACKAGE = Path(toolloop_fsm.__file__).parent
SHELLS = ["pump/inner.py", "pump/outer.py", "temporal/_workflow.py"]
#: The parts of the inner pump, objects it makes and calls.
PUMP_PARTS = ["pump/deadlines.py", "pump/tool_calls.py", "pump/deliveries.py"]


def _private_reads_of_others(path: Path) -> list[str]:
    """``x._name`` where ``x`` is neither ``self`` nor a class of the module (whose methods
    its own table names): a shell reaching into another object."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    own = {"self", "cls"} | {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and not (isinstance(node.value, ast.Name) and node.value.id in own)
        ):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("module", [*SHELLS, *PUMP_PARTS])
def test_a_shell_reads_no_private_attribute_of_another(module: str) -> None:
    assert _private_reads_of_others(PACKAGE / module) == []


#: Functions that look at effects without carrying them out.
DESCRIBING = {"_next_step"}  # the outer pump's log line: what the chain does next
EFFECT_CLASSES = {cls.__name__ for cls in (*INNER_EFFECTS, *OUTER_EFFECTS)}


def _class_tests(path: Path) -> list[str]:
    """Every ``isinstance(x, SomeEffect)`` and ``x is SomeEffect`` outside `DESCRIBING`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in DESCRIBING
        for inner in ast.walk(node)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        names: list[ast.expr] = []
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "isinstance" and len(node.args) == 2:
                names = [node.args[1]]
        elif isinstance(node, ast.Compare) and any(isinstance(op, ast.Is) for op in node.ops):
            names = list(node.comparators)
        for name in names:
            named = {n.id for n in ast.walk(name) if isinstance(n, ast.Name)}
            if named & EFFECT_CLASSES:
                found.append(f"line {getattr(node, 'lineno', '?')}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("module", SHELLS)
def test_a_shell_dispatches_no_effect_by_a_chain_of_class_tests(module: str) -> None:
    """Its effects go through its table: no ``isinstance(effect, X)`` or ``kind is X``."""
    assert _class_tests(PACKAGE / module) == []


def test_the_inner_pump_carries_out_exactly_the_tool_loops_effects() -> None:
    assert EventPump.effect_handlers.handles() == frozenset(INNER_EFFECTS)


def test_the_outer_pump_carries_out_exactly_the_chains_effects() -> None:
    pump = GenerationPump(
        GenerationTurnMachine(TurnPolicy()), [], ToolRegistry([]), typing.cast(Channel, None)
    )
    assert pump.effect_handlers.handles() == frozenset(OUTER_EFFECTS)


def test_the_durable_shells_carry_out_exactly_their_tiers_effects() -> None:
    request = TurnRequest([{"role": "user", "content": "hi"}], turn_id="t")
    turn = _TurnShell(
        typing.cast(GenerationTurnWorkflow, None),
        TurnInput(request, ("model",), "channel"),
        Catalogue(continuation=(False,)),
    )
    attempt = _AttemptShell(turn, StartAttempt(1, 0, "model", None, "own", request, {}))
    assert turn.effect_handlers.handles() == frozenset(OUTER_EFFECTS)
    assert attempt.effect_handlers.handles() == frozenset(INNER_EFFECTS)


@pytest.mark.parametrize("effect", [CancelReview(1), CutStream()], ids=type)
def test_a_durable_attempt_refuses_what_only_drafting_asks_of_it(effect: object) -> None:
    request = TurnRequest([{"role": "user", "content": "hi"}], turn_id="t")
    turn = _TurnShell(
        typing.cast(GenerationTurnWorkflow, None),
        TurnInput(request, ("model",), "channel"),
        Catalogue(continuation=(False,)),
    )
    attempt = _AttemptShell(turn, StartAttempt(1, 0, "model", None, "own", request, {}))
    name = type(effect).__name__
    with pytest.raises(TypeError, match=f"^the durable turn cannot carry out {name}$"):
        asyncio.run(attempt.carry_out([typing.cast(typing.Any, effect)]))
