"""Ollama native adapter: `OllamaProvider` for ``POST {base_url}/api/chat`` (NDJSON).

This module owns:

* `build_ollama_body` — a `ProviderRequest` as an ``/api/chat`` request (each tool batch as
  one assistant message with every call in ``tool_calls`` and one ``tool`` message per call,
  the prefill as a trailing assistant message, ``options``). ``/api/chat`` has no option
  asking for one call per response: ``parallel_tool_calls`` is not sent, and a batch the
  model makes anyway is run whole; nor a tool choice: on the final answer pass (tools
  withdrawn) no ``tools`` are sent;
* `OllamaStreamDecoder` — the sans-IO decoder from NDJSON objects to chunk events
  (``message.content`` / ``message.thinking`` / ``message.tool_calls``, the ``done`` line's
  usage and ``done_reason``, an ``{"error": …}`` line);
* `OllamaProvider` — the adapter on the shared HTTP stream base, with NDJSON framing.

**The decoder also takes ``/api/generate`` lines.** They carry the text in ``response`` (and
reasoning in ``thinking``) instead of ``message``; everything else — ``done``, ``done_reason``,
``prompt_eval_count``, ``eval_count``, ``error`` — is the same. Accepting both lets the one real
Ollama capture we have (an ``/api/generate`` transcript, docs/wire-formats.md §5.1) replay
through the same code as ``/api/chat``; the provider itself only ever calls ``/api/chat``.

Wire facts are in docs/wire-formats.md §1.2 and §5.1.
"""

from __future__ import annotations

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
from toolloop_fsm.providers._stream import PassDecoder
from toolloop_fsm.providers._stream import StreamOptions
from toolloop_fsm.result import ToolHistoryEntry

# `done_reason` is "stop" even when tools were called (§5.1); the decoder upgrades it itself.
_DONE_REASONS: Mapping[str, FinishKind] = {
    "stop": FinishKind.STOP,
    "length": FinishKind.LENGTH,
}


# --------------------------------------------------------------------------- request body
def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        # Text blocks of a structured message: Ollama's content is a plain string.
        return "".join(
            str(block.get("text", "")) for block in content if isinstance(block, Mapping)
        )
    return str(content)


def _tool(tool: ToolSpec) -> dict[str, Any]:
    parameters = dict(tool.parameters) or {"type": "object", "properties": {}}
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": parameters},
    }


def _tool_message(entry: ToolHistoryEntry) -> dict[str, Any]:
    """The ``tool`` message answering one call."""
    result: dict[str, Any] = {
        "role": "tool",
        "content": tool_response_json(entry.response),
        # Which call this answers: by name (all servers since tool results existed) and by
        # id (newer servers); unknown fields are ignored by older ones.
        "tool_name": entry.call.name,
    }
    if entry.call.call_id:
        result["tool_call_id"] = entry.call.call_id
    return result


def _batch_messages(batch: ToolBatch) -> list[dict[str, Any]]:
    """One answered batch: an assistant message with every call, then a ``tool`` message per
    call, in order."""
    calls: list[dict[str, Any]] = []
    for entry in batch.entries:
        call: dict[str, Any] = {
            "function": {"name": entry.call.name, "arguments": dict(entry.call.arguments)}
        }
        if entry.call.call_id:
            call["id"] = entry.call.call_id
        calls.append(call)
    assistant = {"role": "assistant", "content": batch.pre_tool_text or "", "tool_calls": calls}
    return [assistant, *(_tool_message(entry) for entry in batch.entries)]


def build_ollama_body(request: ProviderRequest, *, model: str) -> dict[str, Any]:
    """The ``/api/chat`` request body for one pass."""
    messages: list[dict[str, Any]] = []
    for message in context_items(request.context):
        if isinstance(message, ToolBatch):
            messages.extend(_batch_messages(message))
            continue
        role = str(message.get("role", "user"))
        if role not in ("system", "user", "assistant", "tool"):
            role = "user"
        messages.append({"role": role, "content": _content_text(message.get("content", ""))})
    for batch in tool_batches(request.history):
        messages.extend(_batch_messages(batch))
    if request.prefill:
        # Ollama's chat templates leave a trailing assistant message open, so the model
        # continues it instead of starting a new reply.
        messages.append({"role": "assistant", "content": request.prefill})

    body: dict[str, Any] = {"model": model, "messages": messages, "stream": True}
    # Ollama has no tool choice: on the final answer pass (tools withdrawn) none is offered
    # (its chat templates take tool calls in the history without them)
    if request.tools and not request.tools_withdrawn:
        body["tools"] = [_tool(tool) for tool in request.tools]
    if request.max_output:
        body["options"] = {"num_predict": request.max_output}
    return body


# --------------------------------------------------------------------------- stream decoding
class OllamaStreamDecoder(PassDecoder):
    """NDJSON lines of one ``/api/chat`` (or ``/api/generate``) stream → chunk events: a
    `StreamDecoder`, sans-IO.

    `event` takes one line (the event's name is unused); `finish` is called when the body
    ended; `done` once the ``done`` line arrived. Raises `ProviderError` for an ``error`` line
    (Ollama reports mid-stream failures that way on a 200 response, §5.1), a line that is not
    a JSON object, or a body without a ``done`` line.
    """

    __slots__ = ("_calls", "_secrets")

    def __init__(self, *, secrets: Sequence[str] = ()) -> None:
        super().__init__()  # `response`: a line names its model, never an id
        self._secrets = tuple(secrets)
        self._calls = 0

    def event(self, name: str, data: str, out: list[Chunk]) -> None:
        del name  # NDJSON lines have no names
        if self._done:
            return
        line = decode_json_object(data, what="stream line", secrets=self._secrets)
        if line.get("error"):
            # "the status code of the response will not be changed" (§5.1): a 200 whose model
            # run failed on the server, worth another attempt — unless the error says more.
            raise error_from_payload(
                line, provider="Ollama", secrets=self._secrets, unknown=("server", True)
            )
        self.response.take(line.get("model"), None)
        message = line.get("message")
        if isinstance(message, Mapping):
            out.extend(self._message(message))
        else:
            # /api/generate shape (see the module docstring).
            _reasoning_and_text(line, "response", out)
        if line.get("done"):
            self._done = True
            out.append(UsageReport(_count(line, "prompt_eval_count"), _count(line, "eval_count")))
            raw = line.get("done_reason")
            raw_text = str(raw) if raw else None
            kind = _DONE_REASONS.get(raw_text or "stop", FinishKind.OTHER)
            if kind is FinishKind.STOP and self._calls:
                kind = FinishKind.TOOL_CALLS
            out.append(FinishReason(kind, raw_text))

    finish_marker = "a done line"

    @property
    def finished(self) -> bool:
        """The done line arrived (the same as `done`)."""
        return self._done

    def finish(self, out: list[Chunk]) -> None:
        del out  # the done line already said everything

    def _message(self, message: Mapping[str, Any]) -> list[Chunk]:
        chunks: list[Chunk] = []
        _reasoning_and_text(message, "content", chunks)
        for call in message.get("tool_calls") or ():
            if isinstance(call, Mapping):
                chunks.append(self._call(call))
        return chunks

    def _call(self, call: Mapping[str, Any]) -> FunctionCall:
        function = call.get("function") or {}
        name = str(function.get("name") or "")
        raw_arguments = function.get("arguments")
        truncated, parse_error = False, None
        if isinstance(raw_arguments, str):
            # Arguments are an object on the native API (§5.1); a proxy that re-serialised
            # them as a string still decodes.
            arguments, truncated, parse_error = decode_arguments(raw_arguments, cut=False)
        elif isinstance(raw_arguments, Mapping):
            arguments = dict(raw_arguments)
        else:
            arguments = {}
        self._calls += 1
        call_id = call.get("id")
        return FunctionCall(
            name,
            arguments,
            call_id=str(call_id) if call_id else None,
            truncated=truncated,
            parse_error=parse_error,
        )


def _reasoning_and_text(part: Mapping[str, Any], text_key: str, out: list[Chunk]) -> None:
    """The ``thinking`` and then the text (under ``text_key``: ``content`` in a chat message,
    ``response`` in a generate line) of one line, each as a chunk when it is a non-empty string.

    Reasoning first: a line can carry thinking, text and tool calls at once, and that is the
    order the model produced them in."""
    thinking = part.get("thinking")
    if isinstance(thinking, str) and thinking:
        out.append(ThoughtDelta(thinking))
    text = part.get(text_key)
    if isinstance(text, str) and text:
        out.append(TextDelta(text))


def _count(line: Mapping[str, Any], key: str) -> int:
    value = line.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


# --------------------------------------------------------------------------- the provider
class OllamaProvider(HTTPStreamProvider):
    """Streams one pass from Ollama's native ``/api/chat``.

    ``base_url`` is the server root (``http://127.0.0.1:11434``), not the ``/v1`` root of its
    OpenAI-compatible API. ``client`` is an optional shared ``httpx.AsyncClient`` (never
    closed here). Ollama has no API key; ``headers`` can carry one for a proxy in front of it.
    """

    framing = "ndjson"
    path = "api/chat"
    default_name = "ollama"
    known_provider = "ollama"
    takes_api_key = False

    __slots__ = ()

    def __init__(self, base_url: str, model: str, **options: Unpack[StreamOptions]) -> None:
        super().__init__(base_url, model, **options)

    @property
    def label(self) -> str:
        return "Ollama"

    def build_body(self, request: ProviderRequest) -> dict[str, Any]:
        return build_ollama_body(request, model=self.model)

    def decoder(self) -> OllamaStreamDecoder:
        return OllamaStreamDecoder(secrets=self.secrets)


__all__ = ["OllamaProvider", "OllamaStreamDecoder", "build_ollama_body"]
