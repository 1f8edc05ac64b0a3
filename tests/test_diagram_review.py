"""Diagrams a reviewer can follow: what `toolloop-fsm diagram --highlight` marks for a saved
generation turn (every attempt's path, the guards that fired, every step the trace holds).

The saved turn is made in-process: a first model whose stream fails (a retryable error), then
a second that calls a tool and answers.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest

from toolloop_fsm import Attempt
from toolloop_fsm import FunctionCall
from toolloop_fsm import GenerationTurnResult
from toolloop_fsm import ProviderError
from toolloop_fsm import TextDelta
from toolloop_fsm import Tool
from toolloop_fsm import ToolContext
from toolloop_fsm import ToolResult
from toolloop_fsm import TurnRequest
from toolloop_fsm import UsageReport
from toolloop_fsm import cli
from toolloop_fsm import run_generation_turn
from toolloop_fsm.result import result_to_json
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import ScriptedProvider
from toolloop_fsm.testing import VirtualClock
from toolloop_fsm.testing.scripted import Fail

DOT_EDGE = re.compile(r'^\s*"(\w+)" -> "(\w+)"(?: \[(.*)\])?$')
MERMAID_CLASS = re.compile(r"^\s*class (\w+) s_(\w+)$")


async def _lookup(arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
    return ToolResult(data={"found": arguments.get("q")})


def _fallback_turn() -> GenerationTurnResult:
    """Attempt 1 fails before its first token; attempt 2 calls `lookup` and answers."""
    clock = VirtualClock()
    failing = ScriptedProvider(
        [[Fail(ProviderError("upstream is down", kind="server", retryable=True))]],
        clock=clock,
    )
    answering = ScriptedProvider(
        [
            [FunctionCall("lookup", {"q": "x"}, "c1"), UsageReport(3, 4)],
            [TextDelta("Found it."), UsageReport(5, 6)],
        ],
        clock=clock,
    )
    tools = [Tool("lookup", "Look a thing up", {"type": "object"}, _lookup)]

    async def run() -> GenerationTurnResult:
        return await run_generation_turn(
            [Attempt(failing, label="first"), Attempt(answering, label="second")],
            tools,
            RecordingChannel(clock=clock),
            TurnRequest([{"role": "user", "content": "find x"}]),
            clock=clock,
        )

    return asyncio.run(run())


@pytest.fixture(scope="module")
def saved_turn(tmp_path_factory: pytest.TempPathFactory) -> tuple[GenerationTurnResult, Path]:
    result = _fallback_turn()
    assert [a.status.value for a in result.attempts] == ["error", "completed"]
    path = tmp_path_factory.mktemp("turn") / "turn.json"
    path.write_text(result_to_json(result), encoding="utf-8")
    return result, path


def _diagram(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert cli.main(["diagram", *args]) == 0
    return capsys.readouterr().out


def _dot_edges(text: str) -> dict[tuple[str, str], str]:
    edges: dict[tuple[str, str], str] = {}
    for line in text.splitlines():
        if match := DOT_EDGE.match(line):
            label = re.search(r'label="((?:[^"\\]|\\.)*)"', match[3] or "")
            edges[(match[1], match[2])] = label[1] if label else ""
    return edges


def test_highlight_of_a_generation_turn_marks_every_attempts_path(
    saved_turn: tuple[GenerationTurnResult, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    result, path = saved_turn
    visited = {
        state
        for attempt in result.attempts
        for step in attempt.trace
        for state in (step.state, step.next_state)
    }
    # the first attempt ended `error`, the second `completed`: both light up
    assert {"error", "completed", "executing_tool"} <= visited
    text = _diagram(capsys, "inner", "--highlight", str(path))
    marked = {
        m[1]
        for ln in text.splitlines()
        if (m := MERMAID_CLASS.match(ln)) and m[2].startswith("trace")
    }
    assert marked == visited


def test_highlight_marks_the_guard_that_fired_not_only_the_edge(
    saved_turn: tuple[GenerationTurnResult, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    _result, path = saved_turn
    edges = _dot_edges(_diagram(capsys, "outer", "--format", "dot", "--highlight", str(path)))
    # judging_attempt → finishing is one drawn edge for four declared transitions; the second
    # attempt completed, so only `attempt_is_final` fired there
    lines = edges[("judging_attempt", "finishing")].split("\\n")
    marked = [line for line in lines if line.startswith("✔ ")]
    assert marked == ["✔ advance [attempt_is_final]"]
    # the first attempt failed retryably and the chain moved to the next model
    assert edges[("judging_attempt", "advancing_model")].split("\\n") == [
        "✔ advance [another_model_in_chain]"
    ]


def test_every_step_of_a_superseding_turn_is_drawn_in_the_outer_diagram(
    saved_turn: tuple[GenerationTurnResult, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    result, path = saved_turn
    assert any(step.event == "attempt_superseded" for step in result.trace)
    edges = _dot_edges(_diagram(capsys, "outer", "--format", "dot", "--highlight", str(path)))
    for step in result.trace:
        label = edges.get((step.state, step.next_state))
        assert label is not None, f"no edge {step.state} -> {step.next_state}"
        assert step.event in label, f"{step.state} --{step.event}--> {step.next_state} not drawn"
