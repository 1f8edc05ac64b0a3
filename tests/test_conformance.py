"""Conformance to the reference behaviour: each divergence an audit found, pinned by a test
named after what a chat bot's user would notice (replay by occurrence, lifted suppression,
self-delivered replies that settle, consumed stops, honest final text, and the smaller
rules)."""

from __future__ import annotations

import itertools
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
from toolloop_fsm import Attempt
from toolloop_fsm import ContextRestart
from toolloop_fsm import FunctionCall
from toolloop_fsm import LoopPolicy
from toolloop_fsm import ProviderError
from toolloop_fsm import TextDelta
from toolloop_fsm import Tool
from toolloop_fsm import ToolContext
from toolloop_fsm import ToolResult
from toolloop_fsm import TurnPolicy
from toolloop_fsm import TurnRequest
from toolloop_fsm import TurnSignals
from toolloop_fsm import TurnStatus
from toolloop_fsm import run_generation_turn
from toolloop_fsm.effects import CancelStream
from toolloop_fsm.effects import CancelTool
from toolloop_fsm.effects import RunTool
from toolloop_fsm.events import Chunk
from toolloop_fsm.events import FollowUpArrived
from toolloop_fsm.events import StopRequested
from toolloop_fsm.events import StreamEnded
from toolloop_fsm.sansio import ToolLoopMachine
from toolloop_fsm.testing import Fail
from toolloop_fsm.testing import Pause
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import ScriptedProvider
from toolloop_fsm.testing import VirtualClock

EAGER = LoopPolicy(delivery_flush_chars=1)


def die(executions: Executions, clock: VirtualClock, **options: Any) -> Tool:
    """A die: every real roll gives the next face, so a reused outcome is visible."""
    faces = itertools.count(1)

    async def roll(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        return ToolResult(data={"face": next(faces)})

    return make_tool("roll", executions, clock, roll, **options)


def faces(result: Any) -> list[int]:
    return [entry.response.data["face"] for entry in result.history if entry.call.name == "roll"]


# --------------------------------------------------------------------------- 1. replay identity
async def test_a_deliberate_repeat_inside_one_attempt_runs_again() -> None:
    turn = scripted_turn(
        [
            [FunctionCall("roll", {})],
            [FunctionCall("roll", {})],
            [FunctionCall("roll", {})],
            [TextDelta("You rolled three dice.")],
        ]
    )
    result = await run_turn(turn, [die(turn.executions, turn.clock)])
    assert result.status is TurnStatus.COMPLETED
    assert turn.executions.names() == ["roll", "roll", "roll"]
    assert faces(result) == [1, 2, 3]


async def test_a_restarted_pass_reuses_the_nth_recorded_call_and_runs_a_new_occurrence() -> None:
    turn = scripted_turn(
        [
            [FunctionCall("roll", {})],
            [FunctionCall("enrich", {})],
            # the restarted pass asks again: its 1st roll replays the recorded 1st roll, its
            # 2nd roll is a new occurrence and runs
            [FunctionCall("roll", {})],
            [FunctionCall("roll", {})],
            [TextDelta("done")],
        ]
    )
    enrich = make_tool(
        "enrich",
        turn.executions,
        turn.clock,
        succeeds(context_restart=ContextRestart({"role": "system", "content": "x"})),
    )
    result = await run_turn(turn, [die(turn.executions, turn.clock), enrich])
    assert result.status is TurnStatus.COMPLETED
    assert turn.executions.names() == ["roll", "enrich", "roll"]
    assert faces(result) == [1, 1, 2]


async def test_a_repeat_across_a_model_fallback_reuses_outcomes_by_occurrence() -> None:
    clock = VirtualClock()
    executions = Executions()
    first = ScriptedProvider(
        [
            [FunctionCall("roll", {}, "a1")],
            [FunctionCall("roll", {}, "a2")],
            [Fail(ProviderError("503", kind="server", retryable=True, status_code=503))],
        ],
        clock=clock,
    )
    second = ScriptedProvider(
        [
            [FunctionCall("roll", {}, "b1")],
            [FunctionCall("roll", {}, "b2")],
            [FunctionCall("roll", {}, "b3")],
            [TextDelta("three rolls")],
        ],
        clock=clock,
    )
    result = await run_generation_turn(
        [Attempt(first, label="first"), Attempt(second, label="second")],
        [die(executions, clock)],
        RecordingChannel(clock=clock),
        TurnRequest(USER),
        policy=TurnPolicy(loop=EAGER),
        clock=clock,
    )
    assert result.status is TurnStatus.COMPLETED
    # two rolls in the failed attempt; the fallback reuses both and rolls its third
    assert executions.names() == ["roll", "roll", "roll"]
    assert faces(result) == [1, 2, 3]


async def test_a_tool_marked_rerun_runs_again_even_on_replay() -> None:
    clock = VirtualClock()
    executions = Executions()
    first = ScriptedProvider(
        [
            [FunctionCall("now", {})],
            [Fail(ProviderError("503", kind="server", retryable=True, status_code=503))],
        ],
        clock=clock,
    )
    second = ScriptedProvider([[FunctionCall("now", {})], [TextDelta("it is late")]], clock=clock)
    result = await run_generation_turn(
        [Attempt(first, label="first"), Attempt(second, label="second")],
        [make_tool("now", executions, clock, replay="rerun")],
        RecordingChannel(clock=clock),
        TurnRequest(USER),
        policy=TurnPolicy(loop=EAGER),
        clock=clock,
    )
    assert result.status is TurnStatus.COMPLETED
    assert executions.names() == ["now", "now"]


def test_a_tool_with_an_unknown_replay_mode_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="replay"):
        make_tool("now", Executions(), VirtualClock(), replay="sometimes")


# --------------------------------------------------------------------------- 2. suppression
async def test_continuation_suppression_is_lifted_after_a_successful_tool() -> None:
    turn = scripted_turn(
        [
            [TextDelta("One. "), FunctionCall("flaky", {})],
            [TextDelta("Two. "), FunctionCall("lookup", {})],
            [TextDelta("Three, final.")],
        ],
        continuation_style=True,
    )
    tools = [
        make_tool("flaky", turn.executions, turn.clock, fails("flaky is down")),
        make_tool("lookup", turn.executions, turn.clock),
    ]
    result = await run_turn(turn, tools, policy=EAGER)
    assert result.status is TurnStatus.COMPLETED
    # "Two. " was streamed while suppressed; the successful lookup lifts the suppression
    assert turn.channel.text == "One. Three, final."
    assert result.final_text == "Three, final."


# --------------------------------------------------------------------------- 3. self-delivered
async def test_a_tool_that_delivered_its_own_response_settles_an_empty_follow_up() -> None:
    turn = scripted_turn([[FunctionCall("post_poll", {})], []])
    tool = make_tool("post_poll", turn.executions, turn.clock, succeeds(delivered=True))
    result = await run_turn(turn, [tool])
    assert result.status is TurnStatus.COMPLETED
    assert result.reason == "settled_after_tool"
    assert result.tool_response_delivered


async def test_an_expression_only_reply_settles_an_empty_follow_up() -> None:
    turn = scripted_turn([[FunctionCall("send_sticker", {})], []])
    tool = make_tool("send_sticker", turn.executions, turn.clock, succeeds(expression="wave"))
    result = await run_turn(turn, [tool])
    assert result.status is TurnStatus.COMPLETED
    assert turn.channel.expressions == ["wave"]
    assert result.tool_response_delivered


async def test_an_empty_follow_up_cut_at_the_length_limit_does_not_settle() -> None:
    from toolloop_fsm.events import FinishKind
    from toolloop_fsm.events import FinishReason

    turn = scripted_turn([[FunctionCall("post_poll", {})], [FinishReason(FinishKind.LENGTH)]])
    tool = make_tool("post_poll", turn.executions, turn.clock, succeeds(delivered=True))
    result = await run_turn(turn, [tool])
    assert result.status is TurnStatus.EMPTY_RESPONSE


# --------------------------------------------------------------------------- 4. stop consumed
async def test_a_stop_is_consumed_by_the_turn_that_honours_it() -> None:
    turn = scripted_turn([[TextDelta("Hel"), Pause(5), TextDelta("lo")]])
    first = await run_turn(turn, [], at=[(1.0, lambda s: s.request_stop("halt"))])
    assert first.status is TurnStatus.STOPPED_BY_USER
    assert not turn.signals.stop_requested
    # the same signals object, reused for the next turn, does not stop it
    again = scripted_turn([[TextDelta("Hello again")]])
    again.signals = turn.signals
    second = await run_turn(again, [])
    assert second.status is TurnStatus.COMPLETED
    assert second.final_text == "Hello again"


async def test_a_stop_requested_before_a_turn_starts_still_stops_it() -> None:
    turn = scripted_turn([[TextDelta("never shown")]])
    turn.signals.request_stop()
    result = await run_turn(turn, [])
    assert result.status is TurnStatus.STOPPED_BY_USER
    assert turn.channel.text == ""
    assert not turn.signals.stop_requested


async def test_a_stop_is_consumed_by_the_generation_turn_that_honours_it() -> None:
    clock = VirtualClock()
    signals = TurnSignals()
    signals.request_stop()
    provider = ScriptedProvider([[TextDelta("never")]], clock=clock)
    stopped = await run_generation_turn(
        [Attempt(provider)],
        [],
        RecordingChannel(clock=clock),
        TurnRequest(USER),
        signals=signals,
        clock=clock,
    )
    assert stopped.status is TurnStatus.STOPPED_BY_USER
    provider = ScriptedProvider([[TextDelta("answered")]], clock=clock)
    answered = await run_generation_turn(
        [Attempt(provider)],
        [],
        RecordingChannel(clock=clock),
        TurnRequest(USER),
        signals=signals,
        clock=clock,
    )
    assert answered.status is TurnStatus.COMPLETED


# --------------------------------------------------------------------------- 5. final text
@pytest.mark.parametrize(
    ("ending", "status"),
    [
        ("stop", TurnStatus.STOPPED_BY_USER),
        ("follow_up", TurnStatus.FOLLOW_UP_INTERRUPT),
        ("fail", TurnStatus.ERROR),
        ("stall", TurnStatus.TIMEOUT),
    ],
)
async def test_final_text_holds_only_what_the_user_saw(ending: str, status: TurnStatus) -> None:
    # 12 characters are flushed (the batch size), the rest stays buffered
    tail: list[Any] = [TextDelta(" and more"), Pause(5)]
    if ending == "fail":
        tail = [TextDelta(" and more"), Fail(ProviderError("boom", kind="server", retryable=True))]
    elif ending == "stall":
        tail = [TextDelta(" and more"), Pause(1000)]
    turn = scripted_turn([[TextDelta("Seen by you."), *tail]])
    actions = {
        "stop": [(1.0, lambda s: s.request_stop())],
        "follow_up": [(1.0, lambda s: s.follow_up())],
    }
    result = await run_turn(
        turn,
        [],
        policy=LoopPolicy(delivery_flush_chars=12, inactivity_timeout=10),
        at=actions.get(ending, []),
    )
    assert result.status is status
    assert turn.channel.text == "Seen by you."
    assert result.final_text == "Seen by you."
    assert result.undelivered_text == " and more"


async def test_a_completed_pass_keeps_its_whole_text_as_final_text() -> None:
    turn = scripted_turn([[TextDelta("Seen by you."), TextDelta(" And the rest.")]])
    result = await run_turn(turn, [], policy=LoopPolicy(delivery_flush_chars=12))
    assert result.status is TurnStatus.COMPLETED
    assert result.final_text == "Seen by you. And the rest."
    assert result.undelivered_text == ""


async def test_a_stop_before_anything_was_delivered_leaves_final_text_empty() -> None:
    turn = scripted_turn([[TextDelta("Buffered only"), Pause(5)]])
    result = await run_turn(turn, [], at=[(1.0, lambda s: s.request_stop())])
    assert result.status is TurnStatus.STOPPED_BY_USER
    assert result.final_text == ""
    assert result.undelivered_text == "Buffered only"


# --------------------------------------------------------------------------- 6. smaller rules
async def test_disabled_enrichment_kinds_reach_tools_the_next_request_and_the_result() -> None:
    seen: list[frozenset[str]] = []
    turn = scripted_turn(
        [[FunctionCall("watch_video", {})], [FunctionCall("describe", {})], [TextDelta("ok")]]
    )

    async def describe(_arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        seen.append(ctx.disabled_enrichment_kinds)
        return ToolResult(data="a cat")

    restart = ContextRestart({"role": "system", "content": "transcript"}, ("youtube",))
    tools = [
        make_tool("watch_video", turn.executions, turn.clock, succeeds(context_restart=restart)),
        make_tool("describe", turn.executions, turn.clock, describe),
    ]
    result = await run_turn(turn, tools)
    assert result.status is TurnStatus.COMPLETED
    assert seen == [frozenset({"youtube"})]
    requests = turn.provider.requests
    assert requests[0].disabled_enrichment_kinds == frozenset()
    assert requests[1].disabled_enrichment_kinds == frozenset({"youtube"})
    assert result.disabled_enrichment_kinds == frozenset({"youtube"})


async def test_a_failed_tools_expression_is_not_delivered() -> None:
    turn = scripted_turn([[FunctionCall("send_sticker", {})], [TextDelta("sorry")]])

    async def broken(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        return ToolResult(success=False, message="no such sticker", expression="wave")

    result = await run_turn(turn, [make_tool("send_sticker", turn.executions, turn.clock, broken)])
    assert result.status is TurnStatus.COMPLETED
    assert turn.channel.expressions == []


async def test_the_memory_tool_built_the_ordinary_way_ends_the_turn_after_visible_text() -> None:
    """docs/behaviour.md §4.6: a memory update is silent, whatever ``requires_follow_up``
    says: the model is not asked again and its extra text never reaches the user."""
    turn = scripted_turn(
        [
            [TextDelta("Noted. "), FunctionCall("update_short_term_memory", {"note": "x"})],
            [TextDelta("Anything else?")],
        ]
    )
    memory = make_tool("update_short_term_memory", turn.executions, turn.clock)
    assert memory.requires_follow_up  # the default: the rule does not read it
    result = await run_turn(turn, [memory], policy=EAGER)
    assert (result.status, result.reason) == (TurnStatus.COMPLETED, "pre_tool_text_suffices")
    assert result.final_text == "Noted. "
    assert len(turn.provider.requests) == 1
    assert turn.channel.texts == ["Noted. "]


async def test_a_renamed_memory_tool_in_the_suppress_set_ends_the_turn_after_visible_text() -> None:
    turn = scripted_turn(
        [
            [TextDelta("Noted. "), FunctionCall("remember", {"note": "x"})],
            [TextDelta("Anything else?")],
        ]
    )
    memory = make_tool("remember", turn.executions, turn.clock)
    policy = LoopPolicy(
        memory_tool_name="remember", suppress_followup_after_pre_tool_text={"remember"}
    )
    result = await run_turn(turn, [memory], policy=policy)
    assert (result.status, result.reason) == (TurnStatus.COMPLETED, "pre_tool_text_suffices")
    assert len(turn.provider.requests) == 1


async def test_a_memory_tool_left_out_of_the_suppress_set_is_followed_up() -> None:
    """docs/behaviour.md §4.6: emptying the set is how a host opts out of the memory rule."""
    turn = scripted_turn(
        [
            [TextDelta("Noted. "), FunctionCall("update_short_term_memory", {"note": "x"})],
            [TextDelta("Anything else?")],
        ]
    )
    memory = make_tool("update_short_term_memory", turn.executions, turn.clock)
    policy = LoopPolicy(suppress_followup_after_pre_tool_text=())
    result = await run_turn(turn, [memory], policy=policy)
    assert (result.status, result.reason) == (TurnStatus.COMPLETED, None)
    assert result.iterations == 2
    assert result.final_text == "Anything else?"


async def test_another_suppress_set_tool_that_requires_a_follow_up_does_not_end_the_turn() -> None:
    turn = scripted_turn(
        [
            [TextDelta("Noted. "), FunctionCall("log_mood", {"mood": "calm"})],
            [TextDelta("Anything else?")],
        ]
    )
    mood = make_tool("log_mood", turn.executions, turn.clock, requires_follow_up=True)
    policy = LoopPolicy(
        suppress_followup_after_pre_tool_text={"update_short_term_memory", "log_mood"}
    )
    result = await run_turn(turn, [mood], policy=policy)
    assert (result.status, result.reason) == (TurnStatus.COMPLETED, None)
    assert result.iterations == 2
    assert result.final_text == "Anything else?"


async def test_a_silent_memory_tool_after_text_still_ends_the_turn() -> None:
    turn = scripted_turn(
        [
            [TextDelta("Noted. "), FunctionCall("update_short_term_memory", {"note": "x"})],
            [TextDelta("never asked for")],
        ]
    )
    memory = make_tool(
        "update_short_term_memory", turn.executions, turn.clock, requires_follow_up=False
    )
    result = await run_turn(turn, [memory])
    assert result.status is TurnStatus.COMPLETED
    assert result.iterations == 1


async def test_the_still_working_notice_is_posted_before_the_21st_pass() -> None:
    passes = [[FunctionCall("lookup", {"n": n})] for n in range(21)] + [[TextDelta("done")]]
    turn = scripted_turn(passes)
    seen_at: list[int] = []

    async def lookup(_arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        if any(n.key == "still_working" for n in turn.channel.notices):
            seen_at.append(ctx.iteration)
        return ToolResult(data="ok")

    result = await run_turn(turn, [make_tool("lookup", turn.executions, turn.clock, lookup)])
    assert result.status is TurnStatus.COMPLETED
    notices = [n for n in result.notices if n.key == "still_working"]
    assert len(notices) == 1
    assert notices[0].params == {"iteration": 21}
    assert seen_at[0] == 21  # posted as the 21st pass began, not before the 20th


async def test_both_error_counters_reset_on_a_context_restart() -> None:
    flaky: list[list[Chunk]] = [
        [TextDelta("Hm. "), FunctionCall("flaky", {"n": n})] for n in range(2)
    ]
    turn = scripted_turn(
        [*flaky, [FunctionCall("enrich", {})], *flaky, [TextDelta("done")]],
        continuation_style=True,
    )
    tools = [
        make_tool("flaky", turn.executions, turn.clock, fails("down"), requires_follow_up=True),
        make_tool(
            "enrich",
            turn.executions,
            turn.clock,
            succeeds(context_restart=ContextRestart({"role": "system", "content": "x"})),
        ),
    ]
    # with threshold 3 and ceiling 3, four failures with a restart between the second and the
    # third end neither by the retry rule nor by the error loop
    result = await run_turn(
        turn,
        tools,
        policy=LoopPolicy(max_consecutive_tool_errors=3, continuation_tool_failure_threshold=3),
    )
    assert result.status is TurnStatus.COMPLETED
    assert result.reason is None
    assert turn.executions.names().count("flaky") == 4


async def test_the_held_timeout_notice_is_not_posted_when_a_later_attempt_is_stopped() -> None:
    clock = VirtualClock()
    signals = TurnSignals()
    stalled = ScriptedProvider([[Pause(1000)]], clock=clock)
    stopped = ScriptedProvider([[TextDelta("Hel"), Pause(50)]], clock=clock)
    clock.call_later(330.0, signals.request_stop)
    channel = RecordingChannel(clock=clock)
    result = await run_generation_turn(
        [Attempt(stalled, label="slow"), Attempt(stopped, label="next")],
        [],
        channel,
        TurnRequest(USER),
        policy=TurnPolicy(loop=EAGER),
        signals=signals,
        clock=clock,
    )
    assert result.status is TurnStatus.STOPPED_BY_USER
    assert [n.key for n in channel.notices if n.key == "timeout"] == []


async def test_unreachable_reported_between_attempts_builds_no_further_provider() -> None:
    clock = VirtualClock()
    signals = TurnSignals()
    built: list[str | None] = []

    def failing(key: str | None) -> ScriptedProvider:
        built.append(key)
        error = ProviderError("503", kind="server", retryable=True, status_code=503)
        return ScriptedProvider([[Fail(error)]], clock=clock)

    class Channel(RecordingChannel):
        async def attempt_superseded(self, attempt: int, label: str, text: str) -> None:
            signals.report_unreachable()

    result = await run_generation_turn(
        [Attempt(failing, keys=("k1-aaaaaaaa", "k2-bbbbbbbb"), label="m")],
        [],
        Channel(clock=clock),
        TurnRequest(USER),
        signals=signals,
        clock=clock,
    )
    assert result.status is TurnStatus.SKIPPED
    assert built == ["k1-aaaaaaaa"]


def test_a_stop_emits_cancel_stream_and_cancel_tool_from_the_sansio_machine() -> None:
    async def never(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        raise AssertionError("a sans-IO test runs no tool")

    tool = Tool("lookup", "look up", {"type": "object"}, never)
    streaming = ToolLoopMachine(tools=[tool])
    streaming.start(TurnRequest(USER))
    streaming.feed(TextDelta("Hel"))
    assert any(isinstance(e, CancelStream) for e in streaming.feed(StopRequested()))
    assert streaming.state == "stopped_by_user"

    running = ToolLoopMachine(tools=[tool])
    running.start(TurnRequest(USER))
    running.feed(FunctionCall("lookup", {}))
    dispatched = running.feed(StreamEnded())
    run = next(e for e in dispatched if isinstance(e, RunTool))
    assert running.feed(FollowUpArrived()) == [] or running.state == "executing_tool"
    effects = running.feed(StopRequested())
    assert CancelTool(run.dispatch) in effects
    assert running.state == "stopped_by_user"


async def test_a_kill_during_a_hung_tool_ends_stopped_and_consumes_the_stop() -> None:
    turn = scripted_turn([[FunctionCall("lookup", {})], [TextDelta("never")]])
    result = await run_turn(
        turn,
        [make_tool("lookup", turn.executions, turn.clock, hang)],
        at=[(2.0, lambda s: s.request_stop())],
    )
    assert result.status is TurnStatus.STOPPED_BY_USER
    assert result.reason == "stopped_during_tool"
    assert not turn.signals.stop_requested
