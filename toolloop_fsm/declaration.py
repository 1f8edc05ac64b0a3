"""A machine's declaration: its states, its transitions and the ending each exit leads to, as
typed values that hold the guard and action functions themselves.

Each machine module (`toolloop_fsm.machine`, `toolloop_fsm.generation`) builds one
`MachineDeclaration`; it is the single source of everything derived from it: the compiled step
tables that run a turn (`toolloop_fsm.runner`), the `transitions` machine that can run the same
turn as a reference (`toolloop_fsm.reference`), and the diagrams (`toolloop_fsm.diagrams`).

A transition that ends the turn says so: ``ends=("stopped_by_user", "stopped_during_tool")``
is the status (a final state) and sub-reason it decides. The runner records that ending on the
run's state when the transition is taken, before its action runs, so actions never decide an
ending themselves and the declaration knows which event leads to which terminal state. Every
ending first passes the machine's shared settle step (states flagged ``settle``), which waits
for what is still in flight and then takes the terminal state the ending names.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from attrs import field
from attrs import frozen

from toolloop_fsm.result import TurnStatus

#: A guard: a pure predicate of the run's state.
Guard = Callable[[Any], bool]
#: An action or an entry callback: mutates the run's state (and appends effects) for an event.
Action = Callable[[Any, Any], None]


class DeclarationError(ValueError):
    """A declaration that names what it does not declare, or an ending that a run contradicts."""


def _statuses(value: Iterable[TurnStatus | str]) -> tuple[TurnStatus, ...]:
    statuses = []
    for status in value:
        try:
            statuses.append(TurnStatus(status))
        except ValueError:
            known = ", ".join(s.value for s in TurnStatus)
            raise DeclarationError(f"an ending names {status!r}, not a status ({known})") from None
    return tuple(statuses)


@frozen
class Ending:
    """How a transition ends the turn: the terminal state it leads to and the sub-reason.

    A fixed ending names one status. An ending the run carries over — the outer tier passing on
    how an attempt ended — names every status it can be (one exit each in the exits diagram)
    and reads the one that applies with ``status_of``. The sub-reason is ``reason``, or read
    from the run with ``reason_of``.
    """

    statuses: tuple[TurnStatus, ...] = field(converter=_statuses)
    reason: str | None = None
    status_of: Callable[[Any], TurnStatus] | None = field(default=None, kw_only=True)
    reason_of: Callable[[Any], str | None] | None = field(default=None, kw_only=True)

    def __attrs_post_init__(self) -> None:
        if not self.statuses:
            raise DeclarationError("an ending names at least one status")
        if (self.status_of is None) != (len(self.statuses) == 1):
            raise DeclarationError(
                "an ending with several statuses reads the one that applies with status_of, "
                "and only such an ending does"
            )
        if self.reason is not None and self.reason_of is not None:
            raise DeclarationError("an ending's reason is fixed or read from the run, not both")

    @property
    def reason_label(self) -> str | None:
        """The sub-reason as a diagram shows it: the fixed reason, or the name of the function
        that reads it."""
        return self.reason if self.reason_of is None else self.reason_of.__name__

    def decide(self, model: Any) -> None:
        """Record this ending on the run's state (``status`` and ``reason``)."""
        if self.status_of is None:
            status = self.statuses[0]
        else:
            status = self.status_of(model)
            if status not in self.statuses:
                raise DeclarationError(
                    f"{self.status_of.__name__} read the status {status.value!r}, which this "
                    f"ending does not name ({', '.join(s.value for s in self.statuses)})"
                )
        model.status = status
        model.reason = self.reason if self.reason_of is None else self.reason_of(model)


def _as_ending(value: Ending | tuple[str, str | None] | None) -> Ending | None:
    if value is None or isinstance(value, Ending):
        return value
    status, reason = value
    return Ending((status,), reason)


def _as_sources(value: str | Sequence[str]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


def _actions(value: Iterable[Action]) -> tuple[Action, ...]:
    return tuple(value)


def _states(value: Iterable[State]) -> tuple[State, ...]:
    return tuple(value)


def _transitions(value: Iterable[Transition]) -> tuple[Transition, ...]:
    return tuple(value)


def _notes(value: Iterable[TraceNote]) -> tuple[TraceNote, ...]:
    return tuple(value)


@frozen
class State:
    """One declared state. ``transient``: a decision point, left within the same step by the
    first ``advance`` whose guard holds. ``settle``: part of the shared settle step every
    ending passes through. ``on_enter``: callbacks run each time the state is entered."""

    name: str
    on_enter: tuple[Action, ...] = field(default=(), converter=_actions)
    final: bool = field(default=False, kw_only=True)
    transient: bool = field(default=False, kw_only=True)
    settle: bool = field(default=False, kw_only=True)


@frozen
class Transition:
    """One declared transition from each of ``sources``: taken on ``trigger`` when ``when``
    holds (no guard: always), it runs ``do`` and moves to ``dest`` (``None``: an internal
    transition, the state stays and is not re-entered). ``ends``: the ending it decides, as a
    `Ending` or ``(status, reason)``."""

    trigger: str
    sources: tuple[str, ...] = field(converter=_as_sources)
    dest: str | None
    when: Guard | None = field(default=None, kw_only=True)
    do: Action | None = field(default=None, kw_only=True)
    ends: Ending | None = field(default=None, kw_only=True, converter=_as_ending)

    @property
    def guard_name(self) -> str | None:
        return self.when.__name__ if self.when is not None else None

    def target(self, source: str) -> str:
        """Where the machine is after taking this transition from ``source``."""
        return self.dest if self.dest is not None else source

    def ident(self, source: str) -> str:
        """A stable name for this transition from ``source``:
        ``source --trigger[guard]--> dest``."""
        guard = f"[{self.guard_name}]" if self.when is not None else ""
        return f"{source} --{self.trigger}{guard}--> {self.target(source)}"


@frozen
class TraceNote:
    """A step that an action writes into the trace itself rather than a transition:
    ``state --event--> state`` with a detail (the outer tier notes each attempt it supersedes).
    Declared so that every step a trace can hold is drawn in the diagram."""

    state: str
    event: str
    written_by: Action


@frozen
class Edge:
    """One declared transition from one source state, in declaration order."""

    source: str
    dest: str
    transition: Transition

    @property
    def trigger(self) -> str:
        return self.transition.trigger

    @property
    def guard(self) -> str | None:
        return self.transition.guard_name

    @property
    def conditions(self) -> tuple[str, ...]:
        return (self.guard,) if self.guard is not None else ()

    @property
    def internal(self) -> bool:
        return self.transition.dest is None

    @property
    def ident(self) -> str:
        return self.transition.ident(self.source)

    @property
    def label(self) -> str:
        """``trigger [guard]``, with ``[internal]`` for an internal transition."""
        text = self.trigger
        if self.internal:
            text += " [internal]"
        if self.guard is not None:
            text += f" [{self.guard}]"
        return text


@frozen(eq=False)
class MachineDeclaration:
    """A machine as one immutable value. ``name`` is the machine's name in errors, ``title``
    the diagrams' caption; ``chunks`` maps the stream chunk events to their triggers (the
    events that may take the fast path); ``notes`` are the trace steps actions write."""

    name: str
    title: str
    states: tuple[State, ...] = field(converter=_states)
    transitions: tuple[Transition, ...] = field(converter=_transitions)
    initial: str
    source_module: str
    chunks: Mapping[type, str] = field(factory=dict, kw_only=True)
    notes: tuple[TraceNote, ...] = field(default=(), converter=_notes, kw_only=True)
    # derived once: every run reads them
    final_states: tuple[str, ...] = field(init=False)
    transient_states: frozenset[str] = field(init=False)
    settle_states: frozenset[str] = field(init=False)

    def __attrs_post_init__(self) -> None:
        derive = object.__setattr__  # a frozen instance is filled in once, here
        derive(self, "final_states", tuple(s.name for s in self.states if s.final))
        derive(self, "transient_states", frozenset(s.name for s in self.states if s.transient))
        derive(self, "settle_states", frozenset(s.name for s in self.states if s.settle))
        known = {state.name for state in self.states}
        problems = [
            f"{t.trigger} from {source}"
            for t in self.transitions
            for source in t.sources
            if source not in known
        ]
        problems += [
            f"{t.trigger} to {t.dest}"
            for t in self.transitions
            if t.dest is not None and t.dest not in known
        ]
        problems += [f"the note {n.event} in {n.state}" for n in self.notes if n.state not in known]
        if self.initial not in known:
            problems.append(f"the initial state {self.initial}")
        if len(known) != len(self.states):
            problems.append("a state declared twice")
        endings = {status for t in self.transitions if t.ends for status in t.ends.statuses}
        problems += [f"the ending {s.value}" for s in sorted(endings) if s.value not in known]
        idents = self.transition_ids
        if len(set(idents)) != len(idents):
            problems.append("a transition declared twice")
        if problems:
            raise DeclarationError(f"{self.name} declares {'; '.join(problems)} (undeclared)")

    # ------------------------------------------------------------------ derived views
    @property
    def state_names(self) -> tuple[str, ...]:
        return tuple(state.name for state in self.states)

    def state(self, name: str) -> State:
        for state in self.states:
            if state.name == name:
                return state
        raise KeyError(name)

    @property
    def triggers(self) -> tuple[str, ...]:
        """Every trigger, in order of first declaration."""
        return tuple(dict.fromkeys(t.trigger for t in self.transitions))

    @property
    def guards(self) -> tuple[Guard, ...]:
        """Every guard, in order of first use."""
        return tuple(dict.fromkeys(t.when for t in self.transitions if t.when is not None))

    @property
    def guard_names(self) -> tuple[str, ...]:
        return tuple(guard.__name__ for guard in self.guards)

    @property
    def actions(self) -> tuple[Action, ...]:
        """Every transition action and entry callback, in order of first use."""
        actions: list[Action] = [t.do for t in self.transitions if t.do is not None]
        actions += [callback for state in self.states for callback in state.on_enter]
        return tuple(dict.fromkeys(actions))

    @property
    def action_names(self) -> tuple[str, ...]:
        return tuple(action.__name__ for action in self.actions)

    def edges(self) -> list[Edge]:
        """Every declared transition expanded per source state, in declaration order (which,
        within one source and trigger, is the order the guards are tried)."""
        return [Edge(s, t.target(s), t) for t in self.transitions for s in t.sources]

    @property
    def transition_ids(self) -> tuple[str, ...]:
        return tuple(edge.ident for edge in self.edges())


def declared_transition_ids(transitions: Iterable[Transition]) -> list[str]:
    """The id of every declared transition from each of its sources, in declaration order."""
    return [t.ident(source) for t in transitions for source in t.sources]
