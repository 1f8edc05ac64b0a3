"""AnthropicProvider: every recorded Anthropic stream replayed over a real loopback HTTP server.

Expected values are read off the capture files by hand (docs/wire-formats.md §4) and hard-coded.
Hypothesis re-splits each body at arbitrary byte offsets; a constructed stream with
multi-byte text (the captures are all ASCII) covers splits inside UTF-8 characters.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Sequence
from typing import Any

import httpx
import pytest
from attrs import frozen
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from tests.providers import wire
from tests.providers.native import anthropic_tool_result
from tests.providers.native import anthropic_tool_use
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
from toolloop_fsm.providers import AnthropicProvider
from toolloop_fsm.providers._sse import SSEDecoder
from toolloop_fsm.providers.anthropic import AnthropicStreamDecoder
from toolloop_fsm.providers.anthropic import build_anthropic_body
from toolloop_fsm.result import ToolCallRecord
from toolloop_fsm.result import ToolHistoryEntry
from toolloop_fsm.result import ToolResponseRecord

API_KEY = "sk-ant-test-SECRET-0123456789"
REQUEST = ProviderRequest([{"role": "user", "content": "hi"}])
SPLITS = settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@frozen
class Call:
    name: str
    arguments: Any
    call_id: str | None
    truncated: bool = False


@frozen
class Expected:
    text: str
    thoughts: str
    calls: tuple[Call, ...]
    usage: tuple[int, int]
    finish: FinishReason
    signature: str | None = None


THINKING_TEXT = (
    "Here are the basic steps for safely crossing the street:\n\n"
    "**At intersections with traffic lights:**\n"
    '- Wait for the pedestrian "Walk" signal\n'
    "- Look both ways before stepping into the street\n"
    "- Make eye contact with drivers when possible\n"
    "- Stay alert for turning vehicles\n\n"
    "**At intersections without signals:**\n"
    "- Use crosswalks when available\n"
    "- Stop at the curb and look left, right, then left again\n"
    "- Wait for a clear gap in traffic\n"
    "- Walk briskly but don't run\n"
    "- Keep looking for traffic as you cross\n\n"
    "**General safety tips:**\n"
    "- Put away phones and remove headphones\n"
    "- Wear bright or reflective clothing in low light\n"
    "- Never assume drivers see you\n"
    "- Avoid crossing between parked cars\n"
    "- Walk facing traffic when there's no sidewalk\n\n"
    "**In busy urban areas:**\n"
    "- Follow pedestrian signals strictly\n"
    "- Be extra cautious of cyclists in bike lanes\n"
    "- Watch for buses and large vehicles with blind spots\n\n"
    "The key is to be visible, alert, and predictable in your movements. "
    "Always prioritize safety over speed when crossing streets."
)
THINKING_SIGNATURE = (
    "EvMCCkYICxgCKkCHP2cSuEdcJK/0rFwqES/ecn+VurRpNTwI4XNyM0vnNfGsc9OmE8YYHauwBZ/uaRpmlEn2I4/"
    "kszHlcpptO82JEgyRMSbPkJYaegxYF3AaDHZbSm9EzZ6CM+YtliIw3iNVP/ilYrfoneo8S2+ad/5xSC62nKbk6j"
    "oLtKmqXgXwYFJRpjIUjM2V7EGReOPRKtoBKfNHVmdNf7SeMhHalX/ObSeJ1G/NjDyGQAsDjyHGd7uY1r5gAIn3"
    "Cpdv5r+gHYJmWT+w2uiKZsBDRoSf4O3Km0l752EhPD4InEhqpCKyqhbUZ3dt5+JVKQHk2iyTBhQMB/XBYgZTst"
    "IpRqQRXU5ypcrydgnqj3mD1G9C7YC0ZTCNvFluAx0OL8q+cQwufgfqKquLEf2+XMYzhx9jYkVFEpnf/s1nx6gN"
    "BATKfF3Dmrs2r4tWu2QJB+FjlRuDp/8dxUxgJbmyhGxb7XsYeb1vgb7wwzDvP/UhjfQYAQ=="
)

EXPECTED: dict[str, Expected] = {
    "anthropic__text-with-ping.jsonl": Expected(
        text="Hello! I'm doing well, thank you for asking. How are you doing today?"
        " Is there anything I can help you with?",
        thoughts="",
        calls=(),
        usage=(12, 30),
        finish=FinishReason(FinishKind.STOP, "end_turn"),
    ),
    "anthropic__text-then-tool-use-event-lines.sse": Expected(
        text="I'll check the current weather in Paris for you.",
        thoughts="",
        calls=(Call("get_weather", {"location": "Paris"}, "toolu_01NRLabsLyVHZPKxbKvkfSMn"),),
        usage=(377, 65),
        finish=FinishReason(FinishKind.TOOL_CALLS, "tool_use"),
    ),
    "anthropic__tool-use-no-args-empty-partial-json.jsonl": Expected(
        text="I'll update the issue list for you.",
        thoughts="",
        calls=(Call("updateIssueList", {}, "toolu_01QE1WLsSVp5hy5Q3GmGTmjP"),),
        usage=(565, 48),
        finish=FinishReason(FinishKind.TOOL_CALLS, "tool_use"),
    ),
    "anthropic__thinking-delta-signature-delta-event-lines.cassette.yaml": Expected(
        text=THINKING_TEXT,
        thoughts="This is a straightforward question about pedestrian safety. I should provide"
        " clear, helpful advice about how to safely cross a street. This is basic safety"
        " information that could help prevent accidents.",
        calls=(),
        usage=(43, 282),
        finish=FinishReason(FinishKind.STOP, "end_turn"),
        signature=THINKING_SIGNATURE,
    ),
    "anthropic__max-tokens-truncated-tool-json-padded.sse": Expected(
        text="I'll create a comprehensive tax guide for someone with multiple W2s and save it"
        " in a file called taxes.txt. Let me do that for you now.",
        thoughts="",
        # The input JSON is cut inside the string "\nFiling taxes…: repaired to its last
        # complete member, and flagged.
        calls=(
            Call(
                "make_file",
                {
                    "filename": "taxes.txt",
                    "lines_of_text": [
                        "# COMPREHENSIVE TAX GUIDE FOR INDIVIDUALS WITH MULTIPLE W-2s",
                        "",
                        "## INTRODUCTION",
                        "",
                    ],
                },
                "toolu_01EKqbqmZrGRXy18eN7m9kvY",
                truncated=True,
            ),
        ),
        usage=(450, 124),
        finish=FinishReason(FinishKind.LENGTH, "max_tokens"),
    ),
    # message_start says 43 input tokens, message_delta 61: the later, real figure wins.
    "anthropic-compatible__usage-only-final-in-message-delta.jsonl": Expected(
        text="pong",
        thoughts="",
        calls=(),
        usage=(61, 2),
        finish=FinishReason(FinishKind.STOP, "end_turn"),
    ),
}


# --------------------------------------------------------------------------- helpers
def provider(server: WireServer, client: httpx.AsyncClient | None = None) -> AnthropicProvider:
    return AnthropicProvider(f"{server.url}/v1", "claude-test", api_key=API_KEY, client=client)


async def collect(source: AnthropicProvider, request: ProviderRequest = REQUEST) -> list[Chunk]:
    return [chunk async for chunk in source.stream(request)]


def check(chunks: Sequence[Chunk], expected: Expected) -> None:
    assert "".join(c.text for c in chunks if isinstance(c, TextDelta)) == expected.text
    assert "".join(c.text for c in chunks if isinstance(c, ThoughtDelta)) == expected.thoughts
    signatures = [c.signature for c in chunks if isinstance(c, ThoughtDelta) and c.signature]
    assert signatures == ([expected.signature] if expected.signature else [])
    calls = tuple(
        Call(c.name, c.arguments, c.call_id, c.truncated)
        for c in chunks
        if isinstance(c, FunctionCall)
    )
    assert calls == expected.calls
    assert all(c.parse_error is None for c in chunks if isinstance(c, FunctionCall))
    usage = [c for c in chunks if isinstance(c, UsageReport)]
    assert (usage[-1].input_tokens, usage[-1].output_tokens) == expected.usage
    finishes = [c for c in chunks if isinstance(c, FinishReason)]
    assert finishes == [expected.finish]
    assert chunks[-1] == expected.finish


def decode_sync(body: bytes) -> list[Chunk]:
    """The sans-IO path alone: SSE-decode the whole body, feed the decoder."""
    sse = SSEDecoder()
    decoder = AnthropicStreamDecoder()
    chunks: list[Chunk] = []
    for event in [*sse.feed(body), *sse.finish()]:
        decoder.event(event.event, event.data, chunks)
    decoder.finish(chunks)
    return chunks


def split(body: bytes, cuts: Sequence[int]) -> tuple[bytes, ...]:
    bounds = [0, *sorted(set(cuts)), len(body)]
    return tuple(body[a:b] for a, b in itertools.pairwise(bounds) if b > a)


def sse(*events: tuple[str, dict[str, Any]]) -> bytes:
    return b"".join(
        f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()
        for name, data in events
    )


def message_start(input_tokens: int = 10) -> tuple[str, dict[str, Any]]:
    return (
        "message_start",
        {
            "type": "message_start",
            "message": {
                "id": "msg_test",
                "type": "message",
                "role": "assistant",
                "content": [],
                "usage": {"input_tokens": input_tokens, "output_tokens": 1},
            },
        },
    )


def text_block(index: int, *texts: str) -> list[tuple[str, dict[str, Any]]]:
    events: list[tuple[str, dict[str, Any]]] = [
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": index,
                "content_block": {"type": "text", "text": ""},
            },
        )
    ]
    for text in texts:
        events.append(
            (
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": index,
                    "delta": {"type": "text_delta", "text": text},
                },
            )
        )
    events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
    return events


def message_end(stop_reason: str, output_tokens: int) -> list[tuple[str, dict[str, Any]]]:
    return [
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                "usage": {"output_tokens": output_tokens},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]


# Constructed (not recorded): the documented event shapes with multi-byte text, so that byte
# splits land inside UTF-8 sequences (2-, 3- and 4-byte characters).
UNICODE_TEXT = ("Grüße, ", "日本語の", "テキスト 🐇🥕", " — fin")
UNICODE_BODY = sse(message_start(), *text_block(0, *UNICODE_TEXT), *message_end("end_turn", 9))


# --------------------------------------------------------------------------- recorded replays
def test_every_anthropic_capture_has_expectations() -> None:
    assert set(wire.names("anthropic__", "anthropic-compatible__")) == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_decoder_on_recorded_body(name: str) -> None:
    (response,) = wire.load(name)
    check(decode_sync(response.body), EXPECTED[name])


@pytest.mark.parametrize("name", sorted(EXPECTED))
async def test_replay_over_loopback_http(name: str, wire_server: WireServer) -> None:
    (response,) = wire.load(name)
    wire_server.serve(Scripted.recorded(response))
    chunks = await collect(provider(wire_server))
    check(chunks, EXPECTED[name])
    # The unsplit socket read and the sans-IO decode agree chunk for chunk.
    assert chunks == decode_sync(response.body)


@pytest.mark.parametrize("name", sorted(EXPECTED))
@SPLITS
@given(data=st.data())
async def test_replay_split_anywhere(
    name: str, wire_server: WireServer, client: httpx.AsyncClient, data: st.DataObject
) -> None:
    (response,) = wire.load(name)
    cuts = data.draw(st.lists(st.integers(1, len(response.body) - 1), max_size=40))
    wire_server.serve(Scripted.recorded(response, cuts=cuts))
    chunks = await collect(provider(wire_server, client))
    assert chunks == decode_sync(response.body)
    check(chunks, EXPECTED[name])


@SPLITS
@given(cuts=st.lists(st.integers(1, len(UNICODE_BODY) - 1), max_size=60))
async def test_split_inside_utf8_characters(
    wire_server: WireServer, client: httpx.AsyncClient, cuts: list[int]
) -> None:
    wire_server.serve(Scripted(headers=wire.SSE_HEADERS, chunks=split(UNICODE_BODY, cuts)))
    chunks = await collect(provider(wire_server, client))
    assert [c.text for c in chunks if isinstance(c, TextDelta)] == list(UNICODE_TEXT)
    assert chunks[-1] == FinishReason(FinishKind.STOP, "end_turn")


# --------------------------------------------------------------------------- the request
async def test_request_path_headers_and_body(wire_server: WireServer) -> None:
    (response,) = wire.load("anthropic__text-with-ping.jsonl")
    wire_server.serve(Scripted.recorded(response))
    thinking = {"type": "thinking", "thinking": "Let me look.", "signature": "sig=="}
    request = ProviderRequest(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
        ],
        tools=[
            ToolSpec(
                "get_weather",
                "Current weather",
                {"type": "object", "properties": {"city": {"type": "string"}}},
            )
        ],
        history=[
            ToolHistoryEntry(
                ToolCallRecord(
                    "get_weather",
                    {"city": "Paris"},
                    call_id="toolu_01",
                    provider_data={"anthropic_thinking": [thinking]},
                ),
                ToolResponseRecord(success=True, data={"temp_c": 21}, message="ok"),
                pre_tool_text="Checking.",
                iteration=0,
            )
        ],
        prefill="It is 21 °C in Paris and ",
        max_output=256,
    )
    await collect(provider(wire_server), request)

    (received,) = wire_server.requests
    assert received.method == "POST"
    assert received.target == "/v1/messages"
    assert received.header("x-api-key") == API_KEY
    assert received.header("anthropic-version") == "2023-06-01"
    assert API_KEY not in received.target
    assert json.loads(received.body) == {
        "model": "claude-test",
        "max_tokens": 256,
        "stream": True,
        "system": "Be brief.",
        "tools": [
            {
                "name": "get_weather",
                "description": "Current weather",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
            }
        ],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {
                "role": "assistant",
                "content": [
                    thinking,
                    {"type": "text", "text": "Checking."},
                    anthropic_tool_use("toolu_01", "get_weather", {"city": "Paris"}),
                ],
            },
            {
                "role": "user",
                "content": [
                    anthropic_tool_result(
                        "toolu_01",
                        json.dumps({"success": True, "data": {"temp_c": 21}, "message": "ok"}),
                        is_error=False,
                    )
                ],
            },
            # Trailing whitespace is stripped: the API rejects an assistant prefill ending in it.
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "It is 21 °C in Paris and"}],
            },
        ],
    }


def test_history_without_call_ids_gets_stable_valid_ids() -> None:
    entry = ToolHistoryEntry(
        ToolCallRecord("lookup", {"q": "x"}, call_id=None),
        ToolResponseRecord(
            success=False, status="tool_execution_failed", reason="boom", tool_name="lookup"
        ),
        iteration=3,
    )
    foreign = ToolHistoryEntry(
        ToolCallRecord("lookup", {}, call_id="call:abc/1"),
        ToolResponseRecord(success=True),
        iteration=4,
    )
    body = build_anthropic_body(
        ProviderRequest([{"role": "user", "content": "go"}], history=[entry, foreign]),
        model="m",
        max_tokens=100,
    )
    messages = body["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant", "user"]
    first_use, first_result = messages[1]["content"][0], messages[2]["content"][0]
    assert first_use["id"] == first_result["tool_use_id"] == "toolu_loop_3_0"
    assert first_result["is_error"] is True
    assert json.loads(first_result["content"]) == {
        "success": False,
        "status": "tool_execution_failed",
        "reason": "boom",
        "tool_name": "lookup",
    }
    # An id from another provider is kept but made to fit Anthropic's [a-zA-Z0-9_-] pattern.
    assert messages[3]["content"][0]["id"] == messages[4]["content"][0]["tool_use_id"]
    assert messages[3]["content"][0]["id"] == "call_abc_1"
    assert body["max_tokens"] == 100
    assert "system" not in body and "tools" not in body


def test_thinking_blocks_ride_on_the_first_tool_call_and_go_back_unchanged() -> None:
    body = sse(
        message_start(),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "thinking", "thinking": "", "signature": ""},
            },
        ),
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "thinking_delta", "thinking": "Need the tool."},
            },
        ),
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "signature_delta", "signature": "SIG"},
            },
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 1,
                "content_block": {"type": "redacted_thinking", "data": "opaque"},
            },
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": 1}),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 2,
                "content_block": {"type": "tool_use", "id": "toolu_A", "name": "a", "input": {}},
            },
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": 2}),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 3,
                "content_block": {"type": "tool_use", "id": "toolu_B", "name": "b", "input": {}},
            },
        ),
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 3,
                "delta": {"type": "input_json_delta", "partial_json": '{"n": 1}'},
            },
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": 3}),
        *message_end("tool_use", 20),
    )
    chunks = decode_sync(body)
    assert ThoughtDelta("", signature="SIG") in chunks
    first, second = [c for c in chunks if isinstance(c, FunctionCall)]
    blocks = [
        {"type": "thinking", "thinking": "Need the tool.", "signature": "SIG"},
        {"type": "redacted_thinking", "data": "opaque"},
    ]
    assert first.provider_data == {"anthropic_thinking": blocks}
    assert second.provider_data is None
    assert (first.arguments, second.arguments) == ({}, {"n": 1})

    entry = ToolHistoryEntry(
        ToolCallRecord("a", {}, call_id=first.call_id, provider_data=first.provider_data),
        ToolResponseRecord(success=True),
    )
    replay = build_anthropic_body(
        ProviderRequest([{"role": "user", "content": "go"}], history=[entry]),
        model="m",
        max_tokens=10,
    )
    assert replay["messages"][1]["content"][:2] == blocks


def test_unknown_events_and_fields_are_ignored() -> None:
    body = sse(
        message_start(),
        ("future_event", {"type": "future_event", "x": 1}),
        ("ping", {"type": "ping"}),
        *text_block(0, "ok"),
        (
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "citations_delta"}},
        ),
        *message_end("end_turn", 2),
    )
    chunks = decode_sync(body)
    assert [c for c in chunks if isinstance(c, TextDelta)] == [TextDelta("ok")]
    assert chunks[-1] == FinishReason(FinishKind.STOP, "end_turn")


@pytest.mark.parametrize(
    ("stop_reason", "kind"),
    [
        ("end_turn", FinishKind.STOP),
        ("stop_sequence", FinishKind.STOP),
        ("max_tokens", FinishKind.LENGTH),
        ("tool_use", FinishKind.TOOL_CALLS),
        ("refusal", FinishKind.REFUSAL),
        ("pause_turn", FinishKind.OTHER),
    ],
)
def test_stop_reasons(stop_reason: str, kind: FinishKind) -> None:
    chunks = decode_sync(sse(message_start(), *text_block(0, "x"), *message_end(stop_reason, 3)))
    assert chunks[-1] == FinishReason(kind, stop_reason)


# --------------------------------------------------------------------------- errors
OVERLOADED = (
    b"event: error\n"
    b'data: {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}\n\n'
)


async def test_overloaded_error_event_mid_stream(wire_server: WireServer) -> None:
    # docs/wire-formats.md §4.4: after some output, `event: error` over HTTP 200, then the
    # connection closes with no message_stop.
    head = sse(message_start(), *text_block(0, "Partial answer")[:2])
    wire_server.serve(Scripted(headers=wire.SSE_HEADERS, chunks=(head, OVERLOADED)))
    seen: list[Chunk] = []
    with pytest.raises(ProviderError) as caught:
        async for chunk in provider(wire_server).stream(REQUEST):
            seen.append(chunk)
    assert TextDelta("Partial answer") in seen
    error = caught.value
    assert (error.kind, error.retryable) == ("server", True)
    assert "overloaded_error" in error.message and "Overloaded" in error.message


@pytest.mark.parametrize(
    ("error_type", "kind", "retryable"),
    [
        ("overloaded_error", "server", True),
        ("api_error", "server", True),
        ("rate_limit_error", "rate_limit", True),
        ("invalid_request_error", "bad_request", False),
        ("authentication_error", "auth", False),
        ("permission_error", "auth", False),
    ],
)
def test_error_event_kinds(error_type: str, kind: str, retryable: bool) -> None:
    decoder = AnthropicStreamDecoder()
    payload = {"type": "error", "error": {"type": error_type, "message": "m"}, "request_id": "r"}
    with pytest.raises(ProviderError) as caught:
        decoder.event("error", json.dumps(payload), [])
    assert (caught.value.kind, caught.value.retryable) == (kind, retryable)


def test_a_message_without_a_stop_reason_or_message_stop_is_not_finished() -> None:
    # the body ending here is a cut (`decode_stream`: a retryable protocol failure)
    decoder = AnthropicStreamDecoder()
    for name, data in [message_start(), *text_block(0, "cut")]:
        decoder.event(name, json.dumps(data), [])
    assert not decoder.finished
    assert "stop_reason" in decoder.finish_marker


def test_data_that_is_not_json_is_a_protocol_error() -> None:
    with pytest.raises(ProviderError) as caught:
        AnthropicStreamDecoder().event("message_start", "<html>", [])
    assert caught.value.kind == "protocol"


async def test_dropped_connection_is_a_retryable_connection_error(wire_server: WireServer) -> None:
    (response,) = wire.load("anthropic__text-then-tool-use-event-lines.sse")
    wire_server.serve(Scripted.recorded(response, cuts=[300, 900], drop_after=2))
    with pytest.raises(ProviderError) as caught:
        await collect(provider(wire_server))
    assert (caught.value.kind, caught.value.retryable) == ("connection", True)


async def test_api_key_never_in_messages_or_repr(wire_server: WireServer) -> None:
    # A hostile or careless server echoes the key back in its error body.
    echo = json.dumps(
        {"type": "error", "error": {"type": "authentication_error", "message": f"bad {API_KEY}"}}
    ).encode()
    wire_server.serve(
        Scripted(status=401, headers=(("content-type", "application/json"),), chunks=(echo,))
    )
    source = provider(wire_server)
    with pytest.raises(ProviderError) as caught:
        await collect(source)
    error = caught.value
    assert (error.kind, error.status_code) == ("auth", 401)
    for text in (str(error), repr(error), error.message, repr(source)):
        assert API_KEY not in text
    assert error.__cause__ is None

    # Same for an in-stream error event.
    leak = json.dumps({"type": "error", "error": {"type": "api_error", "message": API_KEY}})
    with pytest.raises(ProviderError) as in_stream:
        AnthropicStreamDecoder(secrets=[API_KEY]).event("error", leak, [])
    assert API_KEY not in str(in_stream.value)


@pytest.mark.parametrize("shared", [False, True])
async def test_cancellation_closes_the_response_promptly(
    wire_server: WireServer, client: httpx.AsyncClient, shared: bool
) -> None:
    (response,) = wire.load("anthropic__text-then-tool-use-event-lines.sse")
    # The server sends the first part, then holds the stream open.
    wire_server.serve(Scripted.recorded(response, cuts=[600], stall_after=1))
    source = provider(wire_server, client if shared else None)
    first = asyncio.Event()

    async def consume() -> None:
        async for _chunk in source.stream(REQUEST):
            first.set()

    task = asyncio.create_task(consume())
    await first.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The connection is closed as part of the cancellation, not at garbage collection.
    await wire_server.client_gone.wait()
    assert not client.is_closed


def test_provider_attributes() -> None:
    source = AnthropicProvider("https://api.anthropic.com/v1/", "claude-x", api_key=API_KEY)
    assert source.name == "anthropic"
    assert source.tool_calling == "native"
    assert source.base_url == "https://api.anthropic.com/v1"
    assert API_KEY not in repr(source)
