"""The tool-call limit (docs/behaviour.md §3.12): `LoopPolicy.max_tool_calls` bounds the calls
a turn runs; the calls of a batch past it are refused with a result saying so, the pass after
the batch that reached it is offered no tools, and a model that calls anyway ends the turn
``timeout``/``tool_call_limit`` with nothing run. Time is virtual."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.inner_kit import USER
from tests.inner_kit import Turn
from tests.inner_kit import engine_and_model_end_alike
from tests.inner_kit import make_tool
from tests.inner_kit import run_turn
from tests.inner_kit import scripted_turn
from tests.inner_kit import succeeds
from toolloop_fsm import ContextRestart
from toolloop_fsm import FunctionCall
from toolloop_fsm import LoopPolicy
from toolloop_fsm import TextDelta
from toolloop_fsm import Tool
from toolloop_fsm import ToolContext
from toolloop_fsm import ToolResult
from toolloop_fsm import TurnRequest
from toolloop_fsm import TurnStatus
from toolloop_fsm import resume_tool_loop
from toolloop_fsm import run_tool_loop
from toolloop_fsm import snapshot_from_json
from toolloop_fsm import snapshot_to_json
from toolloop_fsm.snapshot import SnapshotError
from toolloop_fsm.testing.strategies import TurnScript

LIMIT_MESSAGE = "tool-call limit of {n} calls for this turn was reached; answer with what you have"


def weather(city: str) -> FunctionCall:
    return FunctionCall("get_weather", {"city": city})


def _weather_tool(turn: Turn, **options: Any) -> Tool:
    return make_tool("get_weather", turn.executions, turn.clock, **options)


async def test_a_batch_is_split_at_the_limit_in_emitted_order() -> None:
    # limit 5, 3 used, a batch of 4: calls 1–2 run, 3–4 are refused
    turn = scripted_turn(
        [
            [weather("a"), weather("b"), weather("c")],
            [weather("d"), weather("e"), weather("f"), weather("g")],
            [TextDelta("Here is what I found.")],
        ]
    )
    result = await run_turn(turn, [_weather_tool(turn)], policy=LoopPolicy(max_tool_calls=5))
    assert [args["city"] for _, args, _ in turn.executions.calls] == ["a", "b", "c", "d", "e"]
    assert result.tool_dispatches == 5
    second_batch = [entry.response for entry in result.history[3:]]
    assert [r.success for r in second_batch] == [True, True, False, False]
    for refused in second_batch[2:]:
        assert LIMIT_MESSAGE.format(n=5) in (refused.reason or "")
    # the model sees the refusals, in emitted order, in the next request
    final = turn.provider.requests[2]
    assert [e.call.arguments["city"] for e in final.history[3:]] == ["d", "e", "f", "g"]
    assert final.history[5].response.reason == second_batch[2].reason
    assert (result.status, result.reason) == (TurnStatus.COMPLETED, "answered_at_tool_call_limit")


async def test_the_calls_within_the_limit_run_concurrently() -> None:
    async def slow(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        await turn.clock.sleep(1.0)
        return ToolResult(data="ok")

    turn = scripted_turn([[weather("a"), weather("b"), weather("c")], [TextDelta("ok")]])
    tool = make_tool("get_weather", turn.executions, turn.clock, slow)
    await run_turn(turn, [tool], policy=LoopPolicy(max_tool_calls=2))
    starts = [when for _, _, when in turn.executions.calls]
    assert len(starts) == 2 and starts[0] == starts[1]


async def test_the_pass_after_the_limit_is_offered_no_tools_and_its_answer_completes() -> None:
    turn = scripted_turn([[weather("a"), weather("b")], [TextDelta("Sunny in both.")]])
    result = await run_turn(turn, [_weather_tool(turn)], policy=LoopPolicy(max_tool_calls=2))
    first, final = turn.provider.requests
    assert first.tools_withdrawn is False
    # withdrawn, but still declared: a history holding calls needs its tools (Anthropic)
    assert final.tools_withdrawn is True
    assert [t.name for t in final.tools] == ["get_weather"]
    assert (result.status, result.reason) == (TurnStatus.COMPLETED, "answered_at_tool_call_limit")
    assert result.final_text == "Sunny in both."
    # the limit's refusal is no tool failure: no failure notice, no error counted
    assert not any(n.key == "tool_failed" for n in turn.channel.notices)


async def test_calling_anyway_after_the_limit_ends_the_turn_without_running_anything() -> None:
    turn = scripted_turn(
        [[weather("a")], [TextDelta("One more look."), weather("b"), weather("c")]]
    )
    result = await run_turn(turn, [_weather_tool(turn)], policy=LoopPolicy(max_tool_calls=1))
    assert (result.status, result.reason) == (TurnStatus.TIMEOUT, "tool_call_limit")
    assert turn.executions.names() == ["get_weather"]
    last = result.stream_results[-1]
    assert last.ignored_calls == ("get_weather", "get_weather")
    assert len(result.history) == 1  # the ignored calls are no tool round
    assert any(n.key == "tool_call_limit" for n in turn.channel.notices)
    # the final pass's text was said: it is delivered
    assert "One more look." in turn.channel.text


async def test_refusals_past_the_limit_do_not_end_the_turn_as_consecutive_errors() -> None:
    turn = scripted_turn(
        [[weather(str(i)) for i in range(8)], [TextDelta("Done with what I have.")]]
    )
    result = await run_turn(
        turn,
        [_weather_tool(turn)],
        policy=LoopPolicy(max_tool_calls=1, max_consecutive_tool_errors=2),
    )
    assert (result.status, result.reason) == (TurnStatus.COMPLETED, "answered_at_tool_call_limit")
    assert [e.response.success for e in result.history] == [True] + [False] * 7


async def test_the_default_has_no_limit() -> None:
    assert LoopPolicy().max_tool_calls is None
    turn = scripted_turn([[weather(str(i)) for i in range(30)], [TextDelta("ok")]])
    result = await run_turn(turn, [_weather_tool(turn)])
    assert len(turn.executions.calls) == 30
    assert (result.status, result.reason) == (TurnStatus.COMPLETED, None)
    assert not any(r.tools_withdrawn for r in turn.provider.requests)


async def test_a_limit_not_reached_leaves_every_pass_an_ordinary_one() -> None:
    turn = scripted_turn([[weather("a")], [TextDelta("ok")]])
    result = await run_turn(turn, [_weather_tool(turn)], policy=LoopPolicy(max_tool_calls=2))
    assert (result.status, result.reason) == (TurnStatus.COMPLETED, None)
    assert not any(r.tools_withdrawn for r in turn.provider.requests)


async def test_a_refused_repeat_takes_no_call_of_the_limit() -> None:
    # the repeated-call guard decides before the limit: its refusal names the earlier result
    turn = scripted_turn([[weather("a")], [weather("a")], [weather("b")], [TextDelta("ok")]])
    result = await run_turn(
        turn,
        [_weather_tool(turn)],
        policy=LoopPolicy(max_tool_calls=2, max_identical_calls=1),
    )
    assert [args["city"] for _, args, _ in turn.executions.calls] == ["a", "b"]
    assert "repeats an identical call" in (result.history[1].response.reason or "")
    assert (result.status, result.reason) == (TurnStatus.COMPLETED, "answered_at_tool_call_limit")


async def test_a_replay_from_the_ledger_takes_no_call_of_the_limit() -> None:
    profile = {"role": "system", "content": "User profile: likes hiking."}
    restart = ContextRestart(profile, disable_kinds=("profile",))
    turn = scripted_turn(
        [
            [weather("a")],
            [FunctionCall("load_profile", {"kind": "profile"})],
            [weather("a")],  # after the restart: reused from the ledger, not run
            [weather("b")],  # the limit's third call
            [TextDelta("Sunny, and you like hiking.")],
        ]
    )
    tools = [
        _weather_tool(turn),
        make_tool("load_profile", turn.executions, turn.clock, succeeds(context_restart=restart)),
    ]
    result = await run_turn(turn, tools, policy=LoopPolicy(max_tool_calls=3))
    assert turn.executions.names() == ["get_weather", "load_profile", "get_weather"]
    assert all(entry.response.success for entry in result.history)
    assert (result.status, result.reason) == (TurnStatus.COMPLETED, "answered_at_tool_call_limit")
    assert turn.provider.requests[-1].tools_withdrawn is True


def test_max_tool_calls_must_be_a_positive_count_or_none() -> None:
    for bad in (0, -1):
        with pytest.raises(ValueError, match="max_tool_calls"):
            LoopPolicy(max_tool_calls=bad)
    for bad_type in (True, 1.5, "3"):
        with pytest.raises(TypeError, match="max_tool_calls"):
            LoopPolicy(max_tool_calls=bad_type)  # type: ignore[arg-type]
    assert LoopPolicy(max_tool_calls=None).max_tool_calls is None


# --------------------------------------------------------------------------- snapshots
async def _snapshots_of_a_turn_reaching_the_limit(policy: LoopPolicy) -> tuple[list[str], Turn]:
    turn = scripted_turn([[weather("a"), weather("b")], [TextDelta("ok")]])
    saved: list[str] = []
    await run_tool_loop(
        turn.provider,
        [_weather_tool(turn)],
        turn.channel,
        TurnRequest(USER, turn_id="turn-1"),
        policy=policy,
        clock=turn.clock,
        on_snapshot=lambda snapshot: saved.append(snapshot_to_json(snapshot)),
    )
    return saved, turn


async def test_the_count_survives_a_snapshot_mid_turn() -> None:
    policy = LoopPolicy(max_tool_calls=2)
    saved, _ = await _snapshots_of_a_turn_reaching_the_limit(policy)
    after_batch = snapshot_from_json(saved[1])
    assert after_batch.loop is not None and after_batch.loop.tool_calls_used == 2
    # resumed before the final pass: it is offered no tools, and a call made anyway ends it
    again = scripted_turn([[weather("c")]])
    resumed = await resume_tool_loop(
        after_batch, again.provider, [_weather_tool(again)], again.channel, policy=policy
    )
    assert again.provider.requests[0].tools_withdrawn is True
    assert (resumed.status, resumed.reason) == (TurnStatus.TIMEOUT, "tool_call_limit")
    assert again.executions.calls == []


async def test_an_old_snapshot_without_the_count_or_the_new_terms_still_loads() -> None:
    saved, _ = await _snapshots_of_a_turn_reaching_the_limit(LoopPolicy())
    data = json.loads(saved[1])
    loop = data["loop"]
    del loop["tool_calls_used"]
    for term in ("max_tool_calls", "at_ceiling"):
        del loop["policy_terms"][term]
    old = snapshot_from_json(json.dumps(data))
    assert old.loop is not None and old.loop.tool_calls_used == 0
    again = scripted_turn([[TextDelta("Sunny.")]])
    resumed = await resume_tool_loop(old, again.provider, [_weather_tool(again)], again.channel)
    assert (resumed.status, resumed.reason) == (TurnStatus.COMPLETED, None)
    # a snapshot that does not record the terms ran as their defaults: another limit is refused
    with pytest.raises(SnapshotError, match="max_tool_calls"):
        await resume_tool_loop(
            old,
            again.provider,
            [_weather_tool(again)],
            again.channel,
            policy=LoopPolicy(max_tool_calls=1),
        )


# --------------------------------------------------------------------------- the reference model
@pytest.mark.parametrize(
    ("passes", "expected"),
    [
        (
            ((weather("a"), weather("b"), weather("c")), (TextDelta("ok"),)),
            (TurnStatus.COMPLETED, "answered_at_tool_call_limit"),
        ),
        (
            ((weather("a"), weather("b")), (weather("c"),), (TextDelta("ok"),)),
            (TurnStatus.TIMEOUT, "tool_call_limit"),
        ),
        (
            ((weather("a"),), (TextDelta("ok"),)),
            (TurnStatus.COMPLETED, None),
        ),
    ],
    ids=["answers", "calls-anyway", "within"],
)
async def test_the_reference_model_predicts_the_limits_ending(
    passes: tuple[tuple[object, ...], ...], expected: tuple[TurnStatus, str | None]
) -> None:
    policy = LoopPolicy(max_tool_calls=2)
    script = TurnScript(passes=passes)  # type: ignore[arg-type]
    await engine_and_model_end_alike(script, policy, expected)
