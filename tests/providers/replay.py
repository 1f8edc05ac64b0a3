"""Helpers for replaying recorded responses through an adapter over the loopback server."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any
from typing import Protocol

import httpx
from attrs import frozen

from tests.providers.wire import RecordedResponse
from tests.providers.wire_server import Scripted
from tests.providers.wire_server import WireServer
from toolloop_fsm.events import Chunk
from toolloop_fsm.events import FinishKind
from toolloop_fsm.events import FinishReason
from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import TextDelta
from toolloop_fsm.events import ThoughtDelta
from toolloop_fsm.events import UsageReport
from toolloop_fsm.provider import Provider
from toolloop_fsm.provider import ProviderRequest
from toolloop_fsm.providers import AnthropicProvider
from toolloop_fsm.providers import GeminiProvider
from toolloop_fsm.providers import OllamaProvider
from toolloop_fsm.providers import OpenAICompatibleProvider
from toolloop_fsm.providers import OpenAIResponsesProvider

REQUEST = ProviderRequest([{"role": "user", "content": "hi"}])
ADAPTERS = ("openai-chat", "openai-responses", "anthropic", "gemini", "ollama")
"""The five adapters, by the name their captures and hand-written endings start with."""


SSE = (("content-type", "text/event-stream"),)
NDJSON = (("content-type", "application/x-ndjson"),)


def _sse(*events: tuple[str | None, dict[str, Any] | str]) -> bytes:
    lines = []
    for name, data in events:
        text = data if isinstance(data, str) else json.dumps(data)
        lines.append((f"event: {name}\n" if name else "") + f"data: {text}\n\n")
    return "".join(lines).encode()


FINISHED_PASS: dict[str, Scripted] = {
    "openai-chat": Scripted(
        headers=SSE,
        chunks=(
            _sse(
                (None, {"choices": [{"index": 0, "delta": {"content": "ok"}}]}),
                (None, {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
                (None, "[DONE]"),
            ),
        ),
    ),
    "openai-completions": Scripted(
        headers=SSE,
        chunks=(
            _sse(
                (None, {"choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]}),
                (None, "[DONE]"),
            ),
        ),
    ),
    "openai-responses": Scripted(
        headers=SSE,
        chunks=(
            _sse(
                (
                    "response.output_text.delta",
                    {"type": "response.output_text.delta", "delta": "ok"},
                ),
                (
                    "response.completed",
                    {"type": "response.completed", "response": {"status": "completed"}},
                ),
            ),
        ),
    ),
    "anthropic": Scripted(
        headers=SSE,
        chunks=(
            _sse(
                (
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": 0,
                        "delta": {"type": "text_delta", "text": "ok"},
                    },
                ),
                ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"}}),
                ("message_stop", {"type": "message_stop"}),
            ),
        ),
    ),
    "gemini": Scripted(
        headers=SSE,
        chunks=(
            _sse(
                (
                    None,
                    {
                        "candidates": [
                            {
                                "index": 0,
                                "content": {"role": "model", "parts": [{"text": "ok"}]},
                                "finishReason": "STOP",
                            }
                        ]
                    },
                )
            ),
        ),
    ),
    "ollama": Scripted(
        headers=NDJSON,
        chunks=(b'{"message": {"role": "assistant", "content": "ok"}, "done": true}\n',),
    ),
}
"""The shortest stream each adapter takes as a finished pass whose text is ``"ok"``, by kind
(`ADAPTERS` and ``"openai-completions"``)."""


def adapter(
    kind: str, server_url: str, key: str, client: httpx.AsyncClient | None = None
) -> Provider:
    """The adapter ``kind`` (one of `ADAPTERS`) talking to ``server_url`` with the secret
    ``key``: its API key, or for Ollama, which has none, a proxy's bearer token."""
    if kind == "anthropic":
        return AnthropicProvider(f"{server_url}/v1", "claude-x", api_key=key, client=client)
    if kind == "gemini":
        return GeminiProvider(f"{server_url}/v1beta", "gemini-x", api_key=key, client=client)
    if kind == "ollama":
        return OllamaProvider(
            server_url, "qwen3:8b", headers={"Authorization": f"Bearer {key}"}, client=client
        )
    if kind == "openai-responses":
        return OpenAIResponsesProvider(f"{server_url}/v1", "gpt-x", api_key=key, client=client)
    assert kind == "openai-chat", kind
    return OpenAICompatibleProvider(f"{server_url}/v1", "gpt-x", api_key=key, client=client)


def adapter_kind(capture: str) -> str:
    """Which adapter a capture (or a hand-written ending) was recorded from, by its name."""
    if capture.startswith(("anthropic__", "anthropic-compatible__")):
        return "anthropic"
    if capture.startswith(("gemini__", "gemini-vertex__")):
        return "gemini"
    if capture.startswith("ollama__"):
        return "ollama"
    if capture.startswith(("openai-responses__", "azure-openai-responses__")):
        return "openai-responses"
    return "openai-chat"


@frozen
class Replay:
    """What one pass assembles to: the assertions of a replay test."""

    text: str
    thought: str
    calls: tuple[tuple[str, Any, str | None], ...]
    usage: tuple[tuple[int, int], ...]
    finish: tuple[FinishKind, str | None]


class ProviderFactory(Protocol):
    def __call__(self, base_url: str) -> Provider: ...


def assemble(chunks: Sequence[Chunk]) -> Replay:
    finishes = [c for c in chunks if isinstance(c, FinishReason)]
    assert len(finishes) == 1, finishes
    return Replay(
        text="".join(c.text for c in chunks if isinstance(c, TextDelta)),
        thought="".join(c.text for c in chunks if isinstance(c, ThoughtDelta)),
        calls=tuple(
            (c.name, c.arguments, c.call_id) for c in chunks if isinstance(c, FunctionCall)
        ),
        usage=tuple(
            (c.input_tokens, c.output_tokens) for c in chunks if isinstance(c, UsageReport)
        ),
        finish=(finishes[0].kind, finishes[0].raw),
    )


async def collect(provider: Provider, request: ProviderRequest = REQUEST) -> list[Chunk]:
    return [chunk async for chunk in provider.stream(request)]


async def replay(
    server: WireServer,
    make: ProviderFactory,
    response: RecordedResponse,
    *,
    cuts: Sequence[int] = (),
) -> list[Chunk]:
    """Serve ``response`` (its body cut at ``cuts``) and stream one pass from it."""
    server.serve(Scripted.recorded(response, cuts=cuts))
    return await collect(make(server.url + "/v1"))
