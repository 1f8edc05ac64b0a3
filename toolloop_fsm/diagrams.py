"""State diagrams rendered from the very declarations the machines run.

A machine module (`toolloop_fsm.machine`, later `toolloop_fsm.generation`) declares its
states and transitions as plain data (``STATES``, ``TRANSITIONS``, ``FINAL_STATES``,
``TRANSIENT_STATES``, ``CALLBACKS``). `MachineDeclaration.from_module` reads that data into a
typed, immutable value; the renderers here draw from that value only, so a diagram can never
show a transition the machine does not have, nor miss one it does.

- `render_mermaid` uses transitions' own mermaid engine (`GraphMachine` with
  ``graph_engine="mermaid"``, ``show_conditions=True``). The guard *names* are given as string
  conditions: a graph machine never evaluates them, it only prints them on the edges. Three
  small additions to its output, each because the engine's flat mermaid graph lacks it: final
  states are marked ``state --> [*]``; a ``%%`` comment names the source and how to regenerate;
  trailing whitespace is stripped (committed files must survive editors and hooks).
- `render_dot` writes Graphviz dot text directly (no graphviz Python package, no ``dot``
  program), `render_svg` pipes it through ``dot -Tsvg`` when that program is installed.
- ``highlight`` takes a recorded trace (`toolloop_fsm.result.TraceStep` values) and colours the
  states it visited (mermaid: a ``classDef`` and ``Class`` lines; dot: node and edge colours —
  mermaid state diagrams cannot style individual transitions).

Only declaration names (states, triggers, guards) ever reach a diagram: a trace's ``detail``
is ignored and a trace naming anything undeclared is refused without echoing it, so no key or
other run-time material can leak into a rendered file (docs/invariants.md §9).

Regenerate the committed renders with ``python -m toolloop_fsm.diagrams`` (``--check`` only
reports drift).
"""

from __future__ import annotations

import argparse
import copy
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import Any, Protocol, cast

from attrs import field, frozen
from transitions.extensions.diagrams import GraphMachine

__all__ = [
    "COMMITTED_DIR",
    "DECLARATIONS",
    "DeclaredState",
    "DeclaredTransition",
    "DiagramError",
    "DiagramToolMissing",
    "Edge",
    "MachineDeclaration",
    "TraceLike",
    "declaration",
    "inner_declaration",
    "main",
    "render",
    "render_dot",
    "render_mermaid",
    "render_svg",
    "stale_diagrams",
    "write_committed_diagrams",
]

#: Where the committed renders live in a source checkout (``<repo>/diagrams``).
COMMITTED_DIR = Path(__file__).resolve().parent.parent / "diagrams"

#: File suffix of each committed text format.
_COMMITTED_FORMATS: dict[str, str] = {"mermaid": "mmd", "dot": "dot"}

_REGENERATE = "python -m toolloop_fsm.diagrams"

# One palette for both formats: the trace path in amber, on top of black-on-white.
_TRACE_FILL = "#fde68a"
_TRACE_STROKE = "#b45309"


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


# --------------------------------------------------------------------------- the declaration
@frozen
class DeclaredState:
    name: str
    final: bool = False
    on_enter: tuple[str, ...] = ()


@frozen
class DeclaredTransition:
    """One entry of ``TRANSITIONS``; ``dest`` is ``None`` for an internal transition."""

    trigger: str
    sources: tuple[str, ...]
    dest: str | None
    conditions: tuple[str, ...] = ()
    before: tuple[str, ...] = ()

    def target(self, source: str) -> str:
        """Where the machine is after taking this transition from ``source``."""
        return self.dest if self.dest is not None else source


@frozen
class Edge:
    """One declared transition from one source state, in declaration order."""

    source: str
    dest: str
    trigger: str
    conditions: tuple[str, ...]
    internal: bool

    @property
    def label(self) -> str:
        """``trigger [guard]`` — the same wording transitions' engine puts on mermaid edges."""
        text = self.trigger
        if self.internal:
            text += " [internal]"
        if self.conditions:
            text += f" [{' & '.join(self.conditions)}]"
        return text


def _names(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(str(v) for v in value)


@frozen
class MachineDeclaration:
    """A machine's declaration as an immutable value: what the diagrams and structural tests
    read. Build it with `from_module` from a module in the style of `toolloop_fsm.machine`."""

    name: str
    states: tuple[DeclaredState, ...]
    transitions: tuple[DeclaredTransition, ...]
    initial: str
    final_states: tuple[str, ...]
    transient_states: frozenset[str]
    title: str = ""
    source_module: str = ""
    #: name → function for every guard and action the declaration names.
    callbacks: Mapping[str, Callable[..., Any]] = field(
        factory=lambda: MappingProxyType({}), eq=False
    )

    @classmethod
    def from_module(
        cls, name: str, module: ModuleType, *, title: str = "", initial: str | None = None
    ) -> MachineDeclaration:
        """Read ``STATES``/``TRANSITIONS``/``FINAL_STATES``/``TRANSIENT_STATES`` (and
        ``CALLBACKS``, ``INITIAL_STATE`` when present) from a machine module. The initial state
        defaults to ``INITIAL_STATE``, else the first declared state."""
        states = tuple(
            DeclaredState(
                name=str(s["name"]),
                final=bool(s.get("final", False)),
                on_enter=_names(s.get("on_enter")),
            )
            for s in module.STATES
        )
        transitions = tuple(
            DeclaredTransition(
                trigger=str(t["trigger"]),
                sources=_names(t["source"]),
                dest=None if t.get("dest") is None else str(t["dest"]),
                conditions=_names(t.get("conditions")),
                before=_names(t.get("before")),
            )
            for t in module.TRANSITIONS
        )
        start = initial or getattr(module, "INITIAL_STATE", None) or states[0].name
        decl = cls(
            name=name,
            states=states,
            transitions=transitions,
            initial=start,
            final_states=tuple(module.FINAL_STATES),
            transient_states=frozenset(module.TRANSIENT_STATES),
            title=title or name,
            source_module=module.__name__,
            callbacks=MappingProxyType(dict(getattr(module, "CALLBACKS", {}))),
        )
        decl._check_names()
        return decl

    # ------------------------------------------------------------------ derived views
    @property
    def state_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.states)

    @property
    def triggers(self) -> tuple[str, ...]:
        """Every trigger, in order of first declaration."""
        return tuple(dict.fromkeys(t.trigger for t in self.transitions))

    @property
    def guard_names(self) -> tuple[str, ...]:
        """Every guard name, in order of first use."""
        return tuple(dict.fromkeys(c for t in self.transitions for c in t.conditions))

    @property
    def action_names(self) -> tuple[str, ...]:
        """Every transition action and state entry callback, in order of first use."""
        names = [a for t in self.transitions for a in t.before]
        names += [n for s in self.states for n in s.on_enter]
        return tuple(dict.fromkeys(names))

    def edges(self) -> list[Edge]:
        """Every declared transition expanded per source state, in declaration order (which,
        within one source and trigger, is the order the guards are tried)."""
        return [
            Edge(t.sources[i], t.target(source), t.trigger, t.conditions, t.dest is None)
            for t in self.transitions
            for i, source in enumerate(t.sources)
        ]

    def _check_names(self) -> None:
        known = set(self.state_names)
        problems = [
            f"{t.trigger}: {s}" for t in self.transitions for s in t.sources if s not in known
        ]
        problems += [
            f"{t.trigger} -> {t.dest}"
            for t in self.transitions
            if t.dest is not None and t.dest not in known
        ]
        problems += [f"final {s}" for s in self.final_states if s not in known]
        problems += [f"transient {s}" for s in sorted(self.transient_states) if s not in known]
        if self.initial not in known:
            problems.append(f"initial {self.initial}")
        if problems:
            raise ValueError(
                f"declaration {self.name!r} names undeclared states: {'; '.join(problems)}"
            )


def inner_declaration() -> MachineDeclaration:
    """`ToolLoopMachine`'s declaration (``toolloop_fsm.machine``)."""
    # Imported here so the registry stays cheap to build and a broken machine module only
    # breaks the diagram that needs it.
    from toolloop_fsm import machine

    return MachineDeclaration.from_module("inner", machine, title="ToolLoopMachine (inner tier)")


def outer_declaration() -> MachineDeclaration:
    """`GenerationTurnMachine`'s declaration (``toolloop_fsm.generation``)."""
    from toolloop_fsm import generation

    return MachineDeclaration.from_module(
        "outer", generation, title="GenerationTurnMachine (outer tier)"
    )


#: Name → declaration factory: one line per machine.
DECLARATIONS: dict[str, Callable[[], MachineDeclaration]] = {
    "inner": inner_declaration,
    "outer": outer_declaration,
}


def declaration(name: str) -> MachineDeclaration:
    """The declaration registered under ``name`` (``"inner"``, later ``"outer"``)."""
    try:
        factory = DECLARATIONS[name]
    except KeyError:
        known = ", ".join(sorted(DECLARATIONS))
        raise ValueError(f"no machine named {name!r}; known: {known}") from None
    return factory()


# --------------------------------------------------------------------------- highlight
def _trace_path(
    decl: MachineDeclaration, highlight: Iterable[TraceLike] | None
) -> tuple[set[str], set[tuple[str, str]]]:
    """The states and (source, dest) edges a trace visited, checked against the declaration.

    A step that names something undeclared is refused without echoing the offending value: a
    trace is run-time data, and a diagram (or its error) must carry declaration names only."""
    states: set[str] = set()
    edges: set[tuple[str, str]] = set()
    if highlight is None:
        return states, edges
    known_states = set(decl.state_names)
    known_triggers = set(decl.triggers)
    declared = {(e.source, e.trigger, e.dest) for e in decl.edges()}
    for index, step in enumerate(highlight):
        if getattr(step, "detail", None) is not None:
            continue  # an annotation (e.g. an attempt superseded), not a transition
        for attr in ("state", "next_state"):
            if getattr(step, attr) not in known_states:
                raise ValueError(f"trace step {index}: its {attr} is not a state of {decl.name!r}")
        if step.event not in known_triggers:
            raise ValueError(f"trace step {index}: its event is not a trigger of {decl.name!r}")
        if (step.state, step.event, step.next_state) not in declared:
            raise ValueError(
                f"trace step {index}: {decl.name!r} declares no transition "
                f"{step.state} --{step.event}--> {step.next_state}"
            )
        states.update((step.state, step.next_state))
        edges.add((step.state, step.next_state))
    return states, edges


# --------------------------------------------------------------------------- mermaid
class _DiagramMachine(GraphMachine):
    """transitions' graph machine with one more node style, ``trace``, for `highlight`."""

    style_attributes = copy.deepcopy(GraphMachine.style_attributes)
    cast(dict[str, Any], style_attributes["node"])["trace"] = {
        "fillcolor": _TRACE_FILL,
        "color": "black",
        "stroke": _TRACE_STROKE,
        "stroke-width": "3px",
    }


class _MermaidGraph(Protocol):
    """The slice of transitions' (untyped-by-stub) mermaid ``Graph`` used here."""

    def set_node_style(self, state: str, style: str) -> None: ...

    def get_graph(self, title: str | None = None, roi_state: str | None = None) -> Any: ...


def render_mermaid(
    decl: MachineDeclaration, *, highlight: Sequence[TraceLike] | None = None
) -> str:
    """Mermaid ``stateDiagram-v2`` text of the declaration, by transitions' mermaid engine.

    Edges read ``trigger [guard]``; the transitions of one source to one destination share an
    edge, their labels joined by `` | `` in declaration (= guard) order. ``highlight`` gives
    every state a recorded trace visited the ``s_trace`` class.
    """
    visited, _ = _trace_path(decl, highlight)
    transitions = [
        {
            "trigger": t.trigger,
            "source": list(t.sources),
            "dest": t.dest,
            # strings, never evaluated: a graph machine without a model only prints them
            "conditions": list(t.conditions),
        }
        for t in decl.transitions
    ]
    machine = _DiagramMachine(
        model=None,
        states=[{"name": s.name, "final": s.final} for s in decl.states],
        transitions=transitions,
        initial=decl.initial,
        auto_transitions=False,
        graph_engine="mermaid",
        show_conditions=True,
        title=decl.title,
    )
    # With model=None no model carries a graph; build the engine's graph object directly.
    # (A model would also get its current state painted "active", which a static diagram
    # must not show.)
    graph = cast(_MermaidGraph, machine.graph_cls(machine))
    for state in decl.state_names:
        if state in visited:
            graph.set_node_style(state, "trace")
    # transitions writes the title line verbatim between the front-matter fences; giving it
    # as a YAML key makes it a mermaid title rather than a stray scalar.
    source = cast(str, graph.get_graph(title=f"title: {decl.title}").source)

    lines = [line.rstrip() for line in source.splitlines()]
    at = lines.index("stateDiagram-v2") + 1
    lines[at:at] = [f"  %% {_provenance(decl)}"]
    # The engine's flat mermaid graph marks the initial state but not the final ones.
    lines += [f"  {state} --> [*]" for state in decl.final_states]
    return "\n".join(lines) + "\n"


def _provenance(decl: MachineDeclaration) -> str:
    return (
        f"Rendered from {decl.source_module or decl.name} by toolloop_fsm.diagrams; "
        f"do not edit, regenerate with: {_REGENERATE}"
    )


# --------------------------------------------------------------------------- dot
def _q(text: str) -> str:
    """A dot double-quoted string."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _attrs(**attributes: str) -> str:
    return "[" + ", ".join(f"{key}={_q(value)}" for key, value in attributes.items()) + "]"


def render_dot(decl: MachineDeclaration, *, highlight: Sequence[TraceLike] | None = None) -> str:
    """Graphviz dot text of the declaration, written directly (no graphviz needed to produce
    it). Final states are double circles, transient (decision) states dashed; edges read
    ``trigger [guard]``, one line per declared transition; ``highlight`` colours the states
    and edges a recorded trace took."""
    visited, taken = _trace_path(decl, highlight)
    font = "Helvetica"
    out = [
        f"// {_provenance(decl)}",
        f"digraph {_q(decl.name)} {{",
        "  graph " + _attrs(rankdir="LR", label=decl.title, labelloc="t", fontname=font),
        "  node "
        + _attrs(
            shape="box", style="rounded,filled", fillcolor="white", color="black", fontname=font
        ),
        "  edge " + _attrs(color="black", fontname=font, fontsize="10"),
        "",
        "  " + _q("__initial__") + " " + _attrs(shape="point", width="0.15", label=""),
    ]
    for state in decl.states:
        attributes: dict[str, str] = {}
        if state.final:
            attributes["shape"] = "doublecircle"
        elif state.name in decl.transient_states:
            attributes["style"] = "rounded,filled,dashed"
        if state.name in visited:
            attributes.update(fillcolor=_TRACE_FILL, color=_TRACE_STROKE, penwidth="2")
        suffix = " " + _attrs(**attributes) if attributes else ""
        out.append(f"  {_q(state.name)}{suffix}")
    out += ["", f"  {_q('__initial__')} -> {_q(decl.initial)}"]

    # One drawn edge per (source, dest) pair, its label one line per declared transition.
    labels: dict[tuple[str, str], list[str]] = {}
    for edge in decl.edges():
        labels.setdefault((edge.source, edge.dest), []).append(edge.label)
    for (source, dest), lines in labels.items():
        attributes = {"label": "\n".join(lines)}
        if (source, dest) in taken:
            attributes.update(color=_TRACE_STROKE, fontcolor=_TRACE_STROKE, penwidth="2.5")
        out.append(f"  {_q(source)} -> {_q(dest)} {_attrs(**attributes)}")
    out.append("}")
    return "\n".join(out) + "\n"


def render_svg(decl: MachineDeclaration, *, highlight: Sequence[TraceLike] | None = None) -> bytes:
    """SVG of `render_dot`'s text, drawn by Graphviz's ``dot`` program.

    Raises `DiagramToolMissing` when ``dot`` is not on ``PATH``, `DiagramError` when it fails.
    """
    dot = shutil.which("dot")
    if dot is None:
        raise DiagramToolMissing(
            "SVG output needs Graphviz's `dot` program, which is not on PATH. Install Graphviz "
            "(Debian/Ubuntu: `apt-get install graphviz`; macOS: `brew install graphviz`; "
            "others: https://graphviz.org/download/), or use the mermaid or dot format."
        )
    text = render_dot(decl, highlight=highlight)
    try:
        done = subprocess.run(
            [dot, "-Tsvg"], input=text.encode(), capture_output=True, timeout=120, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise DiagramError(f"running {dot} -Tsvg failed: {err}") from err
    if done.returncode != 0:
        stderr = done.stderr.decode(errors="replace").strip()
        raise DiagramError(f"{dot} -Tsvg exited with status {done.returncode}: {stderr}")
    return done.stdout


def render(
    decl: MachineDeclaration,
    format: str,
    *,
    highlight: Sequence[TraceLike] | None = None,
) -> bytes:
    """Render in ``format`` (``"mermaid"``, ``"dot"`` or ``"svg"``) as bytes ready to write."""
    if format == "mermaid":
        return render_mermaid(decl, highlight=highlight).encode()
    if format == "dot":
        return render_dot(decl, highlight=highlight).encode()
    if format == "svg":
        return render_svg(decl, highlight=highlight)
    raise ValueError(f"unknown diagram format {format!r}; use mermaid, dot or svg")


# --------------------------------------------------------------------------- committed renders
def _committed(directory: Path) -> dict[Path, str]:
    """Every committed render (path → the text the declarations render now)."""
    files: dict[Path, str] = {}
    for name in DECLARATIONS:
        decl = declaration(name)
        files[directory / f"{name}.{_COMMITTED_FORMATS['mermaid']}"] = render_mermaid(decl)
        files[directory / f"{name}.{_COMMITTED_FORMATS['dot']}"] = render_dot(decl)
    return files


def write_committed_diagrams(directory: Path | str = COMMITTED_DIR) -> list[Path]:
    """(Re)write ``<name>.mmd`` and ``<name>.dot`` for every registered machine; returns the
    paths written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    files = _committed(directory)
    for path, text in files.items():
        # newline="" keeps "\n" on every platform: the drift test compares bytes-for-text.
        with path.open("w", encoding="utf-8", newline="") as handle:
            handle.write(text)
    return list(files)


def stale_diagrams(directory: Path | str = COMMITTED_DIR) -> list[Path]:
    """The committed renders that are missing or differ from what the declarations render."""
    stale: list[Path] = []
    for path, text in _committed(Path(directory)).items():
        try:
            current = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            stale.append(path)
            continue
        if current != text:
            stale.append(path)
    return stale


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m toolloop_fsm.diagrams [--check] [DIRECTORY]``."""
    parser = argparse.ArgumentParser(
        prog="python -m toolloop_fsm.diagrams",
        description="Regenerate the committed state diagrams from the machine declarations.",
    )
    parser.add_argument("directory", nargs="?", type=Path, default=COMMITTED_DIR)
    parser.add_argument(
        "--check", action="store_true", help="only report stale diagrams (exit 1 if any)"
    )
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_diagrams(args.directory)
        for path in stale:
            print(f"stale: {path} (regenerate with: {_REGENERATE})", file=sys.stderr)
        return 1 if stale else 0
    for path in write_committed_diagrams(args.directory):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
