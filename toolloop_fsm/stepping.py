"""What every runner of a machine declaration shares: a real trigger taken, then every
decision point it leads to (transient states advance at once), the trace, and transition
coverage.

How one step is taken is each runner's own: `toolloop_fsm.runner.CompiledRunner` takes it
from the compiled step tables, `toolloop_fsm.reference.ReferenceRunner` through
`transitions`' trigger. Both build on this module and on nothing of each other, so the
machine that chooses between them (`toolloop_fsm.runner.DeclaredMachine`) sits above both.
"""

from __future__ import annotations

from abc import ABC
from abc import abstractmethod
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any
from typing import Generic
from typing import Protocol
from typing import TypeVar

from toolloop_fsm.declaration import Action
from toolloop_fsm.declaration import MachineDeclaration
from toolloop_fsm.errors import InvalidEvent
from toolloop_fsm.result import TraceStep
from toolloop_fsm.result import TurnStatus

#: What a runner reports of the transition it took: the guard's name and the transition's id.
Taken = tuple[str | None, str]


class Coverage:
    """Which declared transitions fired, when a test asks (off by default: zero cost)."""

    fired: set[str] | None = None


class Stateful(Protocol):
    """What a runner reads and writes on the run's state."""

    state: str
    status: TurnStatus | None
    reason: str | None
    effects: list[Any]
    trace: list[TraceStep]
    current_event: Any
    step_time: float | None


ModelT = TypeVar("ModelT", bound=Stateful)
#: The chunk handlers of a state that has none (shared; never written).
NO_HANDLERS: dict[type, Action] = {}


class Runner(ABC, Generic[ModelT]):
    """Runs a declaration over one model: a real trigger, then every decision point it leads
    to (transient states advance at once), the trace, and transition coverage. How one step is
    taken is the subclass's (`take`)."""

    __slots__ = ("coverage", "declaration", "fast", "on_step")

    def __init__(
        self, declaration: MachineDeclaration, *, on_step: Callable[[TraceStep], None] | None
    ) -> None:
        self.declaration = declaration
        self.on_step = on_step
        self.coverage = Coverage.fired
        # one dict for the whole run, refilled on every state change, so that the stream
        # reader can hold it: the chunk handlers of the current state
        self.fast: dict[type, Action] = {}

    @abstractmethod
    def take(self, model: ModelT, trigger: str, event: object) -> Taken | None:
        """Take the first declared transition of ``trigger`` whose guard holds; ``None``
        when there is none."""

    def fast_handlers(self, state: str) -> Mapping[type, Action]:
        """The chunk handlers of ``state`` that skip `take` (none, unless compiled)."""
        return NO_HANDLERS

    def take_plain(self, model: ModelT, state: str, trigger: str, event: object) -> bool:
        """Take ``trigger`` at once when ``state`` has one plain internal transition for it
        (see `StepTables`), recording its step; ``False`` when it has not (none, unless
        compiled)."""
        return False

    def fire(self, model: ModelT, trigger: str, event: object) -> None:
        """Take ``trigger`` and then every decision point it leads to."""
        # flat, with the recording inlined: a turn takes a few dozen full steps, and the
        # per-step calls were a tenth of a tool round
        before = model.state
        if self.take_plain(model, before, trigger, event):
            return
        model.current_event = event
        taken = self.take(model, trigger, event)
        if taken is None:
            model.current_event = None  # a refused event leaves no trace on the model
            raise InvalidEvent(self.declaration.name, before, event)
        at = model.step_time
        coverage = self.coverage
        on_step = self.on_step
        trace = model.trace
        transient = self.declaration.transient_states
        state = model.state
        step = TraceStep(before, trigger, state, guard=taken[0], at=at)
        while True:
            if coverage is not None:
                coverage.add(taken[1])
            trace.append(step)
            if on_step is not None:
                on_step(step)
            if state not in transient:
                break
            source = state
            taken = self.take(model, "advance", None)
            if taken is None:
                raise InvalidEvent(
                    self.declaration.name, source, None, "no guard matched", trigger="advance"
                )
            state = model.state
            step = TraceStep(source, "advance", state, guard=taken[0], at=at)
        model.current_event = None
        if state != before:  # the handlers depend on the state only
            fast = self.fast
            fast.clear()
            fast.update(self.fast_handlers(state))

    def record(self, model: ModelT, step: TraceStep, ident: str) -> None:
        if self.coverage is not None:
            self.coverage.add(ident)
        model.trace.append(step)
        if self.on_step is not None:
            self.on_step(step)
