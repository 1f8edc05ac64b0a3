"""`LoopPolicy.at_ceiling` (docs/behaviour.md §2.1): with ``"answer"`` the last pass the
iteration ceiling allows is offered no tools, so the model answers with what it has; a call it
makes anyway ends the turn ``timeout``/``iteration_ceiling`` as the default does. Time is
virtual."""

from __future__ import annotations

from typing import Any

import pytest

from tests.inner_kit import Turn
from tests.inner_kit import engine_and_model_end_alike
from tests.inner_kit import make_tool
from tests.inner_kit import run_turn
from tests.inner_kit import scripted_turn
from toolloop_fsm import FunctionCall
from toolloop_fsm import LoopPolicy
from toolloop_fsm import TextDelta
from toolloop_fsm import Tool
from toolloop_fsm import TurnStatus
from toolloop_fsm.testing.strategies import TurnScript


def weather(city: str) -> FunctionCall:
    return FunctionCall("get_weather", {"city": city})


def _weather_tool(turn: Turn, **options: Any) -> Tool:
    return make_tool("get_weather", turn.executions, turn.clock, **options)


def _calls(n: int) -> list[list[Any]]:
    return [[weather(str(i))] for i in range(n)]


async def test_the_default_ends_at_the_ceiling_as_before() -> None:
    assert LoopPolicy().at_ceiling == "end"
    turn = scripted_turn(_calls(10))
    result = await run_turn(
        turn, [_weather_tool(turn)], policy=LoopPolicy(max_function_call_iterations=3)
    )
    assert (result.status, result.reason) == (TurnStatus.TIMEOUT, "iteration_ceiling")
    assert len(turn.executions.calls) == 3  # every pass allowed ran its call
    assert not any(r.tools_withdrawn for r in turn.provider.requests)


async def test_answer_makes_the_last_pass_a_final_answer_pass() -> None:
    turn = scripted_turn([*_calls(2), [TextDelta("From what I found: sunny.")]])
    policy = LoopPolicy(max_function_call_iterations=3, at_ceiling="answer")
    result = await run_turn(turn, [_weather_tool(turn)], policy=policy)
    assert [r.tools_withdrawn for r in turn.provider.requests] == [False, False, True]
    assert [t.name for t in turn.provider.requests[2].tools] == ["get_weather"]
    assert (result.status, result.reason) == (
        TurnStatus.COMPLETED,
        "answered_at_iteration_ceiling",
    )
    assert result.final_text == "From what I found: sunny."
    assert result.iterations == 3  # the ceiling still bounds the passes


async def test_calling_anyway_on_the_last_pass_ends_at_the_ceiling_without_running() -> None:
    turn = scripted_turn(_calls(10))
    policy = LoopPolicy(max_function_call_iterations=3, at_ceiling="answer")
    result = await run_turn(turn, [_weather_tool(turn)], policy=policy)
    assert (result.status, result.reason) == (TurnStatus.TIMEOUT, "iteration_ceiling")
    assert len(turn.executions.calls) == 2  # the last pass's call did not run
    assert result.iterations == 3
    assert result.stream_results[-1].ignored_calls == ("get_weather",)
    assert any(n.key == "max_iterations" for n in turn.channel.notices)


async def test_an_answer_before_the_last_pass_completes_as_usual() -> None:
    turn = scripted_turn([*_calls(1), [TextDelta("Sunny.")]])
    policy = LoopPolicy(max_function_call_iterations=3, at_ceiling="answer")
    result = await run_turn(turn, [_weather_tool(turn)], policy=policy)
    assert (result.status, result.reason) == (TurnStatus.COMPLETED, None)


async def test_a_ceiling_of_one_pass_offers_no_tools_at_all() -> None:
    turn = scripted_turn([[TextDelta("Hello.")]])
    policy = LoopPolicy(max_function_call_iterations=1, at_ceiling="answer")
    result = await run_turn(turn, [_weather_tool(turn)], policy=policy)
    assert turn.provider.requests[0].tools_withdrawn is True
    assert result.reason == "answered_at_iteration_ceiling"


async def test_the_limit_reached_on_the_ceilings_last_pass_ends_at_the_ceiling() -> None:
    # the limit's final pass is counted by the ceiling: no pass is left for it by default
    turn = scripted_turn([*_calls(3), [TextDelta("unreached")]])
    policy = LoopPolicy(max_function_call_iterations=3, max_tool_calls=3)
    result = await run_turn(turn, [_weather_tool(turn)], policy=policy)
    assert (result.status, result.reason) == (TurnStatus.TIMEOUT, "iteration_ceiling")
    assert len(turn.executions.calls) == 3


async def test_the_limit_is_named_when_both_withdraw_the_last_passs_tools() -> None:
    turn = scripted_turn([*_calls(2), [TextDelta("Done.")]])
    policy = LoopPolicy(max_function_call_iterations=3, max_tool_calls=2, at_ceiling="answer")
    result = await run_turn(turn, [_weather_tool(turn)], policy=policy)
    assert (result.status, result.reason) == (TurnStatus.COMPLETED, "answered_at_tool_call_limit")


def test_at_ceiling_takes_only_end_or_answer() -> None:
    with pytest.raises(ValueError, match="at_ceiling"):
        LoopPolicy(at_ceiling="stop")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="at_ceiling"):
        LoopPolicy(at_ceiling=True)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("last", "expected"),
    [
        ((TextDelta("ok"),), (TurnStatus.COMPLETED, "answered_at_iteration_ceiling")),
        ((weather("z"),), (TurnStatus.TIMEOUT, "iteration_ceiling")),
    ],
    ids=["answers", "calls-anyway"],
)
async def test_the_reference_model_predicts_the_ending_at_the_ceiling(
    last: tuple[Any, ...], expected: tuple[TurnStatus, str]
) -> None:
    policy = LoopPolicy(max_function_call_iterations=3, at_ceiling="answer")
    script = TurnScript(passes=((weather("a"),), (weather("b"),), last))
    await engine_and_model_end_alike(script, policy, expected)
