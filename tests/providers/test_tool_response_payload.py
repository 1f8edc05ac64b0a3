"""What every adapter shows the model for a tool's response, read off the request it sends.

One rule for all of them: a success is ``success: true`` with the tool's ``message`` beside its
``data``; a failure is ``success: false`` with status ``tool_execution_failed``, the reason and
the tool's name. Fields the record leaves unset are left out.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest

from tests.providers.replay import FINISHED_PASS
from tests.providers.replay import adapter
from tests.providers.replay import collect
from tests.providers.wire_server import WireServer
from toolloop_fsm.provider import Provider
from toolloop_fsm.provider import ProviderRequest
from toolloop_fsm.providers.openai_completions import OpenAICompletionsProvider
from toolloop_fsm.result import ToolCallRecord
from toolloop_fsm.result import ToolHistoryEntry
from toolloop_fsm.result import ToolResponseRecord

KEY = "sk-payload-0123456789abcdef"


def _chat_responses(body: dict[str, Any]) -> list[Any]:
    return [json.loads(m["content"]) for m in body["messages"] if m["role"] == "tool"]


def _responses_outputs(body: dict[str, Any]) -> list[Any]:
    return [
        json.loads(item["output"])
        for item in body["input"]
        if item.get("type") == "function_call_output"
    ]


def _anthropic_results(body: dict[str, Any]) -> list[Any]:
    return [
        json.loads(block["content"])
        for message in body["messages"]
        for block in message["content"]
        if block.get("type") == "tool_result"
    ]


def _gemini_responses(body: dict[str, Any]) -> list[Any]:
    return [
        part["functionResponse"]["response"]
        for content in body["contents"]
        for part in content["parts"]
        if "functionResponse" in part
    ]


def _prompt_results(body: dict[str, Any]) -> list[Any]:
    # A completion model reads each response as a "[result of name] {…}" line of its prompt.
    found = re.findall(r"\[result of \w+\] (\{.*\})", body["prompt"])
    return [json.loads(text) for text in found]


_SHOWN: dict[str, Callable[[dict[str, Any]], list[Any]]] = {
    "openai-chat": _chat_responses,
    "openai-completions": _prompt_results,
    "openai-responses": _responses_outputs,
    "anthropic": _anthropic_results,
    "gemini": _gemini_responses,
    "ollama": _chat_responses,
}


def _provider(kind: str, url: str) -> Provider:
    if kind == "openai-completions":
        return OpenAICompletionsProvider(f"{url}/v1", "story-x", api_key=KEY)
    return adapter(kind, url, KEY)


def _entry(name: str, response: ToolResponseRecord, call_id: str) -> ToolHistoryEntry:
    return ToolHistoryEntry(ToolCallRecord(name, {"q": name}, call_id=call_id), response)


async def _shown_for(
    wire_server: WireServer, kind: str, *responses: ToolResponseRecord
) -> list[Any]:
    history = [
        _entry(response.tool_name or "lookup", response, f"call_{position}")
        for position, response in enumerate(responses)
    ]
    wire_server.serve(FINISHED_PASS[kind])
    request = ProviderRequest([{"role": "user", "content": "go"}], history=history)
    await collect(_provider(kind, wire_server.url), request)
    (sent,) = wire_server.requests
    return _SHOWN[kind](json.loads(sent.body))


@pytest.mark.parametrize("kind", sorted(_SHOWN))
async def test_every_adapter_shows_a_tool_success_as_its_message_beside_its_data(
    wire_server: WireServer, kind: str
) -> None:
    # As the loop records a success: the tool's name is on the record, not shown.
    shown = await _shown_for(
        wire_server,
        kind,
        ToolResponseRecord(True, data={"temp_c": 21}, message="sunny", tool_name="weather"),
        ToolResponseRecord(True, tool_name="ping"),
    )
    assert shown == [
        {"success": True, "data": {"temp_c": 21}, "message": "sunny"},
        {"success": True},
    ]


@pytest.mark.parametrize("kind", sorted(_SHOWN))
async def test_every_adapter_shows_a_tool_failure_as_its_status_reason_and_tool_name(
    wire_server: WireServer, kind: str
) -> None:
    # As the loop records a failure (the tool's data and message ride along, not shown), and
    # as a host may write one by hand: without a status, which is still the failure's.
    shown = await _shown_for(
        wire_server,
        kind,
        ToolResponseRecord(
            False,
            data={"seats": 0},
            message="full",
            status="tool_execution_failed",
            reason="no seats left",
            tool_name="book",
        ),
        ToolResponseRecord(False, reason="timed out after 300 s"),
    )
    assert shown == [
        {
            "success": False,
            "status": "tool_execution_failed",
            "reason": "no seats left",
            "tool_name": "book",
        },
        {"success": False, "status": "tool_execution_failed", "reason": "timed out after 300 s"},
    ]
