"""OllamaProvider: the recorded Ollama stream replayed over a real loopback HTTP server.

The only real Ollama capture is an ``/api/generate`` transcript (text in ``response``); the
decoder accepts that shape too, so it replays through the same ``/api/chat`` provider (the
server answers whatever path it is asked). The ``/api/chat`` shapes with ``thinking`` and
``tool_calls`` — of which no capture exists (tests/data/wire/SOURCES.md "Gaps") — are
constructed from the documented shape (docs/wire-formats.md §5.1) and say so.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Sequence
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from tests.providers import wire
from tests.providers.wire_server import Scripted
from tests.providers.wire_server import WireServer
from toolloop_fsm.events import Chunk
from toolloop_fsm.events import FinishKind
from toolloop_fsm.events import FinishReason
from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import TextDelta
from toolloop_fsm.events import ThoughtDelta
from toolloop_fsm.events import UsageReport
from toolloop_fsm.provider import ProviderError
from toolloop_fsm.provider import ProviderRequest
from toolloop_fsm.provider import ToolSpec
from toolloop_fsm.providers import OllamaProvider
from toolloop_fsm.providers.ollama import OllamaStreamDecoder
from toolloop_fsm.result import ToolCallRecord
from toolloop_fsm.result import ToolHistoryEntry
from toolloop_fsm.result import ToolResponseRecord

TRANSCRIPT = "ollama__api-generate-ndjson-demo-transcript.txt"
RABBIT = (
    "A rabbit is a small mammal with long ears and a fluffy white tail. They are known for"
    " their fast movement and agility in the wild. Rabbits have a high reproductive rate and"
    " are often seen in gardens or wild areas."
)
REQUEST = ProviderRequest([{"role": "user", "content": "Describe a rabbit in 3 short sentences"}])
NDJSON = (("content-type", "application/x-ndjson"),)
SPLITS = settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


# --------------------------------------------------------------------------- helpers
def provider(server: WireServer, client: httpx.AsyncClient | None = None) -> OllamaProvider:
    return OllamaProvider(server.url, "dolphin3:8b", client=client)


async def collect(source: OllamaProvider, request: ProviderRequest = REQUEST) -> list[Chunk]:
    return [chunk async for chunk in source.stream(request)]


def ndjson(*lines: dict[str, Any]) -> bytes:
    return b"".join(json.dumps(line, ensure_ascii=False).encode() + b"\n" for line in lines)


def split(body: bytes, cuts: Sequence[int]) -> tuple[bytes, ...]:
    bounds = [0, *sorted(set(cuts)), len(body)]
    return tuple(body[a:b] for a, b in itertools.pairwise(bounds) if b > a)


def decode_sync(body: bytes) -> list[Chunk]:
    decoder = OllamaStreamDecoder()
    chunks: list[Chunk] = []
    for line in body.split(b"\n"):
        if line.strip():
            decoder.event("message", line.decode(), chunks)
    decoder.finish(chunks)
    return chunks


def chat_line(**message: Any) -> dict[str, Any]:
    return {
        "model": "qwen3:8b",
        "created_at": "2025-07-27T14:17:50.4329603Z",
        "message": {"role": "assistant", "content": "", **message},
        "done": False,
    }


def done_line(reason: str = "stop", prompt: int = 31, output: int = 47) -> dict[str, Any]:
    return {
        "model": "qwen3:8b",
        "created_at": "2025-07-27T14:17:52.5400738Z",
        "message": {"role": "assistant", "content": ""},
        "done": True,
        "done_reason": reason,
        "total_duration": 10515596300,
        "load_duration": 8189916700,
        "prompt_eval_count": prompt,
        "prompt_eval_duration": 216158900,
        "eval_count": output,
        "eval_duration": 2108508600,
    }


# Constructed /api/chat stream (documented shape, §5.1): thinking, multi-byte content, two
# tool calls — one with the server's `call_…` id and `function.index`, one as older servers
# and the docs send it (no id, no index) — and the `done` line, whose reason is "stop" even
# though tools were called.
CHAT_TEXT = ("Grüße — ", "日本語 ", "🐇🥕")
CHAT_BODY = ndjson(
    chat_line(thinking="User wants "),
    chat_line(thinking="the weather."),
    *(chat_line(content=text) for text in CHAT_TEXT),
    chat_line(
        tool_calls=[
            {
                "id": "call_k3x9a2b1",
                "function": {"index": 0, "name": "get_weather", "arguments": {"city": "Tōkyō"}},
            }
        ]
    ),
    chat_line(tool_calls=[{"function": {"name": "get_time", "arguments": {"tz": "JST", "n": 2}}}]),
    done_line(prompt=120, output=33),
)
CHAT_CHUNKS: list[Chunk] = [
    ThoughtDelta("User wants "),
    ThoughtDelta("the weather."),
    *(TextDelta(text) for text in CHAT_TEXT),
    FunctionCall("get_weather", {"city": "Tōkyō"}, call_id="call_k3x9a2b1"),
    FunctionCall("get_time", {"tz": "JST", "n": 2}),
    UsageReport(120, 33),
    FinishReason(FinishKind.TOOL_CALLS, "stop"),
]


# --------------------------------------------------------------------------- recorded replay
def test_the_only_ollama_capture_is_covered() -> None:
    assert wire.names("ollama__") == [TRANSCRIPT]


def check_rabbit(chunks: Sequence[Chunk]) -> None:
    assert "".join(c.text for c in chunks if isinstance(c, TextDelta)) == RABBIT
    assert len([c for c in chunks if isinstance(c, TextDelta)]) == 46  # one per token line
    assert not [c for c in chunks if isinstance(c, ThoughtDelta | FunctionCall)]
    assert chunks[-2:] == [UsageReport(31, 47), FinishReason(FinishKind.STOP, "stop")]


def test_decoder_on_recorded_transcript() -> None:
    (response,) = wire.load(TRANSCRIPT)
    check_rabbit(decode_sync(response.body))


async def test_replay_over_loopback_http(wire_server: WireServer) -> None:
    (response,) = wire.load(TRANSCRIPT)
    wire_server.serve(Scripted.recorded(response))
    chunks = await collect(provider(wire_server))
    check_rabbit(chunks)
    assert chunks == decode_sync(response.body)


@SPLITS
@given(data=st.data())
async def test_replay_split_anywhere(
    wire_server: WireServer, client: httpx.AsyncClient, data: st.DataObject
) -> None:
    (response,) = wire.load(TRANSCRIPT)
    cuts = data.draw(st.lists(st.integers(1, len(response.body) - 1), max_size=60))
    wire_server.serve(Scripted.recorded(response, cuts=cuts))
    check_rabbit(await collect(provider(wire_server, client)))


# --------------------------------------------------------------------------- /api/chat shapes
async def test_chat_stream_thinking_text_and_tool_calls(wire_server: WireServer) -> None:
    wire_server.serve(Scripted(headers=NDJSON, chunks=(CHAT_BODY,)))
    assert await collect(provider(wire_server)) == CHAT_CHUNKS


@SPLITS
@given(cuts=st.lists(st.integers(1, len(CHAT_BODY) - 1), max_size=60))
async def test_chat_stream_split_inside_utf8_characters(
    wire_server: WireServer, client: httpx.AsyncClient, cuts: list[int]
) -> None:
    wire_server.serve(Scripted(headers=NDJSON, chunks=split(CHAT_BODY, cuts)))
    assert await collect(provider(wire_server, client)) == CHAT_CHUNKS


@pytest.mark.parametrize(
    ("reason", "kind"),
    [("stop", FinishKind.STOP), ("length", FinishKind.LENGTH), ("", FinishKind.STOP)],
)
def test_done_reasons(reason: str, kind: FinishKind) -> None:
    chunks = decode_sync(ndjson(chat_line(content="x"), done_line(reason)))
    assert chunks[-1] == FinishReason(kind, reason or None)


def test_string_arguments_from_a_proxy_are_decoded() -> None:
    decoder = OllamaStreamDecoder()
    chunks: list[Chunk] = []
    decoder.event(
        "message",
        json.dumps(chat_line(tool_calls=[{"function": {"name": "f", "arguments": '{"a": [1, 2'}}])),
        chunks,
    )
    (call,) = chunks
    assert isinstance(call, FunctionCall)
    assert (call.arguments, call.truncated) == ({"a": [1]}, True)


# --------------------------------------------------------------------------- the request
async def test_request_path_and_body(wire_server: WireServer) -> None:
    wire_server.serve(Scripted(headers=NDJSON, chunks=(ndjson(done_line()),)))
    request = ProviderRequest(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather?"},
        ],
        tools=[ToolSpec("get_weather", "Weather now", {})],
        history=[
            ToolHistoryEntry(
                ToolCallRecord("get_weather", {"city": "Paris"}, call_id="call_1"),
                ToolResponseRecord(success=True, data={"c": 21}),
                pre_tool_text="Let me check.",
            ),
            ToolHistoryEntry(
                ToolCallRecord("get_time", {}),
                ToolResponseRecord(success=False, reason="timed out after 300 s"),
            ),
        ],
        prefill="It is",
        max_output=128,
    )
    await collect(provider(wire_server), request)
    (received,) = wire_server.requests
    assert (received.method, received.target) == ("POST", "/api/chat")
    assert received.header("authorization") is None
    assert json.loads(received.body) == {
        "model": "dolphin3:8b",
        "stream": True,
        "options": {"num_predict": 128},
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "Weather now",
                    "parameters": {"type": "object", "properties": {}},
                },
            }
        ],
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": "Let me check.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    }
                ],
            },
            {
                "role": "tool",
                "content": json.dumps({"success": True, "data": {"c": 21}}),
                "tool_name": "get_weather",
                "tool_call_id": "call_1",
            },
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "get_time", "arguments": {}}}],
            },
            {
                "role": "tool",
                "content": json.dumps(
                    {
                        "success": False,
                        "status": "tool_execution_failed",
                        "reason": "timed out after 300 s",
                    }
                ),
                "tool_name": "get_time",
            },
            {"role": "assistant", "content": "It is"},
        ],
    }


# --------------------------------------------------------------------------- errors
async def test_error_line_on_a_200_response(wire_server: WireServer) -> None:
    # docs/wire-formats.md §5.1: one more NDJSON line, the status stays 200.
    body = ndjson(
        chat_line(content="Partial"),
        {"error": "an error was encountered while running the model"},
    )
    wire_server.serve(Scripted(headers=NDJSON, chunks=(body,)))
    seen: list[Chunk] = []
    with pytest.raises(ProviderError) as caught:
        async for chunk in provider(wire_server).stream(REQUEST):
            seen.append(chunk)
    assert seen == [TextDelta("Partial")]
    error = caught.value
    assert (error.kind, error.retryable) == ("server", True)
    assert "an error was encountered while running the model" in error.message


async def test_non_json_line_is_a_protocol_error(wire_server: WireServer) -> None:
    body = ndjson(chat_line(content="ok")) + b"<html>502 Bad Gateway</html>\n"
    wire_server.serve(Scripted(headers=NDJSON, chunks=(body,)))
    with pytest.raises(ProviderError) as caught:
        await collect(provider(wire_server))
    assert caught.value.kind == "protocol"


async def test_body_without_done_line_is_a_retryable_protocol_error(
    wire_server: WireServer,
) -> None:
    wire_server.serve(Scripted(headers=NDJSON, chunks=(ndjson(chat_line(content="cut")),)))
    with pytest.raises(ProviderError, match="ended without a done line") as caught:
        await collect(provider(wire_server))
    assert (caught.value.kind, caught.value.retryable) == ("protocol", True)


async def test_http_404_for_a_missing_model(wire_server: WireServer) -> None:
    wire_server.serve(
        Scripted(
            status=404,
            headers=(("content-type", "application/json"),),
            chunks=(b'{"error":"model \\"nope\\" not found, try pulling it first"}',),
        )
    )
    with pytest.raises(ProviderError) as caught:
        await collect(provider(wire_server))
    assert (caught.value.kind, caught.value.status_code) == ("not_found", 404)
    assert "not found" in caught.value.message


async def test_proxy_credentials_stay_out_of_messages(wire_server: WireServer) -> None:
    token = "Bearer proxy-SECRET-123"
    echo = json.dumps({"error": f"rejected {token}"}).encode()
    wire_server.serve(
        Scripted(status=401, headers=(("content-type", "application/json"),), chunks=(echo,))
    )
    source = OllamaProvider(wire_server.url, "m", headers={"Authorization": token})
    with pytest.raises(ProviderError) as caught:
        await collect(source)
    assert wire_server.requests[0].header("authorization") == token
    assert token not in str(caught.value) and token not in repr(source)


async def test_cancellation_closes_the_response_promptly(
    wire_server: WireServer, client: httpx.AsyncClient
) -> None:
    (response,) = wire.load(TRANSCRIPT)
    wire_server.serve(Scripted.recorded(response, cuts=[500], stall_after=1))
    source = provider(wire_server, client)
    first = asyncio.Event()

    async def consume() -> None:
        async for _chunk in source.stream(REQUEST):
            first.set()

    task = asyncio.create_task(consume())
    await first.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wire_server.client_gone.wait()


def test_provider_attributes() -> None:
    source = OllamaProvider("http://127.0.0.1:11434/", "qwen3:8b")
    assert (source.name, source.tool_calling) == ("ollama", "native")
    assert source.base_url == "http://127.0.0.1:11434"
