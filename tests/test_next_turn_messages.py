"""The next turn's messages (`turn_messages`): what a turn added to the conversation — the
text the user read, each tool call and its response, in order — in the neutral form a
`TurnRequest` takes, and every adapter's request body for a context that holds them."""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Callable
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.serving import serving
from toolloop_fsm import Attempt
from toolloop_fsm import FinishKind
from toolloop_fsm import FinishReason
from toolloop_fsm import FunctionCall
from toolloop_fsm import GenerationTurnResult
from toolloop_fsm import ProviderError
from toolloop_fsm import ProviderRequest
from toolloop_fsm import TextDelta
from toolloop_fsm import Tool
from toolloop_fsm import ToolContext
from toolloop_fsm import ToolResult
from toolloop_fsm import TurnRequest
from toolloop_fsm import TurnStatus
from toolloop_fsm import run_generation_turn
from toolloop_fsm import run_tool_loop
from toolloop_fsm import turn_messages
from toolloop_fsm.conversation import ToolBatch
from toolloop_fsm.conversation import check_context
from toolloop_fsm.conversation import context_items
from toolloop_fsm.demo import demo_tools
from toolloop_fsm.host import LoopClock
from toolloop_fsm.providers._history import tool_response_json
from toolloop_fsm.providers.anthropic import build_anthropic_body
from toolloop_fsm.providers.gemini import build_gemini_body
from toolloop_fsm.providers.ollama import build_ollama_body
from toolloop_fsm.providers.openai_compat import OpenAICompatibleProvider
from toolloop_fsm.providers.openai_compat import build_chat_body
from toolloop_fsm.providers.openai_completions import OpenAICompletionsProvider
from toolloop_fsm.providers.openai_responses import build_responses_body
from toolloop_fsm.result import Delivered
from toolloop_fsm.result import ToolCallRecord
from toolloop_fsm.result import ToolHistoryEntry
from toolloop_fsm.result import ToolResponseRecord
from toolloop_fsm.testing import Fail
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import ScriptedProvider
from toolloop_fsm.testing import VirtualClock

QUESTION = {"role": "user", "content": "Weather in Paris?"}
WEATHER = {"city": "Paris", "sky": "clear", "temp_c": 21}


async def _weather(arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
    if arguments["city"] == "Atlantis":
        raise LookupError("no such city")
    return ToolResult(data={**WEATHER, "city": arguments["city"]}, message="live data")


TOOLS = [Tool("get_weather", "Current weather", {"type": "object"}, _weather)]


def _call(city: str, call_id: str | None = "call_1") -> FunctionCall:
    return FunctionCall("get_weather", {"city": city}, call_id)


def _tool_pass(text: str, *calls: FunctionCall) -> list[Any]:
    return [TextDelta(text), *calls, FinishReason(FinishKind.TOOL_CALLS, "tool_calls")]


def _text_pass(text: str) -> list[Any]:
    return [TextDelta(text), FinishReason(FinishKind.STOP, "stop")]


async def _turn(
    provider: ScriptedProvider, context: list[dict[str, Any]]
) -> tuple[GenerationTurnResult, RecordingChannel]:
    channel = RecordingChannel()
    result = await run_tool_loop(
        provider, TOOLS, channel, TurnRequest(context), clock=VirtualClock()
    )
    return result, channel


# --------------------------------------------------------------------------- turn_messages
async def test_a_turn_adds_its_text_each_call_and_its_response_in_order() -> None:
    provider = ScriptedProvider(
        [_tool_pass("Let me check. ", _call("Paris")), _text_pass("Clear and 21 °C.")]
    )
    result, channel = await _turn(provider, [QUESTION])

    assert result.status is TurnStatus.COMPLETED
    assert turn_messages(result) == (
        {
            "role": "assistant",
            "content": "Let me check. ",
            "tool_calls": [{"id": "call_1", "name": "get_weather", "arguments": {"city": "Paris"}}],
        },
        {
            "role": "tool",
            "tool_call_id": "call_1",
            "name": "get_weather",
            "content": {
                "success": True,
                "data": WEATHER,
                "message": "live data",
                "tool_name": "get_weather",
            },
        },
        {"role": "assistant", "content": "Clear and 21 °C."},
    )
    # the assistant's text in the messages is what the channel was given, all of it
    assert "".join(m["content"] for m in turn_messages(result) if m["role"] == "assistant") == (
        channel.text
    )


async def test_the_next_turn_sends_the_old_context_these_messages_and_the_new_question() -> None:
    provider = ScriptedProvider(
        [
            _tool_pass("Let me check. ", _call("Paris")),
            _text_pass("Clear and 21 °C."),
            _text_pass("You asked about Paris."),
        ]
    )
    first, _ = await _turn(provider, [QUESTION])
    follow_up = {"role": "user", "content": "Which city did I ask about?"}
    context = [QUESTION, *turn_messages(first), follow_up]

    second, _ = await _turn(provider, context)

    assert second.final_text == "You asked about Paris."
    sent = provider.requests[-1]
    assert list(sent.context) == context and sent.history == ()
    # the model of the second turn is shown the first turn's call and response as the first
    # turn's last pass was shown them
    assert (
        build_chat_body(sent, "m")["messages"][:3]
        == build_chat_body(provider.requests[1], "m")["messages"]
    )


async def test_text_the_user_never_read_is_not_in_the_turns_messages() -> None:
    cut = ProviderError("connection reset", kind="network", retryable=True)
    provider = ScriptedProvider(
        [_tool_pass("Let me check. ", _call("Paris")), [TextDelta("It is clear a"), Fail(cut)]]
    )
    result, channel = await _turn(provider, [QUESTION])

    assert result.status is TurnStatus.ERROR
    assert result.undelivered_text == "It is clear a"
    messages = turn_messages(result)
    assert [m["role"] for m in messages] == ["assistant", "tool"]
    assert messages[0]["content"] == channel.text == "Let me check. "


async def test_a_pass_whose_text_was_suppressed_adds_its_calls_with_no_text() -> None:
    provider = ScriptedProvider([_tool_pass("", _call("Paris")), _text_pass("Clear.")])
    result, _ = await _turn(provider, [QUESTION])

    first = turn_messages(result)[0]
    assert first["content"] == "" and first["tool_calls"][0]["name"] == "get_weather"


async def test_a_batch_and_a_failed_call_read_back_as_the_responses_the_model_was_shown() -> None:
    provider = ScriptedProvider(
        [
            _tool_pass("Checking both. ", _call("Paris", "c1"), _call("Atlantis", "c2")),
            _text_pass("Paris is clear; Atlantis I could not find."),
        ]
    )
    result, _ = await _turn(provider, [QUESTION])

    messages = turn_messages(result)
    assert [m["role"] for m in messages] == ["assistant", "tool", "tool", "assistant"]
    assert messages[2]["content"]["success"] is False
    [batch] = [item for item in context_items(messages) if isinstance(item, ToolBatch)]
    assert [e.call for e in batch.entries] == [e.call for e in result.history]
    assert [tool_response_json(e.response) for e in batch.entries] == [
        tool_response_json(e.response) for e in result.history
    ]
    # the neutral form is JSON: a host stores it as it is
    assert json.loads(json.dumps(messages)) == list(messages)


async def test_a_call_without_an_id_is_answered_by_position() -> None:
    provider = ScriptedProvider([_tool_pass("", _call("Paris", None)), _text_pass("Clear.")])
    result, _ = await _turn(provider, [QUESTION])

    call, response = turn_messages(result)[:2]
    assert "id" not in call["tool_calls"][0] and "tool_call_id" not in response
    TurnRequest([QUESTION, call, response])  # accepted as the next turn's context


# --------------------------------------------------------------------------- bad contexts
_CALL: dict[str, Any] = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"id": "a", "name": "f"}],
}
_ANSWER: dict[str, Any] = {"role": "tool", "tool_call_id": "a", "content": {"success": True}}


@pytest.mark.parametrize(
    ("context", "says"),
    [
        ([_ANSWER], "context message 0 is a tool response that follows no assistant message"),
        ([_CALL], "the next 1 message(s) must be their tool responses"),
        ([{**_CALL, "tool_calls": []}], "tool_calls must be a non-empty list"),
        ([{**_CALL, "tool_calls": [{"id": "a"}]}, _ANSWER], "tool call 0 needs a name"),
        (
            [{**_CALL, "tool_calls": [{"name": "f", "arguments": "{}"}]}, _ANSWER],
            "arguments must be an object, got str",
        ),
        ([_CALL, {**_ANSWER, "tool_call_id": "b"}], "answers call 'b', but the call in its place"),
        ([_CALL, {**_ANSWER, "content": "ok"}], 'must be an object with a boolean "success"'),
        (
            [_CALL, {**_ANSWER, "content": {"success": True, "colour": "red"}}],
            "not colour",
        ),
    ],
)
def test_a_context_whose_tool_messages_do_not_fit_is_refused_naming_the_message(
    context: list[dict[str, Any]], says: str
) -> None:
    with pytest.raises(ValueError) as refused:
        TurnRequest(context)
    assert says in str(refused.value)


# --------------------------------------------------------------------------- adapters
_CONTEXT_CALLS: list[dict[str, Any]] = [
    QUESTION,
    {
        "role": "assistant",
        "content": "Let me check. ",
        "tool_calls": [{"id": "call_1", "name": "get_weather", "arguments": {"city": "Paris"}}],
    },
    {
        "role": "tool",
        "tool_call_id": "call_1",
        "name": "get_weather",
        "content": {"success": True, "data": {"temp_c": 21}},
    },
    {"role": "assistant", "content": "Clear and 21 °C."},
    {"role": "user", "content": "And tomorrow?"},
]
_SHOWN = '{"success": true, "data": {"temp_c": 21}}'


def test_openai_chat_renders_the_context_calls_as_tool_calls_and_tool_messages() -> None:
    messages = build_chat_body(ProviderRequest(_CONTEXT_CALLS), "m")["messages"]
    assert messages[1:3] == [
        {
            "role": "assistant",
            "content": "Let me check. ",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": _SHOWN},
    ]
    assert messages[3:] == _CONTEXT_CALLS[3:]


def test_anthropic_renders_the_context_calls_as_tool_use_and_tool_result_blocks() -> None:
    body = build_anthropic_body(ProviderRequest(_CONTEXT_CALLS), model="m", max_tokens=100)
    assert body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me check. "},
                {
                    "type": "tool_use",
                    "id": "call_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "call_1",
                    "content": _SHOWN,
                    "is_error": False,
                }
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "Clear and 21 °C."}]},
        {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]},
    ]


def test_gemini_renders_the_context_calls_as_function_call_and_function_response() -> None:
    contents = build_gemini_body(ProviderRequest(_CONTEXT_CALLS))["contents"]
    assert [c["role"] for c in contents] == ["user", "model", "user", "model", "user"]
    text, call = contents[1]["parts"]
    assert text == {"text": "Let me check. "}
    assert call["functionCall"] == {
        "name": "get_weather",
        "args": {"city": "Paris"},
        "id": "call_1",
    }
    assert contents[2]["parts"] == [
        {
            "functionResponse": {
                "name": "get_weather",
                "response": {"success": True, "data": {"temp_c": 21}},
                "id": "call_1",
            }
        }
    ]


def test_ollama_renders_the_context_calls_as_tool_calls_and_tool_messages() -> None:
    messages = build_ollama_body(ProviderRequest(_CONTEXT_CALLS), model="m")["messages"]
    assert messages[1:3] == [
        {
            "role": "assistant",
            "content": "Let me check. ",
            "tool_calls": [
                {
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    "id": "call_1",
                }
            ],
        },
        {"role": "tool", "content": _SHOWN, "tool_name": "get_weather", "tool_call_id": "call_1"},
    ]
    assert messages[3] == {"role": "assistant", "content": "Clear and 21 °C."}


def test_openai_responses_renders_the_context_calls_as_function_call_items() -> None:
    items = build_responses_body(ProviderRequest(_CONTEXT_CALLS), "m")["input"]
    assert items[1:4] == [
        {"role": "assistant", "content": "Let me check. "},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": _SHOWN},
    ]


Build = Callable[[ProviderRequest], Any]
_BUILDERS: dict[str, Build] = {
    "openai-chat": lambda r: build_chat_body(r, "m")["messages"],
    "anthropic": lambda r: build_anthropic_body(r, model="m", max_tokens=9)["messages"],
    "gemini": lambda r: build_gemini_body(r)["contents"],
    "ollama": lambda r: build_ollama_body(r, model="m")["messages"],
    "openai-responses": lambda r: build_responses_body(r, "m")["input"],
}


@pytest.mark.parametrize("build", _BUILDERS.values(), ids=_BUILDERS.keys())
async def test_every_adapter_shows_last_turns_calls_as_it_showed_them_during_that_turn(
    build: Build,
) -> None:
    provider = ScriptedProvider(
        [
            _tool_pass("Checking both. ", _call("Paris", "c1"), _call("Atlantis", "c2")),
            _text_pass("Paris is clear."),
        ]
    )
    result, _ = await _turn(provider, [QUESTION])
    during = provider.requests[1]  # the pass that read the batch's responses

    after = ProviderRequest([QUESTION, *turn_messages(result)[:3]])

    assert build(after) == build(during)


def test_a_completion_prompt_refuses_a_context_with_tool_messages_as_a_bad_request() -> None:
    provider = OpenAICompletionsProvider("http://127.0.0.1:9/v1", "m")
    with pytest.raises(ProviderError) as refused:
        provider.build_body(ProviderRequest(_CONTEXT_CALLS))
    assert refused.value.kind == "bad_request"
    assert "context message 2" in str(refused.value)


# --------------------------------------------------------------------------- against serve
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    """``toolloop-fsm serve`` of this checkout, on a free port; yields its base URL."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONIOENCODING": "utf-8"}
    with serving(REPO, env) as url:
        yield url


async def test_a_three_turn_conversation_against_toolloop_fsm_serve(served: str) -> None:
    provider = OpenAICompatibleProvider(served, "steady-2")
    tools = demo_tools([])
    context: list[dict[str, Any]] = []
    added = []
    for question in ("Weather in Paris?", "And tomorrow?", "Thanks!"):
        context.append({"role": "user", "content": question})
        result = await run_tool_loop(
            provider, tools, RecordingChannel(), TurnRequest(context), clock=LoopClock()
        )
        assert result.status is TurnStatus.COMPLETED, result.error_message
        added.append(turn_messages(result))
        context += added[-1]

    # every turn added what the user read and its calls, each answered, ending with the
    # silent memory call; the server accepted each request carrying the turns before it
    for messages in added:
        check_context(messages)
        calls = [c["name"] for m in messages for c in m.get("tool_calls", ())]
        assert calls[-1] == "update_short_term_memory"
        assert len(calls) == sum(m["role"] == "tool" for m in messages)
    assert "21 °C and clear in Paris" in added[0][2]["content"]
    ids = [m["tool_call_id"] for messages in added for m in messages if m["role"] == "tool"]
    assert len(ids) == len(set(ids))  # the server numbered its calls across the conversation


async def test_a_fallback_attempt_adds_the_text_both_attempts_delivered_and_the_calls_once() -> (
    None
):
    down = ProviderError("upstream down", kind="server", retryable=True)
    first = ScriptedProvider([_tool_pass("Let me check. ", _call("Paris")), [Fail(down)]])
    second = ScriptedProvider([_tool_pass("", _call("Paris")), _text_pass("Clear and 21 °C.")])
    channel = RecordingChannel()

    result = await run_generation_turn(
        [Attempt(first), Attempt(second)],
        TOOLS,
        channel,
        TurnRequest([QUESTION]),
        clock=VirtualClock(),
    )

    assert result.status is TurnStatus.COMPLETED and len(result.attempts) == 2
    messages = turn_messages(result)
    assert [m["role"] for m in messages] == ["assistant", "tool", "assistant"]
    assert "".join(m["content"] for m in messages if m["role"] == "assistant") == channel.text
    assert messages[0]["content"] == "Let me check. "
    assert messages[2]["content"] == "Clear and 21 °C."


async def test_a_tool_result_json_cannot_hold_is_stored_as_the_model_was_shown_it() -> None:
    async def today(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        return ToolResult(data={"on": datetime.date(2026, 12, 2), "tags": ("a", "b")})

    tools = [Tool("today", "The date", {"type": "object"}, today)]
    provider = ScriptedProvider(
        [_tool_pass("", FunctionCall("today", {}, "d1")), _text_pass("It is the 2nd.")]
    )
    result = await run_tool_loop(
        provider, tools, RecordingChannel(), TurnRequest([QUESTION]), clock=VirtualClock()
    )

    answer = turn_messages(result)[1]
    assert answer["content"]["data"] == {"on": "2026-12-02", "tags": ["a", "b"]}
    after = ProviderRequest([QUESTION, *turn_messages(result)[:2]])
    assert (
        build_chat_body(after, "m")["messages"]
        == build_chat_body(provider.requests[1], "m")["messages"]
    )


# --------------------------------------------------------------------------- any turn
_json_data = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=5,
)
_responses = st.builds(
    ToolResponseRecord,
    success=st.booleans(),
    data=_json_data,
    message=st.none() | st.text(max_size=5),
    status=st.none() | st.sampled_from(["tool_execution_failed", "timeout"]),
    reason=st.none() | st.text(max_size=5),
    tool_name=st.none() | st.just("get_weather"),
)
_passes = st.lists(
    st.tuples(
        st.lists(st.text(max_size=4), max_size=3),  # the pass's text deliveries
        st.lists(st.tuples(st.booleans(), _responses), max_size=3),  # its calls: id?, response
    ),
    max_size=4,
)


def _result_of(
    passes: list[tuple[list[str], list[tuple[bool, ToolResponseRecord]]]],
) -> GenerationTurnResult:
    delivered: list[Delivered] = []
    history: list[ToolHistoryEntry] = []
    for iteration, (texts, calls) in enumerate(passes, 1):
        delivered += [Delivered(len(delivered), text=t, iteration=iteration) for t in texts]
        for position, (has_id, response) in enumerate(calls):
            record = ToolCallRecord(
                "get_weather", {"city": f"c{iteration}{position}"}, f"id{len(history)}" * has_id
            )
            pre = "".join(texts) or None if position == 0 else None
            history.append(ToolHistoryEntry(record, response, pre, iteration, position))
    return GenerationTurnResult(
        TurnStatus.COMPLETED, delivered=tuple(delivered), history=tuple(history)
    )


@given(_passes)
def test_any_turns_messages_hold_what_the_user_read_and_read_back_as_its_history(
    passes: list[tuple[list[str], list[tuple[bool, ToolResponseRecord]]]],
) -> None:
    result = _result_of(passes)
    messages = turn_messages(result)

    spoken = "".join(m["content"] for m in messages if m["role"] == "assistant")
    assert spoken == result.delivered_text
    batches = [item for item in context_items(messages) if isinstance(item, ToolBatch)]
    read = [entry for batch in batches for entry in batch.entries]
    assert [(e.call.name, e.call.arguments, e.call.call_id) for e in read] == [
        (e.call.name, e.call.arguments, e.call.call_id or None) for e in result.history
    ]
    assert [tool_response_json(e.response) for e in read] == [
        tool_response_json(e.response) for e in result.history
    ]
    assert [len(b.entries) for b in batches] == [len(c) for _, c in passes if c]
