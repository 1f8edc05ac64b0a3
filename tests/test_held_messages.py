"""Messages that arrive while a turn runs (docs/behaviour.md §8.5), in their three modes:
``interrupt`` ends the turn as before; ``steer`` joins the context at the next pass boundary,
after the running tool batch, and the turn goes on; ``queue`` is answered once the turn would
end, in one more pass bounded by the ceilings. A turn holds a bounded number; snapshots carry
them. Time is virtual: each message arrives at a set instant."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.inner_kit import USER
from tests.inner_kit import Turn
from tests.inner_kit import make_tool
from tests.inner_kit import run_turn
from tests.inner_kit import scripted_turn
from toolloop_fsm import FunctionCall
from toolloop_fsm import LoopPolicy
from toolloop_fsm import TextDelta
from toolloop_fsm import Tool
from toolloop_fsm import ToolContext
from toolloop_fsm import ToolResult
from toolloop_fsm import TurnRequest
from toolloop_fsm import TurnSignals
from toolloop_fsm import TurnStatus
from toolloop_fsm import resume_tool_loop
from toolloop_fsm import run_tool_loop
from toolloop_fsm import snapshot_from_json
from toolloop_fsm import snapshot_to_json
from toolloop_fsm import turn_messages
from toolloop_fsm.messages import HeldMessage
from toolloop_fsm.messages import HeldMessagesFull
from toolloop_fsm.messages import TakenMessage
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.testing import Pause
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import ScriptedProvider
from toolloop_fsm.testing import ScriptedReviewer

ROME = "Also Rome, please."


def _slow_weather(turn: Turn, seconds: float = 5.0) -> Tool:
    async def slow(arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        await turn.clock.sleep(seconds)
        return ToolResult(data={"city": arguments["city"], "sky": "clear"})

    return make_tool("get_weather", turn.executions, turn.clock, slow)


def weather(city: str) -> FunctionCall:
    return FunctionCall("get_weather", {"city": city}, f"c-{city}")


async def _drafted(turn: Turn, reviewer: ScriptedReviewer) -> GenerationTurnResult:
    """The turn, drafted, without tools."""
    return await run_tool_loop(
        turn.provider,
        [],
        turn.channel,
        TurnRequest(USER),
        policy=LoopPolicy(drafting=True),
        signals=turn.signals,
        clock=turn.clock,
        reviewer=reviewer,
    )


def _ignore(_held: HeldMessage) -> None:
    """A timer's callback returns nothing: the message is in the signals."""


def _last_user(request_context: Any) -> Any:
    return [m for m in request_context if m.get("role") == "user"][-1]["content"]


# --------------------------------------------------------------------------- steer
async def test_a_steer_during_a_tool_joins_the_next_request_after_the_batch() -> None:
    turn = scripted_turn(
        [[TextDelta("Checking. "), weather("Paris")], [TextDelta("Paris is clear; Rome too.")]]
    )
    result = await run_turn(
        turn, [_slow_weather(turn)], at=[(1.0, lambda s: _ignore(s.steer(ROME)))]
    )
    assert result.status is TurnStatus.COMPLETED
    assert result.taken_messages == (TakenMessage("steer", ROME, 1),)
    first, second = turn.provider.requests
    assert _last_user(first.context) == USER[0]["content"]
    # the tool round, then the message, in the context; nothing left in the history
    assert second.history == ()
    roles = [m["role"] for m in second.context]
    assert roles == ["user", "assistant", "tool", "user"]
    assert second.context[1]["tool_calls"][0]["name"] == "get_weather"
    assert second.context[-1] == {"role": "user", "content": ROME}
    # the result's history is whole, and the next turn's messages place the steer after it
    assert [e.call.name for e in result.history] == ["get_weather"]
    added = turn_messages(result)
    assert [m["role"] for m in added] == ["assistant", "tool", "user", "assistant"]
    assert added[2] == {"role": "user", "content": ROME}


async def test_a_steer_while_streaming_waits_for_the_pass_and_is_answered_in_one_more() -> None:
    turn = scripted_turn(
        [
            [TextDelta("It is clear "), Pause(2.0), TextDelta("in Paris.")],
            [TextDelta(" And in Rome, sunny.")],
        ]
    )
    result = await run_turn(turn, [], at=[(1.0, lambda s: _ignore(s.steer(ROME)))])
    assert result.status is TurnStatus.COMPLETED
    # the pass was not cut: all of it reached the user, then the answer to the steer
    assert turn.channel.text == "It is clear in Paris. And in Rome, sunny."
    assert result.taken_messages == (TakenMessage("steer", ROME, 1),)
    assert result.iterations == 2
    assert _last_user(turn.provider.requests[1].context) == ROME


# --------------------------------------------------------------------------- queue
async def test_a_queued_message_waits_until_the_turn_would_end_then_gets_one_more_pass() -> None:
    turn = scripted_turn(
        [
            [weather("Paris")],
            [weather("Lima")],
            [TextDelta("Paris and Lima are clear.")],
            [TextDelta(" Rome is sunny.")],
        ]
    )
    result = await run_turn(
        turn, [_slow_weather(turn)], at=[(1.0, lambda s: _ignore(s.queue(ROME)))]
    )
    assert result.status is TurnStatus.COMPLETED
    # not taken at the boundaries of the tool loop: only once the turn would have ended
    assert [_last_user(r.context) for r in turn.provider.requests] == [
        USER[0]["content"],
        USER[0]["content"],
        USER[0]["content"],
        ROME,
    ]
    assert result.taken_messages == (TakenMessage("queue", ROME, 3),)
    assert turn.channel.text == "Paris and Lima are clear. Rome is sunny."
    assert result.final_text == " Rome is sunny."


async def test_a_queued_message_during_a_drafted_review_waits_for_the_review() -> None:
    turn = scripted_turn([[TextDelta("Paris is clear.")], [TextDelta(" Rome is sunny.")]])
    from toolloop_fsm.review import Pass
    from toolloop_fsm.testing.reviewer import Slow

    reviewer = ScriptedReviewer([Slow(3.0, Pass())], clock=turn.clock)
    turn.clock.call_later(1.0, lambda: _ignore(turn.signals.queue(ROME)))
    result = await _drafted(turn, reviewer)
    assert result.status is TurnStatus.COMPLETED
    assert [r.verdict for r in result.reviews][:1] == ["pass"]  # the review ran to its end
    assert turn.channel.text.startswith("Paris is clear.")
    assert result.taken_messages == (TakenMessage("queue", ROME, 1),)
    assert "Rome is sunny." in turn.channel.text


async def test_a_queued_message_the_ceiling_leaves_no_pass_for_is_returned_unanswered() -> None:
    turn = scripted_turn([[weather("Paris")], [TextDelta("Paris is clear.")]])
    policy = LoopPolicy(max_function_call_iterations=2)
    result = await run_turn(
        turn, [_slow_weather(turn)], policy=policy, at=[(1.0, lambda s: _ignore(s.queue(ROME)))]
    )
    assert (result.status, result.reason) == (TurnStatus.COMPLETED, None)
    assert result.taken_messages == ()
    assert result.unanswered_messages == (HeldMessage("queue", ROME),)
    assert turn.signals.held == []  # the result hands it back: the signals hold it no more


# --------------------------------------------------------------------------- interrupt
async def test_an_interrupt_ends_the_turn_and_hands_back_what_it_held() -> None:
    turn = scripted_turn([[TextDelta("It is "), Pause(5.0), TextDelta("clear.")]])
    result = await run_turn(
        turn,
        [],
        at=[(1.0, lambda s: _ignore(s.queue(ROME))), (2.0, lambda s: s.interrupt())],
    )
    assert result.status is TurnStatus.FOLLOW_UP_INTERRUPT
    assert result.unanswered_messages == (HeldMessage("queue", ROME),)


# --------------------------------------------------------------------------- the cap
async def test_a_turn_holds_at_most_its_cap_and_refuses_the_next_with_a_typed_error() -> None:
    turn = scripted_turn([[weather("Paris")], [TextDelta("Done.")], [TextDelta(" More.")]])
    turn.signals = TurnSignals(max_held_messages=2)
    refused: list[HeldMessagesFull] = []

    def three(signals: TurnSignals) -> None:
        signals.queue("one")
        signals.queue("two")
        try:
            signals.queue("three")
        except HeldMessagesFull as err:
            refused.append(err)

    result = await run_turn(turn, [_slow_weather(turn)], at=[(1.0, three)])
    [error] = refused
    assert (error.limit, error.message.text) == (2, "three")
    assert "max_held_messages=2" in str(error)
    assert [m.text for m in result.taken_messages] == ["one", "two"]
    assert turn.signals.held == []  # released as the turn ended: the next turn may hold two
    turn.signals.queue("next turn's")
    assert [m.text for m in turn.signals.held] == ["next turn's"]


def test_held_messages_are_checked_at_the_call() -> None:
    signals = TurnSignals()
    with pytest.raises(ValueError, match="non-empty text"):
        signals.steer("  ")
    with pytest.raises(ValueError, match="max_held_messages"):
        TurnSignals(max_held_messages=0)


# --------------------------------------------------------------------------- snapshots
async def test_a_snapshot_carries_the_held_and_taken_messages_and_the_resume_answers_them() -> None:
    turn = scripted_turn(
        [[weather("Paris")], [weather("Lima")], [TextDelta("Both clear.")], [TextDelta(" Rome.")]]
    )
    saved: list[str] = []
    turn.clock.call_later(1.0, lambda: _ignore(turn.signals.steer("steered")))
    turn.clock.call_later(2.0, lambda: _ignore(turn.signals.queue("queued")))

    await run_tool_loop(
        turn.provider,
        [_slow_weather(turn)],
        turn.channel,
        TurnRequest(USER, turn_id="held-1"),
        signals=turn.signals,
        clock=turn.clock,
        on_snapshot=lambda s: saved.append(snapshot_to_json(s)),
    )
    # the snapshot before the second pass: both held (the steer joins as that pass opens)
    snapshot = snapshot_from_json(saved[1])
    assert snapshot.loop is not None
    assert snapshot.loop.held_messages == (
        HeldMessage("steer", "steered"),
        HeldMessage("queue", "queued"),
    )
    # the one before the third: the steer taken after pass 1, the queued message held
    later = snapshot_from_json(saved[2]).loop
    assert later is not None
    assert later.taken_messages == (TakenMessage("steer", "steered", 1),)
    assert later.held_messages == (HeldMessage("queue", "queued"),)
    provider = ScriptedProvider(
        [[weather("Lima")], [TextDelta("Both clear.")], [TextDelta(" Rome.")]], clock=turn.clock
    )
    resumed = await resume_tool_loop(
        snapshot,
        provider,
        [_slow_weather(turn)],
        RecordingChannel(clock=turn.clock),
        clock=turn.clock,
    )
    assert resumed.status is TurnStatus.COMPLETED
    assert [m.text for m in resumed.taken_messages] == ["steered", "queued"]
    assert _last_user(provider.requests[-1].context) == "queued"


# --------------------------------------------------------------------------- generation turns
async def test_a_fallback_attempt_is_given_the_held_messages_again() -> None:
    from toolloop_fsm import Attempt
    from toolloop_fsm import ProviderError
    from toolloop_fsm import run_generation_turn
    from toolloop_fsm.testing import Fail
    from toolloop_fsm.testing import VirtualClock

    clock = VirtualClock()
    signals = TurnSignals()
    failing = ScriptedProvider(
        [[Pause(2.0), Fail(ProviderError("overloaded", kind="server", retryable=True))]],
        clock=clock,
    )
    answering = ScriptedProvider(
        [[TextDelta("Paris is clear.")], [TextDelta(" Rome.")]], clock=clock
    )
    clock.call_later(1.0, lambda: _ignore(signals.queue(ROME)))
    result = await run_generation_turn(
        [Attempt(failing, label="A"), Attempt(answering, label="B")],
        [],
        RecordingChannel(clock=clock),
        TurnRequest(USER),
        signals=signals,
        clock=clock,
    )
    assert result.status is TurnStatus.COMPLETED
    assert result.taken_messages == (TakenMessage("queue", ROME, 1),)
    assert _last_user(answering.requests[-1].context) == ROME
    assert signals.held == []
    await asyncio.sleep(0)


async def test_a_drafted_reply_still_in_flight_is_confirmed_while_the_next_one_is_reviewed() -> (
    None
):
    """Found by the fuzzer: the reply delivered before the turn answers a held message may
    still be in flight when the answer is reviewed; its confirmation is recorded there."""
    from toolloop_fsm.review import Pass
    from toolloop_fsm.testing.reviewer import Slow

    turn = scripted_turn(
        [[TextDelta("Paris is clear.")], [TextDelta(" Rome is sunny.")]], delivery_delay=1.0
    )
    reviewer = ScriptedReviewer([Pass(), Slow(3.0, Pass())], clock=turn.clock)
    turn.signals.queue(ROME)  # held from the turn's start
    result = await _drafted(turn, reviewer)
    assert result.status is TurnStatus.COMPLETED
    assert [r.verdict for r in result.reviews] == ["pass", "pass"]
    assert turn.channel.text == "Paris is clear. Rome is sunny."
    assert [d.text for d in result.delivered] == ["Paris is clear.", " Rome is sunny."]
