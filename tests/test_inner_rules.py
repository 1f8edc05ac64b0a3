"""The inner loop's exact rules, each pinned where a one-token slip would change what a user
or host sees: which exit a turn takes and with what text, how a pass's text and thoughts are
kept, what the gate tells the model, how counters and deadlines bound the turn. Time is
virtual (`VirtualClock`)."""

from __future__ import annotations

import pytest

from tests.inner_kit import USER, Executions, make_tool, run_turn, scripted_turn, succeeds
from toolloop_fsm import (
    FollowUpArrived,
    FunctionCall,
    LoopPolicy,
    StreamEnded,
    TextDelta,
    ThoughtDelta,
    ToolLoopMachine,
    TurnRequest,
    TurnStatus,
)
from toolloop_fsm.testing import Pause, VirtualClock

EAGER = LoopPolicy(delivery_flush_chars=1)


# --------------------------------------------------------------------------- exits and their text
async def test_a_pass_that_times_out_is_recorded_as_a_timed_out_pass() -> None:
    turn = scripted_turn([[TextDelta("Thinking"), Pause(1000)]])
    result = await run_turn(turn, [], policy=LoopPolicy(inactivity_timeout=10))
    assert result.status is TurnStatus.TIMEOUT
    [only] = result.stream_results
    assert (only.outcome, only.error) == ("timeout", "inactivity_timeout")


async def test_end_turn_after_a_silent_pass_does_not_repeat_an_earlier_pass_text() -> None:
    turn = scripted_turn(
        [
            [TextDelta("Looking it up. "), FunctionCall("lookup", {})],
            [FunctionCall("send", {})],  # no text before this call
        ]
    )
    lookup = make_tool("lookup", turn.executions, turn.clock)
    send = make_tool("send", turn.executions, turn.clock, succeeds(end_turn=True))
    result = await run_turn(turn, [lookup, send])
    assert result.status is TurnStatus.COMPLETED
    assert result.reason == "end_turn"
    assert result.final_text == ""  # this pass said nothing; the earlier text was already sent
    assert turn.channel.text == "Looking it up. "


async def test_a_malformed_call_with_a_name_says_its_arguments_are_not_an_object() -> None:
    turn = scripted_turn([[FunctionCall("get_weather", ["Paris"])]])
    result = await run_turn(turn, [make_tool("get_weather", turn.executions, turn.clock)])
    assert result.reason == "malformed_call"
    assert result.error_message == (
        "the model's call to 'get_weather' has arguments that are not an object (list)"
    )


# --------------------------------------------------------------------------- text and thoughts
async def test_thoughts_streamed_in_pieces_are_kept_whole() -> None:
    turn = scripted_turn([[ThoughtDelta("the user "), ThoughtDelta("wants "), TextDelta("Hi")]])
    result = await run_turn(turn, [])
    assert result.thought_log == "the user wants "


# --------------------------------------------------------------------------- the gate
async def test_the_failure_notice_of_a_truncated_call_shows_no_arguments() -> None:
    cut = FunctionCall("get_weather", {"city": "Par"}, truncated=True)
    turn = scripted_turn([[cut], [TextDelta("Sorry.")]])
    await run_turn(turn, [make_tool("get_weather", turn.executions, turn.clock)])
    [notice] = [n for n in turn.channel.notices if n.key == "tool_failed"]
    assert notice.params["summary"].endswith("\narguments: {}")  # never the half-read payload


# --------------------------------------------------------------------------- deadlines and settling
async def test_the_settle_window_stays_bounded_while_deliveries_keep_completing_in_it() -> None:
    # three deliveries of 4 s each are in flight when the reply ends; the window is 6 s
    turn = scripted_turn([[TextDelta("a"), TextDelta("b"), TextDelta("c")]], delivery_delay=4)
    policy = LoopPolicy(delivery_flush_chars=1, inactivity_timeout=6)
    result = await run_turn(turn, [], policy=policy)
    assert result.status is TurnStatus.COMPLETED
    assert turn.clock.now() == pytest.approx(6)
    assert turn.channel.text == "a"  # b (due at 8) and c (at 12) were abandoned
    assert result.delivered_text == "a"


async def test_a_stop_during_the_settle_window_after_a_stall_ends_stopped_while_settling() -> None:
    turn = scripted_turn([[TextDelta("Hello"), Pause(1000)]], delivery_delay=12)
    policy = LoopPolicy(delivery_flush_chars=1, inactivity_timeout=10, abandoned_stream_settle=5)
    result = await run_turn(turn, [], policy=policy, at=[(11, lambda s: s.request_stop())])
    assert result.status is TurnStatus.STOPPED_BY_USER
    assert result.reason == "stopped_while_settling"


# --------------------------------------------------------------------------- follow-ups
@pytest.mark.parametrize(
    ("script", "waiting_in"),
    [
        ([FunctionCall("get_weather", {"city": "Paris"}), StreamEnded()], "executing_tool"),
        ([TextDelta("Sunny."), StreamEnded()], "settling"),
    ],
    ids=["during-a-tool", "while-settling"],
)
def test_a_follow_up_that_cannot_interrupt_is_counted_as_cleared_and_the_turn_goes_on(
    script: list[object], waiting_in: str
) -> None:
    clock = VirtualClock()
    tool = make_tool("get_weather", Executions(), clock)
    machine = ToolLoopMachine(EAGER, tools=[tool])
    machine.start(TurnRequest(USER))
    for event in script:
        machine.feed(event)
    assert machine.state == waiting_in
    machine.feed(FollowUpArrived())
    machine.feed(FollowUpArrived())
    assert machine.state == waiting_in  # not interrupted: the follow-up waits for its turn
    assert machine.turn.follow_ups_cleared == 2
