"""Diagrams a reviewer can follow: what `toolloop-fsm diagram --highlight` marks for a saved
generation turn (every attempt's path, the guards that fired, every step the trace holds).

The saved turn is made in-process: a first model whose stream fails (a retryable error), then
a second that calls a tool and answers. Every view is rendered as a reviewer would see it (dot
to PNG; the mermaid through mermaid-cli where it is installed) and the highlight is read back
from the renderer's own output: Graphviz's layout (``dot -Tjson``), mermaid's SVG.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import struct
import subprocess
from collections.abc import Sequence
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
from toolloop_fsm import diagrams
from toolloop_fsm import run_generation_turn
from toolloop_fsm.declaration import Edge
from toolloop_fsm.diagrams import VIEWS
from toolloop_fsm.diagrams import declaration
from toolloop_fsm.diagrams import mermaid_terminal
from toolloop_fsm.diagrams import render_dot
from toolloop_fsm.diagrams import render_mermaid
from toolloop_fsm.result import TraceStep
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


# --------------------------------------------------------------------------- rendered views
HAS_DOT = shutil.which("dot") is not None
needs_dot = pytest.mark.skipif(not HAS_DOT, reason="Graphviz `dot` is not installed")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MERMAID_SVG_NODE = re.compile(
    r'<g class="node (s_\w+) statediagram-state" id="[^"]*?-state-(\w+)-\d+"'
)


def _steps(trace: Sequence[TraceStep]) -> list[tuple[TraceStep, Edge | None]]:
    """Each step with the declared transition it took (``None`` for a trace note)."""
    decl = declaration("inner")
    edges = {(e.source, e.trigger, e.dest, e.guard): e for e in decl.edges()}
    return [(s, edges.get((s.state, s.event, s.next_state, s.guard))) for s in trace]


def _drawn_path(trace: Sequence[TraceStep], view: str) -> set[tuple[str, str]]:
    """The edges of the inner machine's ``view`` a run's steps are drawn on: in the full view
    each step's own; in the exits view an exit's edge to the box of its terminal states, the
    internal steps and the settle step's routing to the terminal state not drawn."""
    decl = declaration("inner")
    if view == "full":
        return {(s.state, s.next_state) for s in trace}
    path: set[tuple[str, str]] = set()
    for step, edge in _steps(trace):
        assert edge is not None or step.state == step.next_state
        if edge is None or edge.internal:
            continue
        if (ending := edge.transition.ends) is not None:
            statuses = "|".join(status.value for status in ending.statuses)
            path.add((step.state, f"{step.state} → {statuses}"))
        elif not (step.state in decl.settle_states and step.next_state in decl.final_states):
            path.add((step.state, step.next_state))
    return path


def _lit_in_rendered_dot(text: str) -> set[tuple[str, str]]:
    """The edges Graphviz drew in the trace colour: read from its layout (``dot -Tjson``),
    the drawing operations of each edge, not the attributes asked for."""
    done = subprocess.run(["dot", "-Tjson"], input=text.encode(), capture_output=True, check=True)
    layout = json.loads(done.stdout)
    names = {item["_gvid"]: item["name"] for item in layout["objects"]}
    lit: set[tuple[str, str]] = set()
    for edge in layout.get("edges", []):
        colours = {op.get("color") for op in edge["_draw_"] if op["op"] in ("c", "C")}
        if diagrams._TRACE_STROKE in colours:
            lit.add((names[edge["tail"]], names[edge["head"]]))
    return lit


@needs_dot
@pytest.mark.parametrize("view", VIEWS)
def test_an_exit_shared_by_two_states_lights_only_the_state_the_run_left(
    saved_turn: tuple[GenerationTurnResult, Path], view: str
) -> None:
    # the first attempt failed before its first token: its exit to `error` leaves
    # awaiting_first_token, and streaming, boxed with it as sharing its exits, was never entered
    failed = saved_turn[0].attempts[0].trace
    assert failed[-1].next_state == "error"
    assert "streaming" not in {s.state for s in failed} | {s.next_state for s in failed}
    lit = _lit_in_rendered_dot(render_dot(declaration("inner"), view=view, highlight=failed))
    assert lit == _drawn_path(failed, view)
    assert not {edge for edge in lit if edge[0] == "streaming"}
    if view == "exits":
        assert ("awaiting_first_token", "awaiting_first_token → error") in lit


@needs_dot
@pytest.mark.parametrize("view", VIEWS)
def test_the_rendered_dot_lights_exactly_the_steps_of_every_attempt(
    saved_turn: tuple[GenerationTurnResult, Path], view: str
) -> None:
    result, _path = saved_turn
    steps = [step for attempt in result.attempts for step in attempt.trace]
    dot = render_dot(declaration("inner"), view=view, highlight=steps)
    assert _lit_in_rendered_dot(dot) == _drawn_path(steps, view)
    # the outer machine: its one trace, every step of which is its own edge in the full view
    outer = render_dot(declaration("outer"), highlight=result.trace)
    assert _lit_in_rendered_dot(outer) == {(s.state, s.next_state) for s in result.trace}


@needs_dot
@pytest.mark.parametrize("name", ["inner", "outer"])
@pytest.mark.parametrize("view", VIEWS)
def test_each_dot_view_renders_to_png(
    saved_turn: tuple[GenerationTurnResult, Path], name: str, view: str, tmp_path: Path
) -> None:
    result, _path = saved_turn
    steps = result.trace if name == "outer" else result.attempts[-1].trace
    for highlight in (None, steps):
        png = tmp_path / f"{name}-{view}.png"
        dot = render_dot(declaration(name), view=view, highlight=highlight)
        done = subprocess.run(
            ["dot", "-Tpng", "-o", str(png)], input=dot.encode(), capture_output=True
        )
        assert done.returncode == 0, done.stderr.decode()
        assert done.stderr == b"", done.stderr.decode()  # no warning: every label laid out
        width, height = _png_size(png.read_bytes())
        assert width > 400 and height > 200


def _png_size(data: bytes) -> tuple[int, int]:
    assert data.startswith(PNG_MAGIC)
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk comes first
    return width, height


@pytest.fixture(scope="module")
def mermaid_cli(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The mermaid CLI (``mmdc``, npm's @mermaid-js/mermaid-cli) with a browser to draw in."""
    mmdc = shutil.which("mmdc")
    if mmdc is None:
        pytest.skip(
            "mermaid-cli's `mmdc` is not on PATH (npm install @mermaid-js/mermaid-cli, with "
            "PUPPETEER_SKIP_DOWNLOAD=1 and Debian's chromium): the mermaid is not rendered"
        )
    config: dict[str, Any] = {"args": ["--no-sandbox"]}  # Chromium refuses root without it
    browser = os.environ.get("PUPPETEER_EXECUTABLE_PATH") or shutil.which("chromium")
    if browser is not None:
        config["executablePath"] = browser
    path = tmp_path_factory.mktemp("mmdc") / "puppeteer.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    return [mmdc, "--quiet", "-p", str(path), "-b", "white"]


def _mmdc(command: list[str], text: str, out: Path) -> bytes:
    source = out.with_suffix(".mmd")
    source.write_text(text, encoding="utf-8")
    done = subprocess.run([*command, "-i", str(source), "-o", str(out)], capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
    return out.read_bytes()


@pytest.mark.parametrize("view", VIEWS)
def test_each_mermaid_view_renders_and_lights_exactly_the_runs_states(
    saved_turn: tuple[GenerationTurnResult, Path],
    mermaid_cli: list[str],
    view: str,
    tmp_path: Path,
) -> None:
    result, _path = saved_turn
    inner = declaration("inner")
    for index, attempt in enumerate(result.attempts):
        text = render_mermaid(inner, view=view, highlight=attempt.trace)
        png = _mmdc(mermaid_cli, text, tmp_path / f"{view}-{index}.png")
        width, height = _png_size(png)
        assert width > 400 and height > 200
        svg = _mmdc(mermaid_cli, text, tmp_path / f"{view}-{index}.svg").decode()
        classes = {node: cls for cls, node in MERMAID_SVG_NODE.findall(svg)}
        visited = {s.state for s in attempt.trace} | {s.next_state for s in attempt.trace}
        expected = visited
        if view == "exits":
            # each exit is its own node: the one the run took is lit, not the terminal state
            final = attempt.trace[-1].next_state
            taken = {
                mermaid_terminal(step.state, final)
                for step, edge in _steps(attempt.trace)
                if edge is not None and edge.transition.ends is not None
            }
            expected = (visited - set(inner.final_states)) | taken
            drawn = {n for n in inner.state_names if not inner.state(n).final}
            assert drawn <= set(classes)
        else:
            assert set(inner.state_names) <= set(classes)
        assert {node for node, cls in classes.items() if cls.startswith("s_trace")} == expected
