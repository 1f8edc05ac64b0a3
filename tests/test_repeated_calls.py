"""The repeated-call guard (docs/behaviour.md §3.11): a call identical to ones that already
ran (or were reused) `LoopPolicy.max_identical_calls` times in the turn is not run, the model
is told so with the earlier outcome, and it counts as a tool error. Time is virtual."""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest

from tests.inner_kit import engine_and_model_end_alike
from tests.inner_kit import fails
from tests.inner_kit import make_tool
from tests.inner_kit import run_turn
from tests.inner_kit import scripted_turn
from tests.inner_kit import succeeds
from toolloop_fsm import ContextRestart
from toolloop_fsm import FunctionCall
from toolloop_fsm import LoopPolicy
from toolloop_fsm import TextDelta
from toolloop_fsm import Tool
from toolloop_fsm import ToolResult
from toolloop_fsm import TurnStatus
from toolloop_fsm import tool
from toolloop_fsm.ledger import canonical_call_key
from toolloop_fsm.testing.strategies import DEFAULT_TOOLS
from toolloop_fsm.testing.strategies import TurnScript


def weather(city: str = "Paris") -> FunctionCall:
    return FunctionCall("get_weather", {"city": city})


def test_the_default_stops_a_call_repeated_long_before_the_iteration_ceiling() -> None:
    policy = LoopPolicy()
    assert policy.max_identical_calls == 3
    # repeats refused after the allowance, then the error ceiling: far below 100 passes
    assert policy.max_identical_calls + policy.max_consecutive_tool_errors < (
        policy.max_function_call_iterations
    )


async def test_a_model_repeating_one_call_ends_consecutive_tool_errors_before_the_ceiling() -> None:
    turn = scripted_turn([[weather()] for _ in range(40)])
    result = await run_turn(turn, [make_tool("get_weather", turn.executions, turn.clock)])
    assert (result.status, result.reason) == (TurnStatus.ERROR, "consecutive_tool_errors")
    assert len(turn.executions.calls) == 3  # the allowance, then nothing runs
    assert result.tool_dispatches == 3
    assert result.iterations == 3 + 5  # three runs, then five refusals in a row
    assert any(n.key == "tool_error_loop" for n in turn.channel.notices)


async def test_the_refusal_names_the_repeat_and_the_earlier_outcome() -> None:
    turn = scripted_turn([[weather()], [weather()], [TextDelta("It is sunny.")]])
    sunny = succeeds(data={"sky": "sunny", "c": 21})
    result = await run_turn(
        turn,
        [make_tool("get_weather", turn.executions, turn.clock, sunny)],
        policy=LoopPolicy(max_identical_calls=1),
    )
    assert result.status is TurnStatus.COMPLETED
    assert len(turn.executions.calls) == 1
    refused = result.history[1].response
    assert refused.success is False and refused.status == "tool_execution_failed"
    reason = refused.reason or ""
    assert "repeats an identical call of 'get_weather'" in reason
    assert "max_identical_calls=1" in reason
    assert 'succeeded: {"c": 21, "sky": "sunny"}' in reason
    # the model sees the refusal in the next request's history
    assert turn.provider.requests[2].history[1].response.reason == reason


async def test_the_refusal_of_a_repeated_failure_names_the_failure() -> None:
    turn = scripted_turn([[weather()], [weather()], [TextDelta("Down.")]])
    down = fails("service unavailable")
    result = await run_turn(
        turn,
        [make_tool("get_weather", turn.executions, turn.clock, down)],
        policy=LoopPolicy(max_identical_calls=1),
    )
    assert len(turn.executions.calls) == 1
    reason = result.history[1].response.reason or ""
    assert "The last identical call failed: service unavailable." in reason
    assert result.status is TurnStatus.COMPLETED


async def test_a_refused_repeat_counts_toward_the_error_ceiling_after_a_success() -> None:
    turn = scripted_turn([[weather()] for _ in range(10)])
    result = await run_turn(
        turn,
        [make_tool("get_weather", turn.executions, turn.clock)],
        policy=LoopPolicy(max_identical_calls=2, max_consecutive_tool_errors=2),
    )
    assert (result.status, result.reason) == (TurnStatus.ERROR, "consecutive_tool_errors")
    assert [entry.response.success for entry in result.history] == [True, True, False, False]


async def test_different_arguments_are_not_repeats() -> None:
    turn = scripted_turn([[weather(f"city{i}")] for i in range(6)] + [[TextDelta("Done.")]])
    result = await run_turn(
        turn,
        [make_tool("get_weather", turn.executions, turn.clock)],
        policy=LoopPolicy(max_identical_calls=1),
    )
    assert result.status is TurnStatus.COMPLETED
    assert len(turn.executions.calls) == 6


async def test_a_repeatable_tool_runs_every_time() -> None:
    turn = scripted_turn([[FunctionCall("roll_die", {})] for _ in range(6)] + [[TextDelta("6!")]])
    die = make_tool("roll_die", turn.executions, turn.clock, repeatable=True)
    result = await run_turn(turn, [die], policy=LoopPolicy(max_identical_calls=1))
    assert result.status is TurnStatus.COMPLETED
    assert len(turn.executions.calls) == 6
    assert all(entry.response.success for entry in result.history)


async def test_the_decorator_takes_repeatable() -> None:
    rolls: list[int] = []

    @tool(repeatable=True)
    async def roll_die() -> ToolResult:
        """Roll a six-sided die."""
        rolls.append(4)
        return ToolResult(data=4)

    @tool
    async def read_file() -> ToolResult:
        """Read the file."""
        return ToolResult(data="text")

    assert roll_die.repeatable is True and read_file.repeatable is False
    turn = scripted_turn([[FunctionCall("roll_die", {})] for _ in range(4)] + [[TextDelta("ok")]])
    result = await run_turn(turn, [roll_die], policy=LoopPolicy(max_identical_calls=1))
    assert result.status is TurnStatus.COMPLETED
    assert len(rolls) == 4


def test_repeatable_must_be_a_flag() -> None:
    with pytest.raises(TypeError, match="repeatable"):
        Tool("t", "d", {"type": "object"}, _answer, repeatable="yes")  # type: ignore[arg-type]


async def _answer(_arguments: dict[str, Any], _ctx: object) -> ToolResult:
    return ToolResult()


def test_max_identical_calls_must_be_a_positive_count() -> None:
    for bad in (0, -1, True, 1.5):
        with pytest.raises((TypeError, ValueError), match="max_identical_calls"):
            LoopPolicy(max_identical_calls=bad)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- identity
@pytest.mark.parametrize(
    ("first", "second"),
    [
        ('{"city": "Paris", "days": 2}', '{"days": 2, "city": "Paris"}'),  # key order
        ('{"city":"Paris","days":2}', '{ "city" : "Paris" ,\n "days" : 2 }'),  # whitespace
        ('{"q": {"b": 1, "a": [1, 2]}}', '{"q": {"a": [1, 2], "b": 1}}'),  # nested key order
        ('{"days": 1.0}', '{"days": 1.00}'),  # the same JSON number, written twice
        ('{"days": 2.5}', '{"days": 25e-1}'),
        # JSON has one number type: an integer and a float of the same value are one number
        ('{"days": 1}', '{"days": 1.0}'),
        ('{"limit": 100}', '{"limit": 1e2}'),
        ('{"q": [0, {"n": 3}]}', '{"q": [-0.0, {"n": 3.0}]}'),
    ],
)
async def test_identical_calls_are_the_same_whatever_their_layout(first: str, second: str) -> None:
    calls = [FunctionCall("get_weather", json.loads(text)) for text in (first, second)]
    turn = scripted_turn([[calls[0]], [calls[1]], [TextDelta("ok")]])
    result = await run_turn(
        turn,
        [make_tool("get_weather", turn.executions, turn.clock)],
        policy=LoopPolicy(max_identical_calls=1),
    )
    assert len(turn.executions.calls) == 1
    assert "repeats an identical call" in (result.history[1].response.reason or "")


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ('{"days": 1}', '{"days": 1.5}'),
        ('{"city": "Paris"}', '{"city": "paris"}'),
        # a boolean is not a number, and an integer past a float's precision keeps its digits
        ('{"on": true}', '{"on": 1}'),
        ('{"id": 9007199254740993}', '{"id": 9007199254740992.0}'),
        ('{"days": "1"}', '{"days": 1}'),
        ('{"a": null}', "{}"),
    ],
)
async def test_calls_that_differ_in_value_are_not_repeats(first: str, second: str) -> None:
    calls = [FunctionCall("get_weather", json.loads(text)) for text in (first, second)]
    turn = scripted_turn([[calls[0]], [calls[1]], [TextDelta("ok")]])
    result = await run_turn(
        turn,
        [make_tool("get_weather", turn.executions, turn.clock)],
        policy=LoopPolicy(max_identical_calls=1),
    )
    assert len(turn.executions.calls) == 2
    assert result.status is TurnStatus.COMPLETED


def test_the_identity_is_the_ledgers_call_key() -> None:
    one: Any = json.loads('{"b": 1, "a": 1.0}')
    other: Any = json.loads('{ "a" : 1 , "b" : 1e0 }')
    assert canonical_call_key("t", one) == canonical_call_key("t", other) == 't:{"a":1,"b":1}'


def test_the_identity_leaves_the_arguments_the_tool_gets_as_the_model_wrote_them() -> None:
    arguments: Any = json.loads('{"days": 1.0, "nested": [2.0, {"x": 3.0}]}')
    canonical_call_key("t", arguments)
    assert arguments == {"days": 1.0, "nested": [2.0, {"x": 3.0}]}
    assert isinstance(arguments["days"], float)
    assert isinstance(arguments["nested"][1]["x"], float)


# --------------------------------------------------------------------------- batches
async def test_two_identical_calls_in_one_pass_past_the_allowance() -> None:
    turn = scripted_turn([[weather(), weather(), weather("Lyon")], [TextDelta("ok")]])
    result = await run_turn(
        turn,
        [make_tool("get_weather", turn.executions, turn.clock)],
        policy=LoopPolicy(max_identical_calls=1),
    )
    assert result.status is TurnStatus.COMPLETED
    assert [args["city"] for _, args, _ in turn.executions.calls] == ["Paris", "Lyon"]
    first, second, third = (entry.response for entry in result.history)
    assert first.success and third.success
    assert second.success is False
    assert "is in this same batch" in (second.reason or "")


async def test_identical_calls_in_one_pass_within_the_allowance_all_run() -> None:
    turn = scripted_turn([[weather(), weather()], [TextDelta("ok")]])
    result = await run_turn(
        turn,
        [make_tool("get_weather", turn.executions, turn.clock)],
        policy=LoopPolicy(max_identical_calls=2),
    )
    assert len(turn.executions.calls) == 2
    assert all(entry.response.success for entry in result.history)


# --------------------------------------------------------------------------- the ledger
async def test_a_replay_after_a_context_restart_is_no_repeat_and_the_allowance_holds() -> None:
    profile = {"role": "system", "content": "User profile: likes hiking."}
    restart = ContextRestart(profile, disable_kinds=("profile",))
    turn = scripted_turn(
        [
            [weather()],
            [weather()],
            [FunctionCall("load_profile", {"kind": "profile"})],
            [weather()],  # the 1st identical call of the new scope: reuses the 1st run
            [weather()],  # the 2nd: reuses the 2nd run
            [weather()],  # a 3rd would be past the allowance: refused
            [TextDelta("Sunny, and you like hiking.")],
        ]
    )
    tools = [
        make_tool("get_weather", turn.executions, turn.clock),
        make_tool("load_profile", turn.executions, turn.clock, succeeds(context_restart=restart)),
    ]
    result = await run_turn(turn, tools, policy=LoopPolicy(max_identical_calls=2))
    assert result.status is TurnStatus.COMPLETED
    assert turn.executions.names() == ["get_weather", "get_weather", "load_profile"]
    responses = [entry.response for entry in result.history]
    assert [r.success for r in responses] == [True, True, True, True, False]
    assert "repeats an identical call" in (responses[-1].reason or "")
    assert "made 2 times" in (responses[-1].reason or "")


# --------------------------------------------------------------------------- the reference model
def _repeat_script(*, repeatable: bool) -> TurnScript:
    configs = tuple(
        attrs.evolve(config, repeatable=repeatable) if config.name == "get_weather" else config
        for config in DEFAULT_TOOLS
    )
    oslo = FunctionCall("get_weather", {"city": "Oslo"})
    passes = ((oslo,), (oslo, oslo), (oslo,), (oslo,), (TextDelta("Clear."),))
    return TurnScript(passes=passes, tool_configs=configs)


@pytest.mark.parametrize("repeatable", [False, True], ids=["guarded", "repeatable"])
async def test_the_reference_model_predicts_the_guards_ending(repeatable: bool) -> None:
    policy = LoopPolicy(max_identical_calls=2, max_consecutive_tool_errors=3)
    script = _repeat_script(repeatable=repeatable)
    expected = (
        (TurnStatus.COMPLETED, None)
        if repeatable
        else (TurnStatus.ERROR, "consecutive_tool_errors")
    )
    await engine_and_model_end_alike(script, policy, expected)
