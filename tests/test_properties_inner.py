"""Property tests of the inner tool loop (docs/invariants.md §1–§10).

Three groups:

* any scripted turn under any small policy, run through `run_tool_loop` on a virtual
  clock, reaches exactly one terminal state within its ceilings and keeps every invariant
  (`check_invariants` with every witness) — in the kind world, and in a hostile one whose
  channel, tools, signals and provider misbehave in every way the kit knows, where it also
  ends as the reference model predicts (`check_ending`, invariant 10);
* the sans-IO `ToolLoopMachine`, driven without the pump by random event sequences that are
  legal in its current state (the kit's world model, `toolloop_fsm.testing.world.World`,
  reads the effects: `StartStream` lets chunks come, `RunTool` lets its `ToolFinished`
  come, `ArmDeadline` lets that token expire, `Deliver` lets that delivery be recorded or
  fail), is deterministic, keeps the invariants
  a machine alone can show, and rejects illegal events with `InvalidEvent` naming the state
  and the event — without changing anything;
* the invariant checker itself catches doctored results (it is not vacuous).

Async code runs through `asyncio.run` inside sync `@given` tests (one fresh loop per
example): robust against the pytest-asyncio / Hypothesis interplay. Example counts come from
the Hypothesis profile (tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Sequence
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from toolloop_fsm.effects import Effect
from toolloop_fsm.effects import Finish
from toolloop_fsm.errors import InvalidEvent
from toolloop_fsm.events import ContextRestart
from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import TextDelta
from toolloop_fsm.events import UsageReport
from toolloop_fsm.host import ToolRegistry
from toolloop_fsm.host import TurnRequest
from toolloop_fsm.host import TurnSignals
from toolloop_fsm.machine import CHUNK_TRIGGERS
from toolloop_fsm.machine import ToolLoopMachine
from toolloop_fsm.policy import LoopPolicy
from toolloop_fsm.result import TraceStep
from toolloop_fsm.result import TurnStatus
from toolloop_fsm.testing import PROVIDER_KEYS
from toolloop_fsm.testing import InvariantViolation
from toolloop_fsm.testing import ScriptRun
from toolloop_fsm.testing import TimedSignal
from toolloop_fsm.testing import ToolAction
from toolloop_fsm.testing import ToolBehaviour
from toolloop_fsm.testing import TurnScript
from toolloop_fsm.testing import VirtualClock
from toolloop_fsm.testing import build_tools
from toolloop_fsm.testing import check_ending
from toolloop_fsm.testing import check_invariants
from toolloop_fsm.testing import loop_policies
from toolloop_fsm.testing import run_script
from toolloop_fsm.testing import turn_scripts
from toolloop_fsm.testing.hostile import HANG_GUARD_SECONDS
from toolloop_fsm.testing.seeds import SEED_SIZE
from toolloop_fsm.testing.seeds import tool_batch_case_from_seed
from toolloop_fsm.testing.strategies import _ARGUMENTS
from toolloop_fsm.testing.strategies import KNOWN_TOOLS
from toolloop_fsm.testing.strategies import tool_batches
from toolloop_fsm.testing.world import World
from toolloop_fsm.turn import LedgerEntry
from toolloop_fsm.turn import ToolOutcome
from toolloop_fsm.turn import canonical_call_key
from toolloop_fsm.turn import occurrence_key

FINAL_STATES = frozenset(status.value for status in TurnStatus)


# =========================================================================== the pump
def run_turn(script: TurnScript, policy: LoopPolicy) -> ScriptRun:
    """One simulated turn through `run_tool_loop`, on a fresh event loop."""
    return asyncio.run(run_script(script, policy))


@given(script=turn_scripts(), policy=loop_policies())
def test_any_turn_ends_in_one_terminal_state_within_its_ceilings_and_keeps_the_invariants(
    script: TurnScript, policy: LoopPolicy
) -> None:
    run = run_turn(script, policy)
    result = run.result
    assert result.status in TurnStatus
    assert result.trace[-1].next_state == result.status.value
    assert [s.next_state in FINAL_STATES for s in result.trace].count(True) == 1
    assert result.iterations <= policy.max_function_call_iterations
    assert len(run.provider.requests) <= result.iterations
    emitted = sum(isinstance(c, FunctionCall) for chunks in run.streamed for c in chunks)
    assert len(run.executions) <= result.tool_dispatches <= emitted
    run.check()


@given(script=tool_batches(), policy=loop_policies())
def test_any_turn_of_tool_batches_keeps_every_invariant(
    script: TurnScript, policy: LoopPolicy
) -> None:
    """Batches with mixed outcomes, durations, barriers, parallel limits and signals landing
    mid-batch: no call runs twice by its occurrence, every call of a batch is answered once
    and in order, the dispatches stay within the calls emitted, and the ending is the
    predicted one."""
    run = run_turn(script, policy)
    run.check()
    check_ending(run)


@given(seed=st.binary(min_size=SEED_SIZE, max_size=SEED_SIZE))
def test_any_seed_of_tool_batches_is_a_turn_that_keeps_every_invariant(seed: bytes) -> None:
    """The fuzzer's compact seeds expand to turns of tool batches too (2 to 6 calls a
    batch), and each keeps every invariant and ends as predicted."""
    script, policy = tool_batch_case_from_seed(seed)
    batches = [p for p in script.passes if sum(isinstance(i, FunctionCall) for i in p) > 1]
    assert batches
    run = run_turn(script, policy)
    run.check()
    check_ending(run)


#: Hostile examples under the ci profile: fewer than the kind test's, as each hostile turn
#: costs a little more to run.
HOSTILE_CI_EXAMPLES = 300


def _hostile_examples() -> int:
    """300 under the ci profile; any other profile's own count (5,000 under explore)."""
    profile = os.environ.get("HYPOTHESIS_PROFILE") or "ci"
    return HOSTILE_CI_EXAMPLES if profile == "ci" else (settings.default or settings()).max_examples


@settings(max_examples=_hostile_examples())
@given(script=turn_scripts(hostile=True), policy=loop_policies(hostile=True))
def test_any_turn_with_hostile_hosts_ends_and_keeps_every_invariant(
    script: TurnScript, policy: LoopPolicy
) -> None:
    """Channel calls that raise, hang, run long or ignore their cancellation; tools that raise
    their own BaseException or GeneratorExit, ignore cancellation or mutate their arguments;
    stops from another thread; providers that quote their key, report NaN usage or an
    infinite retry hint, or trickle forever: the turn still returns within its bounds, keeps
    every confirmed delivery, names what it abandoned, leaks no key, and ends as the
    reference model predicts (all ten invariants)."""
    run = asyncio.run(run_script(script, policy, real_timeout=HOSTILE_REAL_TIMEOUT))
    result = run.result
    assert result.status in TurnStatus
    assert [s.next_state in FINAL_STATES for s in result.trace].count(True) == 1
    assert result.iterations <= policy.max_function_call_iterations
    run.check()
    check_ending(run)  # invariant 10


@settings(max_examples=max(1, _hostile_examples() // 3))
@given(script=tool_batches(hostile=True), policy=loop_policies(hostile=True))
def test_any_turn_of_hostile_tool_batches_keeps_every_invariant(
    script: TurnScript, policy: LoopPolicy
) -> None:
    """A call that hangs ignoring its cancellation, one raising a `BaseException`, one
    returning garbage: every sibling still gets its result, the stragglers are named, and
    every invariant holds."""
    run = asyncio.run(run_script(script, policy, real_timeout=HOSTILE_REAL_TIMEOUT))
    run.check()
    check_ending(run)


#: Real seconds a hostile virtual-time turn may take before it counts as never returning.
HOSTILE_REAL_TIMEOUT = HANG_GUARD_SECONDS


# =========================================================================== the sans-IO machine
_ALLOWLISTS = st.sampled_from((None, None, frozenset({"get_weather", "send_sticker"}), frozenset()))
MAX_STEPS = 120


def _machine_tools() -> ToolRegistry:
    # the handlers are never called: the machine only names the tool in a RunTool effect
    return build_tools(TurnScript(), clock=VirtualClock(), signals=TurnSignals(), executions=[])


TOOLS = _machine_tools()


#: What an earlier attempt completed: the first occurrence of every well-formed call the
#: strategies draw, each a success (the outer tier hands such a ledger to the next attempt).
CARRIED_LEDGER = {
    key: LedgerEntry(key, ToolOutcome(success=True, data={"carried": True}))
    for call in (FunctionCall(name, args) for args in _ARGUMENTS for name in KNOWN_TOOLS)
    for key in [occurrence_key(canonical_call_key(call.name, call.arguments), 1)]
}


def drive_machine(policy: LoopPolicy, data: st.DataObject, *, probe: bool = True) -> None:
    """Drive a `ToolLoopMachine` with legal events (and, with ``probe``, illegal ones in
    between), then replay the legal events into a fresh machine and compare."""
    request = TurnRequest(
        [{"role": "user", "content": "hello"}],
        tools_allowed=data.draw(_ALLOWLISTS, label="allowlist"),
        prefill=data.draw(st.sampled_from((None, "Sure, ")), label="prefill"),
    )
    continuation = data.draw(st.booleans(), label="continuation style")
    # an earlier attempt's ledger, as the outer tier carries it: a replayed call is reused
    ledger = data.draw(st.sampled_from((None, CARRIED_LEDGER)), label="carried ledger")
    machine = ToolLoopMachine(policy, tools=TOOLS)
    world = World()
    log: list[list[Effect]] = [
        machine.start(request, continuation_style=continuation, ledger=ledger)
    ]
    world.take(log[0])
    events: list[object] = []
    for _ in range(MAX_STEPS):
        if machine.is_finished:
            break
        if probe and data.draw(st.integers(0, 4), label="probe?") == 0:
            _probe_illegal(machine, world, data)
        event = world.draw_event(data)
        effects = machine.feed(event)
        world.fed(event)
        world.take(effects)
        events.append(event)
        log.append(effects)
    if machine.is_finished:
        assert world.finished
        _probe_illegal(machine, world, data)
        check_invariants(machine.result, policy=policy, request=request)
    # determinism: the same events give the same effects, step by step, and the illegal
    # probes above changed nothing
    replay = ToolLoopMachine(policy, tools=TOOLS)
    replayed = [replay.start(request, continuation_style=continuation, ledger=ledger)]
    replayed += [replay.feed(event) for event in events]
    assert replayed == log
    assert replay.state == machine.state
    assert replay.trace == machine.trace
    # the compiled tables and `transitions`' own trigger (the reference interpreter) take
    # the same steps: same effects, same phase steps (the reference also traces each chunk's
    # internal transition, which the fast path does not), same result
    reference = ToolLoopMachine(policy, tools=TOOLS, reference=True)
    referenced = [reference.start(request, continuation_style=continuation, ledger=ledger)]
    referenced += [reference.feed(event) for event in events]
    assert _phase_effects(referenced) == _phase_effects(log)
    assert reference.state == machine.state
    assert _phase_steps(reference.trace) == _phase_steps(machine.trace)
    if machine.is_finished:
        assert attrs.evolve(reference.result, trace=()) == attrs.evolve(machine.result, trace=())


_CHUNK_TRIGGERS = frozenset(CHUNK_TRIGGERS.values())


def _phase_steps(trace: Sequence[TraceStep]) -> list[TraceStep]:
    return [s for s in trace if not (s.event in _CHUNK_TRIGGERS and s.state == s.next_state)]


def _phase_effects(log: Sequence[Sequence[Effect]]) -> list[list[object]]:
    """The effects, with the trace inside a `Finish` result reduced to its phase steps."""
    return [
        [
            Finish(attrs.evolve(e.result, trace=tuple(_phase_steps(e.result.trace))))
            if isinstance(e, Finish)
            else e
            for e in effects
        ]
        for effects in log
    ]


def _probe_illegal(machine: ToolLoopMachine, world: World, data: st.DataObject) -> None:
    state = machine.state
    steps = len(machine.trace)
    event = data.draw(st.sampled_from(world.illegal_events(state)), label="illegal event")
    with pytest.raises(InvalidEvent) as raised:
        machine.feed(event)
    message = str(raised.value)
    assert repr(state) in message, message
    assert type(event).__name__ in message, message
    assert machine.state == state
    assert len(machine.trace) == steps


@given(policy=loop_policies(), data=st.data())
def test_the_machine_is_deterministic_and_refuses_illegal_events_without_changing(
    policy: LoopPolicy, data: st.DataObject
) -> None:
    drive_machine(policy, data)


# =========================================================================== the checker
def _one_run(script: TurnScript, policy: LoopPolicy | None = None) -> ScriptRun:
    run = run_turn(script, policy or LoopPolicy(delivery_flush_chars=1))
    run.check()
    return run


def _expect(number: int, run: ScriptRun, **changes: Any) -> None:
    witnesses: dict[str, Any] = {
        "policy": run.policy,
        "channel": run.channel,
        "provider": run.provider,
        "executions": run.executions,
        "elapsed": run.elapsed,
        "streamed": run.streamed,
        "tools": run.tools,
        "request": run.request,
    }
    result = changes.pop("result", run.result)
    witnesses.update(changes)
    with pytest.raises(InvariantViolation) as raised:
        check_invariants(result, **witnesses)
    assert raised.value.invariant == number, str(raised.value)
    assert str(raised.value).startswith(f"invariant {number}: ")


WEATHER = FunctionCall("get_weather", {"city": "Oslo"})
LIMA = FunctionCall("get_weather", {"city": "Lima"})
STICKER = FunctionCall("send_sticker", {})
ENRICH = ContextRestart({"role": "system", "content": "enriched"})
_FAIL = ToolBehaviour(ToolAction.FAIL, message="no data")


def test_the_checker_catches_a_lost_delivery_and_an_untidy_trace() -> None:
    run = _one_run(TurnScript(passes=((TextDelta("Hi"), TextDelta(" there")),)))
    assert run.result.status is TurnStatus.COMPLETED and len(run.channel.delivered) == 2
    _expect(5, run, result=attrs.evolve(run.result, delivered=run.result.delivered[:1]))
    _expect(1, run, result=attrs.evolve(run.result, trace=run.result.trace[:-1]))
    _expect(1, run, result=attrs.evolve(run.result, trace=run.result.trace * 2))


def test_the_checker_catches_exceeded_ceilings_and_runs_of_failures() -> None:
    script = TurnScript(
        passes=((WEATHER,), (WEATHER,), (TextDelta("sorry"),)),
        tool_plan=(("get_weather", (_FAIL, _FAIL)),),
    )
    run = _one_run(script, LoopPolicy(max_consecutive_tool_errors=3))
    assert [e.response.success for e in run.result.history] == [False, False]
    _expect(2, run, policy=LoopPolicy(max_function_call_iterations=2))
    _expect(3, run, policy=LoopPolicy(max_consecutive_tool_errors=1))


def test_the_checker_catches_a_rerun_call_a_run_after_stop_and_a_slow_run() -> None:
    run = _one_run(TurnScript(passes=((WEATHER,), (TextDelta("3 °C"),))))
    (execution,) = run.executions
    _expect(4, run, executions=(attrs.evolve(execution, stop_requested=True),))
    # a pass of one call that ran twice dispatched more calls than the provider emitted
    twice = (execution, attrs.evolve(execution, dispatch=2))
    _expect(2, run, executions=twice, result=attrs.evolve(run.result, tool_dispatches=2))
    _expect(6, run, elapsed=10_000.0)


def test_the_checker_catches_a_call_run_again_after_a_restart_instead_of_reused() -> None:
    script = TurnScript(
        passes=((WEATHER,), (STICKER,), (WEATHER,), (TextDelta("3 °C"),)),
        tool_plan=(("send_sticker", (ToolBehaviour(context_restart=ENRICH),)),),
    )
    run = _one_run(script)
    assert [e.dispatch for e in run.executions] == [1, 2]  # the 2nd weather was reused
    weather = run.executions[0]
    again = (*run.executions, attrs.evolve(weather, dispatch=3, iteration=3))
    _expect(4, run, executions=again, result=attrs.evolve(run.result, tool_dispatches=3))


def test_the_checker_catches_a_batch_answered_out_of_order_or_twice() -> None:
    script = TurnScript(passes=((TextDelta("Both. "), WEATHER, LIMA), (TextDelta("Done."),)))
    run = _one_run(script)
    first, second = run.result.history
    assert (first.position, second.position) == (0, 1)
    assert (first.pre_tool_text, second.pre_tool_text) == ("Both. ", None)
    swapped = attrs.evolve(run.result, history=(second, first))
    _expect(7, run, result=swapped, provider=None)
    repeated = attrs.evolve(second, pre_tool_text="Both. ")
    _expect(7, run, result=attrs.evolve(run.result, history=(first, repeated)), provider=None)
    twice = attrs.evolve(run.result, history=(first, attrs.evolve(second, position=0)))
    _expect(7, run, result=twice, provider=None)


def test_the_checker_catches_invalid_history_and_a_wrong_ledger() -> None:
    script = TurnScript(
        passes=(
            (TextDelta("Let me look. "), WEATHER, UsageReport(5, 6)),
            (TextDelta("3 °C"), UsageReport(7, 8)),
        )
    )
    run = _one_run(script)
    entry = run.result.history[0]
    assert entry.pre_tool_text == "Let me look. "
    blank = attrs.evolve(entry, pre_tool_text="  ")
    _expect(7, run, result=attrs.evolve(run.result, history=(blank,)), provider=None)
    usage = attrs.evolve(run.result.usage, entries=run.result.usage.entries[:1])
    _expect(8, run, result=attrs.evolve(run.result, usage=usage))


def test_the_checker_catches_an_unnamed_straggler_and_a_signal_that_raised() -> None:
    run = _one_run(TurnScript(passes=((WEATHER,), (TextDelta("3 °C"),))))
    (execution,) = run.executions
    stubborn = attrs.evolve(execution, cancel_ignored=True)
    _expect(1, run, executions=(stubborn,))
    _expect(1, run, running_at_return=("tool get_weather (dispatch 1)",))
    _expect(1, run, signal_errors=(RuntimeError("no running event loop"),))


def test_the_checker_catches_a_leaked_key_run_and_rewritten_arguments() -> None:
    run = _one_run(TurnScript(passes=((WEATHER,), (TextDelta("3 °C"),))))
    key = PROVIDER_KEYS[0]
    # eight characters from the middle of the key are enough to give it away
    quoted = attrs.evolve(run.result, error_message=f"401 for key …{key[5:13]}…")
    _expect(9, run, result=quoted, keys=(key,))
    check_invariants(run.result, policy=run.policy, keys=(key,))  # nothing leaked here
    entry = run.result.history[0]
    rewritten = attrs.evolve(entry, call=attrs.evolve(entry.call, arguments={"city": "Lima"}))
    _expect(7, run, result=attrs.evolve(run.result, history=(rewritten,)))


def test_the_checker_catches_a_ledger_that_holds_no_number() -> None:
    run = _one_run(TurnScript(passes=((TextDelta("Hi"), UsageReport(5, 6)),)))
    (entry,) = run.result.usage.entries
    broken = attrs.evolve(run.result.usage, entries=(attrs.evolve(entry, input_tokens=math.nan),))  # type: ignore[arg-type]
    _expect(8, run, result=attrs.evolve(run.result, usage=broken))


def test_a_call_reused_after_a_batch_whose_first_identical_call_restarted_keeps_invariant_4() -> (
    None
):
    # found by `toolloop-fsm fuzz --examples 20000 --seed 0`: two identical calls in one
    # batch, the first restarting the context (no entry), the second failing (its entry);
    # after the restart the identical call is the first occurrence again, which succeeded
    # (the restart), so it is reused — invariant 4 once paired the failure's entry with it
    weather = FunctionCall("get_weather", {})
    restart = ContextRestart({"role": "system", "content": "enriched: memory"}, ("memory",))
    script = TurnScript(
        passes=(
            (TextDelta("Hi"), weather, weather),
            (TextDelta("Hi"), weather),
            (TextDelta("Hi"),),
        ),
        tool_plan=(
            (
                "get_weather",
                (
                    ToolBehaviour(action=ToolAction.SUCCEED, context_restart=restart),
                    ToolBehaviour(action=ToolAction.FAIL),
                ),
            ),
        ),
    )
    run = run_turn(script, LoopPolicy())
    run.check()
    assert run.result.status is TurnStatus.COMPLETED
    # pass 2's call was reused, not run: two runs in all
    assert len(run.executions) == 2


def test_a_stop_cutting_a_batch_whose_first_call_was_reused_keeps_invariant_4() -> None:
    # found by the batch properties at the explore profile: a restart after pass 1 (the
    # sticker's call succeeded); in pass 2 the gate reuses the identical call's first
    # occurrence and runs its second, which hangs until a stop cuts the batch, so the pass
    # records no entry — the run took the second occurrence, not the reused first
    sticker = FunctionCall("send_sticker", {})
    restart = ContextRestart({"role": "system", "content": "enriched: memory"}, ("memory",))
    script = TurnScript(
        passes=((FunctionCall("get_weather", {}), sticker), (sticker, sticker), (TextDelta("x"),)),
        tool_plan=(
            (
                "send_sticker",
                (
                    ToolBehaviour(action=ToolAction.SUCCEED, context_restart=restart),
                    ToolBehaviour(action=ToolAction.HANG),
                ),
            ),
        ),
        signals=(TimedSignal(at=1.5, kind="stop"),),
    )
    run = run_turn(script, LoopPolicy())
    run.check()
    assert (run.result.status, run.result.reason) == (
        TurnStatus.STOPPED_BY_USER,
        "stopped_during_tool",
    )
    # the sticker ran once a pass: its first occurrence, then (after the reuse) its second
    assert [(e.name, e.iteration) for e in run.executions] == [
        ("get_weather", 1),
        ("send_sticker", 1),
        ("send_sticker", 2),
    ]


def test_a_refused_call_sharing_an_identity_takes_no_occurrence_of_invariant_4() -> None:
    # found by `toolloop-fsm fuzz --seed 5 --examples 40000 --drafting`: an unparseable call is
    # recorded with empty arguments, so it shares the identity of the sticker's calls that
    # ran; it was refused at the gate and takes no occurrence — the success after it is the
    # first occurrence, which the restarted pass reuses
    sticker = FunctionCall("send_sticker", {})
    unparseable = FunctionCall("send_sticker", '{"city": Oslo', parse_error="Expecting value")
    restart = ContextRestart({"role": "system", "content": "enriched: memory"}, ("memory",))
    memory = FunctionCall("update_short_term_memory", {"note": "Oslo"})
    script = TurnScript(
        passes=((unparseable, sticker, memory, sticker), (sticker,), (TextDelta("Done."),)),
        tool_plan=(
            (
                "send_sticker",
                (ToolBehaviour(action=ToolAction.SUCCEED), ToolBehaviour(action=ToolAction.FAIL)),
            ),
            (
                "update_short_term_memory",
                (ToolBehaviour(action=ToolAction.SUCCEED, context_restart=restart),),
            ),
        ),
    )
    run = run_turn(script, LoopPolicy())
    run.check()
    assert run.result.status is TurnStatus.COMPLETED
    # the sticker ran twice in pass 1 (a success, a failure); pass 2's call was reused
    assert [(e.name, e.iteration, e.outcome) for e in run.executions] == [
        ("send_sticker", 1, "succeeded"),
        ("update_short_term_memory", 1, "succeeded"),
        ("send_sticker", 1, "failed"),
    ]
