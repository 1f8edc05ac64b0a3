"""Regression tests: host code that hangs, raises the wrong thing, ignores its cancellation,
mutates what it was handed or calls in from another thread cannot keep a turn from
returning, lose a confirmed delivery or rewrite the history.

One test per defect, each on a virtual clock (no real sleeping) and each behind a real-time
guard (`returns_within`, which, unlike a plain `asyncio.timeout`, still ends when the code
under test swallows its cancellation), so that a regression is a failure, not a hung suite.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import attrs
import pytest

from tests.inner_kit import USER
from tests.inner_kit import Executions
from tests.inner_kit import Turn
from tests.inner_kit import fails
from tests.inner_kit import hang
from tests.inner_kit import make_tool
from tests.inner_kit import run_turn
from toolloop_fsm import Attempt
from toolloop_fsm import FunctionCall
from toolloop_fsm import GenerationTurnResult
from toolloop_fsm import LoopPolicy
from toolloop_fsm import ProviderError
from toolloop_fsm import SharedRoute
from toolloop_fsm import TextDelta
from toolloop_fsm import Tool
from toolloop_fsm import ToolContext
from toolloop_fsm import ToolResult
from toolloop_fsm import TurnPolicy
from toolloop_fsm import TurnRequest
from toolloop_fsm import TurnSignals
from toolloop_fsm import TurnStatus
from toolloop_fsm import run_generation_turn
from toolloop_fsm import run_tool_loop
from toolloop_fsm.attempts import AdmissionRequest
from toolloop_fsm.result import InDoubtCall
from toolloop_fsm.result import InDoubtCause
from toolloop_fsm.result import result_from_json
from toolloop_fsm.result import result_to_json
from toolloop_fsm.testing import Fail
from toolloop_fsm.testing import Pause
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import ScriptedProvider
from toolloop_fsm.testing import ScriptItem
from toolloop_fsm.testing import VirtualClock
from toolloop_fsm.testing import real_time_limit
from toolloop_fsm.testing.hostile import ChannelAct
from toolloop_fsm.testing.hostile import HostileChannel
from toolloop_fsm.testing.hostile import HostileProvider
from toolloop_fsm.testing.hostile import RogueBaseException
from toolloop_fsm.testing.hostile import Stragglers
from toolloop_fsm.testing.hostile import Trickle
from toolloop_fsm.testing.hostile import fire_from_thread
from toolloop_fsm.testing.hostile import returns_within

#: Real seconds any one turn may take before the test calls it hung (a virtual-time turn
#: takes milliseconds).
GUARD = 10.0
#: Float slack for virtual instants.
EPSILON = 1e-6
WEATHER = FunctionCall("get_weather", {"city": "Paris"})


def hostile_turn(
    passes: Sequence[Sequence[Any]],
    policy: LoopPolicy,
    *,
    sends: Sequence[ChannelAct] = (),
    notices: Sequence[ChannelAct] = (),
    delivery_delay: float = 0.0,
    provider: ScriptedProvider | None = None,
) -> tuple[Turn, HostileChannel, Stragglers]:
    clock = VirtualClock()
    stragglers = Stragglers()
    channel = HostileChannel(
        clock=clock,
        host_call_timeout=policy.host_call_timeout,
        stragglers=stragglers,
        sends=sends,
        notices=notices,
        delivery_delay=delivery_delay,
    )
    turn = Turn(
        clock=clock,
        provider=provider if provider is not None else ScriptedProvider(passes, clock=clock),
        channel=channel,
        signals=TurnSignals(),
        executions=Executions(),
    )
    return turn, channel, stragglers


async def guarded(
    turn: Turn,
    tools: Sequence[Tool],
    stragglers: Stragglers,
    *,
    policy: LoopPolicy,
    at: Sequence[tuple[float, Any]] = (),
) -> GenerationTurnResult:
    """Run the turn behind the real-time guard; release what ignored its cancellation."""
    channel = turn.channel
    running = channel.running if isinstance(channel, HostileChannel) else list
    try:
        return await returns_within(
            run_turn(turn, tools, policy=policy, at=at),
            GUARD,
            stragglers=stragglers,
            running=lambda: [call.label for call in running()],
        )
    finally:
        stragglers.release()


def texts(result: GenerationTurnResult) -> list[str]:
    return [d.text for d in result.delivered if d.text is not None]


# --------------------------------------------------------------------------- the channel
async def test_a_notice_that_never_returns_does_not_keep_the_turn_from_returning() -> None:
    policy = LoopPolicy(inactivity_timeout=5, first_token_timeout=5, delivery_flush_chars=1)
    turn, channel, stragglers = hostile_turn(
        [[TextDelta("Checking"), Pause(400)]], policy, notices=(ChannelAct.HANG,)
    )

    result = await guarded(turn, [], stragglers, policy=policy)

    assert (result.status, result.reason) == (TurnStatus.TIMEOUT, "inactivity_timeout")
    assert texts(result) == channel.texts == ["Checking"]
    assert [call.method for call in channel.calls][-1] == "send_notice"
    # the stall (5 s), the settle window, and at most one host-call budget for the notice
    bound = 5 + policy.abandoned_stream_settle + policy.host_call_timeout
    assert turn.clock.now() <= bound + EPSILON


@pytest.mark.parametrize("hanging", [ChannelAct.HANG, ChannelAct.IGNORE_CANCELLATION])
async def test_two_hanging_notices_delay_the_turn_by_one_host_call_budget_not_two(
    hanging: ChannelAct,
) -> None:
    # the tool fails (a hidden tool_failed notice) and that is one failure too many (the
    # tool_error_loop notice): both notices hang; the second is never waited for
    policy = LoopPolicy(max_consecutive_tool_errors=1, host_call_timeout=30, cancel_grace=2)
    turn, channel, stragglers = hostile_turn([[WEATHER]], policy, notices=(hanging, hanging))
    weather = make_tool("get_weather", turn.executions, turn.clock, fails("no station"))

    result = await guarded(turn, [weather], stragglers, policy=policy)

    assert (result.status, result.reason) == (TurnStatus.ERROR, "consecutive_tool_errors")
    assert [notice.key for notice in result.notices] == ["tool_failed", "tool_error_loop"]
    notices_asked = [call for call in channel.calls if call.method == "send_notice"]
    assert [call.act for call in notices_asked] == [hanging]  # the second is not awaited
    assert result.abandoned_calls == ("channel.send_notice",)
    assert turn.clock.now() <= policy.host_call_timeout + policy.cancel_grace + EPSILON


async def test_a_notice_that_overran_mid_turn_is_given_up_on_and_the_turn_goes_on() -> None:
    # the first tool failure's notice hangs; the model then answers: the reply is delivered
    # and the turn completes, the hung notice named and nothing else waited for
    policy = LoopPolicy(host_call_timeout=30, tool_timeout=60, delivery_flush_chars=1)
    turn, channel, stragglers = hostile_turn(
        [[WEATHER], [WEATHER], [TextDelta("No weather today.")]],
        policy,
        notices=(ChannelAct.HANG, ChannelAct.HANG),
    )
    weather = make_tool("get_weather", turn.executions, turn.clock, fails("no station"))

    result = await guarded(turn, [weather], stragglers, policy=policy)

    assert result.status is TurnStatus.COMPLETED
    assert texts(result) == channel.texts == ["No weather today."]
    assert result.abandoned_calls == ("channel.send_notice",)
    assert [call.method for call in channel.calls].count("send_notice") == 1
    assert turn.clock.now() <= policy.host_call_timeout + EPSILON


async def test_a_send_that_never_returns_ends_the_turn_host_timeout_keeping_confirmed_ones() -> (
    None
):
    policy = LoopPolicy(inactivity_timeout=120, host_call_timeout=30, delivery_flush_chars=1)
    turn, channel, stragglers = hostile_turn(
        [[TextDelta("Hello"), TextDelta(" world")]],
        policy,
        sends=(ChannelAct.CONFIRM, ChannelAct.HANG),
    )

    result = await guarded(turn, [], stragglers, policy=policy)

    assert (result.status, result.reason) == (TurnStatus.ERROR, "host_timeout")
    assert texts(result) == channel.texts == ["Hello"]
    assert turn.clock.now() <= policy.host_call_timeout + EPSILON


async def test_a_delivery_confirmed_while_a_notice_holds_up_the_turn_counts_as_read() -> None:
    # The stall times the pass out at 2 s and the settle window (1 s) gives up on "Hello",
    # but the timeout notice hangs (until the 30-second host-call budget) and the channel
    # confirms "Hello" at 4 s, before the turn returns: the user read it.
    policy = LoopPolicy(
        inactivity_timeout=2,
        first_token_timeout=2,
        abandoned_stream_settle=1,
        host_call_timeout=30,
        delivery_flush_chars=1,
    )
    turn, channel, stragglers = hostile_turn(
        [[TextDelta("Hello"), Pause(100)]],
        policy,
        notices=(ChannelAct.HANG,),
        delivery_delay=4.0,
    )

    result = await guarded(turn, [], stragglers, policy=policy)

    assert (result.status, result.reason) == (TurnStatus.TIMEOUT, "inactivity_timeout")
    assert texts(result) == channel.texts == ["Hello"]
    # what the result says was delivered is what it says the user read, and not unread
    assert result.final_text == "Hello"
    assert result.undelivered_text == ""


async def test_a_channel_that_ignores_its_cancellation_is_abandoned_and_named() -> None:
    policy = LoopPolicy(
        inactivity_timeout=120, host_call_timeout=30, cancel_grace=2, delivery_flush_chars=1
    )
    turn, channel, stragglers = hostile_turn(
        [[TextDelta("Hello"), TextDelta(" world")]],
        policy,
        sends=(ChannelAct.CONFIRM, ChannelAct.IGNORE_CANCELLATION),
    )

    result = await guarded(turn, [], stragglers, policy=policy)

    assert (result.status, result.reason) == (TurnStatus.ERROR, "host_timeout")
    assert result.abandoned_calls == ("channel.send_text",)
    assert channel.calls[1].cancel_ignored  # it really was cancelled, and swallowed it
    assert texts(result) == channel.texts == ["Hello"]
    assert turn.clock.now() <= policy.host_call_timeout + policy.cancel_grace + EPSILON


# --------------------------------------------------------------------------- tools
async def test_a_tool_that_ignores_cancellation_after_its_deadline_is_abandoned_and_named() -> None:
    policy = LoopPolicy(tool_timeout=10, cancel_grace=2, delivery_flush_chars=1)
    turn, channel, stragglers = hostile_turn(
        [[WEATHER], [TextDelta("Sorry, no weather today.")]], policy
    )
    dispatches: list[int] = []

    async def stubborn(_arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        dispatches.append(ctx.dispatch)
        await stragglers.ignore_cancellation(f"tool get_weather (dispatch {ctx.dispatch})")
        raise AssertionError("released only after the turn returned")

    tool = make_tool("get_weather", turn.executions, turn.clock, stubborn)

    result = await guarded(turn, [tool], stragglers, policy=policy)

    assert result.status is TurnStatus.COMPLETED
    assert not result.history[0].response.success  # the deadline's failed result
    assert result.abandoned_calls == (f"tool get_weather (dispatch {dispatches[0]})",)
    assert stragglers.cancel_ignored  # cancelled at its deadline, and it swallowed that
    assert channel.text == "Sorry, no weather today."
    assert turn.clock.now() <= policy.tool_timeout + policy.cancel_grace + EPSILON


async def test_hostile_tools_in_one_batch_still_give_every_sibling_its_result() -> None:
    # one call hangs ignoring its cancellation, one raises a BaseException of the host's own,
    # one returns garbage, one works: the batch ends at the hanging call's deadline, each
    # call is answered on its own, and the working one's answer reaches the model
    policy = LoopPolicy(tool_timeout=10, cancel_grace=2, delivery_flush_chars=1)
    batch = [FunctionCall(name, {}, f"call-{name}") for name in ("hangs", "raises", "junk", "ok")]
    turn, channel, stragglers = hostile_turn([batch, [TextDelta("Done what I could.")]], policy)

    async def hangs(_arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        await stragglers.ignore_cancellation(f"tool hangs (dispatch {ctx.dispatch})")
        raise AssertionError("released only after the turn returned")

    async def raises(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        raise RogueBaseException("the host's own")

    async def junk(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        return {"not": "a ToolResult"}  # type: ignore[return-value]

    tools = [
        make_tool("hangs", turn.executions, turn.clock, hangs),
        make_tool("raises", turn.executions, turn.clock, raises),
        make_tool("junk", turn.executions, turn.clock, junk),
        make_tool("ok", turn.executions, turn.clock),
    ]

    result = await guarded(turn, tools, stragglers, policy=policy)

    assert result.status is TurnStatus.COMPLETED
    assert channel.text == "Done what I could."
    # all four started together, at the batch's start
    assert sorted(name for name, _, at in turn.executions.calls if at == 0.0) == [
        "hangs",
        "junk",
        "ok",
        "raises",
    ]
    answers = {e.call.name: e.response for e in result.history}
    assert [e.call.name for e in result.history] == ["hangs", "raises", "junk", "ok"]
    assert answers["hangs"].reason == "timed out after 10 s"
    assert not answers["raises"].success and "RogueBaseException" in (
        answers["raises"].reason or ""
    )
    assert not answers["junk"].success and "not ToolResult" in (answers["junk"].reason or "")
    assert answers["ok"].success and answers["ok"].message == "ok done"
    assert result.abandoned_calls == ("tool hangs (dispatch 1)",)
    # the batch waited for its slowest call's deadline and grace, not for each call in turn
    assert turn.clock.now() <= policy.tool_timeout + policy.cancel_grace + EPSILON


async def test_a_tool_abandoned_mid_turn_is_not_waited_for_again_when_the_turn_ends() -> None:
    # abandoned at its grace (12 s) while the next pass streams (10-15 s): the turn returns
    # when that pass ends, without giving the same tool a second grace
    policy = LoopPolicy(tool_timeout=10, cancel_grace=2, delivery_flush_chars=1)
    turn, channel, stragglers = hostile_turn(
        [[WEATHER], [Pause(5), TextDelta("Sorry, no weather today.")]], policy
    )

    async def stubborn(_arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        await stragglers.ignore_cancellation(f"tool get_weather (dispatch {ctx.dispatch})")
        raise AssertionError("released only after the turn returned")

    tool = make_tool("get_weather", turn.executions, turn.clock, stubborn)

    result = await guarded(turn, [tool], stragglers, policy=policy)

    assert result.status is TurnStatus.COMPLETED
    assert len(result.abandoned_calls) == 1
    assert channel.text == "Sorry, no weather today."
    assert turn.clock.now() <= policy.tool_timeout + 5 + EPSILON


async def test_the_late_answer_of_a_tool_cancelled_at_its_deadline_is_never_shown() -> None:
    # the tool swallows its cancellation and answers anyway, a moment too late: the model
    # sees the deadline's failure, never that answer
    policy = LoopPolicy(tool_timeout=10, cancel_grace=2, delivery_flush_chars=1)
    turn, channel, stragglers = hostile_turn(
        [[WEATHER], [TextDelta("Sorry, no weather today.")]], policy
    )

    async def answers_late(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()
        return ToolResult(data={"forecast": "late sunshine"})

    tool = make_tool("get_weather", turn.executions, turn.clock, answers_late)

    result = await guarded(turn, [tool], stragglers, policy=policy)

    assert result.status is TurnStatus.COMPLETED
    assert turn.executions.names() == ["get_weather"]
    (entry,) = result.history
    assert (entry.response.success, entry.response.reason) == (False, "timed out after 10 s")
    assert entry.response.data is None
    (_, second) = turn.provider.requests
    assert [e.response for e in second.history] == [entry.response]
    assert "late sunshine" not in repr(result)
    assert channel.text == "Sorry, no weather today."
    assert result.abandoned_calls == ()  # it did stop, only with an answer


# --------------------------------------------------------------------------- calls in doubt
PAYMENT = FunctionCall("pay", {"amount": 30}, "call_pay")


def stubborn_payment(turn: Turn, stragglers: Stragglers, reconcile: Any = None) -> Tool:
    """A payment that ignores its cancellation at its deadline: it may have gone through."""

    async def pay(_arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        await stragglers.ignore_cancellation(f"tool pay (dispatch {ctx.dispatch})")
        raise AssertionError("released only after the turn returned")

    tool = make_tool("pay", turn.executions, turn.clock, pay)
    return attrs.evolve(tool, reconcile=reconcile) if reconcile is not None else tool


async def test_a_tool_abandoned_after_its_grace_is_named_in_doubt() -> None:
    policy = LoopPolicy(tool_timeout=10, cancel_grace=2, delivery_flush_chars=1)
    turn, channel, stragglers = hostile_turn([[PAYMENT], [TextDelta("Let me check.")]], policy)

    result = await guarded(turn, [stubborn_payment(turn, stragglers)], stragglers, policy=policy)

    assert result.status is TurnStatus.COMPLETED
    # no reconcile hook: the model is told the timeout at the deadline, as before
    assert result.history[0].response.reason == "timed out after 10 s"
    assert result.in_doubt_calls == (
        InDoubtCall("pay", 1, "call_pay", InDoubtCause.ABANDONED, reconciled=False),
    )
    assert result.abandoned_calls == ("tool pay (dispatch 1)",)
    assert channel.text == "Let me check."
    assert result_from_json(result_to_json(result)).in_doubt_calls == result.in_doubt_calls


async def test_a_reconciled_call_is_the_outcome_the_model_sees() -> None:
    policy = LoopPolicy(tool_timeout=10, cancel_grace=2, delivery_flush_chars=1)
    turn, channel, stragglers = hostile_turn([[PAYMENT], [TextDelta("Paid.")]], policy)
    asked: list[tuple[dict[str, Any], int, float]] = []

    async def look_up(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        asked.append((arguments, ctx.dispatch, turn.clock.now()))
        return ToolResult(data={"payment": "settled", "id": "p-1"}, message="it went through")

    tool = stubborn_payment(turn, stragglers, look_up)

    result = await guarded(turn, [tool], stragglers, policy=policy)

    assert result.status is TurnStatus.COMPLETED
    # asked once, after the deadline and the grace, with the call's own arguments
    assert asked == [({"amount": 30}, 1, 12.0)]
    (entry,) = result.history
    assert entry.response.success
    assert entry.response.data == {"payment": "settled", "id": "p-1"}
    (_, second) = turn.provider.requests
    assert [e.response for e in second.history] == [entry.response]
    assert result.in_doubt_calls == (
        InDoubtCall("pay", 1, "call_pay", InDoubtCause.ABANDONED, reconciled=True),
    )
    assert channel.text == "Paid."


async def test_a_cut_off_tool_with_a_reconcile_hook_that_stops_in_its_grace_timed_out() -> None:
    policy = LoopPolicy(tool_timeout=10, cancel_grace=2, delivery_flush_chars=1)
    turn, channel, stragglers = hostile_turn([[PAYMENT], [TextDelta("Sorry.")]], policy)
    asked: list[int] = []

    async def look_up(_arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        asked.append(ctx.dispatch)
        return ToolResult(data="never asked")

    async def slow_to_stop(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        try:
            await asyncio.Event().wait()
        finally:
            with contextlib.suppress(asyncio.CancelledError):
                await turn.clock.sleep(1)  # cleans up within its grace, then stops
        raise AssertionError("unreachable")

    tool = make_tool("pay", turn.executions, turn.clock, slow_to_stop, reconcile=look_up)

    result = await guarded(turn, [tool], stragglers, policy=policy)

    assert result.status is TurnStatus.COMPLETED
    assert result.history[0].response.reason == "timed out after 10 s"
    assert asked == []
    assert result.in_doubt_calls == ()
    assert result.abandoned_calls == ()
    assert channel.text == "Sorry."


def reconciles_badly(how: str, stragglers: Stragglers) -> Any:
    async def raising(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        raise QuotaExhausted("the ledger service is down")

    async def hanging(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        await stragglers.ignore_cancellation("reconcile pay")
        raise AssertionError("released only after the turn returned")

    async def cannot_tell(_arguments: dict[str, Any], _ctx: ToolContext) -> None:
        return None

    return {"raises": raising, "hangs": hanging, "returns None": cannot_tell}[how]


@pytest.mark.parametrize("how", ["raises", "hangs", "returns None"])
async def test_a_reconcile_that_cannot_tell_leaves_the_call_in_doubt_and_the_model_told(
    how: str,
) -> None:
    policy = LoopPolicy(
        tool_timeout=10, cancel_grace=2, host_call_timeout=5, delivery_flush_chars=1
    )
    turn, channel, stragglers = hostile_turn([[PAYMENT], [TextDelta("I cannot tell.")]], policy)
    tool = stubborn_payment(turn, stragglers, reconciles_badly(how, stragglers))

    result = await guarded(turn, [tool], stragglers, policy=policy)

    assert result.status is TurnStatus.COMPLETED
    (entry,) = result.history
    assert not entry.response.success
    assert entry.response.reason is not None
    assert entry.response.reason.startswith("the outcome of pay is unknown")
    assert result.in_doubt_calls == (
        InDoubtCall("pay", 1, "call_pay", InDoubtCause.ABANDONED, reconciled=False),
    )
    assert channel.text == "I cannot tell."
    # the deadline, the grace, and at most the host-call budget for the hook
    assert turn.clock.now() <= 10 + 2 + 5 + EPSILON


async def pay_then_fall_back(
    answer: ToolResult | None, backup_says: str
) -> tuple[GenerationTurnResult, list[int], list[int]]:
    """A payment that ignores its cancellation past its deadline, settled by a reconcile hook
    answering ``answer``; the primary model then fails and the backup asks for the same
    payment. Returns the result, the dispatches run and those the hook was asked about."""
    clock, channel, stragglers, _ = outer_world()
    policy = TurnPolicy(
        loop=LoopPolicy(
            tool_timeout=10, cancel_grace=2, host_call_timeout=30, delivery_flush_chars=1
        )
    )
    asked: list[int] = []
    runs: list[int] = []

    async def pay(_arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        runs.append(ctx.dispatch)
        await stragglers.ignore_cancellation(f"tool pay (dispatch {ctx.dispatch})")
        raise AssertionError("released only after the turn returned")

    async def look_up(_arguments: dict[str, Any], ctx: ToolContext) -> ToolResult | None:
        asked.append(ctx.dispatch)
        return answer

    tool = Tool("pay", "pay", {"type": "object"}, pay, reconcile=look_up)
    first = ScriptedProvider([[PAYMENT], [Fail(server_error())]], clock=clock)
    second = ScriptedProvider(
        [[FunctionCall("pay", {"amount": 30}, "other_id")], [TextDelta(backup_says)]],
        clock=clock,
    )
    result = await generate(
        [Attempt(first, label="primary"), Attempt(second, label="backup")],
        channel,
        clock,
        stragglers,
        policy=policy,
        tools=[tool],
    )
    return result, runs, asked


async def test_a_reconciled_payment_is_reused_on_a_fallback_without_asking_again() -> None:
    result, runs, asked = await pay_then_fall_back(ToolResult(data={"payment": "settled"}), "Paid.")

    assert result.status is TurnStatus.COMPLETED
    assert runs == [1] and asked == [1]  # neither run nor asked again by the backup
    assert result.history[0].response.data == {"payment": "settled"}
    assert result.tool_dispatches == 0  # the backup reused the reconciled outcome
    assert result.in_doubt_calls == (
        InDoubtCall("pay", 1, "call_pay", InDoubtCause.ABANDONED, reconciled=True),
    )


async def test_a_payment_nobody_could_settle_is_not_run_again_on_a_fallback() -> None:
    # the hook cannot tell: the call stays in doubt, and the backup model asking for the same
    # payment is handed the same unknown outcome instead of paying a second time
    result, runs, asked = await pay_then_fall_back(None, "It may have gone.")

    assert result.status is TurnStatus.COMPLETED
    assert runs == [1] and asked == [1]  # neither run nor asked again by the backup
    assert result.tool_dispatches == 0
    reused = result.history[0].response
    assert not reused.success
    assert reused.reason is not None and reused.reason.startswith("the outcome of pay is unknown")
    assert result.in_doubt_calls == (
        InDoubtCall("pay", 1, "call_pay", InDoubtCause.ABANDONED, reconciled=False),
    )


class QuotaExhausted(BaseException):
    """A host library's own BaseException subclass (as some SDKs define)."""


@pytest.mark.parametrize(
    "raised",
    [QuotaExhausted("monthly quota used up"), GeneratorExit("the client closed itself")],
    ids=["custom BaseException", "GeneratorExit"],
)
async def test_a_tool_raising_a_base_exception_fails_the_call_at_once(
    raised: BaseException,
) -> None:
    policy = LoopPolicy(tool_timeout=300, delivery_flush_chars=1)
    turn, channel, stragglers = hostile_turn(
        [[WEATHER], [TextDelta("The weather service is unavailable.")]], policy
    )

    async def breaks(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        raise raised

    tool = make_tool("get_weather", turn.executions, turn.clock, breaks)

    result = await guarded(turn, [tool], stragglers, policy=policy)

    assert result.status is TurnStatus.COMPLETED
    response = result.history[0].response
    assert not response.success
    assert type(raised).__name__ in (response.reason or "")  # shown to the model by name
    assert channel.text == "The weather service is unavailable."
    # failed at once: no wait for the 300-second tool deadline
    assert turn.clock.now() < 1.0


def test_keyboard_interrupt_from_a_tool_reaches_the_caller_after_the_turns_children_are_cancelled() -> (  # noqa: E501
    None
):
    policy = LoopPolicy(host_call_timeout=100, delivery_flush_chars=1)
    seen_at_raise: list[list[str | None]] = []

    async def main() -> tuple[str, list[str | None]]:
        turn, channel, _stragglers = hostile_turn(
            [[TextDelta("Let me look."), WEATHER], [TextDelta("never")]],
            policy,
            sends=(ChannelAct.SLOW_WITHIN,),  # the first delivery takes 50 s
        )

        async def interrupted(_arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
            await ctx.clock.sleep(1)
            seen_at_raise.append([call.outcome for call in channel.calls])
            raise KeyboardInterrupt

        tool = make_tool("get_weather", turn.executions, turn.clock, interrupted)
        try:
            async with real_time_limit(GUARD):
                await run_turn(turn, [tool], policy=policy)
        except KeyboardInterrupt:
            return "caught by the caller", [call.outcome for call in channel.calls]
        return "returned", []

    try:
        outcome, outcomes = asyncio.run(main())
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped the event loop instead of reaching the caller")
    assert seen_at_raise == [[None]]  # the delivery was still in flight when the tool raised
    assert outcome == "caught by the caller"
    assert outcomes == ["cancelled"]  # the in-flight delivery was cancelled first


def _mutate_nested(arguments: dict[str, Any]) -> None:
    arguments["cities"].append("Paris")
    arguments["units"]["temp"] = "F"
    arguments["days"] = 7
    arguments["injected"] = True


def _mutate_flat(arguments: dict[str, Any]) -> None:
    arguments["city"] = "Paris"
    arguments["days"] = 7
    del arguments["note"]
    arguments["injected"] = True


@pytest.mark.parametrize(
    ("sent", "mutate"),
    [
        ({"cities": ["Oslo", "Lima"], "units": {"temp": "C"}, "days": 2}, _mutate_nested),
        # strings, numbers, flags and nulls only: the tool's copy is a plain one
        ({"city": "Oslo", "days": 2, "metric": True, "note": None, "ratio": 0.5}, _mutate_flat),
    ],
    ids=["nested", "flat"],
)
async def test_a_tool_that_mutates_its_arguments_leaves_the_history_as_the_model_sent_it(
    sent: dict[str, Any], mutate: Callable[[dict[str, Any]], None]
) -> None:
    policy = LoopPolicy(delivery_flush_chars=1)
    turn, _channel, stragglers = hostile_turn(
        [[FunctionCall("get_weather", copy.deepcopy(sent))], [TextDelta("Mild.")]], policy
    )

    async def careless(arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        mutate(arguments)
        return ToolResult(data={"ok": True})

    tool = make_tool("get_weather", turn.executions, turn.clock, careless)

    result = await guarded(turn, [tool], stragglers, policy=policy)

    assert result.status is TurnStatus.COMPLETED
    assert result.history[0].call.arguments == sent
    # and the follow-up request told the model what it really asked for
    assert turn.provider.requests[1].history[0].call.arguments == sent


# --------------------------------------------------------------------------- signals
async def test_a_stop_requested_from_another_thread_stops_the_turn_at_that_instant() -> None:
    policy = LoopPolicy(tool_timeout=300, delivery_flush_chars=1)
    turn, _channel, stragglers = hostile_turn([[WEATHER], [TextDelta("never")]], policy)
    tool = make_tool("get_weather", turn.executions, turn.clock, hang)
    thread_errors: list[BaseException | None] = []

    def stop_from_a_thread(signals: TurnSignals) -> None:
        thread_errors.append(fire_from_thread(signals.request_stop))

    result = await guarded(turn, [tool], stragglers, policy=policy, at=[(5.0, stop_from_a_thread)])

    assert thread_errors == [None]  # the signal itself did not raise in its thread
    assert result.status is TurnStatus.STOPPED_BY_USER
    assert turn.clock.now() <= 5.0 + EPSILON  # not at the 300-second tool deadline


# --------------------------------------------------------------------------- the provider
async def test_a_stream_that_trickles_forever_ends_timeout_at_the_pass_budget() -> None:
    policy = LoopPolicy(
        inactivity_timeout=10,
        first_token_timeout=10,
        max_pass_duration=60,
        delivery_flush_chars=1,
    )
    clock_turn, channel, stragglers = hostile_turn([], policy)
    provider = HostileProvider(
        [[TextDelta("Thinking"), Trickle()]], clock=clock_turn.clock, inactivity_timeout=10
    )
    turn = Turn(clock_turn.clock, provider, channel, clock_turn.signals, clock_turn.executions)

    result = await guarded(turn, [], stragglers, policy=policy)

    assert (result.status, result.reason) == (TurnStatus.TIMEOUT, "pass_duration_timeout")
    assert channel.text.startswith("Thinking.")
    assert texts(result) == channel.texts
    assert (
        policy.max_pass_duration
        <= turn.clock.now()
        <= policy.max_pass_duration + policy.abandoned_stream_settle + EPSILON
    )


# --------------------------------------------------------------------------- a stop's race
async def test_a_delivery_confirmed_at_the_instant_of_a_stop_is_kept() -> None:
    # The stop's timer is armed first, so at t=3 it fires before the delivery's own timer;
    # the stop message takes a while to queue, and the delivery confirms meanwhile.
    policy = LoopPolicy(inactivity_timeout=120, host_call_timeout=10, delivery_flush_chars=1)
    turn, channel, stragglers = hostile_turn(
        [[TextDelta("Hello"), Pause(100)]],
        policy,
        notices=(ChannelAct.SLOW_WITHIN,),  # queueing the stop message takes 5 s
        delivery_delay=3.0,
    )

    def stop(signals: TurnSignals) -> None:
        signals.request_stop("stopping now")

    result = await guarded(turn, [], stragglers, policy=policy, at=[(3.0, stop)])

    assert result.status is TurnStatus.STOPPED_BY_USER
    delivery = channel.calls[0]
    assert (delivery.method, delivery.finished_at) == ("send_text", 3.0)  # the race was run
    # whichever won, what the channel confirmed is what the result says was delivered
    assert texts(result) == channel.texts


# --------------------------------------------------------------------------- the outer tier
def server_error() -> ProviderError:
    return ProviderError("503 overloaded", kind="server", retryable=True, status_code=503)


async def generate(
    attempts: Sequence[Attempt],
    channel: HostileChannel,
    clock: VirtualClock,
    stragglers: Stragglers,
    *,
    policy: TurnPolicy,
    shared_route: SharedRoute | None = None,
    tools: Sequence[Tool] = (),
) -> GenerationTurnResult:
    try:
        return await returns_within(
            run_generation_turn(
                attempts,
                tools,
                channel,
                TurnRequest(USER),
                policy=policy,
                clock=clock,
                shared_route=shared_route,
            ),
            GUARD,
            stragglers=stragglers,
            running=lambda: [call.label for call in channel.running()],
        )
    finally:
        stragglers.release()


def outer_world(
    *, hooks: Sequence[ChannelAct] = (), notices: Sequence[ChannelAct] = ()
) -> tuple[VirtualClock, HostileChannel, Stragglers, TurnPolicy]:
    clock = VirtualClock()
    stragglers = Stragglers()
    policy = TurnPolicy(loop=LoopPolicy(host_call_timeout=30, delivery_flush_chars=1))
    channel = HostileChannel(
        clock=clock, host_call_timeout=30, stragglers=stragglers, hooks=hooks, notices=notices
    )
    return clock, channel, stragglers, policy


def failing_then_answering(clock: VirtualClock) -> list[Attempt]:
    first: list[ScriptItem] = [TextDelta("The answer "), Fail(server_error())]
    return [
        Attempt(ScriptedProvider([first], clock=clock), label="primary"),
        Attempt(ScriptedProvider([[TextDelta("is 42.")]], clock=clock), label="backup"),
    ]


async def test_a_superseded_mark_that_never_returns_does_not_keep_the_turn_from_returning() -> None:
    clock, channel, stragglers, policy = outer_world(hooks=(ChannelAct.HANG,))

    result = await generate(
        failing_then_answering(clock), channel, clock, stragglers, policy=policy
    )

    assert result.status is TurnStatus.COMPLETED
    assert channel.text == "The answer is 42."
    assert [call.method for call in channel.calls if call.act is ChannelAct.HANG] == [
        "attempt_superseded"
    ]
    assert clock.now() <= policy.loop.host_call_timeout + EPSILON


async def test_an_admission_policy_that_never_answers_does_not_keep_the_turn_from_returning() -> (
    None
):
    clock, channel, stragglers, policy = outer_world()
    shared = ScriptedProvider([[TextDelta("from the shared route")]], clock=clock)
    asked: list[AdmissionRequest] = []

    async def admit(request: AdmissionRequest) -> bool:
        asked.append(request)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    primary = ScriptedProvider([[Fail(server_error())]], clock=clock)
    result = await generate(
        [Attempt(primary, label="primary")],
        channel,
        clock,
        stragglers,
        policy=policy,
        shared_route=SharedRoute((Attempt(shared, label="shared"),), admit),
    )

    assert len(asked) == 1
    assert result.status is TurnStatus.ERROR  # no answer is no admission
    assert shared.requests == []
    assert clock.now() <= policy.loop.host_call_timeout + EPSILON


async def test_an_admission_call_still_running_when_the_user_stops_the_turn_is_cancelled() -> None:
    clock, channel, stragglers, policy = outer_world()
    shared = ScriptedProvider([[TextDelta("from the shared route")]], clock=clock)
    cancelled: list[float] = []

    async def admit(_request: AdmissionRequest) -> bool:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(clock.now())
            raise
        raise AssertionError("unreachable")

    signals = TurnSignals()
    clock.call_later(5, signals.request_stop)
    primary = ScriptedProvider([[Fail(server_error())]], clock=clock)
    result = await returns_within(
        run_generation_turn(
            [Attempt(primary, label="primary")],
            [],
            channel,
            TurnRequest(USER),
            policy=policy,
            clock=clock,
            signals=signals,
            shared_route=SharedRoute((Attempt(shared, label="shared"),), admit),
        ),
        GUARD,
        stragglers=stragglers,
    )

    assert result.status is TurnStatus.STOPPED_BY_USER
    assert cancelled == [pytest.approx(5)]  # the host's call was cancelled at the stop
    assert result.abandoned_calls == ()  # and it stopped: nothing left running
    assert shared.requests == []
    assert clock.now() == pytest.approx(5)


async def test_a_notice_that_never_returns_does_not_keep_a_generation_turn_from_returning() -> None:
    clock, channel, stragglers, policy = outer_world(notices=(ChannelAct.HANG,))

    result = await generate(
        failing_then_answering(clock), channel, clock, stragglers, policy=policy
    )

    assert result.status is TurnStatus.COMPLETED
    assert channel.text == "The answer is 42."
    assert [call.method for call in channel.calls if call.act is ChannelAct.HANG] == ["send_notice"]
    assert clock.now() <= policy.loop.host_call_timeout + EPSILON


async def test_hanging_notices_of_both_tiers_delay_a_generation_turn_by_one_budget() -> None:
    # the primary's tool fails (its tool_failed notice hangs), then the primary fails and
    # the backup answers (the closing fallback_used notice would hang too): one budget
    clock, channel, stragglers, policy = outer_world(notices=(ChannelAct.HANG, ChannelAct.HANG))
    weather = make_tool("get_weather", Executions(), clock, fails("no station"))
    primary = ScriptedProvider([[WEATHER], [Fail(server_error())]], clock=clock)
    backup = ScriptedProvider([[TextDelta("No weather today.")]], clock=clock)
    attempts = [Attempt(primary, label="primary"), Attempt(backup, label="backup")]

    result = await generate(attempts, channel, clock, stragglers, policy=policy, tools=[weather])

    assert result.status is TurnStatus.COMPLETED
    assert channel.text == "No weather today."
    assert [notice.key for notice in result.notices][-1] == "fallback_used"
    assert [call.method for call in channel.calls].count("send_notice") == 1
    assert result.abandoned_calls == ("channel.send_notice",)
    assert clock.now() <= policy.loop.host_call_timeout + EPSILON


class _RefusingProvider:
    """A provider whose ``stream()`` raises before it returns an iterator (a client that
    validates the request eagerly, or a bug): the pass fails; the turn does not crash."""

    name = "refusing"

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.calls = 0

    def stream(self, request: Any) -> Any:
        self.calls += 1
        raise self.error


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (
            ProviderError("no such model", kind="not_found", retryable=False, status_code=404),
            "not_found",
        ),
        (RuntimeError("the client was closed"), "provider_error"),
    ],
    ids=["provider-error", "plain-exception"],
)
async def test_a_provider_whose_stream_raises_at_once_fails_the_pass_not_the_turn(
    error: Exception, kind: str
) -> None:
    provider = _RefusingProvider(error)
    channel = RecordingChannel(clock=VirtualClock())
    result = await run_tool_loop(provider, [], channel, TurnRequest(USER))
    assert result.status is TurnStatus.ERROR
    assert result.reason == "provider_error"
    assert result.provider_error_kind == kind
    assert provider.calls == 1
