"""`fork()` on both machines: a fork goes on from where its original stands, on its own.

A fork fed the same events as a `copy.deepcopy` of the same machine, taken at the same
moment, returns the same effects and ends with the same trace and result; and that holds
after the original was fed on first, so feeding the original never changes a fork (nor a
fork its original). The fork shares the configuration and the compiled tables.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import hypothesis.strategies as st
import pytest
from hypothesis import given

from tests.test_properties_inner import MAX_STEPS
from tests.test_properties_inner import TOOLS
from tests.test_properties_outer import _REQUEST as CHAIN_REQUEST
from tests.test_properties_outer import drive_generation_machine
from toolloop_fsm.effects import Effect
from toolloop_fsm.events import DeliveryRecorded
from toolloop_fsm.events import StreamEnded
from toolloop_fsm.events import TextDelta
from toolloop_fsm.generation import GenerationTurnMachine
from toolloop_fsm.host import TurnRequest
from toolloop_fsm.machine import ToolLoopMachine
from toolloop_fsm.policy import LoopPolicy
from toolloop_fsm.testing import loop_policies
from toolloop_fsm.testing.world import World

_REQUEST = TurnRequest([{"role": "user", "content": "hello"}], prefill="Sure, ")


def _feed_all(
    machine: ToolLoopMachine | GenerationTurnMachine, events: Sequence[object]
) -> list[list[Effect]]:
    return [machine.feed(event) for event in events]


@given(policy=loop_policies(), data=st.data())
def test_a_fork_of_the_tool_loop_goes_on_as_a_deep_copy_would_whatever_the_original_is_fed(
    policy: LoopPolicy, data: st.DataObject
) -> None:
    machine = ToolLoopMachine(policy, tools=TOOLS, snapshots=data.draw(st.booleans()))
    sim = World()
    sim.take(machine.start(_REQUEST))
    for _ in range(data.draw(st.integers(0, MAX_STEPS // 2), label="events before the fork")):
        if machine.is_finished:
            break
        event = sim.draw_event(data)
        effects = machine.feed(event)
        sim.fed(event)
        sim.take(effects)
    fork = machine.fork()
    twin = copy.deepcopy(machine)
    assert (fork.state, fork.trace) == (twin.state, twin.trace)
    # the world's events after the fork, drawn against the deep copy's effects
    after: list[object] = []
    expected: list[list[Effect]] = []
    for _ in range(MAX_STEPS):
        if twin.is_finished:
            break
        event = sim.draw_event(data)
        effects = twin.feed(event)
        sim.fed(event)
        sim.take(effects)
        after.append(event)
        expected.append(effects)
    # the original is fed first, the same events: a fork sharing anything a run changes
    # would see each change twice
    assert _feed_all(machine, after) == expected
    assert _feed_all(fork, after) == expected
    assert (fork.state, fork.trace) == (twin.state, twin.trace)
    assert fork.is_finished == twin.is_finished
    if twin.is_finished:
        assert fork.result == twin.result


def test_feeding_the_original_after_forking_leaves_the_fork_as_it_was() -> None:
    machine = ToolLoopMachine(LoopPolicy(delivery_flush_chars=5), tools=TOOLS)
    machine.start(_REQUEST)
    machine.feed(TextDelta("Hello"))
    fork = machine.fork()
    before = (
        fork.state,
        fork.trace,
        list(fork.turn.pass_text),
        dict(fork.turn.deliveries.in_flight),
    )
    machine.feed(TextDelta(", world"))
    machine.feed(StreamEnded())
    assert (
        fork.state,
        fork.trace,
        list(fork.turn.pass_text),
        dict(fork.turn.deliveries.in_flight),
    ) == before
    # and the fork goes on as the original would have
    fork.feed(TextDelta(", world"))
    fork.feed(StreamEnded())
    assert fork.trace == machine.trace
    assert fork.turn.pass_text == machine.turn.pass_text


def test_a_fork_shares_the_configuration_and_the_compiled_tables() -> None:
    machine = ToolLoopMachine(tools=TOOLS)
    machine.start(_REQUEST)
    fork = machine.fork()
    assert fork.turn is not machine.turn
    assert fork.turn.policy is machine.turn.policy
    assert fork.turn.registry is machine.turn.registry
    assert fork.turn.request is machine.turn.request
    assert fork.turn.context is not machine.turn.context
    assert fork._runner.tables is machine._runner.tables  # type: ignore[attr-defined]
    # a stream reader holding the fork's chunk handlers gets the fork's own current ones
    assert fork.chunk_handlers is not machine.chunk_handlers
    assert dict(fork.chunk_handlers) == dict(machine.chunk_handlers)


def test_a_fork_of_a_reference_machine_runs_on_transitions_too_and_goes_on_alike() -> None:
    machine = ToolLoopMachine(tools=TOOLS, reference=True)
    machine.start(_REQUEST)
    machine.feed(TextDelta("Hello"))
    fork = machine.fork()
    assert type(fork._runner) is type(machine._runner)
    events = [TextDelta(", world"), StreamEnded(), DeliveryRecorded(0)]
    assert _feed_all(fork, events) == _feed_all(machine, events)
    assert fork.trace == machine.trace
    assert fork.result == machine.result


def test_a_fork_of_a_finished_machine_is_finished_with_the_same_result() -> None:
    machine = ToolLoopMachine(tools=TOOLS)
    machine.start(_REQUEST)
    machine.feed(TextDelta("Hello"))
    machine.feed(StreamEnded())
    machine.feed(DeliveryRecorded(0))
    assert machine.is_finished
    fork = machine.fork()
    assert fork.is_finished
    assert fork.result == machine.result
    assert fork.trace == machine.trace


def test_a_fork_of_a_machine_not_started_is_not_started_either() -> None:
    fork = ToolLoopMachine(tools=TOOLS).fork()
    assert fork.state == "ready"
    with pytest.raises(RuntimeError):
        fork.turn  # noqa: B018


@given(data=st.data())
def test_a_fork_of_the_generation_turn_goes_on_as_a_deep_copy_would(data: st.DataObject) -> None:
    fed, setup, _ = drive_generation_machine(data)
    legal = [event for kind, event in fed if kind == "legal"]
    if any(kind == "bug5" for kind, _ in fed):
        return  # the drive ended at a known bug's assertion: nothing after it to compare
    policy, plans, shared, health = setup
    machine = GenerationTurnMachine(policy, plans=plans, shared=shared)
    machine.start(CHAIN_REQUEST, health=health)
    forked_at = data.draw(st.integers(0, len(legal)), label="events before the fork")
    _feed_all(machine, legal[:forked_at])
    fork = machine.fork()
    twin = copy.deepcopy(machine)
    _feed_all(machine, legal[forked_at:])
    assert _feed_all(fork, legal[forked_at:]) == _feed_all(twin, legal[forked_at:])
    assert fork.trace == twin.trace == machine.trace
    assert fork.result == twin.result == machine.result
