"""A cut reply is not a completed one (`docs/wire-formats.md` §1.7, `docs/behaviour.md` §10.1).

Issue #21 item 10: an OpenAI-style stream ending with ``data: [DONE]`` and no
``finish_reason`` — what llama.cpp's server sends when a newer request interrupts the stream —
was taken as a completed reply with half a sentence. Each format has its own finish marker
(Chat and completions: a ``finish_reason``; Responses: a terminal event; Anthropic: a
``stop_reason`` or ``message_stop``; Gemini: a ``finishReason``; Ollama: a ``done`` line); a
body that ends cleanly without it is a retryable ``protocol`` failure of the pass, after the
text it delivered, and the outer tier continues the reply from that text on the next attempt.
A 429 whose gzip body does not decode is still a ``rate_limit`` with its ``Retry-After``.
"""

from __future__ import annotations

import gzip
import json
from typing import Any

import httpx
import pytest

from tests.providers.replay import NDJSON
from tests.providers.replay import REQUEST
from tests.providers.replay import SSE
from tests.providers.replay import _sse
from tests.providers.replay import adapter
from tests.providers.replay import collect
from tests.providers.wire_server import Scripted
from tests.providers.wire_server import WireServer
from toolloop_fsm import Attempt
from toolloop_fsm import LoopPolicy
from toolloop_fsm import TurnPolicy
from toolloop_fsm import TurnRequest
from toolloop_fsm import TurnStatus
from toolloop_fsm import run_generation_turn
from toolloop_fsm.events import TextDelta
from toolloop_fsm.host import LoopClock
from toolloop_fsm.provider import Provider
from toolloop_fsm.provider import ProviderError
from toolloop_fsm.providers import OpenAICompletionsProvider
from toolloop_fsm.testing import RecordingChannel

KEY = "sk-zq7x-0123456789abcdef"
QUESTION = TurnRequest([{"role": "user", "content": "Tell me about the harbour."}])
HALF = "The harbour was quiet until"


def _chat(delta: dict[str, Any], finish: str | None = None) -> tuple[None, dict[str, Any]]:
    return (None, {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


# Bodies that end cleanly (the chunked body is complete) without their format's finish marker.
UNFINISHED: dict[str, tuple[tuple[tuple[str, str], ...], bytes]] = {
    "openai-chat [DONE] without finish_reason (llama.cpp, interrupted)": (
        SSE,
        _sse(
            _chat({"role": "assistant", "content": ""}), _chat({"content": HALF}), (None, "[DONE]")
        ),
    ),
    "openai-chat closed without [DONE] or finish_reason": (SSE, _sse(_chat({"content": HALF}))),
    "openai-completions [DONE] without finish_reason": (
        SSE,
        _sse(
            (None, {"choices": [{"index": 0, "text": HALF, "finish_reason": None}]}),
            (None, "[DONE]"),
        ),
    ),
    "openai-responses without a terminal event": (
        SSE,
        _sse(
            ("response.created", {"type": "response.created", "response": {}}),
            ("response.output_text.delta", {"type": "response.output_text.delta", "delta": HALF}),
        ),
    ),
    "anthropic without stop_reason or message_stop": (
        SSE,
        _sse(
            ("message_start", {"type": "message_start", "message": {"usage": {}}}),
            (
                "content_block_start",
                {"type": "content_block_start", "index": 0, "content_block": {"type": "text"}},
            ),
            (
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": HALF},
                },
            ),
            ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ),
    ),
    "gemini without finishReason": (
        SSE,
        _sse((None, {"candidates": [{"index": 0, "content": {"parts": [{"text": HALF}]}}]})),
    ),
    "ollama without a done line": (
        NDJSON,
        json.dumps({"message": {"role": "assistant", "content": HALF}, "done": False}).encode()
        + b"\n",
    ),
}


def _provider(case: str, url: str, client: httpx.AsyncClient | None = None) -> Provider:
    kind = case.split(" ", 1)[0]
    if kind == "openai-completions":
        return OpenAICompletionsProvider(f"{url}/v1", "m", api_key=KEY, client=client)
    return adapter(kind, url, KEY, client)


@pytest.mark.parametrize("case", list(UNFINISHED))
async def test_a_stream_that_ends_without_its_finish_marker_is_a_retryable_protocol_failure(
    wire_server: WireServer, client: httpx.AsyncClient, case: str
) -> None:
    headers, body = UNFINISHED[case]
    wire_server.serve(Scripted(headers=headers, chunks=(body,)))
    received: list[Any] = []
    with pytest.raises(ProviderError, match="ended without") as caught:
        async for chunk in _provider(case, wire_server.url, client).stream(REQUEST):
            received.append(chunk)
    assert (caught.value.kind, caught.value.retryable) == ("protocol", True)
    # what was delivered before the cut still came out, for the outer tier to continue from
    assert "".join(c.text for c in received if isinstance(c, TextDelta)) == HALF


async def test_the_outer_tier_continues_a_reply_cut_by_an_interrupted_llama_cpp_stream(
    wire_server: WireServer, client: httpx.AsyncClient
) -> None:
    headers, cut = UNFINISHED["openai-chat [DONE] without finish_reason (llama.cpp, interrupted)"]
    wire_server.serve(
        Scripted(headers=headers, chunks=(cut,)),
        Scripted(
            headers=SSE,
            chunks=(
                _sse(
                    _chat({"content": " the ferry came in."}),
                    _chat({}, "stop"),
                    (None, "[DONE]"),
                ),
            ),
        ),
    )

    def model(key: str | None) -> Provider:
        return adapter("openai-chat", wire_server.url, key or KEY, client)

    attempts = [
        Attempt(model, keys=("sk-local-0123456789",), label="local"),
        Attempt(model, keys=("sk-backup-0123456789",), label="backup"),
    ]
    channel = RecordingChannel()
    policy = TurnPolicy(
        loop=LoopPolicy(first_token_timeout=5, inactivity_timeout=5, delivery_flush_chars=1)
    )
    result = await run_generation_turn(
        attempts, [], channel, QUESTION, policy=policy, clock=LoopClock()
    )

    assert result.status is TurnStatus.COMPLETED
    assert result.delivered_text == HALF + " the ferry came in."
    assert [(a.label, a.superseded) for a in result.attempts] == [
        ("local", True),
        ("backup", False),
    ]
    assert result.attempts[0].status is TurnStatus.ERROR
    assert [(f.label, f.kind) for f in result.attempt_failures] == [("local", "protocol")]
    # the second model was asked to continue the delivered half, not to start again
    messages = json.loads(wire_server.requests[1].body)["messages"]
    assert messages[-1] == {"role": "assistant", "content": HALF}


async def test_a_429_with_a_corrupt_gzip_body_is_still_a_rate_limit_with_its_retry_after(
    wire_server: WireServer, client: httpx.AsyncClient
) -> None:
    body = gzip.compress(b'{"error": {"message": "Slow down", "type": "rate_limit_error"}}')
    corrupt = body[:10] + b"\x00\xff" * 8 + body[26:]
    wire_server.serve(
        Scripted(
            status=429,
            headers=(
                ("content-type", "application/json"),
                ("content-encoding", "gzip"),
                ("retry-after", "7"),
            ),
            chunks=(corrupt,),
            framing="length",
        )
    )
    with pytest.raises(ProviderError) as caught:
        await collect(adapter("openai-chat", wire_server.url, KEY, client))
    error = caught.value
    assert (error.kind, error.retryable, error.status_code) == ("rate_limit", True, 429)
    assert error.retry_after == 7.0
    assert KEY not in error.message
