"""Trace steps carry the time they were taken on the turn's clock, and the guard that fired;
the machines stay pure: the time is an input (``start``/``feed`` take ``now``)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from toolloop_fsm import Attempt
from toolloop_fsm import FunctionCall
from toolloop_fsm import LoopPolicy
from toolloop_fsm import ProviderError
from toolloop_fsm import TextDelta
from toolloop_fsm import Tool
from toolloop_fsm import ToolContext
from toolloop_fsm import ToolResult
from toolloop_fsm import TurnRequest
from toolloop_fsm import result_from_json
from toolloop_fsm import result_to_json
from toolloop_fsm import run_generation_turn
from toolloop_fsm import run_tool_loop
from toolloop_fsm.errors import InvalidEvent
from toolloop_fsm.sansio import DeliveryRecorded
from toolloop_fsm.sansio import StreamEnded
from toolloop_fsm.sansio import ToolLoopMachine
from toolloop_fsm.testing import Fail
from toolloop_fsm.testing import Pause
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import ScriptedProvider
from toolloop_fsm.testing import VirtualClock

REQUEST = TurnRequest([{"role": "user", "content": "what's the weather?"}])


def step_times(trace: Any, event: str) -> list[float | None]:
    return [step.at for step in trace if step.event == event]


async def test_each_step_carries_the_virtual_time_it_was_taken_at() -> None:
    clock = VirtualClock()

    async def weather(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        await clock.sleep(4)
        return ToolResult(data={"sky": "clear"})

    provider = ScriptedProvider(
        [[Pause(1.5), FunctionCall("weather", {}, "c1")], [Pause(2), TextDelta("Clear skies.")]],
        clock=clock,
    )
    tool = Tool("weather", "the weather", {"type": "object"}, weather)
    result = await run_tool_loop(
        provider, [tool], RecordingChannel(clock=clock), REQUEST, clock=clock
    )
    trace = result.trace
    assert trace[0].at == 0.0
    times = [step.at for step in trace]
    assert None not in times and times == sorted(times)  # type: ignore[type-var]
    assert step_times(trace, "function_call") == [1.5]
    assert step_times(trace, "tool_finished") == [5.5]
    assert step_times(trace, "text_delta") == [7.5]
    # a decision point is taken at the time of the event that led to it
    assert [(s.guard, s.at) for s in trace if s.guard == "call_pending"] == [("call_pending", 1.5)]


async def test_a_generation_turn_stamps_its_own_steps_and_each_attempts() -> None:
    clock = VirtualClock()
    failing = ScriptedProvider(
        [[Pause(3), Fail(ProviderError("503", kind="server", retryable=True))]], clock=clock
    )
    backup = ScriptedProvider([[Pause(1), TextDelta("fine")]], clock=clock)
    result = await run_generation_turn(
        [Attempt(failing, label="main"), Attempt(backup, label="backup")],
        [],
        RecordingChannel(clock=clock),
        REQUEST,
        clock=clock,
    )
    assert step_times(result.trace, "start") == [0.0]
    assert step_times(result.trace, "attempt_finished") == [3.0, 4.0]
    # the note of the superseded attempt is stamped like the step it annotates
    assert step_times(result.trace, "attempt_superseded") == [3.0]
    first, second = result.attempts
    assert step_times(first.trace, "stream_failed") == [3.0]
    assert step_times(second.trace, "start") == [3.0]
    assert step_times(second.trace, "text_delta") == [4.0]


async def test_stamped_traces_round_trip_and_traces_saved_without_times_still_load() -> None:
    clock = VirtualClock()
    provider = ScriptedProvider([[Pause(2), TextDelta("Hello.")]], clock=clock)
    result = await run_tool_loop(provider, [], RecordingChannel(clock=clock), REQUEST, clock=clock)
    text = result_to_json(result)
    assert result_from_json(text) == result
    old = json.loads(text)
    for step in old["trace"]:
        del step["at"]
        del step["guard"]
    loaded = result_from_json(json.dumps(old))
    assert [step.at for step in loaded.trace] == [None] * len(result.trace)
    assert [(s.state, s.event, s.next_state) for s in loaded.trace] == [
        (s.state, s.event, s.next_state) for s in result.trace
    ]


def test_the_machine_stamps_the_time_its_driver_gives_and_none_without_one() -> None:
    machine = ToolLoopMachine()
    machine.start(REQUEST, now=10.0)
    machine.feed(TextDelta("Hello."), now=11.0)
    machine.feed(StreamEnded(), now=12.5)
    machine.feed(DeliveryRecorded(0))  # a driver that gives no time
    assert [(s.event, s.at) for s in machine.trace] == [
        ("start", 10.0),
        ("advance", 10.0),
        ("text_delta", 11.0),
        ("stream_ended", 12.5),
        ("advance", 12.5),
        ("advance", 12.5),
        ("delivery_recorded", None),
        ("advance", None),
    ]


def test_each_delivery_confirmed_while_streaming_is_a_step_at_its_time() -> None:
    machine = ToolLoopMachine(LoopPolicy(delivery_flush_chars=1))
    machine.start(REQUEST, now=1.0)
    machine.feed(TextDelta("a"), now=2.0)
    machine.feed(TextDelta("b"), now=2.0)
    machine.feed(DeliveryRecorded(0), now=3.0)
    machine.feed(DeliveryRecorded(1), now=3.0)  # confirmed at the same time: a step of its own
    machine.feed(TextDelta("c"), now=4.0)  # the stream goes on as before
    machine.feed(DeliveryRecorded(2), now=4.5)
    confirmed = [
        (s.state, s.next_state, s.at) for s in machine.trace if s.event == "delivery_recorded"
    ]
    assert confirmed == [("streaming", "streaming", 3.0)] * 2 + [("streaming", "streaming", 4.5)]
    assert machine.state == "streaming"
    assert [d.seq for d in machine.turn.deliveries.delivered or ()] == [0, 1, 2]
    with pytest.raises(InvalidEvent, match="delivery 0 is not in flight"):
        machine.feed(DeliveryRecorded(0), now=6.0)
