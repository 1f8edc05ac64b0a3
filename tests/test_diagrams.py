"""The diagrams: rendered from the declarations, committed without drift, highlighted from
traces, and made of declaration names only."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from toolloop_fsm import diagrams
from toolloop_fsm.diagrams import (
    DECLARATIONS,
    DiagramError,
    DiagramToolMissing,
    MachineDeclaration,
    declaration,
    render,
    render_dot,
    render_mermaid,
    render_svg,
    stale_diagrams,
    write_committed_diagrams,
)
from toolloop_fsm.events import DeliveryRecorded, StreamEnded, TextDelta
from toolloop_fsm.host import TurnRequest
from toolloop_fsm.machine import ToolLoopMachine
from toolloop_fsm.result import TraceStep

REPO_DIAGRAMS = Path(__file__).resolve().parent.parent / "diagrams"
NAMES = sorted(DECLARATIONS)

MERMAID_EDGE = re.compile(r"^\s*(\w+) --> (\w+): (.*)$")
MERMAID_CLASS = re.compile(r"^\s*Class (\w+) s_(\w+)$")
DOT_NODE = re.compile(r'^\s*"(\w+)"(?: \[(.*)\])?$')
DOT_EDGE = re.compile(r'^\s*"(\w+)" -> "(\w+)"(?: \[(.*)\])?$')


@pytest.fixture(params=NAMES)
def decl(request: pytest.FixtureRequest) -> MachineDeclaration:
    return declaration(request.param)


def _mermaid_edges(text: str) -> dict[tuple[str, str], list[str]]:
    edges: dict[tuple[str, str], list[str]] = {}
    for line in text.splitlines():
        if match := MERMAID_EDGE.match(line):
            edges[(match[1], match[2])] = match[3].split(" | ")
    return edges


def _dot_attrs(raw: str | None) -> dict[str, str]:
    return dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', raw or ""))


def _dot_edges(text: str) -> dict[tuple[str, str], dict[str, str]]:
    return {
        (m[1], m[2]): _dot_attrs(m[3]) for line in text.splitlines() if (m := DOT_EDGE.match(line))
    }


def _dot_nodes(text: str) -> dict[str, dict[str, str]]:
    return {m[1]: _dot_attrs(m[2]) for line in text.splitlines() if (m := DOT_NODE.match(line))}


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
        "regenerate them with `python -m toolloop_fsm.diagrams` (or `toolloop-fsm diagram "
        "NAME --format mermaid|dot -o diagrams/NAME.mmd|.dot`) and commit the result"
    )


def test_committed_dir_is_the_repository_one() -> None:
    assert diagrams.COMMITTED_DIR == REPO_DIAGRAMS
    for name in NAMES:
        assert (REPO_DIAGRAMS / f"{name}.mmd").is_file()
        assert (REPO_DIAGRAMS / f"{name}.dot").is_file()


def test_write_check_and_main_round_trip(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    written = write_committed_diagrams(tmp_path)
    assert sorted(p.name for p in written) == sorted(
        f"{name}.{ext}" for name in NAMES for ext in ("mmd", "dot")
    )
    assert stale_diagrams(tmp_path) == []
    assert diagrams.main(["--check", str(tmp_path)]) == 0

    target = tmp_path / f"{NAMES[0]}.mmd"
    target.write_text(target.read_text(encoding="utf-8").replace("advance", "advnace"))
    (tmp_path / f"{NAMES[0]}.dot").unlink()
    assert stale_diagrams(tmp_path) == [target, tmp_path / f"{NAMES[0]}.dot"]
    assert diagrams.main(["--check", str(tmp_path)]) == 1
    assert "python -m toolloop_fsm.diagrams" in capsys.readouterr().err

    assert diagrams.main([str(tmp_path)]) == 0
    assert stale_diagrams(tmp_path) == []


def test_module_entry_point_regenerates(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "toolloop_fsm.diagrams", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    for name in NAMES:
        assert (tmp_path / f"{name}.mmd").read_text(encoding="utf-8") == (
            REPO_DIAGRAMS / f"{name}.mmd"
        ).read_text(encoding="utf-8")


def test_rendering_is_deterministic_across_processes(tmp_path: Path) -> None:
    """Same declaration, same text: across hash seeds (set order) and runs (no addresses)."""
    outputs = []
    for seed in ("1", "2"):
        out = tmp_path / seed
        env = {**os.environ, "PYTHONHASHSEED": seed}
        subprocess.run(
            [sys.executable, "-m", "toolloop_fsm.diagrams", str(out)],
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


# --------------------------------------------------------------------------- mermaid
def test_mermaid_has_every_state_initial_and_final_markers(decl: MachineDeclaration) -> None:
    text = render_mermaid(decl)
    lines = text.splitlines()
    assert lines[:4] == ["---", f"title: {decl.title}", "---", "stateDiagram-v2"]
    for state in decl.state_names:
        assert f'  state "{state}" as {state}' in lines
    assert [ln.strip() for ln in lines if ln.strip().startswith("[*] -->")] == [
        f"[*] --> {decl.initial}"
    ]
    marked_final = [ln.split()[0] for ln in lines if ln.rstrip().endswith("--> [*]")]
    assert marked_final == list(decl.final_states)


def test_mermaid_edges_are_exactly_the_declared_transitions(decl: MachineDeclaration) -> None:
    edges = _mermaid_edges(render_mermaid(decl))
    expected: dict[tuple[str, str], list[str]] = {}
    for edge in decl.edges():
        expected.setdefault((edge.source, edge.dest), []).append(edge.label)
    # transitions groups by trigger first, so compare each (source, dest) edge's labels as
    # the sequence of one trigger's transitions — the order guards are tried in
    assert set(edges) == set(expected)
    for pair, labels in expected.items():
        assert sorted(edges[pair]) == sorted(labels), pair
        for trigger in {label.split()[0] for label in labels}:
            of = [lb for lb in labels if lb.split()[0] == trigger]
            assert [lb for lb in edges[pair] if lb.split()[0] == trigger] == of


def test_every_declared_guard_is_on_a_mermaid_edge(decl: MachineDeclaration) -> None:
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


# --------------------------------------------------------------------------- dot
def test_dot_nodes_edges_and_shapes(decl: MachineDeclaration) -> None:
    text = render_dot(decl)
    assert text.splitlines()[1] == f'digraph "{decl.name}" {{'
    nodes = _dot_nodes(text)
    assert set(nodes) - {"__initial__"} == set(decl.state_names)
    for state in decl.state_names:
        shape = nodes[state].get("shape")
        assert (shape == "doublecircle") == (state in decl.final_states), state
    edges = _dot_edges(text)
    assert edges.pop(("__initial__", decl.initial)) == {}
    expected: dict[tuple[str, str], list[str]] = {}
    for edge in decl.edges():
        expected.setdefault((edge.source, edge.dest), []).append(edge.label)
    assert {pair: attrs["label"].split("\\n") for pair, attrs in edges.items()} == expected
    shown = {g for attrs in edges.values() for g in re.findall(r"\[(\w+)\]", attrs["label"])}
    assert shown - {"internal"} == set(decl.guard_names)


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` is not installed")
def test_real_dot_renders_the_text_to_svg(decl: MachineDeclaration) -> None:
    svg = render_svg(decl, highlight=_real_trace() if decl.name == "inner" else None)
    assert b"<svg" in svg
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
def test_svg_pipes_the_dot_text_through_dot(
    decl: MachineDeclaration, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    received = tmp_path / "stdin.dot"
    fake = _fake_dot(tmp_path, f'[ "$1" = "-Tsvg" ] || exit 9\ncat > "{received}"\nprintf "<svg/>"')
    monkeypatch.setattr(shutil, "which", lambda name: str(fake) if name == "dot" else None)
    assert render_svg(decl) == b"<svg/>"
    assert received.read_text(encoding="utf-8") == render_dot(decl)


@pytest.mark.skipif(sys.platform == "win32", reason="shell-script stand-in for dot")
def test_svg_reports_a_failing_dot(
    decl: MachineDeclaration, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = _fake_dot(tmp_path, 'cat > /dev/null\necho "syntax error in line 3" >&2\nexit 1')
    monkeypatch.setattr(shutil, "which", lambda name: str(fake))
    with pytest.raises(DiagramError, match="status 1: syntax error in line 3"):
        render_svg(decl)


def test_render_dispatches_and_refuses_unknown_formats(decl: MachineDeclaration) -> None:
    assert render(decl, "mermaid") == render_mermaid(decl).encode()
    assert render(decl, "dot") == render_dot(decl).encode()
    with pytest.raises(ValueError, match="unknown diagram format 'png'"):
        render(decl, "png")
    with pytest.raises(ValueError, match="no machine named 'nope'; known: inner"):
        declaration("nope")


# --------------------------------------------------------------------------- highlight
def _visited(trace: Sequence[TraceStep]) -> set[str]:
    return {s.state for s in trace} | {s.next_state for s in trace}


def _mermaid_marked(text: str) -> set[str]:
    return {m[1] for ln in text.splitlines() if (m := MERMAID_CLASS.match(ln)) and m[2] == "trace"}


def _dot_marked(text: str) -> tuple[set[str], set[tuple[str, str]]]:
    trace_colour = diagrams._TRACE_STROKE
    nodes = {n for n, a in _dot_nodes(text).items() if a.get("color") == trace_colour}
    edges = {e for e, a in _dot_edges(text).items() if a.get("color") == trace_colour}
    return nodes, edges


def test_highlight_marks_exactly_the_states_of_a_recorded_trace() -> None:
    decl = declaration("inner")
    trace = _real_trace()
    assert {"ready", "streaming", "building_result", "settling", "completed"} <= _visited(trace)
    text = render_mermaid(decl, highlight=trace)
    assert _mermaid_marked(text) == _visited(trace)
    assert "classDef s_trace " in text
    # everything else keeps the default style
    unmarked = {
        m[1] for ln in text.splitlines() if (m := MERMAID_CLASS.match(ln)) and m[2] == "default"
    }
    assert unmarked == set(decl.state_names) - _visited(trace)

    nodes, edges = _dot_marked(render_dot(decl, highlight=trace))
    assert nodes == _visited(trace)
    assert edges == {(s.state, s.next_state) for s in trace}


def test_no_highlight_marks_nothing(decl: MachineDeclaration) -> None:
    assert _mermaid_marked(render_mermaid(decl)) == set()
    assert _dot_marked(render_dot(decl)) == (set(), set())
    assert render_mermaid(decl, highlight=[]) == render_mermaid(decl)


@st.composite
def _walks(draw: st.DrawFn, decl: MachineDeclaration) -> list[TraceStep]:
    """A random walk over the declared graph from the initial state (guards ignored)."""
    by_source: dict[str, list[TraceStep]] = {}
    for edge in decl.edges():
        by_source.setdefault(edge.source, []).append(
            TraceStep(edge.source, edge.trigger, edge.dest)
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
def test_highlight_marks_exactly_the_walked_states(name: str, data: st.DataObject) -> None:
    decl = declaration(name)
    trace = data.draw(_walks(decl))
    assert _mermaid_marked(render_mermaid(decl, highlight=trace)) == _visited(trace)
    nodes, edges = _dot_marked(render_dot(decl, highlight=trace))
    assert nodes == _visited(trace)
    assert edges == {(s.state, s.next_state) for s in trace}


def test_highlight_refuses_an_undeclared_step_without_echoing_it() -> None:
    decl = declaration("inner")
    secret = "sk-live-0123456789abcdefABCDEF"
    for step in (
        TraceStep(secret, "start", "starting_pass"),
        TraceStep("ready", secret, "starting_pass"),
        TraceStep("ready", "start", secret),
    ):
        with pytest.raises(ValueError, match="trace step 1") as caught:
            render_mermaid(decl, highlight=[TraceStep("ready", "start", "starting_pass"), step])
        assert secret not in str(caught.value)
        with pytest.raises(ValueError):
            render_dot(decl, highlight=[step])
    # declared names, but no such transition: named (they are declaration names)
    with pytest.raises(ValueError, match="no transition ready --advance--> completed"):
        render_dot(decl, highlight=[TraceStep("ready", "advance", "completed")])


# --------------------------------------------------------------------------- no key material
#: Every word a diagram may contain besides the declaration's own names: mermaid and dot
#: syntax, the styles, and the provenance comment.
SYNTAX_WORDS = set(
    """
    stateDiagram v2 direction LR classDef Class state as title
    s_default s_inactive s_parallel s_active s_previous s_trace
    fill color white black red darksalmon blue azure stroke width 3px fde68a b45309
    internal
    digraph graph node edge rankdir label labelloc t fontname Helvetica fontsize 10
    shape box style rounded filled dashed fillcolor doublecircle point 0 15 __initial__
    penwidth fontcolor 2 5 n
    Rendered from by toolloop_fsm diagrams do not edit regenerate with python m
    """.split()  # noqa: SIM905 - a word list reads better than 70 quoted strings
)


def _words(text: str) -> set[str]:
    # dot labels join lines with a literal backslash-n
    return set(re.findall(r"\w+", text.replace("\\n", " ")))


def test_a_diagram_contains_only_declaration_names(
    decl: MachineDeclaration, monkeypatch: pytest.MonkeyPatch
) -> None:
    planted = "sk-ant-api03-PLANTEDkeyMATERIAL0123456789"
    for var in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GEMINI_API_KEY", "API_KEY"):
        monkeypatch.setenv(var, planted)
    walk = _real_trace() if decl.name == "inner" else []
    trace = [TraceStep(s.state, s.event, s.next_state, detail=planted) for s in walk]
    allowed = (
        SYNTAX_WORDS
        | set(decl.state_names)
        | set(decl.triggers)
        | set(decl.guard_names)
        | set(re.findall(r"\w+", decl.title))
        | set(re.findall(r"\w+", decl.source_module))
        | {decl.name}
    )
    for text in (
        render_mermaid(decl),
        render_mermaid(decl, highlight=trace),
        render_dot(decl),
        render_dot(decl, highlight=trace),
    ):
        assert planted not in text
        assert _words(text) <= allowed, _words(text) - allowed
    for path in REPO_DIAGRAMS.iterdir():
        words = _words(path.read_text(encoding="utf-8"))
        assert not re.search(r"\b(sk-|AIza|xai-|Bearer\b)", path.read_text(encoding="utf-8"))
        if path.stem == decl.name:
            assert words <= allowed, words - allowed
