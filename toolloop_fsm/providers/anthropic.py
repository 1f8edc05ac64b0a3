"""Anthropic Messages adapter: `AnthropicProvider` and the pieces it is made of.

This module owns three things for the Anthropic Messages API (``POST {base_url}/messages`` with
``"stream": true``) and for Anthropic-compatible servers that speak the same stream:

* `build_anthropic_body` — a `ProviderRequest` as a Messages request body (system prompt,
  each tool batch as one assistant turn — thinking, the pre-tool text, every ``tool_use`` —
  and one user turn of ``tool_result`` blocks, ``is_error`` on failures; prefill as a
  trailing assistant turn; with tools offered and ``parallel_tool_calls`` off, ``tool_choice``
  carries ``"disable_parallel_tool_use": true``; on the final answer pass (tools withdrawn),
  ``tool_choice`` is ``{"type": "none"}``);
* `AnthropicStreamDecoder` — the sans-IO decoder from named SSE events to chunk events
  (text, thinking with its signature, tool calls assembled from ``input_json_delta``, usage,
  finish reason, in-stream ``error`` events);
* `AnthropicProvider` — the adapter on the shared HTTP stream base: its path, its headers
  (``anthropic-version``, the key in ``x-api-key``), its body and its decoder.

Wire facts are in docs/wire-formats.md §1.1, §1.3 and §4; every branch below names the fact it
handles.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import Unpack

from toolloop_fsm.conversation import context_items
from toolloop_fsm.events import Chunk
from toolloop_fsm.events import FinishKind
from toolloop_fsm.events import FinishReason
from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import TextDelta
from toolloop_fsm.events import ThoughtDelta
from toolloop_fsm.events import UsageReport
from toolloop_fsm.provider import ProviderRequest
from toolloop_fsm.provider import ToolSpec
from toolloop_fsm.providers._arguments import decode_arguments
from toolloop_fsm.providers._history import ToolBatch
from toolloop_fsm.providers._history import tool_batches
from toolloop_fsm.providers._history import tool_response_json
from toolloop_fsm.providers._http import error_from_payload
from toolloop_fsm.providers._sse import decode_json_object
from toolloop_fsm.providers._stream import HTTPStreamProvider
from toolloop_fsm.providers._stream import KeyedStreamOptions
from toolloop_fsm.providers._stream import PassDecoder
from toolloop_fsm.providers._turns import append_turn
from toolloop_fsm.providers._turns import content_parts
from toolloop_fsm.result import ToolHistoryEntry

ANTHROPIC_VERSION = "2023-06-01"

# ant-py types/stop_reason.py. `pause_turn` asks the client to send the turn back unchanged
# to let a server tool continue; no normalised kind says that, so it stays OTHER with its raw
# word kept. `model_context_window_exceeded` is a length stop by another name.
_STOP_REASONS: Mapping[str, FinishKind] = {
    "end_turn": FinishKind.STOP,
    "stop_sequence": FinishKind.STOP,
    "max_tokens": FinishKind.LENGTH,
    "model_context_window_exceeded": FinishKind.LENGTH,
    "tool_use": FinishKind.TOOL_CALLS,
    "refusal": FinishKind.REFUSAL,
    "pause_turn": FinishKind.OTHER,
}

# Anthropic tool_use ids must match this; ids replayed from another provider may not.
_TOOL_ID_INVALID = re.compile(r"[^a-zA-Z0-9_-]")


# --------------------------------------------------------------------------- request body
def _tool_use_id(entry: ToolHistoryEntry, position: int) -> str:
    # A call replayed from a provider without ids (Gemini, old Ollama) still needs one here,
    # and it must be stable across passes so the tool_result pairs with its tool_use;
    # `position` is the call's index in the whole history, so each call of a batch has its own.
    raw = entry.call.call_id or f"toolu_loop_{entry.iteration}_{position}"
    return _TOOL_ID_INVALID.sub("_", raw)


def _text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _tool_spec(tool: ToolSpec) -> dict[str, Any]:
    schema = dict(tool.parameters) or {"type": "object", "properties": {}}
    return {"name": tool.name, "description": tool.description, "input_schema": schema}


def _add_context_message(
    system: list[str], messages: list[dict[str, Any]], message: Mapping[str, Any]
) -> None:
    """A system message's text joins the top-level ``system``; any other is a user or an
    assistant turn."""
    role = str(message.get("role", "user"))
    content = message.get("content", "")
    if role != "system":
        blocks = content_parts(content, _text_block)
        append_turn(messages, "assistant" if role == "assistant" else "user", blocks, key="content")
    elif isinstance(content, str):
        if content:
            system.append(content)
    else:
        system.extend(b.get("text", "") for b in content_parts(content, _text_block))


def _add_tool_batch(messages: list[dict[str, Any]], batch: ToolBatch) -> None:
    """One answered batch: the assistant's turn (thinking, the pre-tool text, every
    ``tool_use``), then one user turn of a ``tool_result`` per call, in order."""
    calls = [(_tool_use_id(entry, index), entry) for index, entry in batch.numbered()]
    assistant: list[dict[str, Any]] = []
    for number, (call_id, entry) in enumerate(calls):
        # Thinking blocks must go back unchanged, before the tool_use they led to (§4.2): the
        # decoder puts a message's thinking on its first call, ahead of the text.
        data = entry.call.provider_data or {}
        assistant.extend(dict(block) for block in data.get("anthropic_thinking", ()))
        if number == 0 and batch.pre_tool_text:
            assistant.append({"type": "text", "text": batch.pre_tool_text})
        assistant.append(
            {
                "type": "tool_use",
                "id": call_id,
                "name": entry.call.name,
                "input": dict(entry.call.arguments),
            }
        )
    append_turn(messages, "assistant", assistant, key="content")
    results = [
        {
            "type": "tool_result",
            "tool_use_id": call_id,
            "content": tool_response_json(entry.response),
            "is_error": not entry.response.success,
        }
        for call_id, entry in calls
    ]
    append_turn(messages, "user", results, key="content")


def _tool_choice(body: Mapping[str, Any]) -> dict[str, Any]:
    """The body's ``tool_choice`` asking for at most one ``tool_use`` per response: whatever
    choice is already there (``auto`` when none), with parallel tool use disabled."""
    chosen = body.get("tool_choice")
    choice: dict[str, Any] = dict(chosen) if isinstance(chosen, Mapping) else {"type": "auto"}
    choice["disable_parallel_tool_use"] = True
    return choice


def build_anthropic_body(
    request: ProviderRequest, *, model: str, max_tokens: int
) -> dict[str, Any]:
    """The Messages API request body for one pass."""
    system: list[str] = []
    messages: list[dict[str, Any]] = []
    for item in context_items(request.context):
        if isinstance(item, ToolBatch):
            _add_tool_batch(messages, item)
        else:
            _add_context_message(system, messages, item)
    for batch in tool_batches(request.history):
        _add_tool_batch(messages, batch)

    if request.prefill:
        # Anthropic continues a trailing assistant turn natively, but rejects one that ends in
        # whitespace ("final assistant content cannot end with trailing whitespace").
        prefill = request.prefill.rstrip()
        if prefill:
            append_turn(messages, "assistant", [_text_block(prefill)], key="content")

    body: dict[str, Any] = {
        "model": model,
        "max_tokens": request.max_output or max_tokens,
        "messages": messages,
        "stream": True,
    }
    if system:
        body["system"] = "\n\n".join(system)
    if request.tools:
        body["tools"] = [_tool_spec(tool) for tool in request.tools]
        if request.tools_withdrawn:
            # the final answer pass: Anthropic refuses `tool_use` blocks in the messages
            # without `tools`, so they stay declared and the model may call none
            body["tool_choice"] = {"type": "none"}
        elif not request.parallel_tool_calls:
            body["tool_choice"] = _tool_choice(body)
    return body


# --------------------------------------------------------------------------- stream decoding
class _ToolBlock:
    """A ``tool_use`` content block whose ``input_json_delta`` fragments are still arriving."""

    __slots__ = ("call_id", "fragments", "initial_input", "name")

    def __init__(self, call_id: str | None, name: str, initial_input: Any) -> None:
        self.call_id = call_id
        self.name = name
        self.initial_input = initial_input
        self.fragments: list[str] = []


class _ThinkingBlock:
    __slots__ = ("signature", "text")

    def __init__(self, text: str, signature: str) -> None:
        self.text = [text] if text else []
        self.signature = signature


class AnthropicStreamDecoder(PassDecoder):
    """Named SSE events of one Messages stream → chunk events: a `StreamDecoder`, sans-IO.

    `event` takes the SSE event name (``"message"`` when the stream has no ``event:`` lines)
    and the event's data text; `finish` is called once the body ended after the message
    finished (`finished`: a stop reason or ``message_stop``); `done` once ``message_stop``
    arrived. They append the chunks to yield to ``out``, in order, and raise `ProviderError`
    for an in-stream error or a data line that is not JSON.
    """

    __slots__ = (
        "_calls_emitted",
        "_input_tokens",
        "_output_tokens",
        "_secrets",
        "_stop_reason",
        "_thinking",
        "_thinking_open",
        "_tools",
    )

    def __init__(self, *, secrets: Sequence[str] = ()) -> None:
        super().__init__()
        # Values no error message may contain (the API key), however a server words it.
        self._secrets = tuple(secrets)
        self._tools: dict[int, _ToolBlock] = {}
        self._thinking_open: dict[int, _ThinkingBlock] = {}
        # Completed thinking / redacted_thinking blocks, in order; they ride on the first tool
        # call of the message so the loop can echo them back with its history (§4.2).
        self._thinking: list[dict[str, Any]] = []
        self._calls_emitted = 0
        self._input_tokens = 0
        self._output_tokens = 0
        self._stop_reason: str | None = None

    def event(self, name: str, data: str, out: list[Chunk]) -> None:
        if self._done:
            return
        # Anthropic pads its JSON with spaces (§1.3) — json accepts that; anything else that
        # fails here is not the Messages stream.
        payload = decode_json_object(
            data, what=f"Anthropic stream event {name!r}", secrets=self._secrets
        )
        # The event name is authoritative; the SDK falls back to the data's `type` (§1.1).
        kind = name if name and name != "message" else str(payload.get("type", ""))
        handler = _HANDLERS.get(kind)
        # Unknown event types must be ignored (docs "Other events", §4.1); `ping` likewise.
        if handler is not None:
            out.extend(handler(self, payload))

    finish_marker = "a stop_reason (message_delta) or message_stop"

    @property
    def finished(self) -> bool:
        """``message_stop`` arrived, or a ``message_delta`` with the stop reason."""
        return self._done or self._stop_reason is not None

    def finish(self, out: list[Chunk]) -> None:
        if not self._done:
            out.extend(self._finish_message())

    # ---- event handlers
    def _message_start(self, payload: Mapping[str, Any]) -> list[Chunk]:
        message = payload.get("message") or {}
        self.response.take(message.get("model"), message.get("id"))
        usage = message.get("usage") or {}
        self._input_tokens = _int(usage.get("input_tokens"), self._input_tokens)
        self._output_tokens = _int(usage.get("output_tokens"), self._output_tokens)
        return [self._usage()] if usage else []

    def _block_start(self, payload: Mapping[str, Any]) -> list[Chunk]:
        index = _int(payload.get("index"), 0)
        block = payload.get("content_block") or {}
        kind = block.get("type")
        if kind == "text":
            text = block.get("text") or ""
            return [TextDelta(text)] if text else []
        if kind == "thinking":
            thinking = block.get("thinking") or ""
            self._thinking_open[index] = _ThinkingBlock(thinking, block.get("signature") or "")
            return [ThoughtDelta(thinking)] if thinking else []
        if kind == "redacted_thinking":
            self._thinking.append({"type": "redacted_thinking", "data": block.get("data", "")})
            return []
        if kind == "tool_use":
            self._tools[index] = _ToolBlock(
                block.get("id") or None, str(block.get("name") or ""), block.get("input")
            )
        return []

    def _block_delta(self, payload: Mapping[str, Any]) -> list[Chunk]:
        index = _int(payload.get("index"), 0)
        delta = payload.get("delta") or {}
        kind = delta.get("type")
        if kind == "text_delta":
            text = delta.get("text") or ""
            return [TextDelta(text)] if text else []
        if kind == "thinking_delta":
            text = delta.get("thinking") or ""
            open_block = self._thinking_open.get(index)
            if open_block is not None and text:
                open_block.text.append(text)
            return [ThoughtDelta(text)] if text else []
        if kind == "signature_delta":
            signature = delta.get("signature") or ""
            open_block = self._thinking_open.get(index)
            if open_block is not None:
                open_block.signature += signature
            return [ThoughtDelta("", signature=signature)] if signature else []
        if kind == "input_json_delta":
            tool = self._tools.get(index)
            if tool is not None:
                tool.fragments.append(delta.get("partial_json") or "")
        # citations_delta and future delta types carry nothing the loop uses.
        return []

    def _block_stop(self, payload: Mapping[str, Any]) -> list[Chunk]:
        index = _int(payload.get("index"), 0)
        thinking = self._thinking_open.pop(index, None)
        if thinking is not None:
            self._thinking.append(
                {
                    "type": "thinking",
                    "thinking": "".join(thinking.text),
                    "signature": thinking.signature,
                }
            )
        tool = self._tools.pop(index, None)
        return [self._call(tool, cut=False)] if tool is not None else []

    def _message_delta(self, payload: Mapping[str, Any]) -> list[Chunk]:
        delta = payload.get("delta") or {}
        chunks: list[Chunk] = []
        stop_reason = delta.get("stop_reason")
        if stop_reason:
            self._stop_reason = str(stop_reason)
            # A max_tokens stop can arrive with a tool block still open and no
            # content_block_stop for it (§4.2): its JSON was cut, repair and flag it now.
            chunks.extend(self._flush_open_tools())
        usage = payload.get("usage") or {}
        if usage:
            # Cumulative figures; a compatible server may put the real input count only here
            # (§4.3), so it wins over message_start's whenever present.
            self._input_tokens = _int(usage.get("input_tokens"), self._input_tokens)
            self._output_tokens = _int(usage.get("output_tokens"), self._output_tokens)
            chunks.append(self._usage())
        return chunks

    def _message_stop(self, _payload: Mapping[str, Any]) -> list[Chunk]:
        # The message is complete even if a compatible server skipped message_delta.
        return self._finish_message()

    def _error(self, payload: Mapping[str, Any]) -> list[Chunk]:
        # `event: error` comes over HTTP 200; the kind is read from `error.type`
        # (overloaded_error → server, rate_limit_error → rate_limit, …; §4.4).
        raise error_from_payload(payload, provider="Anthropic", secrets=self._secrets)

    # ---- helpers
    def _finish_message(self) -> list[Chunk]:
        chunks = self._flush_open_tools()
        self._done = True
        raw = self._stop_reason
        if raw is None:
            kind = FinishKind.TOOL_CALLS if self._calls_emitted else FinishKind.STOP
        else:
            kind = _STOP_REASONS.get(raw, FinishKind.OTHER)
        chunks.append(FinishReason(kind, raw))
        return chunks

    def _flush_open_tools(self) -> list[Chunk]:
        tools = [self._tools.pop(index) for index in sorted(self._tools)]
        return [self._call(tool, cut=True) for tool in tools]

    def _call(self, tool: _ToolBlock, *, cut: bool) -> FunctionCall:
        text = "".join(tool.fragments)
        if not text.strip() and not cut:
            # No deltas at all (or only ""): the tool takes no arguments (§4.2), or a
            # compatible server put the whole input in content_block_start.
            initial = tool.initial_input
            arguments: Any = dict(initial) if isinstance(initial, Mapping) else {}
            truncated, parse_error = False, None
        else:
            arguments, truncated, parse_error = decode_arguments(text, cut=cut)
        provider_data: dict[str, Any] | None = None
        if self._calls_emitted == 0 and self._thinking:
            provider_data = {"anthropic_thinking": list(self._thinking)}
        self._calls_emitted += 1
        return FunctionCall(
            tool.name,
            arguments,
            call_id=tool.call_id,
            truncated=truncated,
            parse_error=parse_error,
            provider_data=provider_data,
        )

    def _usage(self) -> UsageReport:
        return UsageReport(self._input_tokens, self._output_tokens)


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


_HANDLERS = {
    "message_start": AnthropicStreamDecoder._message_start,
    "content_block_start": AnthropicStreamDecoder._block_start,
    "content_block_delta": AnthropicStreamDecoder._block_delta,
    "content_block_stop": AnthropicStreamDecoder._block_stop,
    "message_delta": AnthropicStreamDecoder._message_delta,
    "message_stop": AnthropicStreamDecoder._message_stop,
    "error": AnthropicStreamDecoder._error,
}


# --------------------------------------------------------------------------- the provider
class AnthropicProvider(HTTPStreamProvider):
    """Streams one pass from the Anthropic Messages API (or a compatible server).

    ``base_url`` is the API root (``https://api.anthropic.com/v1``); the request goes to
    ``{base_url}/messages``. ``api_key`` travels only in the ``x-api-key`` header and appears in
    no message or repr. ``client`` is an optional shared ``httpx.AsyncClient`` (the provider
    never closes it). ``max_tokens`` is the output cap when the request sets none — the
    Messages API requires one.
    """

    path = "messages"
    default_name = "anthropic"
    known_provider = "anthropic"

    __slots__ = ("max_tokens",)

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        max_tokens: int = 4096,
        **options: Unpack[KeyedStreamOptions],
    ) -> None:
        self.max_tokens = max_tokens
        super().__init__(base_url, model, **options)

    @property
    def label(self) -> str:
        return "Anthropic"

    def protocol_headers(self) -> dict[str, str]:
        return {"anthropic-version": ANTHROPIC_VERSION}

    def credential_headers(self, api_key: str) -> dict[str, str]:
        return {"x-api-key": api_key}

    def build_body(self, request: ProviderRequest) -> dict[str, Any]:
        return build_anthropic_body(request, model=self.model, max_tokens=self.max_tokens)

    def decoder(self) -> AnthropicStreamDecoder:
        return AnthropicStreamDecoder(secrets=self.secrets)


__all__ = [
    "ANTHROPIC_VERSION",
    "AnthropicProvider",
    "AnthropicStreamDecoder",
    "build_anthropic_body",
]
