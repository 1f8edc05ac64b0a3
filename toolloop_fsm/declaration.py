"""How a declared machine runs: the `transitions` declaration, compiled.

Both machines (`machine.py`, `generation.py`) declare their states and transitions as
`transitions` data — guards and actions by name. This module builds the `transitions`
`Machine` from that data and compiles the same data into step tables, then runs steps.

Why compile: `transitions` interprets a declaration generically; measured on this project's
machines one trigger costs 18–32 µs, more than a whole streamed chunk may cost. The compiled
tables take exactly the steps `transitions` takes — guards in declared order, then the
action, the state change and the entry callbacks — and `reference=True` runs every step
through `transitions`' own trigger instead (a property test checks both agree):
- ``fast_path``: per state, the internal transitions without a guard that are the only
  taker of their trigger there, for stream chunks: event class → action;
- ``steps``: (state, trigger) → the declared transitions, in declared order.
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

import attrs
from attrs import frozen
from transitions import Machine, MachineError

from toolloop_fsm.effects import Finish
from toolloop_fsm.errors import InvalidEvent
from toolloop_fsm.result import GenerationTurnResult, TraceStep

Handler = Callable[[Any, Any], None]
Guard = Callable[[Any], bool]
Step = tuple[Guard | None, Handler | None, str | None, tuple[Handler, ...], str]


def transition(
    trigger: str,
    source: str | list[str],
    dest: str | None,
    *,
    when: Callable[..., bool] | None = None,
    do: Callable[..., None] | None = None,
) -> dict[str, Any]:
    """One declared transition: ``when`` is its guard (by name), ``do`` its action."""
    spec: dict[str, Any] = {"trigger": trigger, "source": source, "dest": dest}
    if when is not None:
        spec["conditions"] = [when.__name__]
    if do is not None:
        spec["before"] = [do.__name__]
    return spec


def sources_of(spec: Mapping[str, Any]) -> list[str]:
    source = spec["source"]
    return list(source) if isinstance(source, list) else [source]


def transition_id(spec: Mapping[str, Any], source: str) -> str:
    """A stable name for one declared transition (from one source state)."""
    dest = spec["dest"] if spec["dest"] is not None else source
    conditions = ",".join(spec.get("conditions", ()))
    guard = f"[{conditions}]" if conditions else ""
    return f"{source} --{spec['trigger']}{guard}--> {dest}"


def declared_transition_ids(transitions: Iterable[Mapping[str, Any]]) -> list[str]:
    return [transition_id(spec, source) for spec in transitions for source in sources_of(spec)]


class Coverage:
    """Which declared transitions fired, when a test asks (off by default: zero cost)."""

    fired: set[str] | None = None


@frozen
class CompiledDeclaration:
    """A machine's declaration with its `transitions` Machine and its step tables."""

    name: str
    states: Sequence[Mapping[str, Any]]
    transitions: Sequence[Mapping[str, Any]]
    initial: str
    final_states: frozenset[str]
    transient_states: frozenset[str]
    callbacks: Mapping[str, Callable[..., Any]]
    event_class_by_trigger: Mapping[str, type]
    machine: Machine
    steps: Mapping[tuple[str, str], Sequence[Step]]
    fast_path: Mapping[str, Mapping[type, Handler]]
    fast_path_ids: Mapping[tuple[str, type], str]


def compile_declaration(
    name: str,
    *,
    states: Sequence[Mapping[str, Any]],
    transitions: Sequence[Mapping[str, Any]],
    initial: str,
    transient_states: Iterable[str],
    callbacks: Iterable[Callable[..., Any]],
    event_class_by_trigger: Mapping[str, type],
    fast_event_classes: Iterable[type] = (),
) -> CompiledDeclaration:
    """Compile a declaration. Only events of ``fast_event_classes`` (stream chunks: data, no
    identity to check) may take the fast path."""
    by_name = {fn.__name__: fn for fn in callbacks}
    guard_names = frozenset(c for spec in transitions for c in spec.get("conditions", ()))
    for spec in transitions:
        for callback in (*spec.get("conditions", ()), *spec.get("before", ())):
            if callback not in by_name:
                raise ValueError(f"{name}: {callback!r} is declared but not defined")

    def resolve(callback: str) -> Callable[[Any], Any]:
        fn = by_name[callback]
        if callback in guard_names:

            def guard(event_data: Any) -> Any:
                return fn(event_data.model)

            guard.__name__ = callback
            return guard

        def action(event_data: Any) -> None:
            fn(event_data.model, event_data.args[0] if event_data.args else None)

        action.__name__ = callback
        return action

    def covering(ident: str) -> Callable[[Any], None]:
        def covered(_event_data: Any) -> None:
            if Coverage.fired is not None:
                Coverage.fired.add(ident)

        return covered

    runtime_states = [
        {**state, "on_enter": [resolve(n) for n in state.get("on_enter", ())]} for state in states
    ]
    runtime_transitions = [
        {
            **spec,
            "source": source,
            "conditions": [resolve(n) for n in spec.get("conditions", ())],
            "before": [resolve(n) for n in spec.get("before", ())],
            "after": [covering(transition_id(spec, source))],
        }
        for spec in transitions
        for source in sources_of(spec)
    ]
    machine = Machine(
        model=None,
        states=runtime_states,
        transitions=runtime_transitions,
        initial=initial,
        auto_transitions=False,
        send_event=True,
        ignore_invalid_triggers=False,
    )

    on_enter = {
        state["name"]: tuple(by_name[n] for n in state.get("on_enter", ())) for state in states
    }
    steps: dict[tuple[str, str], list[Step]] = {}
    for spec in transitions:
        conditions = spec.get("conditions", ())
        before = spec.get("before", ())
        dest = spec["dest"]
        for source in sources_of(spec):
            steps.setdefault((source, spec["trigger"]), []).append(
                (
                    by_name[conditions[0]] if conditions else None,
                    by_name[before[0]] if before else None,
                    dest,
                    on_enter.get(dest, ()) if dest is not None else (),
                    transition_id(spec, source),
                )
            )
    fast_path: dict[str, dict[type, Handler]] = {}
    fast_path_ids: dict[tuple[str, type], str] = {}
    fast_classes = frozenset(fast_event_classes)
    for (source, trigger), options in steps.items():
        guard, action, dest, _enter, ident = options[0]
        event_class = event_class_by_trigger.get(trigger)
        unguarded_internal = guard is None and dest is None
        fast = event_class is not None and event_class in fast_classes
        if len(options) == 1 and unguarded_internal and action is not None and fast:
            assert event_class is not None
            fast_path.setdefault(source, {})[event_class] = action
            fast_path_ids[(source, event_class)] = ident
    return CompiledDeclaration(
        name=name,
        states=states,
        transitions=transitions,
        initial=initial,
        final_states=frozenset(s["name"] for s in states if s.get("final")),
        transient_states=frozenset(transient_states),
        callbacks=by_name,
        event_class_by_trigger=event_class_by_trigger,
        machine=machine,
        steps=steps,
        fast_path=fast_path,
        fast_path_ids=fast_path_ids,
    )


# --------------------------------------------------------------------------- event shapes
Accepts = Callable[[Any], bool]


@frozen
class FieldCheck:
    """What one event field accepts: an instance of ``classes`` (the quick check, enough for
    most fields) that ``refine``, when set, also accepts."""

    name: str
    classes: tuple[type, ...]
    refine: Accepts | None
    described: str

    def accepts(self, value: object) -> bool:
        return isinstance(value, self.classes) and (self.refine is None or self.refine(value))


def _not_bool(value: int) -> bool:
    return type(value) is not bool


def _finite(value: float) -> bool:
    # a clock time or a delay: NaN compares false with everything, so it is no time at all
    return type(value) is not bool and math.isfinite(value)


def _field_check(name: str, hint: Any) -> FieldCheck | None:
    """The check of a field declared ``hint`` (``None``: it accepts anything)."""
    if hint is Any:
        return None
    if hint is None or hint is type(None):
        return FieldCheck(name, (type(None),), None, "None")
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        options = [_field_check(name, arg) for arg in typing.get_args(hint)]
        members = [option for option in options if option is not None]
        if len(members) < len(options):
            return None
        classes = tuple(cls for member in members for cls in member.classes)
        refine: Accepts | None = None
        if any(member.refine is not None for member in members):

            def refine(value: object) -> bool:
                return any(member.accepts(value) for member in members)

        return FieldCheck(name, classes, refine, " or ".join(m.described for m in members))
    if hint is bool:
        return FieldCheck(name, (bool,), None, "a bool")
    if hint is int:
        return FieldCheck(name, (int,), _not_bool, "an int")
    if hint is float:
        return FieldCheck(name, (int, float), _finite, "a finite number")
    if origin is not None and isinstance(origin, type) and issubclass(origin, Mapping):
        keys, items = (_field_check(name, arg) for arg in typing.get_args(hint))

        def entries(value: Mapping[Any, Any]) -> bool:
            return all(
                (keys is None or keys.accepts(key)) and (items is None or items.accepts(item))
                for key, item in value.items()
            )

        key_type = keys.described if keys is not None else "anything"
        item_type = items.described if items is not None else "anything"
        return FieldCheck(name, (Mapping,), entries, f"a mapping of {key_type} to {item_type}")
    if origin is tuple:
        return FieldCheck(name, (tuple,), None, "a tuple")
    if isinstance(hint, type):
        return FieldCheck(name, (hint,), None, f"a {hint.__name__}")
    raise TypeError(f"an event field of type {hint!r} cannot be checked")


def event_shapes(
    event_classes: Iterable[type], *, read_as: Mapping[tuple[type, str], Any] | None = None
) -> dict[type, tuple[FieldCheck, ...]]:
    """Per event class, a check of each field against its declared type, or against the
    type the machine reads it as (``read_as``: an event field declared ``Any`` that one
    machine reads as a result, say). Built once, when the machine module is imported.

    Events are built by shells and providers without checks of their own (they are made on
    the hot path), so a machine checks the fields it reads before it takes the event.
    """
    read_as = read_as or {}
    shapes: dict[type, tuple[FieldCheck, ...]] = {}
    for cls in event_classes:
        hints = typing.get_type_hints(cls)
        checks = (
            _field_check(f.name, read_as.get((cls, f.name), hints[f.name]))
            for f in attrs.fields(cls)
        )
        shapes[cls] = tuple(check for check in checks if check is not None)
    return shapes


def malformation(shapes: Mapping[type, tuple[FieldCheck, ...]], event: object) -> str | None:
    """What is wrong with ``event``'s fields, or ``None``. The message names the field and
    the type it got, never a value (a shell's mistake may carry an API key)."""
    for check in shapes.get(type(event), ()):
        value = getattr(event, check.name)
        if not isinstance(value, check.classes) or (
            check.refine is not None and not check.refine(value)
        ):
            got = repr(value) if isinstance(value, float) else type(value).__name__
            return f"{check.name} must be {check.described}, got {got}"
    return None


class Stateful(Protocol):
    state: str
    effects: list[Any]
    trace: list[TraceStep]
    current_event: Any


ModelT = TypeVar("ModelT", bound=Stateful)
_NO_HANDLERS: dict[type, Handler] = {}


def _recording(handler: Handler, coverage: set[str], ident: str) -> Handler:
    def recording(model: Any, event: Any) -> None:
        coverage.add(ident)
        handler(model, event)

    return recording


class StepRunner(Generic[ModelT]):
    """Runs a compiled declaration over one model: real triggers, decision points
    (transient states advance at once), the trace, and transition coverage."""

    __slots__ = ("coverage", "declaration", "fast", "on_step", "reference")

    def __init__(
        self,
        declaration: CompiledDeclaration,
        *,
        reference: bool = False,
        on_step: Callable[[TraceStep], None] | None = None,
    ) -> None:
        self.declaration = declaration
        self.reference = reference
        self.on_step = on_step
        self.coverage = Coverage.fired
        # one dict for the whole run, refilled on every state change, so that the stream
        # reader can hold it: the chunk handlers of the current state
        self.fast: dict[type, Handler] = {}

    def fire(self, model: ModelT, trigger: str, event: object) -> None:
        """Take ``trigger`` and then every decision point it leads to."""
        declaration = self.declaration
        before = model.state
        model.current_event = event
        if self.reference:
            events = declaration.machine.events
            try:
                fired = bool(events[trigger].trigger(model, event)) if trigger in events else False
            except MachineError:
                fired = False
        else:
            fired = self.take_step(model, trigger, event)
        if not fired:
            model.current_event = None  # a refused event leaves no trace on the model
            raise InvalidEvent(declaration.name, before, event)
        self.record(model, TraceStep(before, trigger, model.state))
        transient = declaration.transient_states
        while model.state in transient:
            source = model.state
            if self.reference:
                advanced = bool(declaration.machine.events["advance"].trigger(model, None))
            else:
                advanced = self.take_step(model, "advance", None)
            if not advanced:
                raise InvalidEvent(declaration.name, source, "advance", "no guard matched")
            self.record(model, TraceStep(source, "advance", model.state))
        model.current_event = None
        fast = self.fast
        fast.clear()
        fast.update(self.fast_handlers(model.state))

    def take_step(self, model: ModelT, trigger: str, event: object) -> bool:
        """One compiled step: the first declared transition whose guard holds."""
        options = self.declaration.steps.get((model.state, trigger))
        if options is None:
            return False
        for guard, action, dest, on_enter, ident in options:
            if guard is None or guard(model):
                if action is not None:
                    action(model, event)
                if dest is not None:
                    model.state = dest
                    for enter in on_enter:
                        enter(model, event)
                if self.coverage is not None:
                    self.coverage.add(ident)
                return True
        return False

    def fast_handlers(self, state: str) -> Mapping[type, Handler]:
        if self.reference:
            return _NO_HANDLERS
        handlers = self.declaration.fast_path.get(state, _NO_HANDLERS)
        coverage = self.coverage
        if coverage is None or not handlers:
            return handlers
        # only when a test measures coverage: wrap the handlers to record what fired
        ids = self.declaration.fast_path_ids
        return {
            event_class: _recording(handler, coverage, ids[(state, event_class)])
            for event_class, handler in handlers.items()
        }

    def record(self, model: ModelT, step: TraceStep) -> None:
        model.trace.append(step)
        if self.on_step is not None:
            self.on_step(step)


class DeclaredMachine(Generic[ModelT]):
    """What both machines share: the model a run drives, its result, and the public
    surface (``state``, ``is_finished``, ``result``, ``trace``)."""

    __slots__ = ("_model", "_result", "_runner")
    name = "machine"

    def __init__(
        self,
        declaration: CompiledDeclaration,
        *,
        reference: bool = False,
        on_step: Callable[[TraceStep], None] | None = None,
    ) -> None:
        self._runner: StepRunner[ModelT] = StepRunner(
            declaration, reference=reference, on_step=on_step
        )
        self._model: ModelT | None = None
        self._result: GenerationTurnResult | None = None

    @property
    def state(self) -> str:
        return self._model.state if self._model is not None else "ready"

    @property
    def is_finished(self) -> bool:
        return self._result is not None

    @property
    def result(self) -> GenerationTurnResult:
        if self._result is None:
            raise RuntimeError(f"the turn has not finished (state {self.state!r})")
        return self._result

    @property
    def trace(self) -> tuple[TraceStep, ...]:
        return tuple(self._model.trace) if self._model is not None else ()

    def _build_result(self, model: ModelT) -> GenerationTurnResult:
        raise NotImplementedError

    def _fire(self, trigger: str, event: object) -> list[Any]:
        """Take a trigger; collect its effects, and the `Finish` once a final state is
        reached."""
        model = self._model
        assert model is not None
        if self._result is not None:
            raise InvalidEvent(self.name, model.state, event, "the turn has finished")
        self._runner.fire(model, trigger, event)
        effects = model.effects
        model.effects = []
        if model.state in self._runner.declaration.final_states:
            self._result = self._build_result(model)
            effects.append(Finish(self._result))
        return effects
