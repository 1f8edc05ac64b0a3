"""The declaration as a value: what it refuses when a machine is declared, how an exit's
declared ending is decided, trace steps that name their guard, and the `transitions`
reference runner loaded only when a run asks for it."""

from __future__ import annotations

import json
import subprocess
import sys

import attrs
import pytest

from toolloop_fsm.declaration import DeclarationError
from toolloop_fsm.declaration import Ending
from toolloop_fsm.declaration import MachineDeclaration
from toolloop_fsm.declaration import State
from toolloop_fsm.declaration import Transition
from toolloop_fsm.events import DeliveryRecorded
from toolloop_fsm.events import StreamEnded
from toolloop_fsm.events import TextDelta
from toolloop_fsm.generation import DECLARATION as OUTER
from toolloop_fsm.host import TurnRequest
from toolloop_fsm.machine import DECLARATION as INNER
from toolloop_fsm.machine import ToolLoopMachine
from toolloop_fsm.reference import transitions_machine
from toolloop_fsm.result import TurnStatus
from toolloop_fsm.result import result_from_json
from toolloop_fsm.result import result_to_json


def _declare(*transitions: Transition, states: tuple[State, ...] | None = None) -> None:
    MachineDeclaration(
        name="Probe",
        title="probe",
        states=states or (State("ready"), State("done", final=True)),
        transitions=transitions,
        initial="ready",
        source_module=__name__,
    )


# --------------------------------------------------------------------------- refused declarations
def test_a_transition_to_an_undeclared_state_is_refused_naming_it() -> None:
    with pytest.raises(DeclarationError, match="Probe declares go to finished \\(undeclared\\)"):
        _declare(Transition("go", "ready", "finished"))


def test_an_ending_whose_terminal_state_is_not_declared_is_refused() -> None:
    with pytest.raises(DeclarationError, match="the ending completed"):
        _declare(Transition("go", "ready", "done", ends=("completed", "end_turn")))


def test_an_ending_with_a_misspelt_status_is_refused_listing_the_statuses() -> None:
    with pytest.raises(DeclarationError, match="names 'complete', not a status \\(completed, "):
        Transition("go", "ready", "done", ends=("complete", None))


def test_the_same_transition_declared_twice_is_refused() -> None:
    with pytest.raises(DeclarationError, match="a transition declared twice"):
        _declare(Transition("go", "ready", "done"), Transition("go", ["ready"], "done"))


def test_an_ending_of_several_statuses_must_say_how_a_run_picks_one() -> None:
    with pytest.raises(DeclarationError, match="reads the one that applies with status_of"):
        Ending((TurnStatus.ERROR, TurnStatus.TIMEOUT))
    with pytest.raises(DeclarationError, match="reads the one that applies with status_of"):
        Ending((TurnStatus.ERROR,), status_of=lambda _run: TurnStatus.ERROR)
    with pytest.raises(DeclarationError, match="fixed or read from the run, not both"):
        Ending((TurnStatus.ERROR,), "fixed", reason_of=lambda _run: "read")


# --------------------------------------------------------------------------- deciding an ending
@attrs.define
class _Run:
    status: TurnStatus | None = None
    reason: str | None = None


def test_a_fixed_ending_records_its_status_and_reason_on_the_run() -> None:
    run = _Run()
    Ending(("stopped_by_user",), "stopped_during_tool").decide(run)
    assert (run.status, run.reason) == (TurnStatus.STOPPED_BY_USER, "stopped_during_tool")


def test_a_carried_ending_refuses_a_status_it_does_not_name() -> None:
    def attempt_status(_run: object) -> TurnStatus:
        return TurnStatus.COMPLETED

    ending = Ending(("error", "timeout"), "refused", status_of=attempt_status)
    with pytest.raises(DeclarationError, match="attempt_status read the status 'completed'"):
        ending.decide(_Run())


def test_every_exit_of_both_machines_declares_a_terminal_state_they_have() -> None:
    for declaration in (INNER, OUTER):
        finals = set(declaration.final_states)
        endings = [t.ends for t in declaration.transitions if t.ends is not None]
        assert endings
        assert {s.value for ending in endings for s in ending.statuses} <= finals


# --------------------------------------------------------------------------- the trace
def _turn() -> ToolLoopMachine:
    machine = ToolLoopMachine()
    machine.start(TurnRequest(({"role": "user", "content": "hi"},)))
    machine.feed(TextDelta("hello"))
    machine.feed(StreamEnded())
    machine.feed(DeliveryRecorded(0))
    return machine


def test_trace_steps_name_the_guard_that_fired_and_old_saved_traces_still_load() -> None:
    result = _turn().result
    guards = [(s.state, s.guard) for s in result.trace if s.guard is not None]
    assert guards == [
        ("ending_pass", "pass_has_text"),
        ("building_result", "must_settle_deliveries"),
        ("settling", "all_deliveries_recorded"),
        ("building_result", "outcome_is_completed"),
    ]
    text = result_to_json(result)
    assert result_from_json(text) == result
    # a result saved before steps named their guard
    data = json.loads(text)
    for step in data["trace"]:
        del step["guard"]
    old = result_from_json(json.dumps(data))
    assert [s.guard for s in old.trace] == [None] * len(result.trace)
    assert [(s.state, s.event, s.next_state) for s in old.trace] == [
        (s.state, s.event, s.next_state) for s in result.trace
    ]


# --------------------------------------------------------------------------- the reference runner
def test_importing_the_library_does_not_load_transitions() -> None:
    probe = "import sys, toolloop_fsm; print('transitions' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_a_reference_run_takes_the_same_steps_on_transitions_built_once() -> None:
    reference = ToolLoopMachine(reference=True)
    reference.start(TurnRequest(({"role": "user", "content": "hi"},)))
    for event in (TextDelta("hello"), StreamEnded(), DeliveryRecorded(0)):
        reference.feed(event)
    assert reference.trace == _turn().trace
    assert reference.result == _turn().result
    assert transitions_machine(INNER) is transitions_machine(INNER)
