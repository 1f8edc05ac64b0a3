"""How a declared machine runs: the declaration compiled into step tables, the runner that takes
steps from them, and what both machines share around it (`DeclaredMachine`).

Why compile: `transitions` interprets a declaration generically; measured on this project's
machines one trigger costs 18–32 µs, more than a whole streamed chunk may cost. The compiled
tables take exactly the steps `transitions` takes — guards in declared order, then the ending
the transition declares, its action, the state change and the entry callbacks — and
`toolloop_fsm.reference.ReferenceRunner` runs the same declaration on `transitions` itself (a
property test checks both agree):

- ``steps``: (state, trigger) → the declared transitions from that state, in declared order;
- ``fast_path``: per state, the internal transitions without a guard that are the only taker
  of a stream chunk's trigger there: event class → action;
- ``plain``: (state, trigger) → the one internal transition without a guard or an ending
  that takes it there (a delivery confirmed mid-stream, say): its action and id. Such a step
  is taken without the general loop: no guard to try, no state entered, no decision point to
  advance through, and the state's chunk handlers stay as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from functools import cache
from typing import Any
from typing import Generic
from typing import Self

from attrs import frozen

from toolloop_fsm.declaration import Action
from toolloop_fsm.declaration import Ending
from toolloop_fsm.declaration import Guard
from toolloop_fsm.declaration import MachineDeclaration
from toolloop_fsm.effects import Finish
from toolloop_fsm.errors import InvalidEvent
from toolloop_fsm.fork import forked
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.result import TraceStep
from toolloop_fsm.stepping import NO_HANDLERS
from toolloop_fsm.stepping import ModelT
from toolloop_fsm.stepping import Runner
from toolloop_fsm.stepping import Taken

#: One compiled step: guard, ending, action, destination (``None``: internal), the
#: destination's entry callbacks, the guard's name and the transition's id.
Step = tuple[
    Guard | None, Ending | None, Action | None, str | None, tuple[Action, ...], str | None, str
]
_NO_STEPS: dict[str, tuple[Any, ...]] = {}


@frozen
class StepTables:
    """A declaration compiled for the runner."""

    steps: Mapping[tuple[str, str], tuple[Step, ...]]
    fast_path: Mapping[str, Mapping[type, Action]]
    fast_path_ids: Mapping[tuple[str, type], str]
    plain: Mapping[tuple[str, str], tuple[Action, str]]
    #: ``steps`` by state, then trigger: what `CompiledRunner.fire` looks up (no key to build)
    by_state: Mapping[str, Mapping[str, tuple[Step, ...]]]


@cache
def compile_steps(declaration: MachineDeclaration) -> StepTables:
    """The step tables of ``declaration`` (built once per declaration)."""
    on_enter = {state.name: state.on_enter for state in declaration.states}
    steps: dict[tuple[str, str], list[Step]] = {}
    for edge in declaration.edges():
        t = edge.transition
        entered = on_enter[t.dest] if t.dest is not None else ()
        steps.setdefault((edge.source, t.trigger), []).append(
            (t.when, t.ends, t.do, t.dest, entered, t.guard_name, edge.ident)
        )
    fast_path: dict[str, dict[type, Action]] = {}
    fast_path_ids: dict[tuple[str, type], str] = {}
    plain_steps: dict[tuple[str, str], tuple[Action, str]] = {}
    chunk_class = {trigger: cls for cls, trigger in declaration.chunks.items()}
    for (source, trigger), options in steps.items():
        guard, ending, action, dest, _enter, _guard_name, ident = options[0]
        event_class = chunk_class.get(trigger)
        plain = guard is None and ending is None and dest is None and action is not None
        if not (len(options) == 1 and plain):
            continue
        assert action is not None
        if event_class is not None:
            fast_path.setdefault(source, {})[event_class] = action
            fast_path_ids[(source, event_class)] = ident
        if source not in declaration.transient_states:
            plain_steps[(source, trigger)] = (action, ident)
    by_state: dict[str, dict[str, tuple[Step, ...]]] = {}
    for (source, trigger), options in steps.items():
        by_state.setdefault(source, {})[trigger] = tuple(options)
    return StepTables(
        steps={key: tuple(options) for key, options in steps.items()},
        fast_path=fast_path,
        fast_path_ids=fast_path_ids,
        plain=plain_steps,
        by_state=by_state,
    )


def _recording(handler: Action, coverage: set[str], ident: str) -> Action:
    def recording(model: Any, event: Any) -> None:
        coverage.add(ident)
        handler(model, event)

    return recording


class CompiledRunner(Runner[ModelT]):
    """Takes steps from the compiled tables, and hands stream chunks the fast path."""

    __slots__ = ("by_state", "last_plain", "plain", "tables")

    def __init__(
        self, declaration: MachineDeclaration, *, on_step: Callable[[TraceStep], None] | None
    ) -> None:
        super().__init__(declaration, on_step=on_step)
        self.tables = compile_steps(declaration)
        self.plain = self.tables.plain
        self.by_state = self.tables.by_state
        #: the last step a plain transition recorded: an equal next one (same state,
        #: trigger and time) shares it
        self.last_plain: TraceStep | None = None

    def take_plain(self, model: ModelT, state: str, trigger: str, event: object) -> bool:
        plain = self.plain.get((state, trigger))
        if plain is None:
            return False
        action, ident = plain
        model.current_event = event
        action(model, event)
        model.current_event = None
        at = model.step_time
        step = self.last_plain
        if step is None or step.at != at or step.event != trigger or step.state != state:
            step = self.last_plain = TraceStep(state, trigger, state, at=at)
        self.record(model, step, ident)
        return True

    def take(self, model: ModelT, trigger: str, event: object) -> Taken | None:
        return _take(model, self.by_state.get(model.state, _NO_STEPS).get(trigger), event)

    def fast_handlers(self, state: str) -> Mapping[type, Action]:
        handlers = self.tables.fast_path.get(state, NO_HANDLERS)
        coverage = self.coverage
        if coverage is None or not handlers:
            return handlers
        # only when a test measures coverage: wrap the handlers to record what fired
        ids = self.tables.fast_path_ids
        return {
            event_class: _recording(handler, coverage, ids[(state, event_class)])
            for event_class, handler in handlers.items()
        }


def _take(model: Any, options: tuple[Step, ...] | None, event: object) -> Taken | None:
    """The first of ``options`` whose guard holds, taken: its ending decided, its action,
    the state change and the entry callbacks; ``None`` when no guard holds."""
    if options is None:
        return None
    for guard, ending, action, dest, on_enter, guard_name, ident in options:
        if guard is None or guard(model):
            if ending is not None:
                ending.decide(model)
            if action is not None:
                action(model, event)
            if dest is not None:
                model.state = dest
                for enter in on_enter:
                    enter(model, event)
            return guard_name, ident
    return None


class DeclaredMachine(Generic[ModelT]):
    """What both machines share: the model a run drives, its runner, its result, and the
    public surface (``state``, ``is_finished``, ``result``, ``trace``).

    ``reference=True`` runs every step on `transitions` (`ReferenceRunner`: slower, for
    debugging a turn on the library the declaration is written for); the compiled runner must
    agree with it.
    """

    __slots__ = ("_model", "_result", "_runner")
    name = "machine"

    def __init__(
        self,
        declaration: MachineDeclaration,
        *,
        reference: bool = False,
        on_step: Callable[[TraceStep], None] | None = None,
    ) -> None:
        self._runner: Runner[ModelT]
        if reference:
            from toolloop_fsm.reference import ReferenceRunner

            self._runner = ReferenceRunner(declaration, on_step=on_step)
        else:
            self._runner = CompiledRunner(declaration, on_step=on_step)
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

    def fork(self) -> Self:
        """A machine that goes on from where this one stands, on its own: a copy of the run
        state (`toolloop_fsm.fork`), sharing the configuration and the compiled tables, and
        the ``on_step`` observer. Feeding one never changes the other."""
        twin = self._fresh()
        model = self._model
        if model is not None:
            twin._model = forked(model)
            twin._runner.fast.update(twin._runner.fast_handlers(model.state))
        twin._result = self._result
        return twin

    def _started(self) -> ModelT:
        """The run state of a started machine (there is none before `start` or `resume`)."""
        if self._model is None:
            raise RuntimeError("the machine has not been started")
        return self._model

    def _refuse_restart(self, trigger: str) -> None:
        """A machine runs one turn: ``start`` and ``resume`` are refused once it has begun."""
        if self._model is not None:
            raise InvalidEvent(
                self.name, self.state, None, "the machine was already started", trigger=trigger
            )

    def _fresh(self) -> Self:
        """A new machine of the same configuration, not started (what `fork` fills)."""
        raise NotImplementedError

    def _build_result(self, model: ModelT) -> GenerationTurnResult:
        raise NotImplementedError

    def _fire(self, trigger: str, event: object, now: float | None = None) -> list[Any]:
        """Take a trigger at ``now`` (the driver's clock time, stamped on its trace steps);
        collect its effects, and the `Finish` once a final state is reached."""
        model = self._model
        assert model is not None
        if self._result is not None:
            named = trigger if event is None else None  # start and resume carry no event
            raise InvalidEvent(
                self.name, model.state, event, "the turn has finished", trigger=named
            )
        previous = model.step_time
        model.step_time = now
        try:
            self._runner.fire(model, trigger, event)
        except InvalidEvent:
            model.step_time = previous  # a refused event changes nothing
            raise
        effects = model.effects
        model.effects = []
        if model.state in self._runner.declaration.final_states:
            self._result = self._build_result(model)
            effects.append(Finish(self._result))
        return effects
