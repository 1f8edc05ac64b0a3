"""What every adapter gets from the one HTTP stream base: a pass ends at the stream's own end
whatever the server does after it, and a failure leaves the adapter redacted with nothing
chained to it — one that happens while the request body is built included."""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import httpx
import pytest

from tests.providers.replay import ADAPTERS
from tests.providers.replay import FINISHED_PASS
from tests.providers.replay import adapter
from tests.providers.replay import collect
from tests.providers.wire_server import Scripted
from tests.providers.wire_server import WireServer
from toolloop_fsm.events import FinishReason
from toolloop_fsm.events import TextDelta
from toolloop_fsm.provider import ProviderError
from toolloop_fsm.providers.openai_completions import OpenAICompletionsProvider

KEY = "sk-stream-base-0123456789abcdef"
# Gemini's stream has no end of its own: the connection closing is its end.
WITH_AN_END_OF_THEIR_OWN = [kind for kind in ADAPTERS if kind != "gemini"]


@pytest.mark.parametrize("kind", WITH_AN_END_OF_THEIR_OWN)
async def test_a_server_holding_the_connection_open_after_the_streams_end_does_not_hold_the_pass(
    wire_server: WireServer, client: httpx.AsyncClient, kind: str
) -> None:
    finished = FINISHED_PASS[kind]
    wire_server.serve(
        Scripted(headers=finished.headers, chunks=finished.chunks, stall_after=len(finished.chunks))
    )
    chunks = await collect(adapter(kind, wire_server.url, KEY, client))
    assert "".join(c.text for c in chunks if isinstance(c, TextDelta)) == "ok"
    assert sum(isinstance(c, FinishReason) for c in chunks) == 1
    # The response was closed rather than left for the server to end.
    await wire_server.client_gone.wait()


async def test_a_renderer_quoting_the_key_in_its_refusal_leaves_no_key_in_the_failure(
    wire_server: WireServer,
) -> None:
    def careless(messages: Sequence[Mapping[str, Any]]) -> str:
        raise ValueError(f"cannot render for key {KEY}")

    wire_server.serve(FINISHED_PASS["openai-completions"])
    source = OpenAICompletionsProvider(
        f"{wire_server.url}/v1", "story-x", api_key=KEY, render_prompt=careless
    )
    with pytest.raises(ProviderError) as caught:
        await collect(source)
    error = caught.value
    assert (error.kind, error.retryable) == ("bad_request", False)
    assert "cannot render for key" in error.message and "[REDACTED]" in error.message
    assert not any(KEY[i : i + 8] in error.message for i in range(len(KEY) - 7))
    # Nothing chained to it either: the renderer's own error still holds the key.
    assert error.__cause__ is None and error.__context__ is None
    assert wire_server.requests == []
