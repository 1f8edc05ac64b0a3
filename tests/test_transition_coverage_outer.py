"""Transition coverage of the outer tier: the chain workload fires every declared transition
of `GenerationTurnMachine`.

The bodies the outer property tests run — whole generation turns through
`run_generation_turn` drawn from `generation_chains()`, and the sans-IO machine driven with
synthetic attempt results — are run over a fixed, deterministic sample (the ci profile
derandomizes Hypothesis) plus explicit examples for the paths a random chain reaches
rarely, with the coverage switch on. Every id of `declared_transition_ids(TRANSITIONS)`
must fire; a failure lists the ones that did not.

The explicit examples reach, through the real pump: no usable credentials at the start
(every key cooling or retired in the key book), an unreachable report while an attempt
runs, a channel that finds the destination gone, a host failure (the provider factory
raises), the shared route admitted and refused, a stop while the turn waits to ask the
admission policy, and an unreachable report while the admission policy deliberates.

Invariants are not checked here (tests/test_properties_outer.py does that), so a known
invariant bug cannot hide a coverage regression and vice versa.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import attrs
from hypothesis import example
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from tests.test_properties_outer import drive_generation_machine
from toolloop_fsm import Attempt
from toolloop_fsm import FunctionCall
from toolloop_fsm import Tool
from toolloop_fsm import ToolResult
from toolloop_fsm import TurnStatus
from toolloop_fsm import generation
from toolloop_fsm import run_generation_turn
from toolloop_fsm.attempts import AttemptPlan
from toolloop_fsm.declaration import declared_transition_ids
from toolloop_fsm.host import TurnRequest
from toolloop_fsm.policy import Budget
from toolloop_fsm.policy import LoopPolicy
from toolloop_fsm.policy import TurnPolicy
from toolloop_fsm.snapshot_capture import capture_chain
from toolloop_fsm.stepping import Coverage
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import ScriptedProvider
from toolloop_fsm.testing.chains import AttemptScript
from toolloop_fsm.testing.chains import ChainScript
from toolloop_fsm.testing.chains import ChainSignal
from toolloop_fsm.testing.chains import Ending
from toolloop_fsm.testing.chains import ErrorKind
from toolloop_fsm.testing.chains import KeyScript
from toolloop_fsm.testing.chains import KeyState
from toolloop_fsm.testing.chains import ModelScript
from toolloop_fsm.testing.chains import SharedRouteScript
from toolloop_fsm.testing.chains import generation_chains
from toolloop_fsm.testing.chains import run_chain

#: Chains through the pump. Measured: 300 random chains fire 22 of the 25 transitions; the
#: misses are no usable credentials at the start and a stop while admitting (the explicit
#: examples below) and the sans-IO-only transition (the machine workload).
CHAIN_EXAMPLES = 300
#: Sans-IO drives. Measured: 200 fire 24 of 25 (all but the judgement of an attempt whose
#: channel found the destination gone, which the chains fire).
MACHINE_EXAMPLES = 200

_POLICY = TurnPolicy(
    loop=LoopPolicy(
        delivery_flush_chars=1, inactivity_timeout=2.0, first_token_timeout=3.0, tool_timeout=5.0
    )
)
_FAILS = AttemptScript(Ending.FAIL, "", error=ErrorKind.SERVER)
_ANSWERS = AttemptScript(Ending.SUCCESS, "Hello.")
_SLOW = AttemptScript(Ending.SUCCESS, "Hello there", pause=1.0)


def _key(n: int) -> str:
    return f"sk-test-c0e7a9e{n:017x}"


def _shared(admit: bool, delay: float = 0.0) -> SharedRouteScript:
    return SharedRouteScript((ModelScript("s0", keyless=_ANSWERS),), admit=admit, delay=delay)


#: No usable credentials at the start: every key cooling or retired in the key book.
ALL_KEYS_COOLING = ChainScript(
    models=(
        ModelScript(
            "m0",
            keys=(
                KeyScript(_key(0), state=KeyState.COOLING),
                KeyScript(_key(1), state=KeyState.RETIRED),
            ),
        ),
        ModelScript("m1", keys=(KeyScript(_key(2), state=KeyState.COOLING),)),
    ),
    policy=_POLICY,
)
#: The host reports the destination unreachable while the first attempt streams.
UNREACHABLE_WHILE_ATTEMPTING = ChainScript(
    models=(ModelScript("m0", keyless=_SLOW), ModelScript("m1", keyless=_ANSWERS)),
    policy=_POLICY,
    signals=(ChainSignal(0.5, "unreachable"),),
)
#: The channel raises `DestinationUnreachable` (judged from the attempt's result).
CHANNEL_FINDS_DESTINATION_GONE = ChainScript(
    models=(ModelScript("m0", keyless=_ANSWERS), ModelScript("m1", keyless=_ANSWERS)),
    policy=_POLICY,
    broken_delivery=(0, "unreachable"),
)
#: The host's provider factory raises: a host failure, no fallback.
FACTORY_RAISES = ChainScript(
    models=(
        ModelScript("m0", keys=(KeyScript(_key(3), factory_raises=True), KeyScript(_key(4)))),
        ModelScript("m1", keyless=_ANSWERS),
    ),
    policy=_POLICY,
)
#: Key rotation, then the next model, then the shared route admitted.
ROTATE_ADVANCE_ADMIT = ChainScript(
    models=(
        ModelScript("m0", keys=(KeyScript(_key(5), _FAILS), KeyScript(_key(6), _FAILS))),
        ModelScript("m1", keyless=_FAILS),
    ),
    policy=_POLICY,
    shared=_shared(admit=True),
)
#: The shared route refused.
SHARED_ROUTE_REFUSED = ChainScript(
    models=(ModelScript("m0", keyless=_FAILS),), policy=_POLICY, shared=_shared(admit=False)
)
#: A stop that arrives while the host marks the superseded attempt, before admission is asked.
STOP_WHILE_ADMITTING = ChainScript(
    models=(ModelScript("m0", keyless=_FAILS),),
    policy=_POLICY,
    shared=_shared(admit=True),
    signals=(ChainSignal(0.5, "stop", "sorry, stopping"),),
    supersede_delay=1.0,
)
#: The destination is reported unreachable while a slow admission policy deliberates.
UNREACHABLE_WHILE_ADMITTING = ChainScript(
    models=(ModelScript("m0", keyless=_FAILS),),
    policy=_POLICY,
    shared=_shared(admit=False, delay=1.0),
    signals=(ChainSignal(0.5, "unreachable"),),
)
#: The first model's reply runs past the attempt's output budget: final, no fallback.
BUDGET_REACHED = ChainScript(
    models=(ModelScript("m0", keyless=_ANSWERS), ModelScript("m1", keyless=_ANSWERS)),
    policy=attrs.evolve(_POLICY, loop=attrs.evolve(_POLICY.loop, budget=Budget(output_tokens=1))),
)
RARE_PATHS = (
    BUDGET_REACHED,
    UNREACHABLE_WHILE_ADMITTING,
    ALL_KEYS_COOLING,
    UNREACHABLE_WHILE_ATTEMPTING,
    CHANNEL_FINDS_DESTINATION_GONE,
    FACTORY_RAISES,
    ROTATE_ADVANCE_ADMIT,
    SHARED_ROUTE_REFUSED,
    STOP_WHILE_ADMITTING,
)


def _chain_workload() -> None:
    @settings(max_examples=CHAIN_EXAMPLES)
    @given(script=generation_chains())
    def workload(script: ChainScript) -> None:
        asyncio.run(run_chain(script))

    for script in RARE_PATHS:
        workload = example(script=script)(workload)
    workload()


@settings(max_examples=MACHINE_EXAMPLES)
@given(data=st.data())
def _machine_workload(data: st.DataObject) -> None:
    drive_generation_machine(data)


def _resume_workload() -> None:
    """Durable turns: a fresh machine resumes a snapshot's turn (``ready --resume-->``)."""
    plans = [AttemptPlan("only")]
    request = TurnRequest([{"role": "user", "content": "hi"}])
    machine = generation.GenerationTurnMachine(plans=plans)
    machine.start(request)
    resumed = generation.GenerationTurnMachine(plans=plans)
    effects = resumed.resume(capture_chain(machine.generation))
    assert [type(e).__name__ for e in effects] == ["StartAttempt"]


def _approval_workload() -> None:
    """A generation turn pausing for approval (docs/behaviour.md §3.13) with its attempt."""

    async def pay(_arguments: dict[str, object], _ctx: object) -> ToolResult:
        raise AssertionError("a call that waits for approval does not run")

    tools = [Tool("pay", "pay", {"type": "object"}, pay, needs_approval=True)]
    provider = ScriptedProvider([[FunctionCall("pay", {"amount": 5})]])
    result = asyncio.run(
        run_generation_turn(
            [Attempt(provider, label="only")],
            tools,
            RecordingChannel(),
            TurnRequest([{"role": "user", "content": "pay"}]),
        )
    )
    assert result.status is TurnStatus.AWAITING_APPROVAL


def _fired_by(*workloads: Callable[[], object]) -> set[str]:
    """Run the workloads with the coverage switch on (machines read it when built)."""
    fired: set[str] = set()
    Coverage.fired = fired
    try:
        for workload in workloads:
            workload()
    finally:
        Coverage.fired = None
    return fired


def test_the_outer_property_workload_fires_every_declared_transition() -> None:
    fired = _fired_by(_chain_workload, _machine_workload, _resume_workload, _approval_workload)
    declared = declared_transition_ids(generation.TRANSITIONS)
    missing = [ident for ident in declared if ident not in fired]
    assert not missing, (
        f"{len(missing)} of {len(declared)} declared outer transitions never fired:\n  "
        + "\n  ".join(missing)
    )


def test_each_rare_path_example_takes_the_transition_it_is_named_for() -> None:
    """The explicit examples are not decoration: each reaches its path through the pump."""
    expected: dict[str, tuple[ChainScript, str]] = {
        "all keys cooling": (
            ALL_KEYS_COOLING,
            "planning --advance[no_attempt_available]--> finishing",
        ),
        "unreachable while attempting": (
            UNREACHABLE_WHILE_ATTEMPTING,
            "attempting --destination_unreachable--> finishing",
        ),
        "channel finds the destination gone": (
            CHANNEL_FINDS_DESTINATION_GONE,
            "judging_attempt --advance[destination_unreachable]--> finishing",
        ),
        "factory raises": (
            FACTORY_RAISES,
            "judging_attempt --advance[attempt_failed_in_host_code]--> finishing",
        ),
        "rotate, advance, admit": (
            ROTATE_ADVANCE_ADMIT,
            "admitting_shared_route --admission_decided[admission_granted]--> advancing_model",
        ),
        "shared route refused": (
            SHARED_ROUTE_REFUSED,
            "admitting_shared_route --admission_decided--> finishing",
        ),
        "stop while admitting": (
            STOP_WHILE_ADMITTING,
            "admitting_shared_route --stop_requested--> finishing",
        ),
        "a budget reached": (
            BUDGET_REACHED,
            "judging_attempt --advance[attempt_reached_a_budget]--> finishing",
        ),
    }
    declared = set(declared_transition_ids(generation.TRANSITIONS))
    for name, (script, ident) in expected.items():
        assert ident in declared, f"{ident} is not declared"
        fired = _fired_by(_running(script))
        assert ident in fired, f"{name} did not take {ident}; it fired {sorted(fired & declared)}"


def _running(script: ChainScript) -> Callable[[], object]:
    return lambda: asyncio.run(run_chain(script))


def test_an_unreachable_report_while_admitting_ends_the_turn_skipped() -> None:
    """An unreachable report during a slow admission ends the wait: the policy's answer is
    not awaited and no shared attempt starts."""
    fired = _fired_by(_running(UNREACHABLE_WHILE_ADMITTING))
    assert "admitting_shared_route --destination_unreachable--> finishing" in fired
    assert "admitting_shared_route --admission_decided--> finishing" not in fired
    assert "finishing --advance--> skipped" in fired
