"""A custom exit rule (`LoopPolicy.end_after_pre_tool_text`) answers with a bool or the turn
stops on a policy bug that names what it answered — the live engine never reads ``"no"`` as
true."""

from __future__ import annotations

import pytest

from tests.inner_kit import make_tool
from tests.inner_kit import run_turn
from tests.inner_kit import scripted_turn
from toolloop_fsm import FunctionCall
from toolloop_fsm import LoopPolicy
from toolloop_fsm import TextDelta
from toolloop_fsm.guards.exit_policy import ExitRuleError
from toolloop_fsm.policy import ExitView


def answers_no(_view: ExitView) -> bool:
    return "no"  # type: ignore[return-value]  # the bug under test


async def test_an_exit_rule_answering_a_string_is_a_policy_bug_naming_the_answer() -> None:
    turn = scripted_turn([[TextDelta("Sent. "), FunctionCall("notify", {})], [TextDelta("x")]])
    tool = make_tool("notify", turn.executions, turn.clock)
    with pytest.raises(ExitRuleError) as raised:
        await run_turn(turn, [tool], policy=LoopPolicy(end_after_pre_tool_text=answers_no))
    message = str(raised.value)
    assert "end_after_pre_tool_text" in message
    assert "'no'" in message and "not a bool" in message
    # the rule is named where it is defined, so the author can find it
    assert "answers_no" in message and "test_exit_rule_answers.py:" in message
    assert turn.executions.names() == ["notify"]  # the rule was asked after the tool ran


@pytest.mark.parametrize("answer", [True, False])
async def test_an_exit_rule_answering_a_bool_decides_the_turn(answer: bool) -> None:
    turn = scripted_turn([[TextDelta("Sent. "), FunctionCall("notify", {})], [TextDelta("x")]])
    tool = make_tool("notify", turn.executions, turn.clock)
    policy = LoopPolicy(end_after_pre_tool_text=lambda _view: answer)
    result = await run_turn(turn, [tool], policy=policy)
    assert (result.reason == "pre_tool_text_suffices") is answer
