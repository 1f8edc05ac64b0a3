"""Helpers for replaying recorded responses through an adapter over the loopback server."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import httpx
from attrs import frozen

from tests.providers.wire import RecordedResponse
from tests.providers.wire_server import Scripted, WireServer
from toolloop_fsm.events import (
    Chunk,
    FinishKind,
    FinishReason,
    FunctionCall,
    TextDelta,
    ThoughtDelta,
    UsageReport,
)
from toolloop_fsm.provider import Provider, ProviderRequest
from toolloop_fsm.providers import (
    AnthropicProvider,
    GeminiProvider,
    OllamaProvider,
    OpenAICompatibleProvider,
    OpenAIResponsesProvider,
)

REQUEST = ProviderRequest([{"role": "user", "content": "hi"}])
ADAPTERS = ("openai-chat", "openai-responses", "anthropic", "gemini", "ollama")
"""The five adapters, by the name their captures and hand-written endings start with."""


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
