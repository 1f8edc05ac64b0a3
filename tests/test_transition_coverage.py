"""Transition coverage: the property-test workload fires every declared transition.

The same bodies the property tests run — whole turns through `run_tool_loop` drawn from
`turn_scripts()` × `loop_policies()`, and the sans-IO `ToolLoopMachine` driven by the
effects simulator — are run over a fixed, deterministic sample (derandomized under every
Hypothesis profile) with the machine's coverage switch on. Every id of
`declared_transition_ids(TRANSITIONS)` must fire at least once; a failure lists the ones
that did not. A transition that no random turn reaches is either a gap in the strategies
(fix them), dead code in the declaration (report it), or a rare path driven explicitly here
(`_rare_paths`), never something to leave uncovered.

Invariants are not checked here (that is tests/test_properties_inner.py's job), so a
known invariant bug cannot hide a coverage regression and vice versa.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_properties_inner import TOOLS, drive_machine, run_turn
from toolloop_fsm.declaration import declared_transition_ids
from toolloop_fsm.effects import ArmDeadline, OfferSnapshot
from toolloop_fsm.events import (
    DeadlineExpired,
    DeadlineKind,
    DeliveryFailed,
    FunctionCall,
    StopRequested,
    StreamEnded,
    TextDelta,
)
from toolloop_fsm.host import TurnRequest
from toolloop_fsm.machine import TRANSITIONS, ToolLoopMachine
from toolloop_fsm.policy import LoopPolicy
from toolloop_fsm.runner import Coverage
from toolloop_fsm.testing import TurnScript, loop_policies, turn_scripts

#: Measured: 400 turns plus 300 driven machines already fire every declared transition;
#: these counts leave a margin of 2.5x and 1.7x (about 15 s together on one core).
PUMP_EXAMPLES = 1000
#: The sans-IO driver reaches orders of events the pump reaches rarely.
MACHINE_EXAMPLES = 500


# derandomize under every profile: coverage is a property of this fixed sample, not of luck
@settings(max_examples=PUMP_EXAMPLES, derandomize=True, database=None)
@given(script=turn_scripts(), policy=loop_policies())
def _pump_workload(script: TurnScript, policy: LoopPolicy) -> None:
    run_turn(script, policy)


@settings(max_examples=MACHINE_EXAMPLES, derandomize=True, database=None)
@given(policy=loop_policies(), data=st.data())
def _machine_workload(policy: LoopPolicy, data: st.DataObject) -> None:
    drive_machine(policy, data, probe=False)


def _rare_paths() -> None:
    """Sans-IO drives of the paths the random workloads reach rarely: a host call that does
    not return while the machine awaits the first token, streams or runs a tool (the channel
    failing by raising is common; by hanging, only while settling), and a stop while a stalled
    stream's deliveries settle."""
    request = TurnRequest([{"role": "user", "content": "hi"}])
    hung = DeliveryFailed(None, "TimeoutError: send_notice", timed_out=True)
    for before in ((), (TextDelta("Hi"),), (FunctionCall("get_weather", {}), StreamEnded())):
        machine = ToolLoopMachine(tools=TOOLS)
        machine.start(request)
        for event in before:
            machine.feed(event)
        machine.feed(hung)
        assert machine.result.reason == "host_timeout"
    machine = ToolLoopMachine(LoopPolicy(delivery_flush_chars=1))
    token = next(e.token for e in machine.start(request) if isinstance(e, ArmDeadline))
    machine.feed(TextDelta("Hello"))  # handed to the channel at once: in flight
    machine.feed(DeadlineExpired(DeadlineKind.INACTIVITY, token))
    assert machine.state == "settling"
    machine.feed(StopRequested())
    assert machine.result.reason == "stopped_while_settling"


def _resume_paths() -> None:
    """Durable turns: a fresh machine resumes a snapshot's turn (``ready --resume-->``)."""
    request = TurnRequest([{"role": "user", "content": "hi"}])
    machine = ToolLoopMachine(snapshots=True)
    offered = [e for e in machine.start(request) if isinstance(e, OfferSnapshot)]
    resumed = ToolLoopMachine()
    resumed.resume(offered[0].snapshot)
    assert resumed.state == "awaiting_first_token"


def test_the_property_workload_fires_every_declared_transition() -> None:
    fired: set[str] = set()
    previous = Coverage.fired
    Coverage.fired = fired
    try:
        _pump_workload()
        _machine_workload()
        _rare_paths()
        _resume_paths()
    finally:
        Coverage.fired = previous
    declared = declared_transition_ids(TRANSITIONS)
    missing = [ident for ident in declared if ident not in fired]
    assert not missing, (
        f"{len(missing)} of {len(declared)} declared transitions never fired:\n  "
        + "\n  ".join(missing)
    )
    undeclared = sorted(fired - set(declared))
    assert not undeclared, f"transitions fired that are not declared: {undeclared}"
