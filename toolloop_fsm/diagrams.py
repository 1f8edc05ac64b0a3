"""State diagrams drawn from the very declarations the machines run, in two views.

- ``full``: the complete machine. One edge per (source, destination) pair, one label line per
  declared transition (``trigger [guard]``, ``[internal]`` when the state does not change), in
  declaration order (within one source and trigger, the order the guards are tried), and the
  steps actions note in the trace (``attempt_superseded``).
- ``exits``: for review. Each transition that ends the turn is drawn from the state and event
  where it happens straight to the terminal state its declared ending names, labelled
  ``event [guard] / reason``, to a terminal node of its own (no two exits share one, so their
  labels never lie over each other). An exit is drawn from each state it is declared from:
  states that share their exits (a pass awaiting its first token, then streaming) are boxed
  under a caption saying so, never drawn from as a box, so a highlight lights exactly the state
  the run left. The shared settle step (every ending passes it before its terminal state) is
  drawn once, as a group, with its own transitions; the other transitions are drawn as in the
  full view, lighter, and internal transitions are left out.

Every view carries a legend (`legend`): what its boxes, borders, dashes and colours mean, only
those it draws. In dot it is the graph's label, samples drawn in the style they explain; in
mermaid, a note by the initial state.

Formats: mermaid ``stateDiagram-v2`` and Graphviz dot, both written here from the declaration
(`toolloop_fsm.declaration.MachineDeclaration`), and SVG through Graphviz's ``dot`` program
when it is installed.

``highlight`` takes recorded trace steps (`toolloop_fsm.result.TraceStep`; the steps of several
runs, such as every attempt of a generation turn, may be given together) and marks what they
took: the states visited (mermaid: an ``s_trace`` class; dot: amber), each label line of a
transition taken, so the guard that fired (``✔`` before the line), and in dot the edges those
lines are on. An exit whose ending names several statuses is marked to the terminal state the
run reached.

Only declaration names (states, triggers, guards, reasons) ever reach a diagram: a trace's
``detail`` is not drawn and a trace naming anything undeclared is refused without echoing it,
so no key or other run-time material can leak into a rendered file (docs/invariants.md §9).

The committed renders (``diagrams/<machine>.{mmd,dot,svg}`` for the full view,
``diagrams/<machine>-exits.*`` for the exits view) are regenerated with
``python -m toolloop_fsm.diagrams`` (``--check`` only reports drift). Each SVG carries the
SHA-256 of the dot text it was drawn from, so its freshness is checked without Graphviz.
"""

from __future__ import annotations

import argparse
import hashlib
import html
import itertools
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from attrs import frozen

from toolloop_fsm.declaration import Edge
from toolloop_fsm.declaration import MachineDeclaration

__all__ = [
    "COMMITTED_DIR",
    "DECLARATIONS",
    "VIEWS",
    "Diagram",
    "DiagramError",
    "DiagramToolMissing",
    "DrawnEdge",
    "LegendEntry",
    "Line",
    "TraceLike",
    "declaration",
    "diagram",
    "legend",
    "main",
    "mermaid_terminal",
    "render",
    "render_dot",
    "render_mermaid",
    "render_svg",
    "stale_diagrams",
    "write_committed_diagrams",
]

#: Where the committed renders live in a source checkout (``<repo>/diagrams``).
COMMITTED_DIR = Path(__file__).resolve().parent.parent / "diagrams"
#: The views, the first the default.
VIEWS = ("full", "exits")

_REGENERATE = "python -m toolloop_fsm.diagrams"
#: The mark before a label line a highlighted run took.
TAKEN = "✔ "
#: How a committed SVG names the dot text it was drawn from.
_SVG_SOURCE = re.compile(rb"<!-- drawn from dot text sha256:([0-9a-f]{64}) -->")

# One palette for both formats: the trace path in amber, on top of black-on-white.
_TRACE_FILL = "#fde68a"
_TRACE_STROKE = "#b45309"
_FLOW = "#6b7280"  # the exits view's transitions that end nothing
_SETTLE_CAPTION = "settle step: every ending passes here, then takes its terminal state"


class DiagramError(RuntimeError):
    """A diagram could not be rendered."""


class DiagramToolMissing(DiagramError):
    """An external program a format needs (Graphviz's ``dot`` for SVG) is not installed."""


class TraceLike(Protocol):
    """What `highlight` reads from each step: `toolloop_fsm.result.TraceStep` fits."""

    @property
    def state(self) -> str: ...

    @property
    def event(self) -> str: ...

    @property
    def next_state(self) -> str: ...


# --------------------------------------------------------------------------- the registry
def _inner() -> MachineDeclaration:
    # imported here so a broken machine module only breaks the diagram that needs it
    from toolloop_fsm.machine import DECLARATION

    return DECLARATION


def _outer() -> MachineDeclaration:
    from toolloop_fsm.generation import DECLARATION

    return DECLARATION


#: Name → the machine's declaration: one line per machine.
DECLARATIONS: dict[str, Callable[[], MachineDeclaration]] = {"inner": _inner, "outer": _outer}


def declaration(name: str) -> MachineDeclaration:
    """The declaration registered under ``name`` (``"inner"`` or ``"outer"``)."""
    try:
        factory = DECLARATIONS[name]
    except KeyError:
        known = ", ".join(sorted(DECLARATIONS))
        raise ValueError(f"no machine named {name!r}; known: {known}") from None
    return factory()


# --------------------------------------------------------------------------- the drawing
@frozen
class Line:
    """One label line of a drawn edge. ``steps``: the ids of the declared transitions (or
    trace notes) it stands for; ``statuses``: for an exit, the terminal states its ending
    names."""

    text: str
    steps: tuple[str, ...]
    statuses: tuple[str, ...] = ()


@frozen
class DrawnEdge:
    """One drawn edge from ``source``: its label lines in declaration order. ``dests`` is one
    state, or for an exit the terminal states its ending names. ``kind`` is
    ``flow`` (a transition), ``exit`` (to a terminal state, by a declared ending) or
    ``settle`` (within the settle step)."""

    source: str
    dests: tuple[str, ...]
    lines: tuple[Line, ...]
    kind: str = "flow"


@frozen
class Diagram:
    """What one view of a declaration draws."""

    declaration: MachineDeclaration
    view: str
    edges: tuple[DrawnEdge, ...]
    #: the states drawn as the settle step's group (exits view)
    settle_group: tuple[str, ...] = ()
    #: groups of states exits are declared from together (exits view): boxed and captioned,
    #: each exit still drawn from each state
    exit_groups: tuple[tuple[str, ...], ...] = ()


def _note_id(state: str, event: str) -> str:
    return f"{state} --{event}--> {state} (noted)"


_Drawn = tuple[str, tuple[str, ...], Line, str]


def _group(edges: Iterable[_Drawn]) -> tuple[DrawnEdge, ...]:
    """One drawn edge per (source, dests, kind), its lines in order."""
    grouped: dict[tuple[str, tuple[str, ...], str], list[Line]] = {}
    for source, dests, line, kind in edges:
        grouped.setdefault((source, dests, kind), []).append(line)
    return tuple(
        DrawnEdge(source, dests, tuple(lines), kind)
        for (source, dests, kind), lines in grouped.items()
    )


def _full(decl: MachineDeclaration) -> Diagram:
    lines: list[_Drawn] = [
        (edge.source, (edge.dest,), Line(edge.label, (edge.ident,)), "flow")
        for edge in decl.edges()
    ]
    lines += [
        (
            note.state,
            (note.state,),
            Line(note.event, (_note_id(note.state, note.event),)),
            "flow",
        )
        for note in decl.notes
    ]
    return Diagram(decl, "full", _group(lines))


def _exit_label(edge: Edge) -> str:
    ending = edge.transition.ends
    assert ending is not None
    reason = ending.reason_label
    return f"{edge.label} / {reason}" if reason is not None else edge.label


def _exit_groups(decl: MachineDeclaration) -> tuple[tuple[str, ...], ...]:
    """The sets of states exits are declared from together that the run passes through one
    after the other (a pass awaits its first token, then streams): each is boxed and captioned
    as sharing its exits. None when two would overlap."""
    follows = {(e.source, e.dest) for e in decl.edges() if not e.internal}
    groups = tuple(
        dict.fromkeys(
            t.sources
            for t in decl.transitions
            if t.ends is not None
            and len(t.sources) > 1
            and all(pair in follows for pair in itertools.pairwise(t.sources))
        )
    )
    members = [state for group in groups for state in group]
    return groups if len(members) == len(set(members)) else ()


def _exits(decl: MachineDeclaration) -> Diagram:
    settle = decl.settle_states
    finals = set(decl.final_states)
    groups = _exit_groups(decl)
    lines: list[_Drawn] = []
    for t in decl.transitions:
        edges = [edge for edge in decl.edges() if edge.transition is t]
        if t.ends is not None:
            statuses = tuple(status.value for status in t.ends.statuses)
            # drawn from each state it is declared from, even a group's: a highlight then
            # lights the exit from the state the run left, not its neighbour's too
            text = _exit_label(edges[0])
            lines += [(e.source, statuses, Line(text, (e.ident,), statuses), "exit") for e in edges]
            continue
        for edge in edges:
            if edge.internal or (edge.source in settle and edge.dest in finals):
                # nothing changes, or the settle step takes the terminal state the ending named
                continue
            kind = "settle" if edge.source in settle and edge.dest in settle else "flow"
            lines.append((edge.source, (edge.dest,), Line(edge.label, (edge.ident,)), kind))
    return Diagram(
        decl,
        "exits",
        _group(lines),
        settle_group=tuple(s for s in decl.state_names if s in settle),
        exit_groups=groups,
    )


def diagram(decl: MachineDeclaration, view: str = "full") -> Diagram:
    """What ``view`` (``"full"`` or ``"exits"``) of ``decl`` draws."""
    if view == "full":
        return _full(decl)
    if view == "exits":
        return _exits(decl)
    raise ValueError(f"unknown diagram view {view!r}; use {' or '.join(VIEWS)}")


# --------------------------------------------------------------------------- highlight
@frozen
class _Marks:
    """What a highlighted run took: the states it visited, the declared transitions (and trace
    notes) it took, and the terminal states it reached."""

    states: frozenset[str]
    steps: frozenset[str]
    finals: frozenset[str]

    def takes(self, line: Line, dest: str | None = None) -> bool:
        """Whether the run took ``line`` (drawn to ``dest``): one of its steps, and for an
        exit whose ending names several statuses drawn to one of them, to the terminal state
        the run reached."""
        if self.steps.isdisjoint(line.steps):
            return False
        return dest is None or len(line.statuses) < 2 or dest in self.finals


def _marks(decl: MachineDeclaration, highlight: Iterable[TraceLike] | None) -> _Marks:
    """What the recorded steps took, checked against the declaration.

    A step that names something undeclared is refused without echoing the offending value: a
    trace is run-time data, and a diagram (or its error) carries declaration names only."""
    if highlight is None:
        return _Marks(frozenset(), frozenset(), frozenset())
    known_states = set(decl.state_names)
    known_events = set(decl.triggers) | {note.event for note in decl.notes}
    by_step: dict[tuple[str, str, str], list[Edge]] = {}
    for edge in decl.edges():
        by_step.setdefault((edge.source, edge.trigger, edge.dest), []).append(edge)
    notes = {(note.state, note.event) for note in decl.notes}
    states: set[str] = set()
    steps: set[str] = set()
    for index, step in enumerate(highlight):
        for attr in ("state", "next_state"):
            if getattr(step, attr) not in known_states:
                raise ValueError(f"trace step {index}: its {attr} is not a state of {decl.name!r}")
        if step.event not in known_events:
            raise ValueError(f"trace step {index}: its event is not a trigger of {decl.name!r}")
        key = (step.state, step.event, step.next_state)
        if getattr(step, "detail", None) is not None and key[0] == key[2] and key[:2] in notes:
            steps.add(_note_id(step.state, step.event))
        elif key in by_step:
            steps.update(_taken(by_step[key], getattr(step, "guard", None), index))
        else:
            raise ValueError(
                f"trace step {index}: {decl.name!r} declares no transition "
                f"{step.state} --{step.event}--> {step.next_state}"
            )
        states.update((step.state, step.next_state))
    finals = frozenset(states & set(decl.final_states))
    return _Marks(frozenset(states), frozenset(steps), finals)


def _taken(edges: list[Edge], guard: str | None, index: int) -> list[str]:
    """The declared transitions a step took: the one with its guard. A step recorded without
    a guard took the unguarded one; when there is none, the step was saved before steps named
    their guard, and it took one of the guarded ones (all are marked)."""
    named = [edge.ident for edge in edges if edge.guard == guard]
    if named:
        return named
    if guard is not None:
        raise ValueError(f"trace step {index}: its guard is not one of this transition's")
    return [edge.ident for edge in edges]


# --------------------------------------------------------------------------- mermaid
def _provenance(decl: MachineDeclaration, view: str) -> str:
    return (
        f"Rendered from {decl.source_module} ({view} view) by toolloop_fsm.diagrams; "
        f"do not edit, regenerate with: {_REGENERATE}"
    )


def _line_text(line: Line, marks: _Marks, dest: str | None = None) -> str:
    return TAKEN + line.text if marks.takes(line, dest) else line.text


def render_mermaid(
    decl: MachineDeclaration,
    *,
    view: str = "full",
    highlight: Iterable[TraceLike] | None = None,
) -> str:
    """Mermaid ``stateDiagram-v2`` text of ``view``. An edge's label lines are joined by
    `` | ``; decision states are dashed; ``highlight`` gives every state the run visited a
    ``s_trace`` class and marks each line it took with ``✔``. In the exits view each exit leads
    to its own terminal node (``<state>__<terminal state>``, thick-bordered), so no two exits
    share a node or lay their labels over each other. A note by the initial state is the
    legend."""
    drawn = diagram(decl, view)
    marks = _marks(decl, highlight)
    exits = view == "exits"
    out = [
        "---",
        f"title: {decl.title}",
        "---",
        "stateDiagram-v2",
        f"  %% {_provenance(decl, view)}",
        "  direction LR",
        *(f"  classDef {name} {style}" for name, style in _MERMAID_CLASSES.items()),
        "",
    ]
    for state in decl.state_names:
        if exits and decl.state(state).final:
            continue  # drawn once per exit that ends there
        kind = "decision" if decl.state(state).transient else "default"
        out.append(f'  state "{state}" as {state}')
        out.append(f"  class {state} {_mermaid_class(kind, state in marks.states)}")
    out += [f"  note left of {decl.initial}", "    legend:"]
    out += [
        f"    {row.meaning}" for row in legend(drawn, "mermaid", highlighted=bool(marks.states))
    ]
    out.append("  end note")
    for group in drawn.exit_groups:
        out += [f"  note right of {group[0]}", f"    {_shared_exits_caption(group)}", "  end note"]
    if drawn.settle_group:
        out += [f"  note left of {drawn.settle_group[0]}", f"    {_SETTLE_CAPTION}", "  end note"]
    out.append("")
    edges: dict[tuple[str, str], list[Line]] = {}
    for edge in drawn.edges:
        for dest in edge.dests:
            edges.setdefault((edge.source, dest), []).extend(edge.lines)
    for (source, dest), lines in edges.items():
        label = " | ".join(_line_text(line, marks, dest) for line in lines)
        if exits and decl.state(dest).final:
            node = mermaid_terminal(source, dest)
            reached = any(marks.takes(line, dest) for line in lines)
            out.append(f'  state "{dest}" as {node}')
            out.append(f"  class {node} {_mermaid_class('terminal', reached)}")
            dest = node
        out.append(f"  {source} --> {dest}: {label}")
    out.append(f"  [*] --> {decl.initial}")
    if not exits:
        out += [f"  {state} --> [*]" for state in decl.final_states]
    return "\n".join(out) + "\n"


#: The mermaid classes: each kind of node plain and on the highlighted run's path.
_MERMAID_CLASSES = {
    "s_default": "fill:white,color:black",
    "s_decision": "fill:white,color:black,stroke-dasharray:5 5",
    "s_terminal": "fill:white,color:black,stroke-width:4px",
    "s_trace": f"fill:{_TRACE_FILL},color:black,stroke:{_TRACE_STROKE},stroke-width:3px",
    "s_trace_decision": f"fill:{_TRACE_FILL},color:black,stroke:{_TRACE_STROKE},"
    "stroke-width:3px,stroke-dasharray:5 5",
    "s_trace_terminal": f"fill:{_TRACE_FILL},color:black,stroke:{_TRACE_STROKE},stroke-width:4px",
}


def _mermaid_class(kind: str, traced: bool) -> str:
    if traced:
        return "s_trace" if kind == "default" else f"s_trace_{kind}"
    return f"s_{kind}"


def mermaid_terminal(source: str, terminal: str) -> str:
    """The mermaid id of the exits view's node for the exit from ``source`` to ``terminal``."""
    return f"{source}__{terminal}"


# --------------------------------------------------------------------------- dot
def _q(text: str) -> str:
    """A dot double-quoted string."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


#: Marks an attribute value already escaped for dot (a label of left-justified rows).
_RAW = "\x00"


def _attrs(**attributes: str) -> str:
    return (
        "["
        + ", ".join(
            f'{key}="{value[1:]}"' if value.startswith(_RAW) else f"{key}={_q(value)}"
            for key, value in attributes.items()
        )
        + "]"
    )


def _dot_node(decl: MachineDeclaration, state: str, marks: _Marks, **extra: str) -> str:
    attributes: dict[str, str] = dict(extra)
    declared = decl.state(state)
    if declared.final:
        attributes["shape"] = "doublecircle"
    elif declared.transient:
        attributes["style"] = "rounded,filled,dashed"
    if state in marks.states:
        attributes.update(fillcolor=_TRACE_FILL, color=_TRACE_STROKE, penwidth="2")
    return f"{_q(state)} {_attrs(**attributes)}" if attributes else _q(state)


def _exit_rows(line: Line, marks: _Marks) -> str:
    """An exit's label line as dot rows, left-justified: ``event [guard]``, then the reason
    indented below it (one long line each would widen the drawing by as much)."""
    text = _line_text(line, marks)
    event, slash, reason = text.partition(" / ")
    rows = [event, f"    / {reason}"] if slash else [event]
    return "".join(_q(row)[1:-1] + "\\l" for row in rows)


def _back_edges(drawn: Diagram) -> set[tuple[str, str]]:
    """The (source, dest) edges that lead back to a state on the way to them from the initial
    state (a loop): laid out without pulling their target down."""
    successors: dict[str, list[str]] = {}
    for edge in drawn.edges:
        if edge.kind != "exit":
            successors.setdefault(edge.source, []).extend(edge.dests)
    back: set[tuple[str, str]] = set()
    done: set[str] = set()
    # the settle step is entered where the endings lead (the state after each exit)
    entries = [t.dest for t in drawn.declaration.transitions if t.ends is not None and t.dest]
    starts = [drawn.declaration.initial, *dict.fromkeys(entries), *drawn.settle_group]
    for start in starts:
        if start in done:
            continue
        path = [start]
        stack = [(start, iter(successors.get(start, ())))]
        while stack:
            state, pending = stack[-1]
            target = next(pending, None)
            if target is None:
                stack.pop()
                path.pop()
                done.add(state)
            elif target in path:
                back.add((state, target))
            elif target not in done:
                path.append(target)
                stack.append((target, iter(successors.get(target, ()))))
    return back


def _terminal(edge: DrawnEdge) -> str:
    """The exits view's node for the terminal states ``edge`` leads to: one per exit edge, so
    that each state's exits hang beside it."""
    return f"{edge.source} → {'|'.join(edge.dests)}"


def render_dot(
    decl: MachineDeclaration,
    *,
    view: str = "full",
    highlight: Iterable[TraceLike] | None = None,
) -> str:
    """Graphviz dot text of ``view``, written directly (no Graphviz needed to produce it).

    Decision states are dashed; an edge's label has one line per declared transition;
    ``highlight`` colours the states visited and the edges taken, and marks each line taken
    with ``✔``. In the full view final states are double circles. In the exits view each exit
    leads to its own double-bordered box naming the terminal state, so each state's exits hang
    beside it; a group of states that share their exits is a captioned dashed box, each exit
    still drawn from each state; the settle step is a dashed box of its own; the transitions
    that end nothing are grey. A legend box says what each mark means."""
    drawn = diagram(decl, view)
    marks = _marks(decl, highlight)
    font = "Helvetica"
    exits = view == "exits"
    graph = {"rankdir": "TB" if exits else "LR"}
    if exits:
        graph.update(nodesep="0.05", ranksep="0.4")
    rows = legend(drawn, "dot", highlighted=bool(marks.states))
    # the title and legend on top: the exits view is narrow, two samples to a row keep it so
    title = _dot_label(f"{decl.title}: {view} view", rows, per_row=2 if exits else 4)
    out = [
        f"// {_provenance(decl, view)}",
        f"digraph {_q(decl.name)} {{",
        "  graph " + _attrs(**graph, labelloc="t", fontname=font)[:-1] + f", label={title}]",
        "  node "
        + _attrs(
            shape="box", style="rounded,filled", fillcolor="white", color="black", fontname=font
        ),
        # the exits view's labels a shade smaller: the inner machine's view, with its tool
        # batch's gate, must still fit a full-HD screen's width
        "  edge " + _attrs(color="black", fontname=font, fontsize="9.5" if exits else "10"),
        "",
        "  " + _q("__initial__") + " " + _attrs(shape="point", width="0.15", label=""),
    ]
    boxed = {state for group in (drawn.settle_group, *drawn.exit_groups) for state in group}
    # the exits view keeps the states that run the turn in one column, so that each one's exits
    # hang beside it
    column = {"group": "run"} if exits else {}
    drawn_states = [s for s in decl.state_names if not (exits and decl.state(s).final)]
    out += ["  " + _dot_node(decl, s, marks, **column) for s in drawn_states if s not in boxed]
    out += _dot_boxes(decl, drawn, marks, column)
    out += ["", f"  {_q('__initial__')} -> {_q(decl.initial)}"]
    back = _back_edges(drawn) if exits else set()
    entries = _mid_flow_entries(drawn) if exits else set()
    for edge in drawn.edges:
        if (edge.source, edge.dests[0]) in entries:
            out += _dot_mid_flow_entry(edge, marks)
            continue
        out += _dot_edge(edge, marks, exits=exits, back=back)
    out.append("}")
    return "\n".join(out) + "\n"


def _mid_flow_entries(drawn: Diagram) -> set[tuple[str, str]]:
    """The edges by which the initial state enters the flow past its first successor (a
    resume into a paused batch): the exits view draws each from a copy of the initial state
    beside its target, not as an arrow across the whole loop."""
    initial = drawn.declaration.initial
    dests = [d for e in drawn.edges if e.source == initial and e.kind != "exit" for d in e.dests]
    return {(initial, dest) for dest in dests[1:]}


def _dot_mid_flow_entry(edge: DrawnEdge, marks: _Marks) -> list[str]:
    source, dest = edge.source, edge.dests[0]
    copy = f"{source} → {dest}"
    node = _attrs(label=source, shape="box", style="rounded,dashed", fontsize="10")
    attributes = {
        "label": "\n".join(_line_text(line, marks) for line in edge.lines),
        "color": _FLOW,
        "fontcolor": _FLOW,
    }
    if any(marks.takes(line) for line in edge.lines):
        attributes.update(color=_TRACE_STROKE, fontcolor=_TRACE_STROKE, penwidth="2.5")
    return [f"  {_q(copy)} {node}", f"  {_q(copy)} -> {_q(dest)} {_attrs(**attributes)}"]


def _dot_boxes(
    decl: MachineDeclaration, drawn: Diagram, marks: _Marks, column: dict[str, str]
) -> list[str]:
    """The dashed boxes: one per group of states that share their exits, captioned so, then
    the settle step's."""
    out: list[str] = []
    for index, group in enumerate(drawn.exit_groups):
        out.append(f"  subgraph {_q(f'cluster_exits_{index}')} {{")
        caption = _shared_exits_caption(group)
        out.append(
            "    graph "
            + _attrs(label=caption, style="dashed", color=_FLOW, fontcolor=_FLOW, fontsize="9")
        )
        out += ["    " + _dot_node(decl, state, marks, **column) for state in group]
        out.append("  }")
    if drawn.settle_group:
        out.append("  subgraph " + _q("cluster_settle") + " {")
        out.append(
            "    graph " + _attrs(label=_SETTLE_CAPTION, style="dashed", color=_FLOW, fontsize="10")
        )
        out += ["    " + _dot_node(decl, state, marks) for state in drawn.settle_group]
        out.append("  }")
    return out


def _shared_exits_caption(group: tuple[str, ...]) -> str:
    return f"{' and '.join(group)} share their exits, drawn from each"


def _dot_edge(
    edge: DrawnEdge, marks: _Marks, *, exits: bool, back: set[tuple[str, str]]
) -> list[str]:
    """The dot lines of one drawn edge (in the exits view, an exit's terminal box first)."""
    out: list[str] = []
    attributes = {"label": "\n".join(_line_text(line, marks) for line in edge.lines)}
    taken = any(marks.takes(line) for line in edge.lines)
    source, dest = edge.source, edge.dests[0]
    if exits and edge.kind == "exit":
        # one box for the terminal states the ending names; the one reached is marked
        dest = _terminal(edge)
        names = [TAKEN + d if taken and d in marks.finals else d for d in edge.dests]
        terminal = {"label": "\n".join(names), "shape": "box", "peripheries": "2", "fontsize": "10"}
        if taken:
            terminal.update(fillcolor=_TRACE_FILL, color=_TRACE_STROKE, penwidth="2")
        out.append(f"  {_q(dest)} {_attrs(**terminal)}")
        label = "".join(_exit_rows(line, marks) for line in edge.lines)
        attributes["label"] = _RAW + label
    elif exits:
        attributes.update(color=_FLOW, fontcolor=_FLOW)
        if edge.kind == "settle":
            attributes["style"] = "dashed"
        if (source, dest) in back:
            attributes["constraint"] = "false"
        elif edge.kind == "flow":
            attributes["weight"] = "20"
    if taken:
        attributes.update(color=_TRACE_STROKE, fontcolor=_TRACE_STROKE, penwidth="2.5")
    out.append(f"  {_q(source)} -> {_q(dest)} {_attrs(**attributes)}")
    return out


# --------------------------------------------------------------------------- legends
@frozen
class LegendEntry:
    """One row of a view's legend: a sample in the style it explains, and what it means.
    ``sample`` names the style: ``state``, ``decision``, ``terminal_box``, ``terminal_circle``,
    ``end_dot`` (nodes), ``arrow``, ``grey_arrow``, ``grey_dashed_arrow`` (edges) or ``trace``
    (the highlight's colour)."""

    sample: str
    meaning: str


def legend(drawn: Diagram, format: str, *, highlighted: bool) -> tuple[LegendEntry, ...]:
    """What a reader needs to read ``drawn`` in ``format`` (``"dot"`` or ``"mermaid"``), with
    ``highlighted`` when a run is marked on it: only the marks that view draws (mermaid colours
    no arrow, so its exits view has no grey ones; it ends the full view's terminal states on
    its end dot, where dot draws double circles)."""
    dot = format == "dot"
    rows = [
        LegendEntry("state", "box: a state, waiting for its next event"),
        LegendEntry(
            "decision",
            "dashed box: a decision state, left at once by the first advance whose guard holds",
        ),
    ]
    if drawn.view == "exits":
        border = "double box" if dot else "thick box"
        rows += [
            LegendEntry(
                "terminal_box",
                f"{border}: the terminal state an exit ends the turn in, one per exit",
            ),
            LegendEntry("arrow", "arrow into a terminal state: an exit, event [guard] / reason"),
        ]
        if dot:
            rows.append(LegendEntry("grey_arrow", "grey arrow: a transition that ends nothing"))
        if dot and drawn.settle_group:
            rows.append(
                LegendEntry("grey_dashed_arrow", "grey dashed arrow: a step within the settle step")
            )
    else:
        rows += [
            LegendEntry("terminal_circle", "double circle: a terminal state, where the turn ends")
            if dot
            else LegendEntry(
                "end_dot", "arrow to the end dot: a terminal state, where the turn ends"
            ),
            LegendEntry(
                "arrow",
                "arrow: one line per transition, event [guard], [internal] when the state stays",
            ),
        ]
    if highlighted:
        rows.append(
            LegendEntry(
                "trace",
                f"amber: what the highlighted run visited and took, {TAKEN}on each line it took",
            )
        )
    return tuple(rows)


#: How each legend sample is drawn in dot, as the cell of an HTML-like table: a box in the
#: style of the states it explains, an arrow in the colour and dash of the edges.
_DOT_SAMPLES = {
    "state": '<TD BORDER="1" STYLE="rounded" WIDTH="28"> </TD>',
    "decision": '<TD BORDER="1" STYLE="rounded,dashed" WIDTH="28"> </TD>',
    "terminal_box": '<TD><TABLE BORDER="1" CELLSPACING="2" CELLPADDING="0"><TR>'
    '<TD BORDER="1" WIDTH="22" HEIGHT="10"> </TD></TR></TABLE></TD>',
    "terminal_circle": '<TD><FONT POINT-SIZE="18">◎</FONT></TD>',
    "arrow": "<TD>──▶</TD>",
    "grey_arrow": f'<TD><FONT COLOR="{_FLOW}">──▶</FONT></TD>',
    "grey_dashed_arrow": f'<TD><FONT COLOR="{_FLOW}">╌╌▶</FONT></TD>',
    "trace": f'<TD BORDER="2" COLOR="{_TRACE_STROKE}" BGCOLOR="{_TRACE_FILL}" STYLE="rounded">'
    f'<FONT COLOR="{_TRACE_STROKE}">──▶</FONT></TD>',
}


def _dot_label(title: str, rows: Sequence[LegendEntry], per_row: int) -> str:
    """The graph's label: its title over the legend, ``per_row`` samples to a table row."""
    cells = [
        f'{_DOT_SAMPLES[row.sample]}<TD ALIGN="LEFT">{html.escape(row.meaning)}</TD>'
        for row in rows
    ]
    lines = ["".join(cells[at : at + per_row]) for at in range(0, len(cells), per_row)]
    span = f'COLSPAN="{2 * per_row}"'
    return (
        '<<TABLE BORDER="0" CELLSPACING="3" CELLPADDING="2">'
        f'<TR><TD {span}><FONT POINT-SIZE="14">{html.escape(title)}</FONT></TD></TR>'
        f'<TR><TD {span} ALIGN="LEFT"><B>legend</B></TD></TR>'
        + "".join(f"<TR>{line}</TR>" for line in lines)
        + "</TABLE>>"
    )


def _dot_program() -> str:
    dot = shutil.which("dot")
    if dot is None:
        raise DiagramToolMissing(
            "SVG output needs Graphviz's `dot` program, which is not on PATH. Install Graphviz "
            "(Debian/Ubuntu: `apt-get install graphviz`; macOS: `brew install graphviz`; "
            "others: https://graphviz.org/download/), or use the mermaid or dot format."
        )
    return dot


def _svg_of(text: str) -> bytes:
    """``text`` (dot) drawn as SVG by ``dot``, marked with the SHA-256 of ``text``."""
    dot = _dot_program()
    try:
        done = subprocess.run(
            [dot, "-Tsvg"], input=text.encode(), capture_output=True, timeout=120, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise DiagramError(f"running {dot} -Tsvg failed: {err}") from err
    if done.returncode != 0:
        stderr = done.stderr.decode(errors="replace").strip()
        raise DiagramError(f"{dot} -Tsvg exited with status {done.returncode}: {stderr}")
    svg = done.stdout
    mark = b"<!-- drawn from dot text sha256:" + _digest(text).encode() + b" -->\n"
    at = svg.find(b"<svg")
    return svg[:at] + mark + svg[at:] if at >= 0 else mark + svg


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def render_svg(
    decl: MachineDeclaration,
    *,
    view: str = "full",
    highlight: Iterable[TraceLike] | None = None,
) -> bytes:
    """SVG of `render_dot`'s text, drawn by Graphviz's ``dot`` program.

    Raises `DiagramToolMissing` when ``dot`` is not on ``PATH``, `DiagramError` when it fails.
    """
    _dot_program()
    return _svg_of(render_dot(decl, view=view, highlight=highlight))


def render(
    decl: MachineDeclaration,
    format: str,
    *,
    view: str = "full",
    highlight: Sequence[TraceLike] | None = None,
) -> bytes:
    """Render ``view`` in ``format`` (``"mermaid"``, ``"dot"`` or ``"svg"``) as bytes ready to
    write."""
    if format == "mermaid":
        return render_mermaid(decl, view=view, highlight=highlight).encode()
    if format == "dot":
        return render_dot(decl, view=view, highlight=highlight).encode()
    if format == "svg":
        return render_svg(decl, view=view, highlight=highlight)
    raise ValueError(f"unknown diagram format {format!r}; use mermaid, dot or svg")


# --------------------------------------------------------------------------- committed renders
def _stem(name: str, view: str) -> str:
    return name if view == "full" else f"{name}-{view}"


def _committed(directory: Path) -> dict[Path, str]:
    """Every committed text render (path → the text the declarations render now)."""
    files: dict[Path, str] = {}
    for name in DECLARATIONS:
        decl = declaration(name)
        for view in VIEWS:
            stem = _stem(name, view)
            files[directory / f"{stem}.mmd"] = render_mermaid(decl, view=view)
            files[directory / f"{stem}.dot"] = render_dot(decl, view=view)
    return files


def _svg_source(svg: Path) -> str | None:
    """The SHA-256 of the dot text a committed SVG was drawn from, as it says."""
    try:
        found = _SVG_SOURCE.search(svg.read_bytes())
    except FileNotFoundError:
        return None
    return found.group(1).decode() if found else None


def write_committed_diagrams(
    directory: Path | str = COMMITTED_DIR, *, svg: bool = True
) -> list[Path]:
    """(Re)write the mermaid and dot text of every view of every registered machine and, with
    ``svg``, the SVG of each dot text whose SVG is missing or stale (that needs Graphviz's
    ``dot``: without it, `DiagramToolMissing` names what to install, after the text is
    written). Returns the paths written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    files = _committed(directory)
    written: list[Path] = []
    for path, text in files.items():
        # newline="" keeps "\n" on every platform: the drift test compares bytes-for-text.
        with path.open("w", encoding="utf-8", newline="") as handle:
            handle.write(text)
        written.append(path)
    for path, text in files.items():
        drawing = path.with_suffix(".svg")
        if svg and path.suffix == ".dot" and _svg_source(drawing) != _digest(text):
            drawing.write_bytes(_svg_of(text))
            written.append(drawing)
    return written


def stale_diagrams(directory: Path | str = COMMITTED_DIR, *, svg: bool = True) -> list[Path]:
    """The committed renders that are missing or differ from what the declarations render:
    text that differs and, with ``svg``, SVGs not drawn from the dot text of now."""
    stale: list[Path] = []
    for path, text in _committed(Path(directory)).items():
        try:
            current = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            current = None
        if current != text:
            stale.append(path)
        drawing = path.with_suffix(".svg")
        if svg and path.suffix == ".dot" and _svg_source(drawing) != _digest(text):
            stale.append(drawing)
    return stale


def source_checkout_diagrams(directory: Path = COMMITTED_DIR) -> Path | None:
    """``directory`` when the package runs from a source checkout (a ``pyproject.toml`` for
    toolloop-fsm beside it), else ``None``."""
    project = directory.parent / "pyproject.toml"
    try:
        is_ours = 'name = "toolloop-fsm"' in project.read_text(encoding="utf-8")
    except OSError:
        return None
    return directory if is_ours else None


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m toolloop_fsm.diagrams [--check] [--no-svg] [DIRECTORY]``."""
    parser = argparse.ArgumentParser(
        prog="python -m toolloop_fsm.diagrams",
        description="Regenerate the committed state diagrams from the machine declarations.",
    )
    parser.add_argument(
        "directory",
        nargs="?",
        type=Path,
        default=None,
        help="where to write (default: the diagrams/ folder of a source checkout)",
    )
    parser.add_argument(
        "--check", action="store_true", help="only report stale diagrams (exit 1 if any)"
    )
    parser.add_argument(
        "--no-svg",
        dest="svg",
        action="store_false",
        help="the mermaid and dot text only (drawing SVG needs Graphviz's `dot`)",
    )
    args = parser.parse_args(argv)
    if args.directory is None:
        args.directory = source_checkout_diagrams()
        if args.directory is None:
            # an installed package: its parent is site-packages, never a place to write into
            print(
                f"{parser.prog}: not run from a source checkout (no pyproject.toml beside "
                "the package); name the DIRECTORY to write into",
                file=sys.stderr,
            )
            return 2
    if args.check:
        stale = stale_diagrams(args.directory, svg=args.svg)
        for path in stale:
            print(f"stale: {path} (regenerate with: {_REGENERATE})", file=sys.stderr)
        return 1 if stale else 0
    try:
        written = write_committed_diagrams(args.directory, svg=args.svg)
    except DiagramError as err:
        print(f"{parser.prog}: {err}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
