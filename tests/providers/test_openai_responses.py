"""OpenAIResponsesProvider over real HTTP: every recorded Responses stream, split anywhere;
both error-event shapes, response.failed / response.incomplete; the request body."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from tests.providers import wire
from tests.providers.replay import Replay
from tests.providers.replay import assemble
from tests.providers.replay import collect
from tests.providers.replay import replay
from tests.providers.wire_server import Scripted
from tests.providers.wire_server import WireServer
from toolloop_fsm.events import FinishKind
from toolloop_fsm.events import FunctionCall
from toolloop_fsm.provider import ProviderError
from toolloop_fsm.provider import ProviderRequest
from toolloop_fsm.provider import ToolSpec
from toolloop_fsm.providers.openai_responses import OpenAIResponsesProvider
from toolloop_fsm.result import ToolCallRecord
from toolloop_fsm.result import ToolHistoryEntry
from toolloop_fsm.result import ToolResponseRecord

API_KEY = "sk-responses-SECRET-abcdef0123"
PREFIXES = ("openai-responses__", "azure-openai-responses__")


def make(base_url: str) -> OpenAIResponsesProvider:
    return OpenAIResponsesProvider(base_url, "test-model", api_key=API_KEY)


EXPECTED: dict[tuple[str, int], Replay] = {
    ("azure-openai-responses__function-call-args-deltas.jsonl", 0): Replay(
        text="",
        thought="",
        calls=(("weather", {"location": "San Francisco"}, "call_H5DxLSFnsGhiROnUiDHmgyc8"),),
        usage=((45, 24),),
        finish=(FinishKind.TOOL_CALLS, "completed"),
    ),
    ("azure-openai-responses__text.jsonl", 0): Replay(
        text="Hello",
        thought="",
        calls=(),
        usage=((11, 11),),
        finish=(FinishKind.STOP, "completed"),
    ),
    # openai-responses__error-event-then-response-failed.jsonl[0] raises rate_limit
    ("openai-responses__function-call-then-text-event-lines.cassette.yaml", 0): Replay(
        text="",
        thought="",
        calls=(("get_capital", {"country": "France"}, "call_kL0PCQV7M2WMoVX8V8OtYSAL"),),
        usage=((255, 16),),
        finish=(FinishKind.TOOL_CALLS, "completed"),
    ),
    ("openai-responses__function-call-then-text-event-lines.cassette.yaml", 1): Replay(
        text="The capital of France is Paris.",
        thought="",
        calls=(),
        usage=((278, 9),),
        finish=(FinishKind.STOP, "completed"),
    ),
    ("openai-responses__reasoning-summary-function-calls-4-turns.jsonl", 0): Replay(
        text="",
        thought=(
            "**Calculating step-by-step using calculator**\n\nI'll compute 12 plus 7, then "
            "multiply the result by 3, and finally multiply that by 10, reporting the final "
            "product."
        ),
        calls=(("calculator", {"a": 12, "b": 7, "op": "add"}, "call_AB6AaRZ1FYZB2RwS6A5vbdqn"),),
        usage=((134, 28),),
        finish=(FinishKind.TOOL_CALLS, "completed"),
    ),
    ("openai-responses__reasoning-summary-function-calls-4-turns.jsonl", 1): Replay(
        text="",
        thought="",
        calls=(
            ("calculator", {"a": 19, "b": 3, "op": "multiply"}, "call_Q6pW65MUgW9vF59BmItYGos3"),
        ),
        usage=((221, 26),),
        finish=(FinishKind.TOOL_CALLS, "completed"),
    ),
    ("openai-responses__reasoning-summary-function-calls-4-turns.jsonl", 2): Replay(
        text="",
        thought="",
        calls=(
            ("calculator", {"a": 57, "b": 10, "op": "multiply"}, "call_Zl5vIMnD7dVAjgU6FkhmiCZh"),
        ),
        usage=((260, 26),),
        finish=(FinishKind.TOOL_CALLS, "completed"),
    ),
    ("openai-responses__reasoning-summary-function-calls-4-turns.jsonl", 3): Replay(
        text="The final result is **570**.",
        thought="",
        calls=(),
        usage=((299, 12),),
        finish=(FinishKind.STOP, "completed"),
    ),
}
FAILING = {("openai-responses__error-event-then-response-failed.jsonl", 0)}
ALL_RESPONSES = [(n, i) for n in wire.names(*PREFIXES) for i in range(len(wire.load(n)))]
SUCCEEDING = [key for key in ALL_RESPONSES if key not in FAILING]


def test_every_responses_capture_has_an_expectation() -> None:
    assert sorted([*EXPECTED, *FAILING]) == sorted(ALL_RESPONSES)
    # The 4-turn file really is four responses (split on response.created).
    assert len(wire.load("openai-responses__reasoning-summary-function-calls-4-turns.jsonl")) == 4


@pytest.mark.parametrize(("name", "index"), SUCCEEDING)
async def test_recorded_stream_assembles_exactly(
    wire_server: WireServer, name: str, index: int
) -> None:
    chunks = await replay(wire_server, make, wire.load(name)[index])
    assert assemble(chunks) == EXPECTED[name, index]


@settings(
    max_examples=4,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
@pytest.mark.parametrize(("name", "index"), SUCCEEDING)
async def test_any_byte_split_assembles_the_same(
    wire_server: WireServer, name: str, index: int, data: st.DataObject
) -> None:
    response = wire.load(name)[index]
    cuts = data.draw(st.lists(st.integers(1, len(response.body) - 1), max_size=60))
    chunks = await replay(wire_server, make, response, cuts=cuts)
    assert assemble(chunks) == EXPECTED[name, index]


async def test_reasoning_items_ride_on_the_first_call(wire_server: WireServer) -> None:
    name = "openai-responses__reasoning-summary-function-calls-4-turns.jsonl"
    chunks = await replay(wire_server, make, wire.load(name)[0])
    [call] = [c for c in chunks if isinstance(c, FunctionCall)]
    assert call.provider_data is not None
    assert call.provider_data["item_id"].startswith("fc_")
    [reasoning] = call.provider_data["reasoning"]
    assert reasoning["type"] == "reasoning" and reasoning["encrypted_content"]


async def test_recorded_error_event_nested_shape(wire_server: WireServer) -> None:
    name = "openai-responses__error-event-then-response-failed.jsonl"
    with pytest.raises(ProviderError, match="exceeded your current quota") as caught:
        await replay(wire_server, make, wire.load(name)[0])
    assert (caught.value.kind, caught.value.retryable) == ("rate_limit", True)


def _events(*payloads: dict[str, Any]) -> bytes:
    return b"".join(
        b"event: " + p["type"].encode() + b"\ndata: " + json.dumps(p).encode() + b"\n\n"
        for p in payloads
    )


async def _stream_body(server: WireServer, body: bytes) -> list[Any]:
    server.serve(Scripted(chunks=(body,)))
    return await collect(make(server.url + "/v1"))


async def test_error_event_top_level_shape(wire_server: WireServer) -> None:
    body = _events(
        {"type": "response.created", "response": {}},
        {"type": "error", "code": "server_error", "message": "The server had an error"},
    )
    with pytest.raises(ProviderError, match="The server had an error") as caught:
        await _stream_body(wire_server, body)
    assert (caught.value.kind, caught.value.retryable) == ("server", True)


async def test_response_failed_without_error_event(wire_server: WireServer) -> None:
    body = _events(
        {"type": "response.created", "response": {}},
        {
            "type": "response.failed",
            "response": {
                "status": "failed",
                "error": {"code": "rate_limit_exceeded", "message": "Slow down"},
            },
        },
    )
    with pytest.raises(ProviderError, match="Slow down") as caught:
        await _stream_body(wire_server, body)
    assert caught.value.kind == "rate_limit"


async def test_incomplete_max_output_tokens_truncates_the_open_call(
    wire_server: WireServer,
) -> None:
    item = {
        "id": "fc_1",
        "type": "function_call",
        "call_id": "call_1",
        "name": "w",
        "arguments": "",
    }
    body = _events(
        {"type": "response.created", "response": {}},
        {"type": "response.output_text.delta", "item_id": "m", "delta": "Checking"},
        {"type": "response.output_item.added", "output_index": 1, "item": item},
        {
            "type": "response.function_call_arguments.delta",
            "item_id": "fc_1",
            "delta": '{"city": "Be',
        },
        {
            "type": "response.incomplete",
            "response": {
                "status": "incomplete",
                "incomplete_details": {"reason": "max_output_tokens"},
                "usage": {"input_tokens": 10, "output_tokens": 16},
            },
        },
    )
    chunks = await _stream_body(wire_server, body)
    assert assemble(chunks) == Replay(
        text="Checking",
        thought="",
        calls=(("w", {}, "call_1"),),
        usage=((10, 16),),
        finish=(FinishKind.LENGTH, "max_output_tokens"),
    )
    [call] = [c for c in chunks if isinstance(c, FunctionCall)]
    assert call.truncated


async def test_reasoning_text_and_refusal_deltas(wire_server: WireServer) -> None:
    body = _events(
        {"type": "response.reasoning_text.delta", "delta": "hmm"},
        {"type": "response.refusal.delta", "delta": "I can't."},
        {
            "type": "response.completed",
            "response": {"usage": {"input_tokens": 1, "output_tokens": 2}},
        },
    )
    assert assemble(await _stream_body(wire_server, body)) == Replay(
        text="I can't.",
        thought="hmm",
        calls=(),
        usage=((1, 2),),
        finish=(FinishKind.STOP, "completed"),
    )


async def test_stream_without_terminal_event_is_a_retryable_protocol_error(
    wire_server: WireServer,
) -> None:
    body = _events({"type": "response.output_text.delta", "delta": "half"})
    with pytest.raises(ProviderError, match="ended without a terminal event") as caught:
        await _stream_body(wire_server, body)
    assert (caught.value.kind, caught.value.retryable) == ("protocol", True)


async def test_dropped_connection(wire_server: WireServer) -> None:
    response = wire.load("azure-openai-responses__text.jsonl")[0]
    wire_server.serve(
        Scripted.recorded(response, cuts=range(400, len(response.body), 400), drop_after=4)
    )
    with pytest.raises(ProviderError) as caught:
        await collect(make(wire_server.url + "/v1"))
    assert (caught.value.kind, caught.value.retryable) == ("connection", True)


async def test_http_401_does_not_leak_the_key(wire_server: WireServer) -> None:
    body = b'{"error": {"message": "Incorrect API key provided: ' + API_KEY.encode() + b'"}}'
    wire_server.serve(Scripted(status=401, headers=(), chunks=(body,), framing="length"))
    with pytest.raises(ProviderError) as caught:
        await collect(make(wire_server.url + "/v1"))
    assert (caught.value.kind, caught.value.retryable, caught.value.status_code) == (
        "auth",
        False,
        401,
    )
    assert API_KEY not in str(caught.value) and API_KEY not in repr(caught.value)
    assert API_KEY not in repr(make(wire_server.url))


async def test_request_body(wire_server: WireServer) -> None:
    reasoning = {"type": "reasoning", "id": "rs_1", "encrypted_content": "enc", "summary": []}
    request = ProviderRequest(
        [{"role": "user", "content": "12+7?"}],
        tools=(ToolSpec("calculator", "Arithmetic", {"type": "object"}),),
        history=(
            ToolHistoryEntry(
                call=ToolCallRecord(
                    "calculator",
                    {"a": 12, "b": 7},
                    call_id="call_A",
                    provider_data={"reasoning": (reasoning,)},
                ),
                response=ToolResponseRecord(True, data=19),
                pre_tool_text="Computing.",
            ),
        ),
        prefill="The answer",
        max_output=64,
    )
    wire_server.serve(Scripted.recorded(wire.load("azure-openai-responses__text.jsonl")[0]))
    await collect(make(wire_server.url + "/v1"), request)
    [sent] = wire_server.requests
    assert sent.target == "/v1/responses"
    assert sent.header("authorization") == f"Bearer {API_KEY}"
    assert json.loads(sent.body) == {
        "model": "test-model",
        "stream": True,
        "max_output_tokens": 64,
        "tools": [
            {
                "type": "function",
                "name": "calculator",
                "description": "Arithmetic",
                "parameters": {"type": "object"},
            }
        ],
        "input": [
            {"role": "user", "content": "12+7?"},
            {"role": "assistant", "content": "Computing."},
            reasoning,
            {
                "type": "function_call",
                "call_id": "call_A",
                "name": "calculator",
                "arguments": '{"a": 12, "b": 7}',
            },
            {
                "type": "function_call_output",
                "call_id": "call_A",
                "output": '{"success": true, "data": 19}',
            },
            {"role": "assistant", "content": "The answer"},
        ],
    }
