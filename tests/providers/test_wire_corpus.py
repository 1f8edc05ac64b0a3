"""The copied wire corpus is byte-identical to its sources, and every capture loads."""

from __future__ import annotations

import pytest

from tests.providers import wire


def test_every_copy_matches_its_sha256_in_sources() -> None:
    expected = wire.expected_sha256()
    assert sorted(expected) == wire.names()
    mismatched = [name for name, digest in expected.items() if wire.sha256(name) != digest]
    assert mismatched == []


@pytest.mark.parametrize("name", wire.names())
def test_every_capture_loads_to_responses(name: str) -> None:
    responses = wire.load(name)
    assert responses and all(r.body for r in responses)


def test_jsonl_framing_per_provider() -> None:
    chat = wire.load("mistral__tool-call-no-index-finish-same-chunk.jsonl")[0].body
    assert chat.startswith(b'data: {"id"') and chat.endswith(b"}\n\ndata: [DONE]\n\n")
    named = wire.load("anthropic__text-with-ping.jsonl")[0].body
    assert named.startswith(b'event: message_start\ndata: {"type":"message_start"')
    assert b"[DONE]" not in named
    gemini = wire.load("gemini__text-empty-part-thought-signature.jsonl")[0].body
    assert gemini.startswith(b"data: {") and gemini.endswith(b"}\r\n\r\n")


def test_cassette_keeps_crlf_and_status() -> None:
    [first, _second] = wire.load("gemini__two-turn-tool-call-crlf.cassette.yaml")
    assert b"\r\n\r\n" in first.body and first.status == 200
    statuses = [
        r.status for r in wire.load("openrouter__http-429-error-body-no-retry-after.cassette.yaml")
    ]
    assert statuses == [429, 429, 429]


def test_transcript_is_ndjson_from_line_13() -> None:
    body = wire.load("ollama__api-generate-ndjson-demo-transcript.txt")[0].body
    assert body.startswith(b'{"model":"dolphin3:8b"')
