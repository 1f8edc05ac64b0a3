"""A tool call and its answer as each adapter writes them into the body it sends (OpenAI
chat's ``tool_calls`` entries, Anthropic's ``tool_use`` and ``tool_result`` blocks), for the
tests that read those bodies back."""

from __future__ import annotations

from typing import Any


def openai_tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """One entry of an OpenAI chat assistant message's ``tool_calls``."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def anthropic_tool_use(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic assistant message's ``tool_use`` block."""
    return {"type": "tool_use", "id": call_id, "name": name, "input": arguments}


def anthropic_tool_result(call_id: str, content: str, *, is_error: bool) -> dict[str, Any]:
    """An Anthropic user message's ``tool_result`` block answering ``call_id``."""
    return {"type": "tool_result", "tool_use_id": call_id, "content": content, "is_error": is_error}
