"""The inner-tier cases every rule must have, each as a named test, plus the inner
behaviours of docs/behaviour.md §2–§8 a user would notice. Time is virtual: a 300-second
deadline costs microseconds."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.inner_kit import USER
from tests.inner_kit import Executions
from tests.inner_kit import fails
from tests.inner_kit import hang
from tests.inner_kit import make_tool
from tests.inner_kit import run_turn
from tests.inner_kit import scripted_turn
from tests.inner_kit import succeeds
from toolloop_fsm import ContextRestart
from toolloop_fsm import FinishKind
from toolloop_fsm import FinishReason
from toolloop_fsm import FunctionCall
from toolloop_fsm import LoopPolicy
from toolloop_fsm import ProviderError
from toolloop_fsm import TextDelta
from toolloop_fsm import ThoughtDelta
from toolloop_fsm import ToolContext
from toolloop_fsm import ToolResult
from toolloop_fsm import TurnRequest
from toolloop_fsm import TurnSignals
from toolloop_fsm import TurnStatus
from toolloop_fsm import UsageReport
from toolloop_fsm import result_from_json
from toolloop_fsm import result_to_json
from toolloop_fsm import run_tool_loop
from toolloop_fsm.host import LoopClock
from toolloop_fsm.sansio import Chunk
from toolloop_fsm.sansio import InvalidEvent
from toolloop_fsm.sansio import Notice
from toolloop_fsm.sansio import StreamEnded
from toolloop_fsm.sansio import ToolFinished
from toolloop_fsm.sansio import ToolLoopMachine
from toolloop_fsm.sansio import ToolOutcomeKind
from toolloop_fsm.testing import Fail
from toolloop_fsm.testing import Pause
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import ScriptedProvider


def weather_call(city: str = "Paris", **kwargs: Any) -> FunctionCall:
    return FunctionCall("get_weather", {"city": city}, **kwargs)


# --------------------------------------------------------------------------- kill and stop
async def test_kill_during_a_tool_consumes_the_stop_and_never_shows_the_killed_result() -> None:
    turn = scripted_turn([[TextDelta("Checking the forecast. "), weather_call()], [TextDelta("x")]])
    tool = make_tool("get_weather", turn.executions, turn.clock, hang)
    result = await run_turn(
        turn, [tool], at=[(10, lambda s: s.request_stop("/kill: ok, stopping"))]
    )

    assert result.status is TurnStatus.STOPPED_BY_USER
    assert result.reason == "stopped_during_tool"
    assert turn.executions.names() == ["get_weather"]
    assert result.history == ()  # the killed result is not recorded...
    assert len(turn.provider.requests) == 1  # ...and never shown to the model
    assert turn.channel.queued_front == ["/kill: ok, stopping"]
    assert result.stop_message == "/kill: ok, stopping"
    assert turn.channel.delivered_text == "Checking the forecast. "
    assert turn.clock.now() == pytest.approx(10)


async def test_stopped_stream_still_returns_the_text_it_had_delivered() -> None:
    turn = scripted_turn([[TextDelta("Partial answer, "), Pause(5), TextDelta("never sent")]])
    result = await run_turn(
        turn, [], policy=LoopPolicy(delivery_flush_chars=1), at=[(2, lambda s: s.request_stop())]
    )
    assert result.status is TurnStatus.STOPPED_BY_USER
    assert result.final_text == "Partial answer, "
    assert result.delivered_text == "Partial answer, "
    assert turn.channel.delivered_text == "Partial answer, "
    assert turn.channel.queued_front == []


async def test_stop_before_the_first_pass_runs_nothing() -> None:
    turn = scripted_turn([[weather_call()]])
    turn.signals.request_stop("stop")
    tool = make_tool("get_weather", turn.executions, turn.clock)
    result = await run_turn(turn, [tool])
    assert result.status is TurnStatus.STOPPED_BY_USER
    assert turn.executions.calls == []
    assert turn.channel.queued_front == ["stop"]


async def test_follow_up_while_streaming_discards_the_undelivered_buffer() -> None:
    turn = scripted_turn([[TextDelta("Buffered "), Pause(3), TextDelta("later")]])
    result = await run_turn(turn, [], at=[(1, lambda s: s.follow_up())])
    assert result.status is TurnStatus.FOLLOW_UP_INTERRUPT
    assert turn.channel.delivered == []  # the 9-char buffer was below the flush size
    assert result.delivered == ()


async def test_stale_follow_up_during_a_tool_chain_is_cleared_and_the_chain_continues() -> None:
    turn = scripted_turn([[weather_call()], [weather_call("Lyon")], [TextDelta("Sunny in both.")]])

    async def slow(_arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        await ctx.clock.sleep(10)
        return ToolResult(data={"sky": "clear"})

    tool = make_tool("get_weather", turn.executions, turn.clock, slow)
    result = await run_turn(turn, [tool], at=[(5, lambda s: s.follow_up())])
    assert result.status is TurnStatus.COMPLETED
    assert result.final_text == "Sunny in both."
    assert turn.executions.names() == ["get_weather", "get_weather"]
    cleared = [s for s in result.trace if s.event == "follow_up_arrived"]
    assert [(s.state, s.next_state) for s in cleared] == [("executing_tool", "executing_tool")]
    assert turn.signals.follow_ups == 1


# --------------------------------------------------------------------------- tool deadline
async def test_plain_tool_timeout_is_a_failure_shown_to_the_model_and_the_loop_continues() -> None:
    turn = scripted_turn([[weather_call()], [TextDelta("The weather service is down.")]])
    tool = make_tool("get_weather", turn.executions, turn.clock, hang)
    result = await run_turn(turn, [tool])

    assert result.status is TurnStatus.COMPLETED
    assert turn.clock.now() == pytest.approx(300)
    (entry,) = result.history
    assert entry.response.success is False
    assert entry.response.status == "tool_execution_failed"
    assert entry.response.reason == "timed out after 300 s"
    assert turn.provider.requests[1].history == (entry,)
    notice = next(n for n in turn.channel.notices if n.key == "tool_failed")
    assert notice.hidden and "timed out after 300 s" in notice.params["summary"]


async def test_a_tool_timeout_of_its_own_overrides_the_policy() -> None:
    turn = scripted_turn([[weather_call()], [TextDelta("ok")]])
    tool = make_tool("get_weather", turn.executions, turn.clock, hang, timeout=7.5)
    result = await run_turn(turn, [tool])
    assert result.history[0].response.reason == "timed out after 7.5 s"
    assert turn.clock.now() == pytest.approx(7.5)


# --------------------------------------------------------------------------- the gate
@pytest.mark.parametrize(
    "call",
    [FunctionCall("", {"city": "Paris"}), FunctionCall("   ", {})],
    ids=["no-name", "blank-name"],
)
async def test_a_call_without_a_name_ends_the_turn_error_and_no_call_of_its_batch_runs(
    call: FunctionCall,
) -> None:
    turn = scripted_turn([[TextDelta("Let me look. "), weather_call(), call]])
    tool = make_tool("get_weather", turn.executions, turn.clock)
    result = await run_turn(turn, [tool])
    assert result.status is TurnStatus.ERROR
    assert result.reason == "malformed_call"
    assert result.error_message == "the model asked for a tool call without a name"
    assert turn.executions.calls == []
    assert result.tool_dispatches == 0


@pytest.mark.parametrize(
    ("arguments", "kind"), [(["Paris"], "list"), ("Paris", "str")], ids=["list", "string"]
)
async def test_arguments_that_are_not_an_object_are_refused_and_the_model_is_told(
    arguments: object, kind: str
) -> None:
    turn = scripted_turn([[FunctionCall("get_weather", arguments)], [TextDelta("sorry")]])
    tool = make_tool("get_weather", turn.executions, turn.clock)
    result = await run_turn(turn, [tool])
    assert result.status is TurnStatus.COMPLETED
    assert turn.executions.calls == []
    assert result.tool_dispatches == 0
    (entry,) = result.history
    assert entry.response.success is False
    assert entry.response.reason == (
        f"The arguments must be a JSON object, not {kind}; the tool was not run."
    )
    assert turn.provider.requests[1].history == (entry,)


async def test_allowlist_blocks_a_registered_tool_and_names_the_allowed_ones() -> None:
    turn = scripted_turn([[FunctionCall("send_email", {"to": "x"})], [TextDelta("I can't.")]])
    weather = make_tool("get_weather", turn.executions, turn.clock)
    email = make_tool("send_email", turn.executions, turn.clock)
    result = await run_turn(
        turn, [weather, email], request=TurnRequest(USER, tools_allowed={"get_weather"})
    )
    assert result.status is TurnStatus.COMPLETED
    assert turn.executions.calls == []
    reason = result.history[0].response.reason or ""
    assert "'send_email' is not available" in reason and "get_weather" in reason
    assert [spec.name for spec in turn.provider.requests[0].tools] == ["get_weather"]


async def test_unknown_tool_gets_the_closest_known_name() -> None:
    turn = scripted_turn([[FunctionCall("get_wether", {"city": "Paris"})], [TextDelta("ok")]])
    result = await run_turn(turn, [make_tool("get_weather", turn.executions, turn.clock)])
    assert "Did you mean 'get_weather'?" in (result.history[0].response.reason or "")
    assert turn.executions.calls == []


async def test_truncated_arguments_ten_in_a_row_end_error_with_zero_dispatches() -> None:
    passes = [[weather_call(f"Par{i}", truncated=True)] for i in range(10)]
    turn = scripted_turn(passes)
    result = await run_turn(turn, [make_tool("get_weather", turn.executions, turn.clock)])
    assert result.status is TurnStatus.ERROR
    assert result.reason == "consecutive_tool_errors"
    assert turn.executions.calls == []
    assert result.tool_dispatches == 0
    assert len(result.history) == 5  # the ceiling (5) ends it before the 10 are used up
    for entry in result.history:
        assert entry.call.arguments == {}  # the replayed call carries no arguments
        assert "truncated" in (entry.response.reason or "")
        assert "nothing was updated" in (entry.response.reason or "")
    assert any(n.key == "tool_error_loop" for n in turn.channel.notices)


async def test_unparseable_arguments_are_a_failure_naming_the_parse_error() -> None:
    bad = FunctionCall("get_weather", '{"city": nope}', parse_error="Expecting value at 9")
    turn = scripted_turn([[bad], [TextDelta("Sorry.")]])
    result = await run_turn(turn, [make_tool("get_weather", turn.executions, turn.clock)])
    assert result.status is TurnStatus.COMPLETED
    assert "Expecting value at 9" in (result.history[0].response.reason or "")
    assert turn.executions.calls == []


# --------------------------------------------------------------------------- ceilings
async def test_five_consecutive_failures_end_error_after_exactly_five_dispatches() -> None:
    turn = scripted_turn([[weather_call(f"city{i}")] for i in range(10)])
    tool = make_tool("get_weather", turn.executions, turn.clock, fails("service unavailable"))
    result = await run_turn(turn, [tool])
    assert result.status is TurnStatus.ERROR
    assert result.reason == "consecutive_tool_errors"
    assert len(turn.executions.calls) == 5
    assert result.tool_dispatches == 5
    assert [n.key for n in turn.channel.notices].count("tool_error_loop") == 1


async def test_a_success_resets_the_consecutive_failure_count() -> None:
    outcomes = iter([False, False, False, False, True, False, False, False, False])

    async def flaky(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        return ToolResult(success=next(outcomes), message="flaky")

    turn = scripted_turn([[weather_call(f"c{i}")] for i in range(9)] + [[TextDelta("done")]])
    result = await run_turn(turn, [make_tool("get_weather", turn.executions, turn.clock, flaky)])
    assert result.status is TurnStatus.COMPLETED
    assert len(turn.executions.calls) == 9


async def test_iteration_ceiling_ends_timeout_after_exactly_one_hundred_passes() -> None:
    turn = scripted_turn([[weather_call(f"city{i}")] for i in range(120)])
    tool = make_tool("get_weather", turn.executions, turn.clock)
    result = await run_turn(turn, [tool])
    assert result.status is TurnStatus.TIMEOUT
    assert result.reason == "iteration_ceiling"
    assert len(turn.provider.requests) == 100
    assert result.iterations == 100
    assert len(turn.executions.calls) == 100
    keys = [n.key for n in turn.channel.notices]
    assert keys.count("max_iterations") == 1
    assert keys.count("still_working") == 1
    still = next(n for n in turn.channel.notices if n.key == "still_working")
    assert still.params == {"iteration": 21}  # posted as the 21st pass begins


# --------------------------------------------------------------------------- restart
async def test_restart_appends_context_once_and_adds_no_history_entry() -> None:
    profile = {"role": "system", "content": "User profile: likes hiking."}
    restart = ContextRestart(profile, disable_kinds=("profile",))
    turn = scripted_turn(
        [
            [TextDelta("Let me look you up. "), FunctionCall("load_profile", {"kind": "profile"})],
            [FunctionCall("load_profile", {"kind": "profile"})],  # asked again: reused
            [TextDelta("You like hiking!")],
        ]
    )
    loader = make_tool(
        "load_profile", turn.executions, turn.clock, succeeds(context_restart=restart)
    )
    result = await run_turn(turn, [loader])
    assert result.status is TurnStatus.COMPLETED
    assert turn.executions.names() == ["load_profile"]  # never run twice
    first, second, third = turn.provider.requests
    assert profile not in first.context
    assert list(second.context).count(profile) == 1
    assert second.context[-1] == profile
    assert second.history == ()  # the restart call is not in the tool history
    assert list(third.context).count(profile) == 1
    assert result.iterations == 3  # the iteration counter still advances


# --------------------------------------------------------------------------- history
async def test_pre_tool_text_is_kept_per_iteration_and_not_repeated_in_the_prefill() -> None:
    turn = scripted_turn(
        [
            [TextDelta("Let me check. "), weather_call()],
            [TextDelta("  \n"), weather_call("Lyon")],
            [TextDelta("Now the forecast. "), weather_call("Nice")],
            [TextDelta("All sunny.")],
        ]
    )
    tool = make_tool("get_weather", turn.executions, turn.clock)
    result = await run_turn(turn, [tool], request=TurnRequest(USER, prefill="Sure! "))
    requests = turn.provider.requests
    assert requests[0].prefill == "Sure! "
    assert all(r.prefill is None for r in requests[1:])  # cleared after the history push
    assert [e.pre_tool_text for e in result.history] == [
        "Let me check. ",
        None,
        "Now the forecast. ",
    ]
    assert requests[3].history == result.history
    assert result.final_text == "All sunny."


async def test_history_entry_carries_the_tools_message_beside_its_data() -> None:
    turn = scripted_turn([[weather_call()], [TextDelta("ok")]])
    tool = make_tool(
        "get_weather",
        turn.executions,
        turn.clock,
        succeeds(data={"temp_c": 21}, message="from the cache"),
    )
    result = await run_turn(turn, [tool])
    response = result.history[0].response
    assert response.success and response.data == {"temp_c": 21}
    assert response.message == "from the cache"


async def test_a_tool_that_raises_is_a_failure_shown_to_the_model() -> None:
    async def broken(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        raise KeyError("city")

    turn = scripted_turn([[weather_call()], [TextDelta("Sorry.")]])
    result = await run_turn(turn, [make_tool("get_weather", turn.executions, turn.clock, broken)])
    assert result.status is TurnStatus.COMPLETED
    assert "KeyError" in (result.history[0].response.reason or "")


async def test_failure_notice_shows_the_arguments_through_the_tools_redaction() -> None:
    turn = scripted_turn([[FunctionCall("login", {"user": "ann", "password": "hunter2"})], []])
    tool = make_tool(
        "login",
        turn.executions,
        turn.clock,
        fails("denied"),
        redact=lambda args: {**args, "password": "***"},
    )
    await run_turn(turn, [tool])
    notice = next(n for n in turn.channel.notices if n.key == "tool_failed")
    assert notice.hidden
    assert notice.params["tool"] == "login"
    # the reason is short, so the arguments are in the summary: redacted, the rest as given
    assert notice.params["summary"] == (
        'tool login failed: denied\narguments: {"password": "***", "user": "ann"}'
    )
    assert "hunter2" not in str(notice)


async def test_failure_notice_is_cut_to_1800_characters() -> None:
    turn = scripted_turn([[FunctionCall("login", {"user": "ann"})], []])
    tool = make_tool("login", turn.executions, turn.clock, fails("denied: " + "x" * 5000))
    await run_turn(turn, [tool])
    notice = next(n for n in turn.channel.notices if n.key == "tool_failed")
    summary = notice.params["summary"]
    assert len(summary) == 1800
    assert summary.startswith("tool login failed: denied: xxx") and summary.endswith("x…")


# --------------------------------------------------------------------------- exit rules
async def test_memory_tool_after_text_ends_the_turn_and_without_text_continues() -> None:
    after_text = scripted_turn(
        [[TextDelta("Noted, I'll remember. "), FunctionCall("update_short_term_memory", {"n": 1})]]
    )
    memory = make_tool(
        "update_short_term_memory",
        after_text.executions,
        after_text.clock,
        requires_follow_up=False,
    )
    result = await run_turn(after_text, [memory])
    assert result.status is TurnStatus.COMPLETED
    assert result.reason == "pre_tool_text_suffices"
    assert result.final_text == "Noted, I'll remember. "
    assert len(after_text.provider.requests) == 1

    no_text = scripted_turn(
        [[FunctionCall("update_short_term_memory", {"n": 1})], [TextDelta("Got it.")]]
    )
    memory = make_tool("update_short_term_memory", no_text.executions, no_text.clock)
    result = await run_turn(no_text, [memory])
    assert result.status is TurnStatus.COMPLETED
    assert result.final_text == "Got it."
    assert len(no_text.provider.requests) == 2
    # a successful memory update disables further memory updates for the turn
    assert [t.name for t in no_text.provider.requests[1].tools] == []


async def test_end_turn_ends_completed_with_this_pass_text() -> None:
    turn = scripted_turn(
        [[TextDelta("Sending it now. "), FunctionCall("send", {})], [TextDelta("x")]]
    )
    tool = make_tool("send", turn.executions, turn.clock, succeeds(end_turn=True, delivered=True))
    result = await run_turn(turn, [tool])
    assert result.status is TurnStatus.COMPLETED
    assert result.reason == "end_turn"
    assert result.final_text == "Sending it now. "
    assert result.tool_response_delivered is True
    assert len(turn.provider.requests) == 1


@pytest.mark.parametrize(
    ("requires_follow_up", "finish", "expected"),
    [
        (False, None, TurnStatus.COMPLETED),
        (True, None, TurnStatus.EMPTY_RESPONSE),
        (False, FinishKind.LENGTH, TurnStatus.EMPTY_RESPONSE),
        (False, FinishKind.SPEAKER_GUARD, TurnStatus.EMPTY_RESPONSE),
    ],
    ids=["settled", "needs-follow-up", "cut-by-length", "speaker-guard"],
)
async def test_empty_follow_up_settles_only_when_allowed(
    requires_follow_up: bool, finish: FinishKind | None, expected: TurnStatus
) -> None:
    empty_pass = [FinishReason(finish)] if finish is not None else []
    turn = scripted_turn(
        [[TextDelta("Here you go. "), FunctionCall("react", {"e": 1})], empty_pass]
    )
    tool = make_tool("react", turn.executions, turn.clock, requires_follow_up=requires_follow_up)
    result = await run_turn(turn, [tool])
    assert result.status is expected
    if expected is TurnStatus.COMPLETED:
        assert result.reason == "settled_after_tool"


async def test_empty_pass_without_visible_text_before_is_an_empty_response() -> None:
    turn = scripted_turn([[FunctionCall("react", {"e": 1})], []])
    tool = make_tool("react", turn.executions, turn.clock, requires_follow_up=False)
    result = await run_turn(turn, [tool])
    assert result.status is TurnStatus.EMPTY_RESPONSE


async def test_expression_ordering_and_at_most_one_expression_per_turn() -> None:
    turn = scripted_turn(
        [
            [TextDelta("Look at this: "), FunctionCall("sticker", {"name": "cat"})],
            [TextDelta("Cute, right? "), FunctionCall("sticker", {"name": "dog"})],
            [TextDelta("Bye!")],
        ]
    )

    async def sticker(arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        return ToolResult(expression=f"{arguments['name']}_sticker")

    tool = make_tool("sticker", turn.executions, turn.clock, sticker)
    result = await run_turn(turn, [tool])
    delivered = [(d.text, d.expression) for d in turn.channel.delivered]
    assert delivered == [
        ("Look at this: ", None),
        (None, "cat_sticker"),
        ("Cute, right? ", None),
        ("Bye!", None),
    ]
    assert [(d.text, d.expression) for d in result.delivered] == delivered


# --------------------------------------------------------------------------- continuation providers
async def test_continuation_provider_failure_after_text_suppresses_text_then_gives_up() -> None:
    passes: list[list[Chunk]] = [
        [TextDelta(f"Part {i}. "), FunctionCall("lookup", {"i": i})] for i in range(5)
    ]
    turn = scripted_turn(passes, continuation_style=True)
    tool = make_tool("lookup", turn.executions, turn.clock, fails("nope"))
    result = await run_turn(turn, [tool], policy=LoopPolicy(delivery_flush_chars=1))
    assert result.status is TurnStatus.COMPLETED
    assert result.reason == "continuation_retries_exhausted"
    assert any(n.key == "retry_exhausted" for n in turn.channel.notices)
    assert turn.channel.texts == ["Part 0. "]  # text after the first failure is suppressed
    assert len(turn.executions.calls) == 3


async def test_continuation_provider_ends_after_text_when_the_tool_needs_no_follow_up() -> None:
    turn = scripted_turn(
        [[TextDelta("Done. "), FunctionCall("react", {})]], continuation_style=True
    )
    tool = make_tool("react", turn.executions, turn.clock, requires_follow_up=False)
    result = await run_turn(turn, [tool])
    assert result.status is TurnStatus.COMPLETED
    assert result.reason == "pre_tool_text_suffices"


async def test_custom_exit_rule_replaces_should_end_after_pre_tool_text() -> None:
    turn = scripted_turn([[TextDelta("Sent. "), FunctionCall("notify", {})], [TextDelta("x")]])
    tool = make_tool("notify", turn.executions, turn.clock)
    policy = LoopPolicy(end_after_pre_tool_text=lambda view: view.tool_name == "notify")
    result = await run_turn(turn, [tool], policy=policy)
    assert result.reason == "pre_tool_text_suffices"


# --------------------------------------------------------------------------- budgets and settling
@pytest.mark.parametrize(("pause", "expected"), [(299.0, "completed"), (301.0, "timeout")])
async def test_first_token_budget(pause: float, expected: str) -> None:
    turn = scripted_turn([[Pause(pause), TextDelta("hello")]])
    result = await run_turn(turn, [])
    assert result.status == expected
    if expected == "timeout":
        assert result.reason == "first_token_timeout"
        assert turn.clock.now() == pytest.approx(300)
        assert any(n.key == "timeout" for n in turn.channel.notices)


@pytest.mark.parametrize(("pause", "expected"), [(119.0, "completed"), (121.0, "timeout")])
async def test_inactivity_budget_rolls_with_every_chunk(pause: float, expected: str) -> None:
    # chunks keep arriving for 200 s (past the 120 s budget), then one silence of `pause`
    steady = [item for _ in range(20) for item in (Pause(10), TextDelta("."))]
    turn = scripted_turn([[TextDelta("a"), *steady, Pause(pause), TextDelta("b")]])
    result = await run_turn(turn, [])
    assert result.status == expected
    if expected == "timeout":
        assert result.reason == "inactivity_timeout"
        assert turn.clock.now() == pytest.approx(200 + 120)


async def test_settle_window_lets_an_in_flight_delivery_be_recorded() -> None:
    turn = scripted_turn([[TextDelta("Hello"), Pause(1000)]], delivery_delay=12)
    policy = LoopPolicy(delivery_flush_chars=1, inactivity_timeout=10, abandoned_stream_settle=5)
    result = await run_turn(turn, [], policy=policy)
    assert result.status is TurnStatus.TIMEOUT
    assert result.reason == "inactivity_timeout"
    assert result.delivered_text == "Hello"  # recorded at t=12, inside the 5 s window
    assert turn.clock.now() == pytest.approx(12)


async def test_settle_window_is_bounded_and_abandons_what_is_still_in_flight() -> None:
    turn = scripted_turn([[TextDelta("Hello"), Pause(1000)]], delivery_delay=30)
    policy = LoopPolicy(delivery_flush_chars=1, inactivity_timeout=10, abandoned_stream_settle=5)
    result = await run_turn(turn, [], policy=policy)
    assert result.status is TurnStatus.TIMEOUT
    assert result.delivered == ()
    assert turn.channel.delivered == []  # cancelled, never confirmed
    assert turn.clock.now() == pytest.approx(15)


async def test_kill_path_skips_the_settle_window() -> None:
    turn = scripted_turn([[TextDelta("Hello"), Pause(1000)]], delivery_delay=12)
    policy = LoopPolicy(delivery_flush_chars=1, inactivity_timeout=10, abandoned_stream_settle=5)
    result = await run_turn(turn, [], policy=policy, at=[(11, lambda s: s.request_stop())])
    assert result.status is TurnStatus.STOPPED_BY_USER
    assert turn.clock.now() == pytest.approx(11)
    assert result.delivered == ()
    assert turn.channel.delivered == []


async def test_a_stop_while_streaming_does_not_wait_for_the_delivery_in_flight() -> None:
    # "Hello" is on its way to the user (confirmed only at t=12) when the stop comes at t=5
    turn = scripted_turn([[TextDelta("Hello"), Pause(1000)]], delivery_delay=12)
    policy = LoopPolicy(delivery_flush_chars=1, inactivity_timeout=10, abandoned_stream_settle=5)
    result = await run_turn(turn, [], policy=policy, at=[(5, lambda s: s.request_stop())])
    assert result.status is TurnStatus.STOPPED_BY_USER
    assert turn.clock.now() == pytest.approx(5)  # no settle window for a stop
    assert result.delivered == ()
    assert turn.channel.delivered == []


# --------------------------------------------------------------------------- providers and hosts
async def test_provider_failure_ends_error_with_the_providers_facts() -> None:
    error = ProviderError(
        "rate limited", kind="rate_limit", retryable=True, status_code=429, retry_after=7.0
    )
    turn = scripted_turn([[TextDelta("Hel"), Fail(error)]])
    result = await run_turn(turn, [])
    assert result.status is TurnStatus.ERROR
    assert result.reason == "provider_error"
    assert (result.provider_error_kind, result.retryable, result.retry_after) == (
        "rate_limit",
        True,
        7.0,
    )
    assert result.error_message == "rate limited"


async def test_a_channel_that_raises_ends_the_turn_error_with_the_exception_attached() -> None:
    turn = scripted_turn([[TextDelta("Hello there")]])
    turn.channel.fail_when = lambda text, _expr: text is not None
    result = await run_turn(turn, [])
    assert result.status is TurnStatus.ERROR
    assert result.reason == "host_error"
    assert isinstance(result.exception, ConnectionError)


async def test_usage_thoughts_and_scene_metadata_reach_the_result() -> None:
    from toolloop_fsm.events import SceneMetadata

    turn = scripted_turn(
        [
            [ThoughtDelta("need weather"), weather_call(), UsageReport(10, 5)],
            [
                ThoughtDelta("answer now"),
                TextDelta("Sunny."),
                SceneMetadata("mood: calm"),
                UsageReport(30, 8),
            ],
        ]
    )
    result = await run_turn(turn, [make_tool("get_weather", turn.executions, turn.clock)])
    assert (result.usage.input_tokens, result.usage.output_tokens) == (40, 13)
    assert result.thought_log == "answer now"
    assert result.final_text == "Sunny.\n\n[Scene Metadata]\nmood: calm"
    assert result.iterations == 2
    assert [s.outcome for s in result.stream_results] == ["function_call", "completed"]
    assert result.details_text == "get_weather: ok"


async def test_result_and_trace_round_trip_through_json() -> None:
    turn = scripted_turn(
        [[TextDelta("Checking. "), weather_call(), UsageReport(3, 4)], [TextDelta("Sunny.")]]
    )
    result = await run_turn(turn, [make_tool("get_weather", turn.executions, turn.clock)])
    text = result_to_json(result)
    again = result_from_json(text)
    assert again == result
    assert again.trace == result.trace and len(again.trace) > 5
    assert result_to_json(again) == text


# --------------------------------------------------------------------------- the machine contract
def test_an_event_the_state_cannot_take_raises_invalid_event_naming_both() -> None:
    machine = ToolLoopMachine()
    machine.start(TurnRequest(USER))
    with pytest.raises(InvalidEvent) as caught:
        machine.feed(ToolFinished(1, ToolOutcomeKind.SUCCEEDED))
    message = str(caught.value)
    assert "awaiting_first_token" in message and "ToolFinished" in message
    assert machine.state == "awaiting_first_token"  # nothing changed


def test_feeding_a_finished_machine_raises_invalid_event() -> None:
    machine = ToolLoopMachine()
    machine.start(TurnRequest(USER))
    machine.feed(StreamEnded())
    assert machine.is_finished and machine.result.status is TurnStatus.EMPTY_RESPONSE
    with pytest.raises(InvalidEvent, match="empty_response"):
        machine.feed(TextDelta("late"))


# --------------------------------------------------------------------------- real cancellation
async def test_cancelling_the_caller_cancels_the_tool_and_the_stream_and_propagates() -> None:
    started = asyncio.Event()
    cancelled: list[str] = []

    async def blocking(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append("tool")
            raise
        raise AssertionError("unreachable")

    executions = Executions()
    provider = ScriptedProvider([[TextDelta("Working. "), weather_call()]])
    tool = make_tool("get_weather", executions, LoopClock(), blocking)  # type: ignore[arg-type]
    task = asyncio.ensure_future(
        run_tool_loop(provider, [tool], RecordingChannel(), TurnRequest(USER), clock=LoopClock())
    )
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cancelled == ["tool"]
    assert provider.streams_closed == 1


async def test_an_outer_asyncio_timeout_raises_timeout_error_and_cancels_the_stream() -> None:
    reached = asyncio.Event()

    class StallingProvider:
        name = "stalling"
        closed = False

        async def _stream(self) -> Any:
            try:
                yield TextDelta("thinking…")
                reached.set()
                await asyncio.Event().wait()
            finally:
                StallingProvider.closed = True

        def stream(self, request: Any) -> Any:
            return self._stream()

    async def guarded() -> Any:
        async with asyncio.timeout(None) as scope:
            holder.append(scope)
            return await run_tool_loop(
                StallingProvider(), [], RecordingChannel(), TurnRequest(USER), clock=LoopClock()
            )

    holder: list[asyncio.Timeout] = []
    task = asyncio.ensure_future(guarded())
    await reached.wait()
    holder[0].reschedule(asyncio.get_running_loop().time())
    with pytest.raises(TimeoutError):
        await task
    assert StallingProvider.closed


async def test_signals_object_is_reusable_for_a_later_turn() -> None:
    signals = TurnSignals()
    clock_turn = scripted_turn([[TextDelta("one")]])
    clock_turn.signals = signals
    first = await run_turn(clock_turn, [])
    second_turn = scripted_turn([[TextDelta("two")]])
    second_turn.signals = signals
    second = await run_turn(second_turn, [])
    assert (first.final_text, second.final_text) == ("one", "two")
    assert signals._listeners == []


def test_notice_is_plain_data() -> None:
    notice = Notice("tool_failed", {"tool": "x"}, hidden=True)
    assert notice == Notice("tool_failed", {"tool": "x"}, hidden=True)


async def test_a_provider_that_yields_something_else_fails_the_pass_with_a_clear_message() -> None:
    turn = scripted_turn([[TextDelta("ok "), {"content": "not an event"}]])  # type: ignore[list-item]
    result = await run_turn(turn, [])
    assert result.status is TurnStatus.ERROR
    assert result.provider_error_kind == "protocol"
    assert "yielded dict, not a chunk event" in (result.error_message or "")


async def test_a_failing_step_observer_surfaces_as_its_own_exception() -> None:
    def observer(_step: Any) -> None:
        raise RuntimeError("observer broke")

    provider = ScriptedProvider([[TextDelta("hi")]])
    with pytest.raises(RuntimeError, match="observer broke"):
        await run_tool_loop(provider, [], RecordingChannel(), TurnRequest(USER), on_step=observer)
