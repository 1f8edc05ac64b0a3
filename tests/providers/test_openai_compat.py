"""OpenAICompatibleProvider over real HTTP: every recorded chat stream, split anywhere; the
tool-call accumulator's quirks; request bodies; HTTP and in-stream failures; cancellation."""

from __future__ import annotations

import asyncio
import email.utils
import json
import time
from contextlib import aclosing
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from tests.providers import wire
from tests.providers.native import openai_tool_call
from tests.providers.replay import REQUEST
from tests.providers.replay import Replay
from tests.providers.replay import assemble
from tests.providers.replay import collect
from tests.providers.replay import replay
from tests.providers.wire_server import Scripted
from tests.providers.wire_server import WireServer
from toolloop_fsm.events import FinishKind
from toolloop_fsm.events import FinishReason
from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import TextDelta
from toolloop_fsm.events import UsageReport
from toolloop_fsm.provider import ProviderError
from toolloop_fsm.provider import ProviderRequest
from toolloop_fsm.provider import ToolSpec
from toolloop_fsm.providers.openai_compat import OpenAICompatibleProvider
from toolloop_fsm.result import ToolCallRecord
from toolloop_fsm.result import ToolHistoryEntry
from toolloop_fsm.result import ToolResponseRecord

API_KEY = "sk-test-0123456789abcdef-SECRET"
CHAT_PREFIXES = (
    "openai-chat__",
    "azure-openai-chat__",
    "deepseek__",
    "groq__",
    "mistral__",
    "openrouter__",
    "vllm__",
)


def make(base_url: str) -> OpenAICompatibleProvider:
    return OpenAICompatibleProvider(base_url, "test-model", api_key=API_KEY)


# Hardcoded from reading each capture (text and thoughts cross-checked against a naive
# concatenation of the payloads in test_expected_text_matches_the_raw_payloads).
EXPECTED: dict[tuple[str, int], Replay] = {
    ("azure-openai-chat__prompt-filter-results-first-chunk.jsonl", 0): Replay(
        text="Capital of Denmark.",
        thought="",
        calls=(),
        usage=((15, 78),),
        finish=(FinishKind.STOP, "stop"),
    ),
    ("deepseek__reasoning-content-then-tool-call.jsonl", 0): Replay(
        text="",
        thought=(
            "The user is asking for the weather in San Francisco. I need to use the weather "
            "tool to get this information. Let me invoke the weather tool with the location "
            'parameter set to "San Francisco".'
        ),
        calls=(("weather", {"location": "San Francisco"}, "call_00_ioIn7yN9p1ZOMNpDLwd4MgAF"),),
        usage=((339, 83),),
        finish=(FinishKind.TOOL_CALLS, "tool_calls"),
    ),
    # groq__error-event-mid-stream-tool-use-failed.cassette.yaml[0] raises bad_request
    ("groq__error-event-mid-stream-tool-use-failed.cassette.yaml", 1): Replay(
        text="",
        thought=(
            'We need to call the function with correct parameter "name". Provide a name, e.g., '
            '"example".'
        ),
        calls=(
            (
                "get_something_by_name",
                {"name": "example"},
                "fc_bfb39741-3748-4def-9886-a93fc9c64a90",
            ),
        ),
        usage=((304, 49),),
        finish=(FinishKind.TOOL_CALLS, "tool_calls"),
    ),
    ("groq__error-event-mid-stream-tool-use-failed.cassette.yaml", 2): Replay(
        text="The tool returned the expected result for the valid call.",
        thought=(
            "The user wants to test error handling by calling tool with non-existent "
            "parameters first (we did) and then second try with valid args. We have succeeded. "
            "Now respond concisely."
        ),
        calls=(),
        usage=((339, 58),),
        finish=(FinishKind.STOP, "stop"),
    ),
    ("mistral__magistral-thinking-content-array.cassette.yaml", 0): Replay(
        text=(
            "To cross the street safely, follow these steps:\n\n1. Look both ways to check for "
            "oncoming traffic.\n2. Use a crosswalk if one is available.\n3. Obey any traffic "
            "signals or signs that may be present.\n4. Proceed with caution until you have "
            "safely reached the other side.\n\n```markdown\nTo cross the street safely, follow "
            "these steps:\n\n1. Look both ways to check for oncoming traffic.\n2. Use a "
            "crosswalk if one is available.\n3. Obey any traffic signals or signs that may be "
            "present.\n4. Proceed with caution until you have safely reached the other side.\n"
            "```\n\nBy following these steps, you can ensure a safe crossing."
        ),
        thought=(
            "Okay, the user is asking how to cross the street. I know that crossing the street "
            "safely involves a few key steps: first, look both ways to check for oncoming "
            "traffic; second, use a crosswalk if one is available; third, obey any traffic "
            "signals or signs that may be present; and finally, proceed with caution until you "
            "have safely reached the other side. Let me compile this information into a clear "
            "and concise response."
        ),
        calls=(),
        usage=((10, 232),),
        finish=(FinishKind.STOP, "stop"),
    ),
    ("mistral__tool-call-incremental-empty-name-continuation.jsonl", 0): Replay(
        text="",
        thought="",
        calls=(
            (
                "webSearchTool",
                {"query": "current Berlin weather"},
                "chatcmpl-tool-9f149c74c42f265b",
            ),
        ),
        usage=((171, 14),),
        finish=(FinishKind.TOOL_CALLS, "tool_calls"),
    ),
    ("mistral__tool-call-no-index-finish-same-chunk.jsonl", 0): Replay(
        text="",
        thought="",
        calls=(("weather", {"location": "San Francisco"}, "gSIMJiOkT"),),
        usage=((124, 22),),
        finish=(FinishKind.TOOL_CALLS, "tool_calls"),
    ),
    ("openai-chat__finish-length.sse", 0): Replay(
        text='{"',
        thought="",
        calls=(),
        usage=((79, 1),),
        finish=(FinishKind.LENGTH, "length"),
    ),
    ("openai-chat__moderation-chunk-after-usage.cassette.yaml", 0): Replay(
        text="Paris.",
        thought="",
        calls=(),
        usage=((13, 11),),
        finish=(FinishKind.STOP, "stop"),
    ),
    ("openai-chat__n3-multiple-choices.sse", 0): Replay(
        text='{"city":"San Francisco","temperature":65,"units":"f"}',
        thought="",
        calls=(),
        usage=((79, 42),),
        finish=(FinishKind.STOP, "stop"),
    ),
    ("openai-chat__refusal.sse", 0): Replay(
        text="I'm sorry, I can't assist with that request.",
        thought="",
        calls=(),
        usage=((79, 11),),
        finish=(FinishKind.REFUSAL, "stop"),
    ),
    ("openai-chat__text-obfuscation-usage-null.jsonl", 0): Replay(
        text=(
            "**Holiday Name:** Harmony Day\n\n**Date:** Celebrated annually on the first "
            "Saturday of May\n\n**Purpose:** Harmony Day is dedicated to fostering "
            "understanding, kindness, and unity among diverse communities. It emphasizes "
            "celebrating cultural differences while promoting empathy and collaboration.\n\n"
            "**Traditions:**\n\n1. **Cultural Potluck Gatherings:** Communities come together "
            "to share traditional dishes from their backgrounds, encouraging conversation and "
            "curiosity about different cultures.\n\n2. **Story Circles:** People of all ages "
            "are encouraged to share stories from their heritage or personal experiences that "
            "promote understanding and empathy.\n\n3. **Decorate for Unity:** Public spaces "
            "and homes are decorated with symbols representing different cultures—flags, "
            "traditional art, and meaningful motifs—to visually celebrate diversity.\n\n4. "
            "**Collaborative Art Projects:** Communities create murals or sculptures that "
            "symbolize unity and diversity, involving artists and residents of all ages.\n\n5. "
            "**Acts of Kindness:** As a central activity, participants perform Small acts of "
            "kindness throughout the day, such as volunteering, helping neighbors, or inviting "
            "someone new to join festivities.\n\n6. **Music & Dance Festivals:** Local "
            "performances showcase a variety of musical styles and dances from different parts "
            "of the world, emphasizing shared joy and creativity.\n\n7. **Educational "
            "Workshops:** Interactive sessions teach about various cultures’ histories, "
            "traditions, and celebrations, fostering respect and knowledge.\n\n**Overall "
            "Spirit:** Harmony Day aims to create a sense of global community, reminding "
            "everyone that despite our differences, we are all connected through shared human "
            "experiences and mutual respect."
        ),
        thought="",
        calls=(),
        usage=((16, 300),),
        finish=(FinishKind.STOP, "stop"),
    ),
    ("openai-chat__text-with-usage-chunk.sse", 0): Replay(
        text=(
            "I'm unable to provide real-time weather updates. To get the current weather in "
            "San Francisco, I recommend checking a reliable weather website or a weather app."
        ),
        thought="",
        calls=(),
        usage=((14, 30),),
        finish=(FinishKind.STOP, "stop"),
    ),
    ("openai-chat__tool-call-single.sse", 0): Replay(
        text="",
        thought="",
        calls=(("get_weather", {"city": "New York City"}, "call_4XzlGBLtUe9dy3GVNV4jhq7h"),),
        usage=((44, 16),),
        finish=(FinishKind.TOOL_CALLS, "tool_calls"),
    ),
    ("openai-chat__tool-calls-parallel.sse", 0): Replay(
        text="",
        thought="",
        calls=(
            (
                "GetWeatherArgs",
                {"city": "Edinburgh", "country": "GB", "units": "c"},
                "call_JMW1whyEaYG438VE1OIflxA2",
            ),
            (
                "get_stock_price",
                {"ticker": "AAPL", "exchange": "NASDAQ"},
                "call_DNYTawLBoN8fj3KN6qU9N1Ou",
            ),
        ),
        usage=((149, 60),),
        finish=(FinishKind.TOOL_CALLS, "tool_calls"),
    ),
    # openrouter__http-429-error-body-no-retry-after.cassette.yaml[0] raises rate_limit
    # openrouter__http-429-error-body-no-retry-after.cassette.yaml[1] raises rate_limit
    # openrouter__http-429-error-body-no-retry-after.cassette.yaml[2] raises rate_limit
    ("vllm__llama33-text-stop-reason-token-ids.cassette.yaml", 0): Replay(
        text="1, 2, 3, 4, 5",
        thought="",
        calls=(),
        usage=((46, 14),),
        finish=(FinishKind.STOP, "stop"),
    ),
}

# Captures whose (only) interactions fail, by design of the recording.
FAILING: dict[tuple[str, int], tuple[str, bool]] = {
    ("groq__error-event-mid-stream-tool-use-failed.cassette.yaml", 0): ("bad_request", False),
    ("openrouter__http-429-error-body-no-retry-after.cassette.yaml", 0): ("rate_limit", True),
    ("openrouter__http-429-error-body-no-retry-after.cassette.yaml", 1): ("rate_limit", True),
    ("openrouter__http-429-error-body-no-retry-after.cassette.yaml", 2): ("rate_limit", True),
}
ALL_RESPONSES = [
    (name, index) for name in wire.names(*CHAT_PREFIXES) for index in range(len(wire.load(name)))
]
SUCCEEDING = [key for key in ALL_RESPONSES if key not in FAILING]


def test_every_chat_capture_has_an_expectation() -> None:
    assert sorted([*EXPECTED, *FAILING]) == sorted(ALL_RESPONSES)


@pytest.mark.parametrize(("name", "index"), SUCCEEDING)
async def test_recorded_stream_assembles_exactly(
    wire_server: WireServer, name: str, index: int
) -> None:
    chunks = await replay(wire_server, make, wire.load(name)[index])
    assert assemble(chunks) == EXPECTED[name, index]


@pytest.mark.parametrize(("name", "index"), sorted(FAILING))
async def test_recorded_failure_raises_classified_error(
    wire_server: WireServer, name: str, index: int
) -> None:
    with pytest.raises(ProviderError) as caught:
        await replay(wire_server, make, wire.load(name)[index])
    assert (caught.value.kind, caught.value.retryable) == FAILING[name, index]
    assert API_KEY not in str(caught.value) and API_KEY not in repr(caught.value)


def test_expected_text_matches_the_raw_payloads() -> None:
    """An independent oracle for the hardcoded text: concatenate choice 0's string content."""
    for (name, index), expected in EXPECTED.items():
        text, reasoning = "", ""
        for line in wire.load(name)[index].body.split(b"\n"):
            if not line.startswith(b"data: {"):
                continue
            for choice in json.loads(line[6:]).get("choices") or []:
                if choice.get("index", 0) != 0:
                    continue
                delta = choice.get("delta") or {}
                content = delta.get("content")
                text += content if isinstance(content, str) else ""
                text += delta.get("refusal") or ""
                reasoning += delta.get("reasoning") or delta.get("reasoning_content") or ""
                if isinstance(content, list):
                    reasoning += "".join(p["text"] for c in content for p in c["thinking"])
        assert (text, reasoning) == (expected.text, expected.thought), name


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


async def test_splits_inside_every_multibyte_character(wire_server: WireServer) -> None:
    """Cut before every continuation byte of every UTF-8 character ('—', '’' in this capture)."""
    name = "openai-chat__text-obfuscation-usage-null.jsonl"
    response = wire.load(name)[0]
    cuts = [i for i, byte in enumerate(response.body) if byte & 0xC0 == 0x80]
    assert len(cuts) == 6  # "—" twice, "’" once
    chunks = await replay(wire_server, make, response, cuts=cuts)
    assert assemble(chunks) == EXPECTED[name, 0]


# ----------------------------------------------------------------------------- tool-call quirks
def _sse(*payloads: Any, done: bool = True) -> bytes:
    body = b"".join(b"data: " + json.dumps(p).encode() + b"\n\n" for p in payloads)
    return body + (b"data: [DONE]\n\n" if done else b"")


def _chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> Any:
    return {
        "id": "c",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}],
        **extra,
    }


def _call(**fields: Any) -> dict[str, Any]:
    return {"tool_calls": [fields]}


async def _stream_body(server: WireServer, body: bytes) -> list[Any]:
    server.serve(Scripted(chunks=(body,)))
    return await collect(make(server.url + "/v1"))


def _calls(chunks: list[Any]) -> list[tuple[str, Any, str | None, bool, str | None]]:
    return [
        (c.name, c.arguments, c.call_id, c.truncated, c.parse_error)
        for c in chunks
        if isinstance(c, FunctionCall)
    ]


async def test_index_starting_at_one_and_sparse_indexes(wire_server: WireServer) -> None:
    body = _sse(
        _chunk(
            _call(index=1, id="call_a", type="function", function={"name": "f", "arguments": ""})
        ),
        _chunk(_call(index=1, function={"arguments": '{"x": '})),
        _chunk(_call(index=5, id="call_b", function={"name": "g", "arguments": "{}"})),
        _chunk(_call(index=1, function={"arguments": "1}"})),
        _chunk(finish="tool_calls"),
    )
    assert _calls(await _stream_body(wire_server, body)) == [
        ("f", {"x": 1}, "call_a", False, None),
        ("g", {}, "call_b", False, None),
    ]


async def test_empty_id_and_name_on_continuations_never_overwrite(wire_server: WireServer) -> None:
    body = _sse(
        _chunk(_call(index=0, id="call_q", function={"name": "search", "arguments": '{"q"'})),
        _chunk(_call(index=0, id="", function={"name": "", "arguments": ': "x"'})),
        _chunk(_call(index=0, id="", function={"name": "", "arguments": "}"})),
        _chunk(_call(index=0, id="", function={"arguments": ""})),  # trailing empty fragment
        _chunk(finish="tool_calls"),
    )
    assert _calls(await _stream_body(wire_server, body)) == [
        ("search", {"q": "x"}, "call_q", False, None)
    ]


async def test_no_index_continuations_follow_the_latest_call(wire_server: WireServer) -> None:
    body = _sse(
        _chunk(_call(id="A1", function={"name": "first", "arguments": '{"a":'})),
        _chunk(_call(function={"arguments": "1}"})),
        _chunk(_call(id="B2", function={"name": "second", "arguments": '{"b":2}'})),
        _chunk(finish="tool_calls"),
    )
    assert _calls(await _stream_body(wire_server, body)) == [
        ("first", {"a": 1}, "A1", False, None),
        ("second", {"b": 2}, "B2", False, None),
    ]


async def test_index_reused_by_a_new_call_id_starts_a_new_call(wire_server: WireServer) -> None:
    body = _sse(
        _chunk(_call(index=0, id="one", function={"name": "a", "arguments": "{}"})),
        _chunk(_call(index=0, id="two", function={"name": "b", "arguments": "{}"})),
        _chunk(finish="tool_calls"),
    )
    assert [c[:3] for c in _calls(await _stream_body(wire_server, body))] == [
        ("a", {}, "one"),
        ("b", {}, "two"),
    ]


async def test_arguments_cut_by_length_are_truncated(wire_server: WireServer) -> None:
    body = _sse(
        _chunk(_call(index=0, id="c1", function={"name": "w", "arguments": '{"city": "Par'})),
        _chunk(finish="length"),
        {"id": "c", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}},
    )
    chunks = await _stream_body(wire_server, body)
    assert _calls(chunks) == [("w", {}, "c1", True, None)]
    assert [c for c in chunks if isinstance(c, FinishReason)] == [
        FinishReason(FinishKind.LENGTH, "length")
    ]


async def test_malformed_arguments_carry_the_parse_error(wire_server: WireServer) -> None:
    body = _sse(
        _chunk(_call(index=0, id="c1", function={"name": "w", "arguments": '{"a": nope}'})),
        _chunk(finish="tool_calls"),
    )
    [(name, arguments, _id, truncated, error)] = _calls(await _stream_body(wire_server, body))
    assert (name, arguments, truncated) == ("w", '{"a": nope}', False)
    assert error is not None and "Expecting value" in error


async def test_calls_streamed_before_done_without_a_finish_reason_are_a_cut_not_calls(
    wire_server: WireServer,
) -> None:
    # [DONE] without a finish_reason ends an interrupted stream (llama.cpp): nothing says the
    # call was complete, so it is not handed on to be run
    body = _sse(_chunk(_call(id="x", function={"name": "f", "arguments": '{"k": [1, 2]}'})))
    with pytest.raises(ProviderError, match="ended without a finish_reason") as caught:
        await _stream_body(wire_server, body)
    assert (caught.value.kind, caught.value.retryable) == ("protocol", True)


async def test_repeated_finish_reason_is_reported_once(wire_server: WireServer) -> None:
    body = _sse(
        _chunk({"content": "hi"}),
        _chunk(finish="length"),
        _chunk(finish="length", native_finish_reason="MAX_TOKENS"),
    )
    chunks = await _stream_body(wire_server, body)
    assert [c for c in chunks if isinstance(c, FinishReason)] == [
        FinishReason(FinishKind.LENGTH, "length")
    ]


async def test_other_choices_are_ignored(wire_server: WireServer) -> None:
    body = _sse(
        {"choices": [{"index": 1, "delta": {"content": "B"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": "A"}, "finish_reason": None}]},
        {"choices": [{"index": 1, "delta": {}, "finish_reason": "length"}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    )
    assert assemble(await _stream_body(wire_server, body)) == Replay(
        text="A", thought="", calls=(), usage=(), finish=(FinishKind.STOP, "stop")
    )


async def test_comments_crlf_framing_and_reasoning_fields(wire_server: WireServer) -> None:
    body = b": OPENROUTER PROCESSING\r\n\r\n" + _sse(
        _chunk({"reasoning": "think ", "reasoning_details": [{"text": "think "}]}),
        _chunk({"reasoning": "more", "reasoning_content": "more"}),  # vLLM's copy
        _chunk({"content": "answer"}, finish="stop"),
    ).replace(b"\n", b"\r\n")
    assert assemble(await _stream_body(wire_server, body)) == Replay(
        text="answer",
        thought="think more",
        calls=(),
        usage=(),
        finish=(FinishKind.STOP, "stop"),
    )


async def test_groq_usage_in_x_groq(wire_server: WireServer) -> None:
    body = _sse(
        _chunk(
            {"content": "x"},
            finish="stop",
            x_groq={"usage": {"prompt_tokens": 5, "completion_tokens": 6}},
        )
    )
    chunks = await _stream_body(wire_server, body)
    assert [c for c in chunks if isinstance(c, UsageReport)] == [UsageReport(5, 6)]


# ----------------------------------------------------------------------------- in-stream errors
@pytest.mark.parametrize(
    ("error", "kind", "retryable"),
    [
        ({"message": "Rate limit reached", "type": "rate_limit_error"}, "rate_limit", True),
        ({"message": "Overloaded", "type": "overloaded_error"}, "server", True),
        ({"message": "Token limit reached", "code": 400}, "bad_request", False),
        ({"message": "boom", "code": 502}, "server", True),
        (
            {"message": "bad", "type": "invalid_request_error", "code": "tool_use_failed"},
            "bad_request",
            False,
        ),
        ({"message": "something else"}, "provider_error", True),
    ],
)
async def test_error_inside_a_chunk_raises(
    wire_server: WireServer, error: dict[str, Any], kind: str, retryable: bool
) -> None:
    body = _sse(_chunk({"content": "partial"}), {**_chunk({"content": "x"}), "error": error})
    with pytest.raises(ProviderError) as caught:
        await _stream_body(wire_server, body)
    assert (caught.value.kind, caught.value.retryable) == (kind, retryable)
    assert error["message"] in caught.value.message


async def test_error_event_raises(wire_server: WireServer) -> None:
    body = _sse(_chunk({"content": "a"}), done=False) + (
        b'event: error\ndata: {"error": {"message": "Overloaded", "type": "overloaded_error"}}\n\n'
    )
    with pytest.raises(ProviderError, match="Overloaded") as caught:
        await _stream_body(wire_server, body)
    assert (caught.value.kind, caught.value.retryable) == ("server", True)


# ----------------------------------------------------------------------------- transport faults
async def test_connection_dropped_mid_stream(wire_server: WireServer) -> None:
    response = wire.load("openai-chat__text-with-usage-chunk.sse")[0]
    wire_server.serve(
        Scripted.recorded(response, cuts=range(500, len(response.body), 500), drop_after=3)
    )
    received: list[Any] = []
    with pytest.raises(ProviderError) as caught:
        async for chunk in make(wire_server.url + "/v1").stream(REQUEST):
            received.append(chunk)
    assert (caught.value.kind, caught.value.retryable) == ("connection", True)
    assert received and isinstance(received[0], TextDelta)


async def test_connection_closed_cleanly_before_finish(wire_server: WireServer) -> None:
    body = _sse(_chunk({"content": "half"}), done=False)
    wire_server.serve(Scripted(chunks=(body,), framing="close"))
    with pytest.raises(ProviderError, match="ended without a finish_reason") as caught:
        await collect(make(wire_server.url + "/v1"))
    assert (caught.value.kind, caught.value.retryable) == ("protocol", True)


async def test_connection_refused(wire_server: WireServer) -> None:
    url = wire_server.url + "/v1"
    await wire_server.close()
    with pytest.raises(ProviderError) as caught:
        await collect(make(url))
    assert caught.value.kind == "connection" and caught.value.retryable


async def test_garbage_instead_of_sse(wire_server: WireServer) -> None:
    wire_server.serve(
        Scripted(
            headers=(("content-type", "text/html"),),
            chunks=(b"<html><head><title>502 Bad Gateway</title></head></html>\n",),
        )
    )
    with pytest.raises(ProviderError, match="502 Bad Gateway") as caught:
        await collect(make(wire_server.url + "/v1"))
    assert caught.value.kind == "protocol"


async def test_non_json_data_line_is_named(wire_server: WireServer) -> None:
    wire_server.serve(
        Scripted(chunks=(_sse(_chunk({"content": "ok"}), done=False), b"data: {oops\n\n"))
    )
    with pytest.raises(ProviderError, match=r"\{oops") as caught:
        await collect(make(wire_server.url + "/v1"))
    assert caught.value.kind == "protocol"


async def test_empty_body_is_a_protocol_error(wire_server: WireServer) -> None:
    wire_server.serve(Scripted(chunks=()))
    with pytest.raises(ProviderError) as caught:
        await collect(make(wire_server.url + "/v1"))
    assert caught.value.kind == "protocol"


# ----------------------------------------------------------------------------- HTTP errors
def _http_error(status: int, headers: tuple[tuple[str, str], ...], body: bytes) -> Scripted:
    return Scripted(
        status=status,
        headers=(("content-type", "application/json"), *headers),
        chunks=(body,),
        framing="length",
    )


OPENAI_429 = (
    b'{"error": {"message": "Rate limit reached for requests", "type": "requests",'
    b' "code": "rate_limit_exceeded"}}'
)


@pytest.mark.parametrize(
    ("headers", "retry_after"),
    [
        ((("retry-after", "7"),), 7.0),
        ((("retry-after-ms", "1500"), ("retry-after", "9")), 1.5),
        ((("retry-after", "0.25"),), 0.25),
        ((), None),
    ],
)
async def test_429_retry_after(
    wire_server: WireServer, headers: tuple[tuple[str, str], ...], retry_after: float | None
) -> None:
    wire_server.serve(_http_error(429, headers, OPENAI_429))
    with pytest.raises(ProviderError) as caught:
        await collect(make(wire_server.url + "/v1"))
    error = caught.value
    assert (error.kind, error.retryable, error.status_code) == ("rate_limit", True, 429)
    assert error.retry_after == retry_after
    assert "Rate limit reached for requests" in error.message


async def test_429_retry_after_http_date(wire_server: WireServer) -> None:
    # an hour ahead: however slow the machine, the wait read from the date is still positive
    # (the exact arithmetic is test_http's, with `now` given)
    when = email.utils.formatdate(time.time() + 3600, usegmt=True)
    wire_server.serve(_http_error(429, (("retry-after", when),), OPENAI_429))
    with pytest.raises(ProviderError) as caught:
        await collect(make(wire_server.url + "/v1"))
    assert caught.value.retry_after is not None and 0.0 < caught.value.retry_after <= 3600.0


async def test_openrouter_429_without_retry_after(wire_server: WireServer) -> None:
    recorded = wire.load("openrouter__http-429-error-body-no-retry-after.cassette.yaml")[0]
    wire_server.serve(Scripted.recorded(recorded, framing="length"))
    with pytest.raises(ProviderError) as caught:
        await collect(make(wire_server.url + "/v1"))
    error = caught.value
    assert (error.kind, error.retryable, error.retry_after) == ("rate_limit", True, None)
    assert "temporarily rate-limited upstream" in error.message


@pytest.mark.parametrize(
    ("status", "kind", "retryable"),
    [
        (500, "server", True),
        (502, "server", True),
        (503, "server", True),
        (529, "server", True),
        (408, "server", True),
        (409, "server", True),
        (400, "bad_request", False),
        (404, "not_found", False),
        (401, "auth", False),
        (403, "auth", False),
    ],
)
async def test_http_status_classification(
    wire_server: WireServer, status: int, kind: str, retryable: bool
) -> None:
    body = (
        b'{"error": {"message": "Incorrect API key provided: '
        + API_KEY.encode()
        + b'", "type": "x"}}'
    )
    wire_server.serve(_http_error(status, (), body))
    with pytest.raises(ProviderError) as caught:
        await collect(make(wire_server.url + "/v1"))
    error = caught.value
    assert (error.kind, error.retryable, error.status_code) == (kind, retryable, status)
    assert "Incorrect API key provided" in error.message
    assert API_KEY not in str(error) and API_KEY not in repr(error)


async def test_x_should_retry_overrides(wire_server: WireServer) -> None:
    wire_server.serve(_http_error(500, (("x-should-retry", "false"),), b"{}"))
    with pytest.raises(ProviderError) as caught:
        await collect(make(wire_server.url + "/v1"))
    assert (caught.value.kind, caught.value.retryable) == ("server", False)


# ----------------------------------------------------------------------------- cancellation
def _stalling_stream() -> Scripted:
    response = wire.load("openai-chat__text-obfuscation-usage-null.jsonl")[0]
    return Scripted.recorded(response, cuts=range(300, len(response.body), 300), stall_after=8)


async def test_cancelling_the_consumer_disconnects_promptly(wire_server: WireServer) -> None:
    wire_server.serve(_stalling_stream())
    first = asyncio.Event()

    async def consume() -> None:
        async for _chunk in make(wire_server.url + "/v1").stream(REQUEST):
            first.set()

    task = asyncio.create_task(consume())
    await first.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wire_server.client_gone.wait()


async def test_closing_the_stream_early_disconnects_promptly(wire_server: WireServer) -> None:
    wire_server.serve(_stalling_stream())
    async with aclosing(make(wire_server.url + "/v1").stream(REQUEST)) as stream:  # type: ignore[type-var]
        async for _chunk in stream:
            break
    await wire_server.client_gone.wait()


async def test_shared_client_is_left_open(wire_server: WireServer) -> None:
    response = wire.load("openai-chat__tool-call-single.sse")[0]
    async with httpx.AsyncClient() as client:
        provider = OpenAICompatibleProvider(wire_server.url + "/v1", "m", client=client)
        for _ in range(2):
            wire_server.serve(Scripted.recorded(response))
            chunks = await collect(provider)
            assert assemble(chunks) == EXPECTED["openai-chat__tool-call-single.sse", 0]
        assert not client.is_closed


# ----------------------------------------------------------------------------- the request
async def test_request_body_and_headers(wire_server: WireServer) -> None:
    history = (
        ToolHistoryEntry(
            call=ToolCallRecord("get_weather", {"city": "Paris"}, call_id="call_1"),
            response=ToolResponseRecord(True, data={"temp": 21}, message="sunny"),
            pre_tool_text="Let me check.",
        ),
        ToolHistoryEntry(
            call=ToolCallRecord("book", {"day": "mon"}),
            response=ToolResponseRecord(False, reason="no seats", tool_name="book"),
        ),
    )
    request = ProviderRequest(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}],
        tools=(
            ToolSpec(
                "get_weather",
                "Weather by city",
                {"type": "object", "properties": {"city": {"type": "string"}}},
            ),
        ),
        history=history,
        prefill="It is",
        max_output=256,
    )
    wire_server.serve(Scripted.recorded(wire.load("openai-chat__text-with-usage-chunk.sse")[0]))
    provider = OpenAICompatibleProvider(
        wire_server.url + "/v1/", "gpt-test", api_key=API_KEY, extra_body={"temperature": 0}
    )
    await collect(provider, request)
    [sent] = wire_server.requests
    assert (sent.method, sent.target) == ("POST", "/v1/chat/completions")
    assert sent.header("authorization") == f"Bearer {API_KEY}"
    assert API_KEY not in sent.target
    body = json.loads(sent.body)
    generated_id = body["messages"][4]["tool_calls"][0]["id"]
    assert len(generated_id) == 9 and generated_id.isalnum()
    assert body == {
        "model": "gpt-test",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 256,
        "temperature": 0,
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "Weather by city",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                },
            }
        ],
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": "Let me check.",
                "tool_calls": [openai_tool_call("call_1", "get_weather", '{"city": "Paris"}')],
            },
            {
                "role": "tool",
                "tool_call_id": "call_1",
                "content": '{"success": true, "data": {"temp": 21}, "message": "sunny"}',
            },
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [openai_tool_call(generated_id, "book", '{"day": "mon"}')],
            },
            {
                "role": "tool",
                "tool_call_id": generated_id,
                "content": (
                    '{"success": false, "status": "tool_execution_failed", "reason": "no seats", '
                    '"tool_name": "book"}'
                ),
            },
            {"role": "assistant", "content": "It is"},
        ],
    }
    # Deterministic: the same history gives the same generated id.
    assert provider.build_body(request)["messages"][4]["tool_calls"][0]["id"] == generated_id


def test_a_tool_call_made_without_text_is_sent_back_with_empty_content_not_null() -> None:
    # llama.cpp's server answers HTTP 500 to an assistant message whose content is null, and
    # every key of the model would be tried against the same refusal
    request = ProviderRequest(
        [{"role": "user", "content": "Weather?"}],
        history=(
            ToolHistoryEntry(
                call=ToolCallRecord("get_weather", {"city": "Paris"}, call_id="call_1"),
                response=ToolResponseRecord(True, data={"temp": 21}),
            ),
        ),
    )
    messages = make("http://127.0.0.1:1/v1").build_body(request)["messages"]
    [assistant] = [m for m in messages if m["role"] == "assistant"]
    assert assistant["content"] == ""
    assert [call["function"]["name"] for call in assistant["tool_calls"]] == ["get_weather"]


def test_api_key_never_in_repr() -> None:
    provider = make("http://127.0.0.1:1/v1")
    assert API_KEY not in repr(provider) and "api_key=<set>" in repr(provider)
    assert provider.tool_calling == "native" and provider.name == "openai-compatible:test-model"
