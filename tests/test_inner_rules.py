"""The inner loop's exact rules, each pinned where a one-token slip would change what a user
or host sees: which exit a turn takes and with what text, how a pass's text and thoughts are
kept, what the gate tells the model, how counters and deadlines bound the turn. Time is
virtual (`VirtualClock`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from collections.abc import Sequence
from typing import Any

import pytest

from tests.inner_kit import USER
from tests.inner_kit import Executions
from tests.inner_kit import make_tool
from tests.inner_kit import run_turn
from tests.inner_kit import scripted_turn
from tests.inner_kit import succeeds
from toolloop_fsm import FunctionCall
from toolloop_fsm import LoopPolicy
from toolloop_fsm import TextDelta
from toolloop_fsm import ThoughtDelta
from toolloop_fsm import TurnRequest
from toolloop_fsm import TurnSignals
from toolloop_fsm import TurnStatus
from toolloop_fsm import UsageReport
from toolloop_fsm import run_tool_loop
from toolloop_fsm.effects import CancelStream
from toolloop_fsm.effects import Deliver
from toolloop_fsm.events import DeliveryFailed
from toolloop_fsm.provider import ProviderError
from toolloop_fsm.result import TraceStep
from toolloop_fsm.result import estimate_tokens
from toolloop_fsm.sansio import FollowUpArrived
from toolloop_fsm.sansio import InvalidEvent
from toolloop_fsm.sansio import StreamEnded
from toolloop_fsm.sansio import ToolLoopMachine
from toolloop_fsm.testing import Fail
from toolloop_fsm.testing import Pause
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import ScriptedProvider
from toolloop_fsm.testing import VirtualClock

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


async def test_a_reply_with_text_after_a_self_delivered_tool_response_completes_as_a_reply() -> (
    None
):
    turn = scripted_turn(
        [[FunctionCall("send_photo", {})], [TextDelta("Here it is. Anything else?")]]
    )
    tool = make_tool("send_photo", turn.executions, turn.clock, succeeds(delivered=True))
    result = await run_turn(turn, [tool])
    assert result.status is TurnStatus.COMPLETED
    assert result.reason is None  # a reply in its own right, not an empty pass that settled
    assert result.stream_results[-1].outcome == "completed"
    assert result.final_text == "Here it is. Anything else?"


async def test_a_blank_follow_up_that_settles_leaves_nothing_undelivered() -> None:
    turn = scripted_turn(
        [[TextDelta("Here you go. "), FunctionCall("react", {})], [TextDelta("\n")]]
    )
    tool = make_tool("react", turn.executions, turn.clock, requires_follow_up=False)
    result = await run_turn(turn, [tool])
    assert result.reason == "settled_after_tool"
    assert turn.channel.text == "Here you go. \n"  # the blank pass was handed over too
    assert result.undelivered_text == ""


async def test_a_stop_in_a_later_pass_keeps_that_pass_confirmed_text_as_final_text() -> None:
    turn = scripted_turn(
        [
            [TextDelta("Checking. "), FunctionCall("lookup", {})],
            [TextDelta("It is sunny"), Pause(5), TextDelta(" and warm.")],
        ]
    )
    tool = make_tool("lookup", turn.executions, turn.clock)
    result = await run_turn(turn, [tool], policy=EAGER, at=[(1.0, lambda s: s.request_stop())])
    assert result.status is TurnStatus.STOPPED_BY_USER
    assert turn.channel.text == "Checking. It is sunny"
    assert result.final_text == "It is sunny"  # the latest pass the user saw, not the first


# --------------------------------------------------------------------------- text and thoughts
async def test_thoughts_streamed_in_pieces_are_kept_whole() -> None:
    turn = scripted_turn([[ThoughtDelta("the user "), ThoughtDelta("wants "), TextDelta("Hi")]])
    result = await run_turn(turn, [])
    assert result.thought_log == "the user wants "


async def test_usage_added_up_in_a_pass_is_estimated_if_any_report_was() -> None:
    turn = scripted_turn(
        [
            [
                UsageReport(10, 0, cumulative=False, estimated=True),
                TextDelta("Hi"),
                UsageReport(0, 3, cumulative=False),
            ]
        ]
    )
    result = await run_turn(turn, [])
    [entry] = result.usage.entries
    assert (entry.input_tokens, entry.output_tokens, entry.estimated) == (10, 3, True)


async def test_a_pass_without_a_usage_report_is_recorded_as_a_marked_estimate() -> None:
    # llama.cpp's server reports no usage: the ledger holds the estimate, marked estimated
    turn = scripted_turn([[ThoughtDelta("Let me think."), TextDelta("今日は晴れです。")]])
    result = await run_turn(turn, [])
    [entry] = result.usage.entries
    question = USER[0]["content"]  # what the model read
    assert (entry.input_tokens, entry.output_tokens, entry.estimated) == (
        estimate_tokens(question),
        estimate_tokens("Let me think.今日は晴れです。"),  # the thoughts and the text
        True,
    )
    # o200k_base counts 9 tokens, where a quarter of the 21 characters said 6
    assert 8 <= entry.output_tokens <= 11
    assert result.usage.has_estimates


async def test_a_call_the_model_wrote_counts_in_the_estimate_and_so_does_its_result() -> None:
    turn = scripted_turn([[FunctionCall("lookup", {"q": "x"})], [TextDelta("Done.")]])
    tool = make_tool("lookup", turn.executions, turn.clock)
    result = await run_turn(turn, [tool])
    first, second = result.usage.entries
    assert first.estimated and second.estimated
    # the call as 'lookup:{"q":"x"}': 7 tokens for o200k_base (16 characters)
    assert first.output_tokens == estimate_tokens('lookup:{"q":"x"}') == 7
    assert second.output_tokens == estimate_tokens("Done.") == 2
    # the second request also carries the call and the tool's answer
    assert second.input_tokens > first.input_tokens


async def test_a_reported_usage_is_never_replaced_by_an_estimate() -> None:
    turn = scripted_turn([[TextDelta("y" * 400), UsageReport(3, 2)]])
    result = await run_turn(turn, [])
    [entry] = result.usage.entries
    assert (entry.input_tokens, entry.output_tokens, entry.estimated) == (3, 2, False)


async def test_a_pass_that_failed_before_its_first_chunk_has_no_usage_entry() -> None:
    refused = ProviderError("HTTP 429", kind="rate_limit", retryable=True)
    turn = scripted_turn([[Fail(refused)]])
    result = await run_turn(turn, [])
    assert result.status is TurnStatus.ERROR
    assert result.usage.entries == ()


# --------------------------------------------------------------------------- the gate
async def test_the_failure_notice_of_a_truncated_call_shows_no_arguments() -> None:
    cut = FunctionCall("get_weather", {"city": "Par"}, truncated=True)
    turn = scripted_turn([[cut], [TextDelta("Sorry.")]])
    await run_turn(turn, [make_tool("get_weather", turn.executions, turn.clock)])
    [notice] = [n for n in turn.channel.notices if n.key == "tool_failed"]
    assert notice.params["summary"].endswith("\narguments: {}")  # never the half-read payload


async def test_a_call_when_no_tool_is_allowed_says_none_may_be_called() -> None:
    turn = scripted_turn([[FunctionCall("get_wether", {})], [TextDelta("Sorry.")]])
    result = await run_turn(turn, [])
    reason = result.history[0].response.reason or ""
    assert reason.endswith("Tools you may call: none.")


# a call that breaks two gate rules at once meets the earlier one (docs/behaviour.md §2.4):
# what the model is told, checked by behaviour rather than by the declaration's order
_GATE_ORDER_CASES = [
    pytest.param(
        FunctionCall(" ", {"city": "Par"}, truncated=True),
        None,
        id="a blank name is malformed before its arguments are called truncated",
    ),
    pytest.param(
        FunctionCall("get_weather", '{"city": "Par', truncated=True, parse_error="unterminated"),
        "The provider truncated the arguments",
        id="truncated before unparseable",
    ),
    pytest.param(
        FunctionCall("get_wether", '{"city": nope}', parse_error="Expecting value at 9"),
        "The arguments were not valid JSON (Expecting value at 9)",
        id="unparseable before outside the allowlist",
    ),
    pytest.param(
        FunctionCall("get_wether", {"city": "Par"}, truncated=True),
        "The provider truncated the arguments",
        id="truncated before outside the allowlist",
    ),
]


@pytest.mark.parametrize(("call", "shown"), _GATE_ORDER_CASES)
async def test_a_call_breaking_two_gate_rules_meets_the_earlier_one(
    call: FunctionCall, shown: str | None
) -> None:
    turn = scripted_turn([[call], [TextDelta("Sorry.")]])
    result = await run_turn(turn, [make_tool("get_weather", turn.executions, turn.clock)])
    assert turn.executions.calls == []  # never run, whichever rule refused it
    if shown is None:
        assert (result.status, result.reason) == (TurnStatus.ERROR, "malformed_call")
        assert result.history == ()
    else:
        assert result.status is TurnStatus.COMPLETED
        (entry,) = result.history
        assert not entry.response.success
        assert (entry.response.reason or "").startswith(shown)


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
    assert machine.turn.produced.follow_ups_cleared == 2


# --------------------------------------------------------------------------- the sans-IO contract
def test_a_channel_failure_while_streaming_tells_the_host_to_cancel_the_stream() -> None:
    machine = ToolLoopMachine(EAGER)
    machine.start(TurnRequest(USER))
    [deliver] = [e for e in machine.feed(TextDelta("Hel")) if isinstance(e, Deliver)]
    effects = machine.feed(DeliveryFailed(deliver.seq, "ConnectionError: gone"))
    assert CancelStream() in effects
    assert machine.state == "error"
    assert machine.result.reason == "host_error"
    [cut] = machine.result.stream_results  # the pass is recorded as ended by the failure
    assert (cut.outcome, cut.error) == ("error", "the host's channel raised")


def test_starting_a_tool_loop_twice_is_refused_naming_the_start() -> None:
    machine = ToolLoopMachine()
    machine.start(TurnRequest(USER))
    with pytest.raises(InvalidEvent, match="already started") as refused:
        machine.start(TurnRequest(USER))
    assert refused.value.event == "start"
    assert machine.state == "awaiting_first_token"


# --------------------------------------------------------------------------- the run's own duties
async def test_a_stream_abandoned_between_chunks_is_closed_before_the_turn_returns() -> None:
    signals = TurnSignals()
    channel = RecordingChannel(on_delivery=lambda _delivered: signals.request_stop())
    provider = ScriptedProvider([[TextDelta("Hel"), TextDelta("lo"), TextDelta(" there")]])
    result = await run_tool_loop(
        provider, [], channel, TurnRequest(USER), policy=EAGER, signals=signals
    )
    assert result.status is TurnStatus.STOPPED_BY_USER
    assert channel.text == "Hel"
    assert provider.streams_closed == 1  # the provider's connection is not left open


class _StoppedMidStream(ScriptedProvider):
    """Notes each chunk as the turn pulls it; the user asks to stop while the provider is
    between its first and second chunk (as a host task would, while the provider waits on
    the network)."""

    def __init__(self, signals: TurnSignals, chunks: list[TextDelta]) -> None:
        super().__init__([chunks])
        self.signals = signals
        self.pulled: list[str] = []

    async def _play(self, script: Sequence[Any]) -> AsyncIterator[Any]:
        for index, chunk in enumerate(script):
            if index == 1:
                self.signals.request_stop()
            self.pulled.append(chunk.text)
            yield chunk


async def test_a_stop_between_two_chunks_ends_the_read_before_the_next_chunk() -> None:
    signals = TurnSignals()
    chunks = [TextDelta("Hel"), TextDelta("lo"), TextDelta(" there")]
    provider = _StoppedMidStream(signals, chunks)
    result = await run_tool_loop(
        provider, [], RecordingChannel(), TurnRequest(USER), signals=signals
    )
    assert result.status is TurnStatus.STOPPED_BY_USER
    assert provider.pulled == ["Hel", "lo"]  # " there" is never asked for


class _CancellableChannel(RecordingChannel):
    """Records the texts whose delivery was cancelled (a real channel would clean up)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.cancelled: list[str] = []

    async def send_text(self, text: str, *, idempotency_key: str | None = None) -> None:
        try:
            await super().send_text(text, idempotency_key=idempotency_key)
        except asyncio.CancelledError:
            self.cancelled.append(text)
            raise


async def test_a_delivery_the_turn_abandons_is_cancelled_before_the_turn_returns() -> None:
    clock = VirtualClock()
    channel = _CancellableChannel(clock=clock, delivery_delay=30)
    provider = ScriptedProvider([[TextDelta("Hello"), Pause(1000)]], clock=clock)
    policy = LoopPolicy(delivery_flush_chars=1, inactivity_timeout=10, abandoned_stream_settle=5)
    result = await run_tool_loop(
        provider, [], channel, TurnRequest(USER), policy=policy, clock=clock
    )
    assert result.status is TurnStatus.TIMEOUT
    assert clock.now() == pytest.approx(15)
    assert channel.cancelled == ["Hello"]  # its cancellation ran before the result came back


async def test_a_step_observer_failing_on_a_deadline_ends_the_run_while_the_provider_stalls() -> (
    None
):
    def observer(step: TraceStep) -> None:
        if step.event.endswith("_deadline"):
            raise RuntimeError("observer broke")

    clock = VirtualClock()
    provider = ScriptedProvider([[TextDelta("Hel"), Pause(1000)]], clock=clock)
    with pytest.raises(RuntimeError, match="observer broke"):
        await run_tool_loop(
            provider,
            [],
            RecordingChannel(clock=clock),
            TurnRequest(USER),
            policy=LoopPolicy(inactivity_timeout=10),
            clock=clock,
            on_step=observer,
        )
    assert clock.now() == pytest.approx(10)  # not left reading the stalled stream
