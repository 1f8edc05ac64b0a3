"""A three-turn conversation against a real LLMock process, for every adapter it speaks: each
turn's context is the one before, `turn_messages` of the turn and the new question, and the
server is sent — and accepts — the earlier turns' tool calls and responses in its own wire
format."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.interop.servers import LLMockControl
from tests.interop.turns import ANTHROPIC
from tests.interop.turns import GEMINI
from tests.interop.turns import LLMOCK_ADAPTERS
from tests.interop.turns import OPENAI_CHAT
from tests.interop.turns import OPENAI_RESPONSES
from tests.interop.turns import POLICY
from tests.interop.turns import WEATHER
from tests.interop.turns import Adapter
from tests.interop.turns import WeatherTool
from tests.interop.turns import body_text
from toolloop_fsm import CollectingChannel
from toolloop_fsm import TurnRequest
from toolloop_fsm import TurnStatus
from toolloop_fsm import run_tool_loop
from toolloop_fsm import turn_messages
from toolloop_fsm.host import LoopClock

pytestmark = pytest.mark.interop

QUESTIONS = ("Weather in Paris?", "And in Rome?", "Which cities did I ask about?")
ANSWERS = ("Clear in Paris.", "Clear in Rome too.", "You asked about Paris and Rome.")


def _call(city: str) -> dict[str, object]:
    return {"type": "reply", "tool_calls": [{"name": "get_weather", "arguments": {"city": city}}]}


def _reply(text: str) -> dict[str, object]:
    return {"type": "reply", "text": text}


def _pairs_openai_chat(body: dict[str, Any]) -> list[tuple[str, str]]:
    calls = [c for m in body["messages"] for c in m.get("tool_calls", ())]
    answers = [m for m in body["messages"] if m["role"] == "tool"]
    return [(c["id"], a["tool_call_id"]) for c, a in zip(calls, answers, strict=True)]


def _pairs_responses(body: dict[str, Any]) -> list[tuple[str, str]]:
    calls = [i for i in body["input"] if i.get("type") == "function_call"]
    answers = [i for i in body["input"] if i.get("type") == "function_call_output"]
    return [(c["call_id"], a["call_id"]) for c, a in zip(calls, answers, strict=True)]


def _pairs_anthropic(body: dict[str, Any]) -> list[tuple[str, str]]:
    blocks = [b for m in body["messages"] for b in m["content"]]
    calls = [b for b in blocks if b["type"] == "tool_use"]
    answers = [b for b in blocks if b["type"] == "tool_result"]
    return [(c["id"], a["tool_use_id"]) for c, a in zip(calls, answers, strict=True)]


def _pairs_gemini(body: dict[str, Any]) -> list[tuple[str, str]]:
    parts = [p for c in body["contents"] for p in c["parts"]]
    calls = [p["functionCall"] for p in parts if "functionCall" in p]
    answers = [p["functionResponse"] for p in parts if "functionResponse" in p]
    return [(c["name"], a["name"]) for c, a in zip(calls, answers, strict=True)]


#: Each wire format's calls in a request body, paired with the responses that answer them
PAIRS: dict[str, Callable[[dict[str, Any]], list[tuple[str, str]]]] = {
    OPENAI_CHAT: _pairs_openai_chat,
    OPENAI_RESPONSES: _pairs_responses,
    ANTHROPIC: _pairs_anthropic,
    GEMINI: _pairs_gemini,
}


@pytest.mark.parametrize("adapter", LLMOCK_ADAPTERS, ids=lambda a: a.name)
async def test_a_three_turn_conversation_sends_the_earlier_turns_calls_in_the_wire_format(
    llmock: LLMockControl, adapter: Adapter
) -> None:
    await llmock.script(
        _call("Paris"), _reply(ANSWERS[0]), _call("Rome"), _reply(ANSWERS[1]), _reply(ANSWERS[2])
    )
    provider = adapter.provider(llmock.url, "sk-interop-conversation")
    weather = WeatherTool()
    context: list[dict[str, Any]] = []
    for question, answer in zip(QUESTIONS, ANSWERS, strict=True):
        context.append({"role": "user", "content": question})
        channel = CollectingChannel()
        result = await run_tool_loop(
            provider, weather.tools, channel, TurnRequest(context), policy=POLICY, clock=LoopClock()
        )
        assert result.status is TurnStatus.COMPLETED, result.error_message
        assert channel.text == answer
        context += turn_messages(result)

    assert weather.runs == [{"city": "Paris"}, {"city": "Rome"}]
    last = (await llmock.requests())[-1]
    # the third turn's request: both earlier calls, each answered in place, both results
    pairs = PAIRS[adapter.name](last["body"])
    assert len(pairs) == 2 and all(call == answer for call, answer in pairs), pairs
    sent = body_text(last)
    assert sent.count(str(WEATHER["marker"])) == 2
    assert all(text in sent for text in (*QUESTIONS, ANSWERS[0], ANSWERS[1]))
