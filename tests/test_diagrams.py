"""The diagrams: both views drawn from the declarations, committed without drift (SVGs
included, checked without Graphviz), highlighted from traces, and made of declaration names
only."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from toolloop_fsm import diagrams
from toolloop_fsm.declaration import MachineDeclaration
from toolloop_fsm.diagrams import DECLARATIONS
from toolloop_fsm.diagrams import VIEWS
from toolloop_fsm.diagrams import DiagramError
from toolloop_fsm.diagrams import DiagramToolMissing
from toolloop_fsm.diagrams import declaration
from toolloop_fsm.diagrams import render
from toolloop_fsm.diagrams import render_dot
from toolloop_fsm.diagrams import render_mermaid
from toolloop_fsm.diagrams import render_svg
from toolloop_fsm.diagrams import stale_diagrams
from toolloop_fsm.diagrams import write_committed_diagrams
from toolloop_fsm.events import DeliveryRecorded
from toolloop_fsm.events import StreamEnded
from toolloop_fsm.events import TextDelta
from toolloop_fsm.host import TurnRequest
from toolloop_fsm.machine import ToolLoopMachine
from toolloop_fsm.result import TraceStep
from toolloop_fsm.testing.chains import ChainScript
from toolloop_fsm.testing.chains import generation_chains
from toolloop_fsm.testing.chains import run_chain

REPO_DIAGRAMS = Path(__file__).resolve().parent.parent / "diagrams"
NAMES = sorted(DECLARATIONS)
HAS_DOT = shutil.which("dot") is not None

MERMAID_EDGE = re.compile(r"^\s*(\w+) --> (\w+): (.*)$")
MERMAID_CLASS = re.compile(r"^\s*class (\w+) s_(\w+)$")
MERMAID_NODE = re.compile(r'^\s*state "(\w+)" as (\w+)$')
DOT_NODE = re.compile(r'^\s*"([^"]+)"(?: \[(.*)\])?$')
DOT_EDGE = re.compile(r'^\s*"([^"]+)" -> "([^"]+)"(?: \[(.*)\])?$')


@pytest.fixture(params=NAMES)
def decl(request: pytest.FixtureRequest) -> MachineDeclaration:
    return declaration(request.param)


def _stem(name: str, view: str) -> str:
    return name if view == "full" else f"{name}-{view}"


def _mermaid_edges(text: str) -> dict[tuple[str, str], list[str]]:
    """(source, dest) → label lines, each node named by the state it shows (the exits view's
    terminal nodes, one per exit, by their terminal state)."""
    shows = {m[2]: m[1] for line in text.splitlines() if (m := MERMAID_NODE.match(line))}
    edges: dict[tuple[str, str], list[str]] = {}
    for line in text.splitlines():
        if match := MERMAID_EDGE.match(line):
            pair = (shows[match[1]], shows[match[2]])
            assert pair not in edges, f"two edges {pair}: a terminal node shared by two exits"
            edges[pair] = match[3].split(" | ")
    return edges


def _dot_attrs(raw: str | None) -> dict[str, str]:
    return dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', raw or ""))


def _dot_edges(text: str) -> dict[tuple[str, str], dict[str, str]]:
    return {
        (m[1], m[2]): _dot_attrs(m[3]) for line in text.splitlines() if (m := DOT_EDGE.match(line))
    }


def _dot_nodes(text: str) -> dict[str, dict[str, str]]:
    return {
        m[1]: _dot_attrs(m[2])
        for line in text.splitlines()
        if (m := DOT_NODE.match(line)) and " -> " not in line
    }


def _dot_rows(label: str) -> list[str]:
    """A dot label's rows: centred (``\\n``) or left-justified (``\\l``)."""
    return [row for row in re.split(r"\\[nl]", label) if row]


def _real_trace() -> tuple[TraceStep, ...]:
    """A turn that streams text, ends the pass, settles its delivery and completes."""
    machine = ToolLoopMachine()
    machine.start(TurnRequest(({"role": "user", "content": "hi"},)))
    machine.feed(TextDelta("hello"))
    machine.feed(StreamEnded())
    machine.feed(DeliveryRecorded(0))
    assert machine.is_finished
    return machine.trace


# --------------------------------------------------------------------------- committed renders
def test_committed_diagrams_match_the_declarations() -> None:
    stale = stale_diagrams(REPO_DIAGRAMS)
    assert not stale, (
        f"stale diagrams: {[p.name for p in stale]} no longer match the machine declarations; "
        "regenerate them with `python -m toolloop_fsm.diagrams` (which needs Graphviz's `dot` "
        "for the SVGs) and commit the result"
    )


def test_committed_dir_holds_every_view_in_every_format() -> None:
    assert diagrams.COMMITTED_DIR == REPO_DIAGRAMS
    expected = {
        f"{_stem(n, v)}.{ext}" for n in NAMES for v in VIEWS for ext in ("mmd", "dot", "svg")
    }
    assert {p.name for p in REPO_DIAGRAMS.iterdir()} == expected


def test_each_committed_svg_was_drawn_from_its_committed_dot_text() -> None:
    # checked without Graphviz: the SVG names the SHA-256 of the dot text it was drawn from
    for name in NAMES:
        for view in VIEWS:
            svg = REPO_DIAGRAMS / f"{_stem(name, view)}.svg"
            dot = (REPO_DIAGRAMS / f"{_stem(name, view)}.dot").read_text(encoding="utf-8")
            assert diagrams._svg_source(svg) == diagrams._digest(dot), svg.name
            assert svg.read_bytes().lstrip().startswith(b"<?xml")


def test_the_committed_exits_views_fit_a_normal_screen() -> None:
    # an SVG's size is in points (1/72 in); a screen pixel is 1/96 in. The bound is a full-HD
    # screen's width: the inner view grew past 1,600 px when drafting's four states came in
    for name in NAMES:
        svg = (REPO_DIAGRAMS / f"{name}-exits.svg").read_text(encoding="utf-8")
        size = re.search(r'<svg width="(\d+)pt" height="(\d+)pt"', svg)
        assert size is not None
        assert int(size[1]) * 96 / 72 <= 1920, f"{name}: {int(size[1]) * 96 // 72} px wide"


def test_write_check_and_main_round_trip(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    written = write_committed_diagrams(tmp_path, svg=False)
    assert sorted(p.name for p in written) == sorted(
        f"{_stem(n, v)}.{ext}" for n in NAMES for v in VIEWS for ext in ("mmd", "dot")
    )
    assert stale_diagrams(tmp_path, svg=False) == []
    assert diagrams.main(["--check", "--no-svg", str(tmp_path)]) == 0
    # the SVGs: missing here, then the committed ones, drawn from the same dot text
    assert {p.name for p in stale_diagrams(tmp_path)} == {
        f"{_stem(n, v)}.svg" for n in NAMES for v in VIEWS
    }
    for svg in REPO_DIAGRAMS.glob("*.svg"):
        shutil.copy(svg, tmp_path / svg.name)
    assert diagrams.main(["--check", str(tmp_path)]) == 0

    target = tmp_path / f"{NAMES[0]}.mmd"
    target.write_text(target.read_text(encoding="utf-8").replace("advance", "advnace"))
    (tmp_path / f"{NAMES[0]}.dot").unlink()
    # the SVG is still the drawing of the dot text the declaration renders
    assert stale_diagrams(tmp_path) == [target, tmp_path / f"{NAMES[0]}.dot"]
    assert diagrams.main(["--check", str(tmp_path)]) == 1
    assert "python -m toolloop_fsm.diagrams" in capsys.readouterr().err

    assert diagrams.main(["--no-svg", str(tmp_path)]) == 0
    assert stale_diagrams(tmp_path) == []  # the same dot text again: the SVG is fresh


@pytest.mark.skipif(not HAS_DOT, reason="Graphviz `dot` is not installed")
def test_writing_draws_the_svgs_that_are_missing_or_stale(tmp_path: Path) -> None:
    written = write_committed_diagrams(tmp_path)
    assert {p.name for p in written if p.suffix == ".svg"} == {
        f"{_stem(n, v)}.svg" for n in NAMES for v in VIEWS
    }
    assert stale_diagrams(tmp_path) == []
    assert all(p.suffix != ".svg" for p in write_committed_diagrams(tmp_path))


def test_writing_without_dot_writes_the_text_and_names_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(shutil, "which", lambda _name: None)
    assert diagrams.main([str(tmp_path)]) == 2
    assert "apt-get install graphviz" in capsys.readouterr().err
    assert stale_diagrams(tmp_path, svg=False) == []


def test_module_entry_point_regenerates(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "toolloop_fsm.diagrams", "--no-svg", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    for path in tmp_path.iterdir():
        assert path.read_bytes() == (REPO_DIAGRAMS / path.name).read_bytes()


def test_rendering_is_deterministic_across_processes(tmp_path: Path) -> None:
    """Same declaration, same text: across hash seeds (set order) and runs (no addresses)."""
    outputs = []
    for seed in ("1", "2"):
        out = tmp_path / seed
        env = {**os.environ, "PYTHONHASHSEED": seed}
        subprocess.run(
            [sys.executable, "-m", "toolloop_fsm.diagrams", "--no-svg", str(out)],
            env=env,
            check=True,
            capture_output=True,
            timeout=120,
        )
        outputs.append({p.name: p.read_bytes() for p in sorted(out.iterdir())})
    assert outputs[0] == outputs[1]
    for blob in outputs[0].values():
        assert not re.search(rb"0x[0-9a-f]{6,}|\d{4}-\d\d-\d\d", blob)
        assert not re.search(rb"[ \t]+$", blob, re.MULTILINE), "trailing whitespace"
        assert blob.endswith(b"\n") and b"\r" not in blob


# --------------------------------------------------------------------------- the full view
@pytest.mark.parametrize("view", VIEWS)
def test_mermaid_has_every_state_initial_and_final_markers(
    decl: MachineDeclaration, view: str
) -> None:
    text = render_mermaid(decl, view=view)
    lines = text.splitlines()
    assert lines[:4] == ["---", f"title: {decl.title}", "---", "stateDiagram-v2"]
    finals = set(decl.final_states)
    for state in decl.state_names:
        # the exits view draws a terminal state once per exit that ends there, never shared
        drawn = view == "full" or state not in finals
        assert (f'  state "{state}" as {state}' in lines) == drawn, state
    assert [ln.strip() for ln in lines if ln.strip().startswith("[*] -->")] == [
        f"[*] --> {decl.initial}"
    ]
    marked_final = [ln.split()[0] for ln in lines if ln.rstrip().endswith("--> [*]")]
    assert marked_final == (list(decl.final_states) if view == "full" else [])


def test_full_mermaid_edges_are_exactly_the_declared_transitions_and_trace_notes(
    decl: MachineDeclaration,
) -> None:
    edges = _mermaid_edges(render_mermaid(decl))
    expected: dict[tuple[str, str], list[str]] = {}
    for edge in decl.edges():
        expected.setdefault((edge.source, edge.dest), []).append(edge.label)
    for note in decl.notes:
        expected.setdefault((note.state, note.state), []).append(note.event)
    # one edge per (source, dest), its labels in declaration order: within one trigger, the
    # order the guards are tried
    assert edges == expected


def test_every_declared_guard_is_on_a_full_mermaid_edge(decl: MachineDeclaration) -> None:
    shown: set[str] = set()
    for labels in _mermaid_edges(render_mermaid(decl)).values():
        for label in labels:
            for bracket in re.findall(r"\[([^\]]+)\]", label):
                shown.update(part for part in bracket.split(" & ") if part != "internal")
    assert decl.guard_names
    assert shown == set(decl.guard_names)


def test_internal_transitions_are_labelled_as_such(decl: MachineDeclaration) -> None:
    edges = _mermaid_edges(render_mermaid(decl))
    for edge in decl.edges():
        if edge.internal:
            assert f"{edge.trigger} [internal]" in " | ".join(edges[(edge.source, edge.source)])


def test_full_dot_nodes_edges_and_shapes(decl: MachineDeclaration) -> None:
    text = render_dot(decl)
    assert text.splitlines()[1] == f'digraph "{decl.name}" {{'
    nodes = _dot_nodes(text)
    assert set(nodes) - {"__initial__"} == set(decl.state_names)
    for state in decl.state_names:
        shape = nodes[state].get("shape")
        assert (shape == "doublecircle") == (state in decl.final_states), state
        dashed = "dashed" in nodes[state].get("style", "")
        assert dashed == (state in decl.transient_states), state
    edges = _dot_edges(text)
    assert edges.pop(("__initial__", decl.initial)) == {}
    expected: dict[tuple[str, str], list[str]] = {}
    for edge in decl.edges():
        expected.setdefault((edge.source, edge.dest), []).append(edge.label)
    for note in decl.notes:
        expected.setdefault((note.state, note.state), []).append(note.event)
    assert {pair: attrs["label"].split("\\n") for pair, attrs in edges.items()} == expected


# --------------------------------------------------------------------------- the exits view
def _exit_lines(decl: MachineDeclaration) -> dict[tuple[str, str], list[str]]:
    """(source, status) → ``event [guard] / reason`` for every source of every declared exit."""
    lines: dict[tuple[str, str], list[str]] = {}
    for edge in decl.edges():
        ending = edge.transition.ends
        if ending is None:
            continue
        reason = ending.reason_label
        text = f"{edge.label} / {reason}" if reason is not None else edge.label
        for status in ending.statuses:
            lines.setdefault((edge.source, status.value), []).append(text)
    return lines


def test_exits_mermaid_draws_each_exit_from_where_it_happens_to_its_terminal_state(
    decl: MachineDeclaration,
) -> None:
    edges = _mermaid_edges(render_mermaid(decl, view="exits"))
    exits = _exit_lines(decl)
    assert exits
    for pair, lines in exits.items():
        assert edges[pair] == lines, pair
    # the settle step takes the ending's terminal state: no funnel of outcome guards
    settle, finals = decl.settle_states, set(decl.final_states)
    into_finals = {pair for pair in edges if pair[1] in finals}
    assert into_finals == set(exits)
    assert not {pair for pair in into_finals if pair[0] in settle} - set(exits)
    # nothing leads into the settle step from outside it: every way there is an exit
    assert not [pair for pair in edges if pair[1] in settle and pair[0] not in settle]


def test_exits_dot_hangs_each_exit_on_its_state_and_draws_the_settle_step_once(
    decl: MachineDeclaration,
) -> None:
    text = render_dot(decl, view="exits")
    assert text.count('subgraph "cluster_settle"') == 1
    settle_block = text[text.index('subgraph "cluster_settle"') :].split("}")[0]
    assert set(re.findall(r'^\s+"(\w+)"', settle_block, re.MULTILINE)) == decl.settle_states
    nodes = _dot_nodes(text)
    drawn: dict[tuple[str, str], list[str]] = {}
    for (source, dest), attrs in _dot_edges(text).items():
        terminal = nodes.get(dest, {})
        if terminal.get("peripheries") != "2":
            continue
        statuses = _dot_rows(terminal["label"])
        rows = _dot_rows(attrs["label"])
        # each exit line is `event [guard]` with its reason indented below it
        texts: list[str] = []
        for row in rows:
            if row.startswith("    / "):
                texts[-1] += " " + row.strip()
            else:
                texts.append(row)
        assert "ltail" not in attrs, "an exit is drawn from its state, never from a box"
        for status in statuses:
            drawn.setdefault((source, status), []).extend(texts)
    assert drawn == _exit_lines(decl)


def test_a_box_of_states_that_share_their_exits_says_so_in_its_caption() -> None:
    text = render_dot(declaration("inner"), view="exits")
    block = text[text.index('subgraph "cluster_exits_0"') :].split("}")[0]
    assert set(re.findall(r'^\s+"(\w+)"', block, re.MULTILINE)) == {
        "awaiting_first_token",
        "streaming",
    }
    caption = re.search(r'label="([^"]*)"', block)
    assert caption is not None
    assert caption[1] == "awaiting_first_token and streaming share their exits, drawn from each"


def test_every_guard_but_the_settle_steps_routing_is_in_the_exits_view(
    decl: MachineDeclaration,
) -> None:
    labels = " | ".join(
        " | ".join(v) for v in _mermaid_edges(render_mermaid(decl, view="exits")).values()
    )
    shown = set(re.findall(r"\[(\w+)\]", labels)) - {"internal"}
    routing = {
        edge.guard
        for edge in decl.edges()
        if edge.source in decl.settle_states and edge.dest in decl.final_states
    }
    internal_only = {e.guard for e in decl.edges() if e.internal} - {
        e.guard for e in decl.edges() if not e.internal
    }
    assert shown == set(decl.guard_names) - routing - internal_only


# --------------------------------------------------------------------------- svg
@pytest.mark.skipif(not HAS_DOT, reason="Graphviz `dot` is not installed")
@pytest.mark.parametrize("view", VIEWS)
def test_real_dot_renders_the_text_to_svg(decl: MachineDeclaration, view: str) -> None:
    highlight = _real_trace() if decl.name == "ToolLoopMachine" else None
    svg = render_svg(decl, view=view, highlight=highlight)
    assert b"<svg" in svg
    text = render_dot(decl, view=view, highlight=highlight)
    assert diagrams._SVG_SOURCE.search(svg)[1].decode() == diagrams._digest(text)  # type: ignore[index]
    for state in decl.state_names:
        assert state.encode() in svg


def test_svg_without_dot_names_what_to_install(
    decl: MachineDeclaration, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shutil, "which", lambda _name: None)
    with pytest.raises(DiagramToolMissing) as caught:
        render_svg(decl)
    message = str(caught.value)
    assert "apt-get install graphviz" in message and "brew install graphviz" in message
    with pytest.raises(DiagramToolMissing):
        render(decl, "svg")


def _fake_dot(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "dot"
    script.write_text(f"#!/bin/sh\n{body}\n", encoding="utf-8")
    script.chmod(0o755)
    return script


@pytest.mark.skipif(sys.platform == "win32", reason="shell-script stand-in for dot")
def test_svg_pipes_the_dot_text_through_dot_and_names_its_digest(
    decl: MachineDeclaration, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    received = tmp_path / "stdin.dot"
    fake = _fake_dot(tmp_path, f'[ "$1" = "-Tsvg" ] || exit 9\ncat > "{received}"\nprintf "<svg/>"')
    monkeypatch.setattr(shutil, "which", lambda name: str(fake) if name == "dot" else None)
    text = render_dot(decl, view="exits")
    assert render_svg(decl, view="exits") == (
        f"<!-- drawn from dot text sha256:{diagrams._digest(text)} -->\n<svg/>".encode()
    )
    assert received.read_text(encoding="utf-8") == text


@pytest.mark.skipif(sys.platform == "win32", reason="shell-script stand-in for dot")
def test_svg_reports_a_failing_dot(
    decl: MachineDeclaration, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = _fake_dot(tmp_path, 'cat > /dev/null\necho "syntax error in line 3" >&2\nexit 1')
    monkeypatch.setattr(shutil, "which", lambda name: str(fake))
    with pytest.raises(DiagramError, match="status 1: syntax error in line 3"):
        render_svg(decl)


def test_render_dispatches_and_refuses_unknown_formats_views_and_machines(
    decl: MachineDeclaration,
) -> None:
    assert render(decl, "mermaid") == render_mermaid(decl).encode()
    assert render(decl, "dot", view="exits") == render_dot(decl, view="exits").encode()
    with pytest.raises(ValueError, match="unknown diagram format 'png'"):
        render(decl, "png")
    with pytest.raises(ValueError, match="unknown diagram view 'flat'; use full or exits"):
        render(decl, "dot", view="flat")
    with pytest.raises(ValueError, match="no machine named 'nope'; known: inner"):
        declaration("nope")


# --------------------------------------------------------------------------- highlight
def _visited(trace: Sequence[TraceStep]) -> set[str]:
    return {s.state for s in trace} | {s.next_state for s in trace}


def _mermaid_marked(text: str) -> set[str]:
    """The states drawn in a ``s_trace`` class (the exits view's terminal nodes by the state
    they show)."""
    shows = {m[2]: m[1] for line in text.splitlines() if (m := MERMAID_NODE.match(line))}
    return {
        shows[m[1]]
        for ln in text.splitlines()
        if (m := MERMAID_CLASS.match(ln)) and m[2].startswith("trace")
    }


def _dot_marked(text: str) -> tuple[set[str], set[tuple[str, str]]]:
    trace_colour = diagrams._TRACE_STROKE
    nodes = {n for n, a in _dot_nodes(text).items() if a.get("color") == trace_colour}
    edges = {e for e, a in _dot_edges(text).items() if a.get("color") == trace_colour}
    return nodes, edges


def _marked_lines(text: str) -> list[str]:
    return [
        line.removeprefix(diagrams.TAKEN)
        for labels in _mermaid_edges(text).values()
        for line in labels
        if line.startswith(diagrams.TAKEN)
    ]


def test_highlight_marks_exactly_the_states_edges_and_guards_of_a_recorded_trace() -> None:
    decl = declaration("inner")
    trace = _real_trace()
    assert {"ready", "streaming", "building_result", "settling", "completed"} <= _visited(trace)
    text = render_mermaid(decl, highlight=trace)
    assert _mermaid_marked(text) == _visited(trace)
    assert "classDef s_trace " in text
    unmarked = {
        m[1]
        for ln in text.splitlines()
        if (m := MERMAID_CLASS.match(ln)) and not m[2].startswith("trace")
    }
    assert unmarked == set(decl.state_names) - _visited(trace)
    # each line taken, with the guard that fired: one per step of the trace
    taken = [
        s.event
        + (" [internal]" if s.state == s.next_state else "")
        + (f" [{s.guard}]" if s.guard else "")
        for s in trace
    ]
    assert sorted(_marked_lines(text)) == sorted(taken)
    assert "advance [pass_has_text]" in _marked_lines(text)
    assert "advance [is_settled_after_tool]" not in _marked_lines(text)

    nodes, edges = _dot_marked(render_dot(decl, highlight=trace))
    assert nodes == _visited(trace)
    assert edges == {(s.state, s.next_state) for s in trace}


def test_highlight_in_the_exits_view_marks_the_exit_the_turn_took() -> None:
    decl = declaration("inner")
    trace = _real_trace()
    text = render_mermaid(decl, view="exits", highlight=trace)
    assert "advance [pass_has_text]" in _marked_lines(text)
    assert "✔ advance [pass_has_text]" in _mermaid_edges(text)[("ending_pass", "completed")]
    dot = render_dot(decl, view="exits", highlight=trace)
    nodes, edges = _dot_marked(dot)
    assert ("ending_pass", "ending_pass → completed") in edges
    assert "ending_pass → completed" in nodes
    assert _dot_nodes(dot)["ending_pass → completed"]["label"] == "✔ completed"


def test_no_highlight_marks_nothing(decl: MachineDeclaration) -> None:
    for view in VIEWS:
        assert _mermaid_marked(render_mermaid(decl, view=view)) == set()
        assert _dot_marked(render_dot(decl, view=view)) == (set(), set())
        assert diagrams.TAKEN not in render_dot(decl, view=view)
        assert render_mermaid(decl, view=view, highlight=[]) == render_mermaid(decl, view=view)


def test_a_step_without_a_guard_took_the_unguarded_transition_else_any_candidate() -> None:
    decl = declaration("inner")
    # a trace saved before steps named their guard: `ending_pass --advance--> building_result`
    # reads as the unguarded (empty response) transition; a step with no unguarded candidate
    # (`building_result --advance--> completed`) marks the guarded ones it may have taken
    old = [TraceStep(s.state, s.event, s.next_state) for s in _real_trace()]
    marked = _marked_lines(render_mermaid(decl, highlight=old))
    assert "advance" in marked
    assert "advance [pass_has_text]" not in marked
    assert "advance [outcome_is_completed]" in marked


@st.composite
def _walks(draw: st.DrawFn, decl: MachineDeclaration) -> list[TraceStep]:
    """A random walk over the declared graph from the initial state (guards ignored), with
    the trace notes its states may hold."""
    by_source: dict[str, list[TraceStep]] = {}
    for edge in decl.edges():
        by_source.setdefault(edge.source, []).append(
            TraceStep(edge.source, edge.trigger, edge.dest, guard=edge.guard)
        )
    for note in decl.notes:
        by_source.setdefault(note.state, []).append(
            TraceStep(note.state, note.event, note.state, detail="noted")
        )
    state, steps = decl.initial, []
    for _ in range(draw(st.integers(0, 25))):
        options = by_source.get(state)
        if not options:
            break
        step = draw(st.sampled_from(options))
        steps.append(step)
        state = step.next_state
    return steps


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_highlight_marks_exactly_the_walked_states_and_lines(
    name: str, data: st.DataObject
) -> None:
    decl = declaration(name)
    trace = data.draw(_walks(decl))
    text = render_mermaid(decl, highlight=trace)
    assert _mermaid_marked(text) == _visited(trace)
    assert len(_marked_lines(text)) == len(
        {(s.state, s.event, s.next_state, s.guard) for s in trace}
    )
    nodes, edges = _dot_marked(render_dot(decl, highlight=trace))
    assert nodes == _visited(trace)
    assert edges == {(s.state, s.next_state) for s in trace}
    render_dot(decl, view="exits", highlight=trace)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)
@given(chain=generation_chains())
def test_every_step_of_a_generation_turn_is_drawn(chain: ChainScript) -> None:
    """The outer trace and every attempt's trace of real runs light up only what is drawn:
    no step is refused, every state they visit is marked."""
    result = asyncio.run(run_chain(chain)).result
    assert result is not None
    outer, inner = declaration("outer"), declaration("inner")
    attempts = [step for attempt in result.attempts for step in attempt.trace]
    for decl, steps in ((outer, result.trace), (inner, attempts)):
        for view in VIEWS:
            assert _mermaid_marked(render_mermaid(decl, view=view, highlight=steps)) == (
                _visited(steps)
            )
            render_dot(decl, view=view, highlight=steps)


def test_highlight_refuses_an_undeclared_step_without_echoing_it() -> None:
    decl = declaration("inner")
    secret = "sk-live-0123456789abcdefABCDEF"
    for step in (
        TraceStep(secret, "start", "starting_pass"),
        TraceStep("ready", secret, "starting_pass"),
        TraceStep("ready", "start", secret),
        TraceStep("ending_pass", "advance", "building_result", guard=secret),
    ):
        with pytest.raises(ValueError, match="trace step 1") as caught:
            render_mermaid(decl, highlight=[TraceStep("ready", "start", "starting_pass"), step])
        assert secret not in str(caught.value)
        with pytest.raises(ValueError):
            render_dot(decl, view="exits", highlight=[step])
    # declared names, but no such transition: named (they are declaration names)
    with pytest.raises(ValueError, match="no transition ready --advance--> completed"):
        render_dot(decl, highlight=[TraceStep("ready", "advance", "completed")])


# --------------------------------------------------------------------------- no key material
#: Every word a diagram may contain besides the declaration's own names: mermaid and dot
#: syntax, the styles, the captions and the provenance comment.
SYNTAX_WORDS = set(
    """
    stateDiagram v2 direction LR TB classDef class state as title note left right of end
    s_default s_trace fill color white black stroke width 3px fde68a b45309 6b7280
    internal
    digraph graph node edge rankdir label labelloc t fontname Helvetica fontsize 10 9
    shape box style rounded filled dashed fillcolor doublecircle point 0 15 2 4 __initial__
    penwidth fontcolor 5 05 n l compound true nodesep ranksep weight 20 constraint false
    peripheries ltail subgraph cluster_settle cluster_exits_0 group run
    settle step every ending passes here then takes its terminal
    full exits view
    Rendered from by toolloop_fsm diagrams do not edit regenerate with python m
    s_decision s_terminal s_trace_decision s_trace_terminal dasharray 4px legend
    share their and drawn each
    TABLE BORDER CELLSPACING CELLPADDING TR TD COLSPAN ALIGN LEFT FONT POINT SIZE B STYLE WIDTH
    HEIGHT BGCOLOR COLOR 1 3 8 14 18 22 28
    """.split()  # noqa: SIM905 - a word list reads better than 90 quoted strings
)


def _legend_words() -> set[str]:
    """The words of every legend (constant text, written in the library)."""
    return {
        word
        for name in NAMES
        for view in VIEWS
        for fmt in ("dot", "mermaid")
        for row in diagrams.legend(diagrams.diagram(declaration(name), view), fmt, highlighted=True)
        for word in re.findall(r"\w+", row.meaning)
    }


def _words(text: str) -> set[str]:
    # dot labels join lines with a literal backslash-n or backslash-l; a mermaid exit's
    # terminal node is `<state>__<terminal state>`
    text = re.sub(r"(?<=[a-z])__(?=[a-z])", " ", re.sub(r"\\[nl]", " ", text))
    return set(re.findall(r"\w+", text))


def test_a_diagram_contains_only_declaration_names(
    decl: MachineDeclaration, monkeypatch: pytest.MonkeyPatch
) -> None:
    planted = "sk-ant-api03-PLANTEDkeyMATERIAL0123456789"
    for var in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GEMINI_API_KEY", "API_KEY"):
        monkeypatch.setenv(var, planted)
    walk = _real_trace() if decl.name == "ToolLoopMachine" else []
    trace = [TraceStep(s.state, s.event, s.next_state, guard=s.guard) for s in walk]
    reasons = {
        word
        for t in decl.transitions
        if t.ends is not None and t.ends.reason_label is not None
        for word in re.findall(r"\w+", t.ends.reason_label)
    }
    allowed = (
        SYNTAX_WORDS
        | set(decl.state_names)
        | set(decl.triggers)
        | {note.event for note in decl.notes}
        | set(decl.guard_names)
        | reasons
        | set(re.findall(r"\w+", decl.title))
        | set(re.findall(r"\w+", decl.source_module))
        | {decl.name}
        | _legend_words()
    )
    texts = [
        render(decl, fmt, view=view, highlight=h).decode()
        for fmt in ("mermaid", "dot")
        for view in VIEWS
        for h in (None, trace)
    ]
    for text in texts:
        assert planted not in text
        assert _words(text) <= allowed, _words(text) - allowed
    name = next(n for n in NAMES if declaration(n) is decl)
    for path in REPO_DIAGRAMS.iterdir():
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"\b(sk-|AIza|xai-|Bearer\b)", text)
        if path.stem in (name, f"{name}-exits") and path.suffix != ".svg":
            assert _words(text) <= allowed, _words(text) - allowed


def test_regenerating_from_an_installed_package_never_writes_beside_site_packages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import toolloop_fsm.diagrams as diagrams_module

    site = tmp_path / "site-packages"
    monkeypatch.setattr(diagrams_module, "COMMITTED_DIR", site.parent / "diagrams")
    monkeypatch.setattr(
        diagrams_module,
        "source_checkout_diagrams",
        lambda directory=site.parent / "diagrams": None,
    )
    assert diagrams_module.main(["--no-svg"]) == 2
    assert "name the DIRECTORY" in capsys.readouterr().err
    assert not (tmp_path / "diagrams").exists()
    target = tmp_path / "mine"
    assert diagrams_module.main(["--no-svg", str(target)]) == 0
    assert (target / "inner.mmd").exists()


def test_a_source_checkout_is_recognised_by_its_pyproject(tmp_path: Path) -> None:
    from toolloop_fsm.diagrams import COMMITTED_DIR
    from toolloop_fsm.diagrams import source_checkout_diagrams

    assert source_checkout_diagrams() == COMMITTED_DIR  # the tests run from the checkout
    assert source_checkout_diagrams(tmp_path / "diagrams") is None


# --------------------------------------------------------------------------- legends
@pytest.mark.parametrize("view", VIEWS)
def test_every_view_carries_a_legend_of_what_it_draws(decl: MachineDeclaration, view: str) -> None:
    trace = _real_trace() if decl.name == "ToolLoopMachine" else None
    for highlight in (None, trace):
        drawn = diagrams.diagram(decl, view)
        lit = highlight is not None
        for fmt, render_text in (("dot", render_dot), ("mermaid", render_mermaid)):
            text = render_text(decl, view=view, highlight=highlight)
            rows = diagrams.legend(drawn, fmt, highlighted=lit)
            samples = [row.sample for row in rows]
            for row in rows:
                assert row.meaning in text, (fmt, row.meaning)
            assert samples[:2] == ["state", "decision"]
            assert ("trace" in samples) == lit
            # the grey arrows are explained where, and only where, they are drawn
            greys = fmt == "dot" and view == "exits"
            assert ("grey_arrow" in samples) == greys
            assert (f'color="{diagrams._FLOW}", fontcolor=' in text) == greys
            assert ("grey_dashed_arrow" in samples) == (greys and bool(drawn.settle_group))
    # mermaid's legend is a note by the initial state
    mermaid = render_mermaid(decl, view=view).splitlines()
    at = mermaid.index(f"  note left of {decl.initial}")
    assert mermaid[at + 1] == "    legend:"
