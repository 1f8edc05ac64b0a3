"""GeminiProvider: every recorded Gemini / Vertex stream replayed over a real loopback server.

Expected values are read off the capture files by hand (docs/wire-formats.md §6) and hard-coded;
the opaque thought signatures are pinned by length and sha256 prefix (checked against the files
with grep). Hypothesis re-splits each body at arbitrary byte offsets — across the CRLF pairs
Gemini frames events with — and a constructed stream with multi-byte text covers splits
inside UTF-8 characters.
"""

from __future__ import annotations

import asyncio
import hashlib
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
from toolloop_fsm.providers import GeminiProvider
from toolloop_fsm.providers._sse import SSEDecoder
from toolloop_fsm.providers.gemini import SKIP_SIGNATURE
from toolloop_fsm.providers.gemini import GeminiStreamDecoder
from toolloop_fsm.providers.gemini import build_gemini_body
from toolloop_fsm.result import ToolCallRecord
from toolloop_fsm.result import ToolHistoryEntry
from toolloop_fsm.result import ToolResponseRecord

API_KEY = "AIzaSy-test-SECRET-0123456789"
MODEL = "gemini-3-pro-preview"
REQUEST = ProviderRequest([{"role": "user", "content": "hi"}])
SPLITS = settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@frozen
class Sig:
    """An opaque signature pinned by its length and the first 16 hex digits of its sha256."""

    length: int
    sha256: str

    @classmethod
    def of(cls, value: str) -> Sig:
        return cls(len(value), hashlib.sha256(value.encode()).hexdigest()[:16])


@frozen
class Call:
    name: str
    arguments: Any
    signature: Sig | None = None


@frozen
class Expected:
    text: str
    thoughts: str
    calls: tuple[Call, ...]
    usage: tuple[int, int]
    finish: FinishReason
    text_signatures: tuple[Sig, ...] = ()


VERTEX_THOUGHT = (
    "**Processing User Requests**\n\nI've started by understanding the user's instructions. "
    "Currently, I'm focusing on the initial steps: reading the specified theme using the "
    "appropriate tool. Next, I plan to tackle reading the screens, beginning with screen "
    '"A," then proceeding with "B" and "C" in parallel as instructed.\n\n\n'
)

# (capture, response index) → what the stream assembles to. Usage output = candidates +
# thoughts tokens (thinking is billed as output).
EXPECTED: dict[tuple[str, int], Expected] = {
    ("gemini__sse-function-call-crlf-finish-message.sse", 0): Expected(
        text="",
        thoughts="",
        calls=(Call("getWeather", {"location": "Tokyo"}, Sig(788, "3c25b820534ef3c3")),),
        usage=(83, 14 + 104),
        # finishReason STOP with a call: there is no tool-call finish reason in Gemini.
        finish=FinishReason(FinishKind.TOOL_CALLS, "STOP"),
    ),
    ("gemini__text-empty-part-thought-signature.jsonl", 0): Expected(
        text='There are **3** "r"s in strawberry.\n\nst**r**awbe**rr**y',
        thoughts="",
        calls=(),
        usage=(9, 23 + 185),
        finish=FinishReason(FinishKind.STOP, "STOP"),
        # On the final empty text part; kept so it can be echoed back.
        text_signatures=(Sig(916, "e5bb5ce61d3210ca"),),
    ),
    ("gemini-vertex__thought-parallel-calls-partial-args.jsonl", 0): Expected(
        text="",
        thoughts=VERTEX_THOUGHT,
        calls=(
            # No `args` at all: a function without parameters.
            Call("read_theme", {}, Sig(1060, "240b3953bff3f13a")),
            # Streamed partialArgs: "$.id" = "A" + "" (willContinue), closed by {}.
            Call("read_screen", {"id": "A"}),
            Call("read_screen", {"id": "B"}),
            Call("read_screen", {"id": "C"}),
        ),
        usage=(249, 58 + 183),
        finish=FinishReason(FinishKind.TOOL_CALLS, "STOP"),
    ),
    ("gemini__two-turn-tool-call-crlf.cassette.yaml", 0): Expected(
        text="",
        thoughts="",
        calls=(Call("get_country", {}, Sig(1408, "5d9ba8d754fc1f7d")),),
        usage=(29, 10 + 202),
        finish=FinishReason(FinishKind.TOOL_CALLS, "STOP"),
    ),
    ("gemini__two-turn-tool-call-crlf.cassette.yaml", 1): Expected(
        text="The capital of Mexico is Mexico City.",
        thoughts="",
        calls=(),
        usage=(257, 8),
        finish=FinishReason(FinishKind.STOP, "STOP"),
    ),
}
CASES = sorted(EXPECTED)


def case_id(case: tuple[str, int]) -> str:
    return f"{case[0]}#{case[1]}"


# --------------------------------------------------------------------------- helpers
def provider(server: WireServer, client: httpx.AsyncClient | None = None) -> GeminiProvider:
    return GeminiProvider(f"{server.url}/v1beta", MODEL, api_key=API_KEY, client=client)


async def collect(source: GeminiProvider, request: ProviderRequest = REQUEST) -> list[Chunk]:
    return [chunk async for chunk in source.stream(request)]


def recorded(case: tuple[str, int]) -> wire.RecordedResponse:
    return wire.load(case[0])[case[1]]


def check(chunks: Sequence[Chunk], expected: Expected) -> None:
    assert "".join(c.text for c in chunks if isinstance(c, TextDelta)) == expected.text
    assert "".join(c.text for c in chunks if isinstance(c, ThoughtDelta)) == expected.thoughts
    text_signatures = tuple(
        Sig.of(c.signature) for c in chunks if isinstance(c, ThoughtDelta) and c.signature
    )
    assert text_signatures == expected.text_signatures
    calls = []
    for c in chunks:
        if isinstance(c, FunctionCall):
            assert c.call_id is None  # the Gemini API sends no call ids
            assert not c.truncated and c.parse_error is None
            data = c.provider_data or {}
            signature = Sig.of(data["thoughtSignature"]) if "thoughtSignature" in data else None
            calls.append(Call(c.name, c.arguments, signature))
    assert tuple(calls) == expected.calls
    usage = [c for c in chunks if isinstance(c, UsageReport)]
    assert (usage[-1].input_tokens, usage[-1].output_tokens) == expected.usage
    assert [c for c in chunks if isinstance(c, FinishReason)] == [expected.finish]
    assert chunks[-1] == expected.finish


def decode_sync(body: bytes) -> list[Chunk]:
    """The sans-IO path alone: SSE-decode the whole body, feed the decoder."""
    sse = SSEDecoder()
    decoder = GeminiStreamDecoder()
    chunks: list[Chunk] = []
    for event in [*sse.feed(body), *sse.finish()]:
        decoder.event(event.event, event.data, chunks)
    decoder.finish(chunks)
    return chunks


def frames(*payloads: dict[str, Any]) -> bytes:
    return b"".join(
        b"data: " + json.dumps(p, ensure_ascii=False).encode() + b"\r\n\r\n" for p in payloads
    )


def split(body: bytes, cuts: Sequence[int]) -> tuple[bytes, ...]:
    bounds = [0, *sorted(set(cuts)), len(body)]
    return tuple(body[a:b] for a, b in itertools.pairwise(bounds) if b > a)


def chunk_of(*parts: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    candidate: dict[str, Any] = {"content": {"role": "model", "parts": list(parts)}}
    if finish:
        candidate["finishReason"] = finish
    return {"candidates": [candidate]}


# Constructed (not recorded): the documented chunk shape with multi-byte text, so that byte
# splits land inside UTF-8 sequences.
UNICODE_TEXT = ("Grüße, ", "日本語の", "テキスト 🐇🥕", " — fin")
UNICODE_BODY = frames(
    *(chunk_of({"text": t}) for t in UNICODE_TEXT),
    {
        **chunk_of({"text": ""}, finish="STOP"),
        "usageMetadata": {"promptTokenCount": 4, "candidatesTokenCount": 9},
    },
)


# --------------------------------------------------------------------------- recorded replays
def test_every_gemini_capture_has_expectations() -> None:
    recorded_cases = {
        (name, index)
        for name in wire.names("gemini__", "gemini-vertex__")
        for index in range(len(wire.load(name)))
    }
    assert recorded_cases == set(EXPECTED)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_decoder_on_recorded_body(case: tuple[str, int]) -> None:
    check(decode_sync(recorded(case).body), EXPECTED[case])


@pytest.mark.parametrize("case", CASES, ids=case_id)
async def test_replay_over_loopback_http(case: tuple[str, int], wire_server: WireServer) -> None:
    response = recorded(case)
    wire_server.serve(Scripted.recorded(response))
    chunks = await collect(provider(wire_server))
    check(chunks, EXPECTED[case])
    assert chunks == decode_sync(response.body)


@pytest.mark.parametrize("case", CASES, ids=case_id)
@SPLITS
@given(data=st.data())
async def test_replay_split_anywhere(
    case: tuple[str, int], wire_server: WireServer, client: httpx.AsyncClient, data: st.DataObject
) -> None:
    response = recorded(case)
    cuts = data.draw(st.lists(st.integers(1, len(response.body) - 1), max_size=40))
    wire_server.serve(Scripted.recorded(response, cuts=cuts))
    chunks = await collect(provider(wire_server, client))
    assert chunks == decode_sync(response.body)
    check(chunks, EXPECTED[case])


@SPLITS
@given(cuts=st.lists(st.integers(1, len(UNICODE_BODY) - 1), max_size=60))
async def test_split_inside_utf8_characters(
    wire_server: WireServer, client: httpx.AsyncClient, cuts: list[int]
) -> None:
    wire_server.serve(Scripted(headers=wire.SSE_HEADERS, chunks=split(UNICODE_BODY, cuts)))
    chunks = await collect(provider(wire_server, client))
    assert [c.text for c in chunks if isinstance(c, TextDelta)] == list(UNICODE_TEXT)
    assert chunks[-1] == FinishReason(FinishKind.STOP, "STOP")


# --------------------------------------------------------------------------- the request
async def test_two_turn_tool_call_echoes_the_signature(wire_server: WireServer) -> None:
    """Turn 1's call and signature go back in turn 2's request, as Gemini 3 requires."""
    name = "gemini__two-turn-tool-call-crlf.cassette.yaml"
    first, second = wire.load(name)
    wire_server.serve(Scripted.recorded(first), Scripted.recorded(second))
    source = provider(wire_server)
    tool = ToolSpec(
        "get_country", "", {"additionalProperties": False, "properties": {}, "type": "object"}
    )
    context = [
        {"role": "user", "content": "What is the capital of the user country? Call the tool"}
    ]
    turn1 = await collect(source, ProviderRequest(context, tools=[tool]))
    (call,) = [c for c in turn1 if isinstance(c, FunctionCall)]
    entry = ToolHistoryEntry(
        ToolCallRecord(call.name, call.arguments, call.call_id, call.provider_data),
        ToolResponseRecord(success=True, data="Mexico"),
    )
    turn2 = await collect(source, ProviderRequest(context, tools=[tool], history=[entry]))
    check(turn2, EXPECTED[(name, 1)])

    sent = [json.loads(r.body) for r in wire_server.requests]
    assert sent[1]["contents"] == [
        {"role": "user", "parts": [{"text": context[0]["content"]}]},
        {
            "role": "model",
            "parts": [
                {
                    "functionCall": {"name": "get_country", "args": {}},
                    # Byte for byte what turn 1 streamed.
                    "thoughtSignature": call.provider_data["thoughtSignature"]
                    if call.provider_data
                    else None,
                }
            ],
        },
        {
            "role": "user",
            "parts": [
                {
                    "functionResponse": {
                        "name": "get_country",
                        "response": {"success": True, "data": "Mexico"},
                    }
                }
            ],
        },
    ]
    # Same turn structure as the recorded second request (pydantic-ai's).
    recorded_request = wire.request_bodies(name)[1]
    assert [c["role"] for c in sent[1]["contents"]] == [
        c["role"] for c in recorded_request["contents"]
    ]
    assert [sorted(p) for c in sent[1]["contents"] for p in c["parts"]] == [
        sorted(p) for c in recorded_request["contents"] for p in c["parts"]
    ]
    assert sent[0]["tools"] == [
        {
            "functionDeclarations": [
                {
                    "name": "get_country",
                    "description": "",
                    "parametersJsonSchema": {
                        "additionalProperties": False,
                        "properties": {},
                        "type": "object",
                    },
                }
            ]
        }
    ]
    for received in wire_server.requests:
        assert received.method == "POST"
        assert received.target == f"/v1beta/models/{MODEL}:streamGenerateContent?alt=sse"
        assert received.header("x-goog-api-key") == API_KEY
        assert "key=" not in received.target and API_KEY not in received.target


def test_body_system_prefill_max_output_and_foreign_calls() -> None:
    foreign = ToolHistoryEntry(
        # A call first made by another provider: it has an id but no Gemini signature.
        ToolCallRecord("lookup", {"q": "x"}, call_id="toolu_01"),
        ToolResponseRecord(success=False, status="tool_execution_failed", reason="boom"),
        pre_tool_text="Looking it up.",
    )
    body = build_gemini_body(
        ProviderRequest(
            [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "q1"},
                {"role": "assistant", "content": "a1"},
                {"role": "user", "content": "q2"},
            ],
            history=[foreign],
            prefill="So far",
            max_output=64,
        )
    )
    assert body == {
        "systemInstruction": {"parts": [{"text": "Be brief."}]},
        "contents": [
            {"role": "user", "parts": [{"text": "q1"}]},
            {"role": "model", "parts": [{"text": "a1"}]},
            {"role": "user", "parts": [{"text": "q2"}]},
            {
                "role": "model",
                "parts": [
                    {"text": "Looking it up."},
                    {
                        "functionCall": {"name": "lookup", "args": {"q": "x"}, "id": "toolu_01"},
                        "thoughtSignature": SKIP_SIGNATURE,
                    },
                ],
            },
            {
                "role": "user",
                "parts": [
                    {
                        "functionResponse": {
                            "name": "lookup",
                            "id": "toolu_01",
                            "response": {
                                "success": False,
                                "status": "tool_execution_failed",
                                "reason": "boom",
                            },
                        }
                    }
                ],
            },
            # The prefill: a trailing model turn the model continues.
            {"role": "model", "parts": [{"text": "So far"}]},
        ],
        "generationConfig": {"maxOutputTokens": 64},
    }


# --------------------------------------------------------------------------- decoding details
def test_partial_args_paths_and_value_kinds() -> None:
    body = frames(
        chunk_of({"functionCall": {"name": "plan", "willContinue": True}}),
        chunk_of(
            {
                "functionCall": {
                    "partialArgs": [
                        {"jsonPath": "$.title", "stringValue": "Hel", "willContinue": True},
                    ],
                    "willContinue": True,
                }
            }
        ),
        chunk_of(
            {
                "functionCall": {
                    "partialArgs": [
                        {"jsonPath": "$.title", "stringValue": "lo"},
                        {"jsonPath": "$.count", "numberValue": 3.0},
                        {"jsonPath": "$.ratio", "numberValue": 0.5},
                        {"jsonPath": "$.opts.dry", "boolValue": True},
                        {"jsonPath": "$.opts['note key']", "nullValue": "NULL_VALUE"},
                        {"jsonPath": "$.steps[1].name", "stringValue": "b"},
                        {"jsonPath": "$.steps[0].name", "stringValue": "a"},
                    ],
                    "willContinue": True,
                }
            }
        ),
        chunk_of({"functionCall": {}}, finish="STOP"),
    )
    chunks = decode_sync(body)
    (call,) = [c for c in chunks if isinstance(c, FunctionCall)]
    assert call.name == "plan"
    assert call.arguments == {
        "title": "Hello",
        "count": 3,
        "ratio": 0.5,
        "opts": {"dry": True, "note key": None},
        "steps": [{"name": "a"}, {"name": "b"}],
    }
    assert chunks[-1] == FinishReason(FinishKind.TOOL_CALLS, "STOP")


def test_streamed_call_cut_by_max_tokens_is_truncated() -> None:
    body = frames(
        chunk_of({"functionCall": {"name": "write", "willContinue": True}}),
        chunk_of(
            {
                "functionCall": {
                    "partialArgs": [
                        {"jsonPath": "$.text", "stringValue": "Once upon", "willContinue": True}
                    ],
                    "willContinue": True,
                }
            },
            finish="MAX_TOKENS",
        ),
    )
    chunks = decode_sync(body)
    (call,) = [c for c in chunks if isinstance(c, FunctionCall)]
    assert (call.arguments, call.truncated) == ({"text": "Once upon"}, True)
    assert chunks[-1] == FinishReason(FinishKind.LENGTH, "MAX_TOKENS")


@pytest.mark.parametrize(
    ("reason", "kind"),
    [
        ("STOP", FinishKind.STOP),
        ("MAX_TOKENS", FinishKind.LENGTH),
        ("SAFETY", FinishKind.CONTENT_FILTER),
        ("RECITATION", FinishKind.CONTENT_FILTER),
        ("BLOCKLIST", FinishKind.CONTENT_FILTER),
        ("PROHIBITED_CONTENT", FinishKind.CONTENT_FILTER),
        ("SPII", FinishKind.CONTENT_FILTER),
        ("MALFORMED_FUNCTION_CALL", FinishKind.OTHER),
        ("SOMETHING_NEW", FinishKind.OTHER),
    ],
)
def test_finish_reasons(reason: str, kind: FinishKind) -> None:
    chunks = decode_sync(frames(chunk_of({"text": "x"}, finish=reason)))
    assert chunks[-1] == FinishReason(kind, reason)


def test_blocked_prompt_is_a_content_filter_finish() -> None:
    chunks = decode_sync(frames({"promptFeedback": {"blockReason": "OTHER"}}))
    assert chunks == [FinishReason(FinishKind.CONTENT_FILTER, "OTHER")]


def test_a_stream_without_a_finish_reason_is_not_finished() -> None:
    # the body ending here is a cut (`decode_stream`: a retryable protocol failure)
    decoder = GeminiStreamDecoder()
    decoder.event("message", json.dumps(chunk_of({"text": "cut"})), [])
    assert not decoder.finished
    assert decoder.finish_marker == "a finishReason"


# --------------------------------------------------------------------------- errors
RETRY_INFO_429 = {
    "error": {
        "code": 429,
        "message": "You exceeded your current quota, please check your plan and billing details.",
        "status": "RESOURCE_EXHAUSTED",
        "details": [
            {
                "@type": "type.googleapis.com/google.rpc.QuotaFailure",
                "violations": [
                    {
                        "quotaMetric": "generativelanguage.googleapis.com/"
                        "generate_content_free_tier_requests",
                        "quotaId": "GenerateRequestsPerMinutePerProjectPerModel-FreeTier",
                    }
                ],
            },
            {"@type": "type.googleapis.com/google.rpc.Help", "links": []},
            {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "34.4s"},
        ],
    }
}


async def test_429_with_retry_info(wire_server: WireServer) -> None:
    # Shape from docs/wire-formats.md §6.3; no retry-after header, the delay is in the body only.
    wire_server.serve(
        Scripted(
            status=429,
            headers=(("content-type", "application/json; charset=UTF-8"),),
            chunks=(json.dumps(RETRY_INFO_429).encode(),),
        )
    )
    source = provider(wire_server)
    with pytest.raises(ProviderError) as caught:
        await collect(source)
    error = caught.value
    assert (error.kind, error.retryable, error.status_code) == ("rate_limit", True, 429)
    assert error.retry_after == pytest.approx(34.4)
    assert "exceeded your current quota" in error.message
    for text in (str(error), repr(error), repr(source)):
        assert API_KEY not in text


async def test_error_object_mid_stream(wire_server: WireServer) -> None:
    body = frames(chunk_of({"text": "Partial"})) + frames(
        {"error": {"code": 503, "message": "The model is overloaded.", "status": "UNAVAILABLE"}}
    )
    wire_server.serve(Scripted(headers=wire.SSE_HEADERS, chunks=(body,)))
    seen: list[Chunk] = []
    with pytest.raises(ProviderError) as caught:
        async for chunk in provider(wire_server).stream(REQUEST):
            seen.append(chunk)
    assert seen == [TextDelta("Partial")]
    assert (caught.value.kind, caught.value.retryable) == ("server", True)


async def test_key_echoed_by_the_server_is_redacted(wire_server: WireServer) -> None:
    echo = {
        "error": {
            "code": 400,
            "message": f"API key not valid: {API_KEY}",
            "status": "INVALID_ARGUMENT",
        }
    }
    wire_server.serve(
        Scripted(
            status=400,
            headers=(("content-type", "application/json"),),
            chunks=(json.dumps(echo).encode(),),
        )
    )
    with pytest.raises(ProviderError) as caught:
        await collect(provider(wire_server))
    assert caught.value.kind == "bad_request"
    assert API_KEY not in str(caught.value) and API_KEY not in repr(caught.value)


async def test_cancellation_closes_the_response_promptly(
    wire_server: WireServer, client: httpx.AsyncClient
) -> None:
    response = recorded(("gemini__two-turn-tool-call-crlf.cassette.yaml", 1))
    wire_server.serve(Scripted.recorded(response, cuts=[400], stall_after=1))
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
    source = GeminiProvider("https://g.example/v1beta/", "models/gemini-x", api_key=API_KEY)
    assert (source.name, source.tool_calling) == ("gemini", "native")
    assert (source.base_url, source.model) == ("https://g.example/v1beta", "gemini-x")
    assert API_KEY not in repr(source)
