"""`ReferenceRunner`: a machine's declaration run on `transitions` itself.

The library's machines are declared for `transitions`; the compiled runner
(`toolloop_fsm.runner.CompiledRunner`) exists only because a generic trigger costs more than a
streamed chunk may. This runner builds the `transitions` `Machine` from the same declaration —
each guard a condition, the declared ending and the action ``before`` callbacks (in that
order), the entry callbacks ``on_enter`` — and fires every event, stream chunks included,
through `transitions`' own trigger. A host can run a turn on it to debug
(``ToolLoopMachine(reference=True)``); a property test requires that both runners produce the
same effects, trace and result.

The `transitions` machine is built on first use, once per declaration, and shared: it holds no
run's state (``model=None``; each trigger names the run's state as its model).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

from transitions import Machine
from transitions import MachineError

from toolloop_fsm.declaration import Action
from toolloop_fsm.declaration import Ending
from toolloop_fsm.declaration import Guard
from toolloop_fsm.declaration import MachineDeclaration
from toolloop_fsm.result import TraceStep
from toolloop_fsm.stepping import ModelT
from toolloop_fsm.stepping import Runner
from toolloop_fsm.stepping import Taken

_TAKEN = "taken"  # the keyword each trigger carries: where the taken transition is reported


def _condition(guard: Guard) -> Callable[[Any], bool]:
    def condition(event_data: Any) -> bool:
        return bool(guard(event_data.model))

    condition.__name__ = guard.__name__
    return condition


def _callback(action: Action) -> Callable[[Any], None]:
    def callback(event_data: Any) -> None:
        action(event_data.model, event_data.args[0] if event_data.args else None)

    callback.__name__ = action.__name__
    return callback


def _deciding(ending: Ending) -> Callable[[Any], None]:
    def decide(event_data: Any) -> None:
        ending.decide(event_data.model)

    return decide


def _reporting(taken: Taken) -> Callable[[Any], None]:
    def report(event_data: Any) -> None:
        event_data.kwargs[_TAKEN].append(taken)

    return report


@cache
def transitions_machine(declaration: MachineDeclaration) -> Machine:
    """The `transitions` machine of ``declaration`` (built once)."""
    states = [
        {
            "name": state.name,
            "final": state.final,
            "on_enter": [_callback(callback) for callback in state.on_enter],
        }
        for state in declaration.states
    ]
    transitions = []
    for edge in declaration.edges():
        t = edge.transition
        before = [_deciding(t.ends)] if t.ends is not None else []
        if t.do is not None:
            before.append(_callback(t.do))
        transitions.append(
            {
                "trigger": t.trigger,
                "source": edge.source,
                "dest": t.dest,
                "conditions": [_condition(t.when)] if t.when is not None else [],
                "before": before,
                "after": [_reporting((t.guard_name, edge.ident))],
            }
        )
    return Machine(
        model=None,
        states=states,
        transitions=transitions,
        initial=declaration.initial,
        auto_transitions=False,
        send_event=True,
        ignore_invalid_triggers=False,
    )


class ReferenceRunner(Runner[ModelT]):
    """Takes every step through `transitions`' trigger; no chunk skips it."""

    __slots__ = ("machine",)

    def __init__(
        self, declaration: MachineDeclaration, *, on_step: Callable[[TraceStep], None] | None
    ) -> None:
        super().__init__(declaration, on_step=on_step)
        self.machine = transitions_machine(declaration)

    def take(self, model: ModelT, trigger: str, event: object) -> Taken | None:
        events = self.machine.events
        if trigger not in events:
            return None
        taken: list[Taken] = []
        try:
            events[trigger].trigger(model, event, **{_TAKEN: taken})
        except MachineError:
            return None  # the state declares no transition of this trigger
        return taken[0] if taken else None
