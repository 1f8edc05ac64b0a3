"""The SSE and NDJSON decoders: WHATWG rules, arbitrary chunking, and agreement with httpx-sse."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from collections.abc import Sequence

import httpx
import httpx_sse
import pytest
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from tests.providers import wire
from toolloop_fsm.provider import ProviderError
from toolloop_fsm.providers._sse import ServerSentEvent
from toolloop_fsm.providers._sse import SSEDecoder
from toolloop_fsm.providers._sse import aiter_ndjson
from toolloop_fsm.providers._sse import aiter_sse


async def _bytes(chunks: Sequence[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


async def _events(
    chunks: Sequence[bytes], *, strict: bool = True, secrets: Sequence[str] = ()
) -> list[ServerSentEvent]:
    return [event async for event in aiter_sse(_bytes(chunks), strict=strict, secrets=secrets)]


def _split(body: bytes, cuts: Sequence[int]) -> list[bytes]:
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(body)}), len(body)]
    return [body[a:b] for a, b in itertools.pairwise(bounds)]


async def test_line_endings_cr_lf_crlf_all_dispatch() -> None:
    body = b"data: a\r\n\r\ndata: b\n\ndata: c\r\rdata: d\r\n\n"
    assert [e.data for e in await _events([body])] == ["a", "b", "c", "d"]


async def test_crlf_split_between_chunks_counts_once() -> None:
    events = await _events([b"data: a\r", b"\ndata: b\r", b"\n\r", b"\n"])
    assert [e.data for e in events] == ["a\nb"]


async def test_comments_fields_and_multiline_data() -> None:
    body = (
        b": OPENROUTER PROCESSING\n\n"
        b"event: delta\nid: 7\nretry: 1500\ndata: line one\ndata:line two\ndata\n\n"
        b"data: after\n\n"
    )
    events = await _events([body])
    assert events == [
        ServerSentEvent(event="delta", data="line one\nline two\n", id="7", retry=1500),
        ServerSentEvent(event="message", data="after", id="7", retry=1500),
    ]


async def test_only_one_leading_space_is_stripped() -> None:
    events = await _events([b"data:  two spaces\n\n", b"data:none\n\n"])
    assert [e.data for e in events] == [" two spaces", "none"]


async def test_event_without_data_is_not_dispatched_and_its_name_does_not_leak() -> None:
    events = await _events([b"event: ping\n\ndata: x\n\n"])
    assert events == [ServerSentEvent(event="message", data="x")]


async def test_empty_data_field_dispatches_empty_string() -> None:
    assert [e.data for e in await _events([b"data:\n\n"])] == [""]


async def test_id_with_nul_is_ignored_and_bad_retry_is_ignored() -> None:
    events = await _events([b"id: 1\ndata: a\n\nid: x\x00y\nretry: 1s\ndata: b\n\n"])
    assert [(e.id, e.retry) for e in events] == [("1", None), ("1", None)]


async def test_bom_at_stream_start_is_dropped_even_when_split() -> None:
    events = await _events([b"\xef", b"\xbb", b"\xbfdata: x", b"\n\n"])
    assert [e.data for e in events] == ["x"]


async def test_utf8_character_split_across_chunks() -> None:
    text = 'data: {"t": "Édinbourg — 東京 🌍"}\n\n'.encode()
    for cut in range(1, len(text)):
        events = await _events([text[:cut], text[cut:]])
        assert json.loads(events[0].data) == {"t": "Édinbourg — 東京 🌍"}


async def test_undelimited_last_event_is_flushed_at_eof() -> None:
    events = await _events([b"event: a\ndata: 1\n\nevent: message_stop\ndata: {}"])
    assert [(e.event, e.data) for e in events] == [("a", "1"), ("message_stop", "{}")]


async def test_html_instead_of_sse_is_a_protocol_error_naming_the_text() -> None:
    with pytest.raises(ProviderError) as caught:
        await _events([b"<html><body>502 Bad Gateway</body></html>\n"])
    assert caught.value.kind == "protocol"
    assert "502 Bad Gateway" in caught.value.message


async def test_events_before_garbage_are_delivered_then_error() -> None:
    seen: list[str] = []
    with pytest.raises(ProviderError, match="overloaded"):
        async for event in aiter_sse(_bytes([b'data: {"a":1}\n\n{\n  "error": "overloaded"\n}'])):
            seen.append(event.data)
    assert seen == ['{"a":1}']


async def test_lenient_mode_ignores_unknown_fields() -> None:
    events = await _events([b"<html>\ndata: x\n\n"], strict=False)
    assert [e.data for e in events] == ["x"]


# ----------------------------------------------------------------------------- recorded streams
SSE_CAPTURES = [
    n
    for n in wire.names()
    if all((r.header("content-type") or "").startswith("text/event-stream") for r in wire.load(n))
]


def _whatwg_reference(body: bytes) -> list[tuple[str, str]]:
    """httpx-sse's decoder over httpx's line splitter: the independent reference."""
    decoder = httpx_sse._decoders.SSEDecoder()
    events = []
    lines = body.decode("utf-8").splitlines()
    for line in [*lines, ""]:
        event = decoder.decode(line)
        if event is not None:
            events.append((event.event, event.data))
    return events


@pytest.mark.parametrize("name", SSE_CAPTURES)
async def test_every_recorded_stream_decodes_like_the_reference(name: str) -> None:
    for response in wire.load(name):
        ours = [(e.event, e.data) for e in await _events([response.body])]
        assert ours == _whatwg_reference(response.body)
        assert ours, name


@pytest.mark.parametrize("name", SSE_CAPTURES)
async def test_httpx_sse_on_recorded_streams_over_httpx(name: str) -> None:
    """What httpx-sse itself yields from a real httpx response of each capture."""
    for response in wire.load(name):
        transport = httpx.MockTransport(
            lambda request, r=response: httpx.Response(
                r.status, headers=list(r.headers), content=r.body
            )
        )
        async with (
            httpx.AsyncClient(transport=transport) as client,
            httpx_sse.aconnect_sse(client, "POST", "http://x/") as source,
        ):
            reference = [(e.event, e.data) async for e in source.aiter_sse()]
        ours = [(e.event, e.data) for e in await _events([response.body])]
        decoder = SSEDecoder()
        decoder.feed(response.body)
        if decoder.finish():
            # httpx-sse drops the undelimited last event; we flush it (module docstring).
            assert ours[:-1] == reference
        else:
            assert ours == reference


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
@pytest.mark.parametrize(
    "name",
    [
        "openai-chat__tool-calls-parallel.sse",
        "gemini__two-turn-tool-call-crlf.cassette.yaml",
        "anthropic__thinking-delta-signature-delta-event-lines.cassette.yaml",
        "anthropic__text-then-tool-use-event-lines.sse",
        "mistral__magistral-thinking-content-array.cassette.yaml",
    ],
)
async def test_any_chunking_gives_the_same_events(name: str, data: st.DataObject) -> None:
    body = wire.load(name)[0].body
    cuts = data.draw(st.lists(st.integers(1, len(body) - 1), max_size=40))
    assert await _events(_split(body, cuts)) == await _events([body])


def test_decoder_is_incremental_byte_by_byte() -> None:
    body = wire.load("gemini__sse-function-call-crlf-finish-message.sse")[0].body
    decoder = SSEDecoder()
    events = [e for i in range(len(body)) for e in decoder.feed(body[i : i + 1])]
    events += decoder.finish()
    assert len(events) == 1
    assert json.loads(events[0].data)["candidates"][0]["finishReason"] == "STOP"


# ----------------------------------------------------------------------------- NDJSON
async def test_ndjson_recorded_transcript_any_chunking() -> None:
    body = wire.load("ollama__api-generate-ndjson-demo-transcript.txt")[0].body
    whole = [v async for v in aiter_ndjson(_bytes([body]))]
    assert whole[-1]["done"] is True and whole[-1]["done_reason"] == "stop"
    assert all(v["done"] is False for v in whole[:-1])
    for step in (1, 7, 64):
        chunks = [body[i : i + step] for i in range(0, len(body), step)]
        assert [v async for v in aiter_ndjson(_bytes(chunks))] == whole


async def test_ndjson_crlf_blank_lines_and_unterminated_last_line() -> None:
    chunks = [b'{"a": 1}\r\n\r\n{"b"', b": 2}\n  \n", b'{"c": 3}']
    assert [v async for v in aiter_ndjson(_bytes(chunks))] == [{"a": 1}, {"b": 2}, {"c": 3}]


async def test_ndjson_non_json_line_is_a_protocol_error_naming_it() -> None:
    with pytest.raises(ProviderError) as caught:
        _ = [v async for v in aiter_ndjson(_bytes([b'{"a": 1}\nnot json at all\n']))]
    assert caught.value.kind == "protocol"
    assert "not json at all" in caught.value.message


async def test_the_quote_of_non_sse_text_does_not_depend_on_the_reads() -> None:
    page = b"<html>\n" + b"".join(b"<p>line %d of a long proxy page</p>\n" % i for i in range(200))
    body = b'data: {"a":1}\n\n' + page
    messages = []
    for step in (1, 3, 64, len(body)):
        chunks = [body[i : i + step] for i in range(0, len(body), step)]
        with pytest.raises(ProviderError) as caught:
            await _events(chunks)
        messages.append(caught.value.message)
    assert len(set(messages)) == 1
    assert "line 0 of a long proxy page" in messages[0] and messages[0].endswith("…'")


async def test_the_quote_of_non_sse_text_is_redacted_before_it_is_cut() -> None:
    key = "sk-quote-0123456789abcdef"
    body = b"<html>" + b"x" * 274 + key.encode() + b"</html>\n"  # the key crosses the cut
    with pytest.raises(ProviderError) as caught:
        await _events([body[i : i + 7] for i in range(0, len(body), 7)], secrets=[key])
    assert "sk-quote" not in caught.value.message and "01234567" not in caught.value.message
