"""OpenAI Chat Completions adapter: `OpenAICompatibleProvider` and the pieces it is made of.

Owns, for ``POST {base_url}/chat/completions`` with ``"stream": true`` on OpenAI and on the
servers that imitate it (Azure, DeepSeek, Groq, Mistral, OpenRouter, vLLM, Ollama ``/v1``, …):

* `build_chat_messages` / `build_chat_body` — a `ProviderRequest` as a request body: the
  context, then per tool batch one assistant message (the pre-tool text + every call in
  ``tool_calls``) and one ``tool`` message per call, in order (the response as every adapter
  shows it, as JSON), then the prefill as a trailing assistant message; with tools offered
  and ``parallel_tool_calls`` off, ``"parallel_tool_calls": false``, which asks for at most
  one call per response (``extra_body``, merged last, can still say otherwise); on the final
  answer pass (tools withdrawn), ``"tool_choice": "none"``;
* `ChatStreamDecoder` — sans-IO, from SSE events to chunk events. Text from ``delta.content``
  (a string, or Mistral's array of ``thinking``/``text`` parts); reasoning from ``reasoning``
  or else ``reasoning_content`` (vLLM sends both, one a copy of the other); refusals as text;
  usage from ``usage`` or Groq's ``x_groq.usage``, wherever it comes; finish reasons
  normalised to `FinishKind`; tool calls through one tolerant accumulator; in-stream errors
  (a truthy top-level ``error`` or ``event: error``) raised as `ProviderError`;
* `OpenAIStyleProvider` — what the OpenAI-style adapters add to the HTTP stream base (how the
  key travels, ``extra_body``, how their decoder is made), and `OpenAICompatibleProvider`,
  the chat adapter on it.

Decisions (each a place where the wire allows more than one reading):

* Only choice 0 is the reply. With ``n > 1`` the other choices' deltas, finishes and calls
  are ignored: the loop drives one conversation.
* A pass that streamed only ``refusal`` text and finished ``stop`` ends with
  ``FinishKind.REFUSAL`` (raw ``"stop"``): OpenAI never sends ``content_filter`` for a refusal,
  and the loop should know the text is a refusal rather than an answer.
* Tool calls are emitted at the first finish chunk; argument fragments arriving after that
  are ignored. Arguments are decoded with
  ``cut=True`` when the finish was ``length``.
* A finish reason repeated on later chunks (OpenRouter) is reported once. Usage is reported
  each time it changes (the ledger keeps a pass's last, cumulative report).
* ``[DONE]``, a finish chunk, and the connection closing are separate endings, and only the
  finish completes the reply: a stream that ends without one — closed early, or ``[DONE]``
  alone, as llama.cpp's server ends an interrupted stream — was cut, a retryable
  ``protocol`` error (`unfinished_stream`); an empty body is a ``protocol`` error
  (`post_stream`). Events after ``[DONE]``
  are not part of the pass and are not decoded.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import ClassVar
from typing import Protocol
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
from toolloop_fsm.providers._history import dump_json
from toolloop_fsm.providers._history import tool_batches
from toolloop_fsm.providers._history import tool_response_json
from toolloop_fsm.providers._http import error_from_payload
from toolloop_fsm.providers._sse import decode_json_object
from toolloop_fsm.providers._stream import HTTPStreamProvider
from toolloop_fsm.providers._stream import KeyedStreamOptions
from toolloop_fsm.providers._stream import PassDecoder
from toolloop_fsm.providers._stream import StreamDecoder
from toolloop_fsm.result import ToolHistoryEntry

FINISH_KINDS: Mapping[str, FinishKind] = {
    "stop": FinishKind.STOP,
    "eos": FinishKind.STOP,
    "eos_token": FinishKind.STOP,
    "stop_sequence": FinishKind.STOP,
    "end_turn": FinishKind.STOP,
    "length": FinishKind.LENGTH,
    "max_tokens": FinishKind.LENGTH,
    "model_length": FinishKind.LENGTH,
    "tool_calls": FinishKind.TOOL_CALLS,
    "function_call": FinishKind.TOOL_CALLS,
    "tool_use": FinishKind.TOOL_CALLS,
    "content_filter": FinishKind.CONTENT_FILTER,
    "refusal": FinishKind.REFUSAL,
}


# --------------------------------------------------------------------------- request side
def history_call_id(entry: ToolHistoryEntry, position: int) -> str:
    """The call's own id, or a deterministic one: 9 alphanumerics, which even Mistral takes.

    ``position`` is the call's index in the whole history, so two identical calls of one
    batch get two ids."""
    if entry.call.call_id:
        return entry.call.call_id
    canonical = json.dumps(entry.call.arguments, sort_keys=True, default=str)
    digest = hashlib.sha256(f"{position}:{entry.call.name}:{canonical}".encode()).hexdigest()
    return digest[:9]


def build_chat_messages(request: ProviderRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for item in context_items(request.context):
        if isinstance(item, ToolBatch):
            messages.extend(_batch_messages(item))
        else:
            # keys of the library's own ("toolloop_…" markers) are not for the server
            messages.append({k: v for k, v in item.items() if not k.startswith("toolloop_")})
    for batch in tool_batches(request.history):
        messages.extend(_batch_messages(batch))
    if request.prefill:
        messages.append({"role": "assistant", "content": request.prefill})
    return messages


def _batch_messages(batch: ToolBatch) -> list[dict[str, Any]]:
    """One answered batch: an assistant message with every call, then a ``tool`` message per
    call, in order."""
    calls = [(history_call_id(entry, index), entry) for index, entry in batch.numbered()]
    assistant = {
        "role": "assistant",
        # "" rather than null: llama.cpp's server rejects a null content (HTTP 500)
        "content": batch.pre_tool_text or "",
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {
                    "name": entry.call.name,
                    "arguments": dump_json(dict(entry.call.arguments)),
                },
            }
            for call_id, entry in calls
        ],
    }
    return [
        assistant,
        *(
            {"role": "tool", "tool_call_id": call_id, "content": tool_response_json(entry.response)}
            for call_id, entry in calls
        ),
    ]


def chat_tool(tool: ToolSpec) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": dict(tool.parameters) or {"type": "object", "properties": {}},
        },
    }


def build_chat_body(
    request: ProviderRequest, model: str, extra_body: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": build_chat_messages(request),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if request.tools:
        body["tools"] = [chat_tool(tool) for tool in request.tools]
        if request.tools_withdrawn:
            # the final answer pass: the tools stay declared for the calls in the history
            body["tool_choice"] = "none"
        elif not request.parallel_tool_calls:
            body["parallel_tool_calls"] = False
    if request.max_output is not None:
        body["max_tokens"] = request.max_output
    if extra_body:
        body.update(extra_body)
    return body


# --------------------------------------------------------------------------- stream side
class _PendingCall:
    """A tool call being assembled from fragments (mutable, private to the decoder)."""

    __slots__ = ("call_id", "index", "name", "parts")

    def __init__(self, index: int | None) -> None:
        self.index = index
        self.call_id: str | None = None
        self.name: str | None = None
        self.parts: list[str] = []


class ToolCallAccumulator:
    """Assembles ``delta.tool_calls`` fragments into calls, tolerating every known quirk.

    A fragment joins the call with its ``index``, else the call with its (non-empty) ``id``;
    a fragment with neither a new ``id`` nor a ``name`` continues the latest call. So: no
    ``index`` at all (Mistral), an ``index`` starting at 1 or sparse (gateways), an index
    reused by a call with a different id, ``""`` ids or names on continuations (qwen, glm —
    never overwriting the real ones), a whole call in one delta, and trailing empty
    fragments all assemble to the calls the model made, in the order they started.
    """

    __slots__ = ("_by_id", "_by_index", "_calls")

    def __init__(self) -> None:
        self._calls: list[_PendingCall] = []
        self._by_index: dict[int, _PendingCall] = {}
        self._by_id: dict[str, _PendingCall] = {}

    def __bool__(self) -> bool:
        return bool(self._calls)

    def add(self, fragment: Mapping[str, Any]) -> None:
        index = fragment.get("index")
        function = fragment.get("function")
        call_id = fragment.get("id") or None
        if call_id is None and type(function) is dict and not function.get("name"):
            # Fast path: an argument fragment continuing a known index (the common case).
            known = self._by_index.get(index) if type(index) is int else None
            arguments = function.get("arguments")
            if known is not None and type(arguments) is str:
                if arguments:
                    known.parts.append(arguments)
                return
        if not isinstance(index, int) or isinstance(index, bool):
            index = None
        if not isinstance(function, Mapping):
            function = {}
        name = function.get("name") or None
        call = self._call_joined(index, call_id, name)
        self._fill(call, index, call_id, name, function.get("arguments"))

    def _call_joined(
        self, index: int | None, call_id: str | None, name: str | None
    ) -> _PendingCall:
        """The call a fragment joins: the one with its index (unless a new id reused it), else
        the one with its id, else, for a bare continuation, the latest; else a new call."""
        call = self._by_index.get(index) if index is not None else None
        if call is not None and call_id and call.call_id and call.call_id != call_id:
            call = None  # the index was reused by a new call
        if call is None and call_id:
            call = self._by_id.get(call_id)
        if call is None and not call_id and not name and self._calls:
            call = self._calls[-1]  # a bare continuation
        if call is None:
            call = _PendingCall(index)
            self._calls.append(call)
        return call

    def _fill(
        self,
        call: _PendingCall,
        index: int | None,
        call_id: str | None,
        name: str | None,
        arguments: Any,
    ) -> None:
        """What the fragment tells of ``call``: the index, id and name it did not know yet
        (a real one never overwritten), and more of its arguments."""
        if index is not None and (call.index is None or index not in self._by_index):
            call.index = index
            self._by_index[index] = call
        if call_id and not call.call_id:
            call.call_id = call_id
            self._by_id[call_id] = call
        if name and not call.name:
            call.name = name
        if isinstance(arguments, str):
            if arguments:
                call.parts.append(arguments)
        elif arguments is not None:
            # Some servers send the arguments already decoded.
            call.parts.append(json.dumps(arguments, ensure_ascii=False))

    def finish(self, *, cut: bool) -> list[FunctionCall]:
        calls = []
        for pending in self._calls:
            arguments, truncated, parse_error = decode_arguments("".join(pending.parts), cut=cut)
            calls.append(
                FunctionCall(
                    name=pending.name or "",
                    arguments=arguments,
                    call_id=pending.call_id,
                    truncated=truncated,
                    parse_error=parse_error,
                )
            )
        self._calls.clear()
        self._by_index.clear()
        self._by_id.clear()
        return calls


def _groq_usage(chunk: dict[str, Any]) -> Any:
    """Groq reports usage under ``x_groq`` instead."""
    x_groq = chunk.get("x_groq")
    return x_groq.get("usage") if isinstance(x_groq, dict) else None


class ChatStreamDecoder(PassDecoder):
    """Chat Completions SSE events → chunk events (sans-IO).

    Call `event(name, data, out)` for each SSE event — it appends chunk events to ``out`` and
    raises `ProviderError` on an in-stream error or a non-JSON line — then `finish(out)` when
    the body ends.
    """

    __slots__ = (
        "_calls",
        "_calls_emitted",
        "_finish",
        "_last_usage",
        "_provider",
        "_refusal_only",
        "_secrets",
        "_text_seen",
    )

    def __init__(self, *, provider: str, secrets: Sequence[str | None] = ()) -> None:
        super().__init__()
        self._provider = provider
        self._secrets = tuple(secrets)
        self._calls = ToolCallAccumulator()
        self._calls_emitted = False
        self._finish: str | None = None
        self._last_usage: tuple[int, int] | None = None
        self._refusal_only = False
        self._text_seen = False

    def event(self, name: str, data: str, out: list[Chunk]) -> None:
        if self._done:
            return  # nothing after [DONE] belongs to this pass
        if data[:1] != "{":
            if data.startswith("[DONE]"):
                self._done = True
                return
            if not data.strip():
                return  # keep-alive with an empty data field
        chunk = decode_json_object(
            data, what=f"{self._provider}: stream event", secrets=self._secrets
        )
        if name == "error" or chunk.get("error"):
            raise error_from_payload(chunk, provider=self._provider, secrets=self._secrets)
        self.response.take(chunk.get("model"), chunk.get("id"))
        choices = chunk.get("choices")
        if choices:
            for choice in choices:
                if choice.get("index", 0) == 0:
                    self._choice(choice, out)
                    break
        usage = chunk.get("usage") or _groq_usage(chunk)
        if usage and isinstance(usage, dict):
            self._usage(usage, out)

    def _choice(self, choice: dict[str, Any], out: list[Chunk]) -> None:
        delta = choice.get("delta")
        if delta:
            self._delta(delta, out)
        finish = choice.get("finish_reason")
        if finish and self._finish is None:
            self._finished(str(finish), out)

    def _delta(self, delta: dict[str, Any], out: list[Chunk]) -> None:
        """A choice's delta: text (a string, or Mistral's content parts), reasoning, a
        refusal's text, tool-call fragments (until the calls were emitted)."""
        content = delta.get("content")
        if content and type(content) is str:
            self._text_seen = True
            out.append(TextDelta(content))
        elif content and isinstance(content, list):
            self._content_parts(content, out)
        reasoning = delta.get("reasoning")
        if reasoning is None:
            reasoning = delta.get("reasoning_content")
        if reasoning and isinstance(reasoning, str):
            out.append(ThoughtDelta(reasoning))
        refusal = delta.get("refusal")
        if refusal and isinstance(refusal, str):
            if not self._text_seen:
                self._refusal_only = True
            out.append(TextDelta(refusal))
        tool_calls = delta.get("tool_calls")
        if tool_calls and not self._calls_emitted:
            for fragment in tool_calls:
                if isinstance(fragment, dict):
                    self._calls.add(fragment)

    def _finished(self, finish: str, out: list[Chunk]) -> None:
        """The first finish reason: the assembled calls go out, then the finish (a stop after
        nothing but a refusal is a refusal)."""
        self._finish = finish
        self._emit_calls(out)
        kind = FINISH_KINDS.get(finish, FinishKind.OTHER)
        if kind is FinishKind.STOP and self._refusal_only and not self._text_seen:
            kind = FinishKind.REFUSAL
        out.append(FinishReason(kind, finish))

    def _content_parts(self, parts: list[Any], out: list[Chunk]) -> None:
        """Mistral's content array: ``thinking`` parts (themselves text-part lists) and ``text``."""
        for part in parts:
            if not isinstance(part, dict):
                continue
            kind = part.get("type")
            if kind == "text":
                text = part.get("text")
                if text and isinstance(text, str):
                    self._text_seen = True
                    out.append(TextDelta(text))
            elif kind == "thinking":
                thinking = part.get("thinking")
                pieces = thinking if isinstance(thinking, list) else [thinking]
                for piece in pieces:
                    text = piece.get("text") if isinstance(piece, dict) else piece
                    if text and isinstance(text, str):
                        out.append(ThoughtDelta(text))

    def _usage(self, usage: dict[str, Any], out: list[Chunk]) -> None:
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        if not isinstance(prompt, int) and not isinstance(completion, int):
            return
        figures = (
            prompt if isinstance(prompt, int) else 0,
            completion if isinstance(completion, int) else 0,
        )
        if figures != self._last_usage:
            self._last_usage = figures
            out.append(UsageReport(input_tokens=figures[0], output_tokens=figures[1]))

    def _emit_calls(self, out: list[Chunk]) -> None:
        if self._calls and not self._calls_emitted:
            out.extend(self._calls.finish(cut=self._finish in ("length", "max_tokens")))
        self._calls_emitted = True

    finish_marker = "a finish_reason"

    @property
    def finished(self) -> bool:
        """Choice 0 reported a ``finish_reason``: ``[DONE]`` alone does not finish a reply
        (llama.cpp's server ends an interrupted stream with it)."""
        return self._finish is not None

    def finish(self, out: list[Chunk]) -> None:
        """The body ended after the finish: emit what is pending."""
        self._emit_calls(out)


# --------------------------------------------------------------------------- the provider
class OpenAIStyleOptions(KeyedStreamOptions, total=False):
    """`KeyedStreamOptions` and what every OpenAI-style adapter takes besides."""

    extra_body: Mapping[str, Any] | None
    auth_header: str


class OpenAIStyleDecoderType(Protocol):
    """How an OpenAI-style decoder is made: with the provider's name (its errors name it by
    that) and the secrets no error text may contain."""

    def __call__(self, *, provider: str, secrets: Sequence[str | None]) -> StreamDecoder: ...


class OpenAIStyleProvider(HTTPStreamProvider):
    """What the OpenAI APIs' adapters add to the HTTP stream base: the key as a bearer
    ``authorization`` header, or bare in the header ``auth_header`` names (Azure's
    ``api-key``); ``extra_body`` merged into every request body; a default name of
    ``{default_name}:{model}`` (their errors name them by their name); a decoder for each
    pass, a `decoder_type` made with that name and the provider's secrets. Subclasses name
    the path, the body and the `decoder_type`."""

    default_name = "openai"
    known_provider = "openai"
    decoder_type: ClassVar[OpenAIStyleDecoderType]

    __slots__ = ("_auth_header", "extra_body")

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        extra_body: Mapping[str, Any] | None = None,
        auth_header: str = "authorization",
        **options: Unpack[KeyedStreamOptions],
    ) -> None:
        # Set before the base builds the headers: where the key travels depends on it.
        self._auth_header = auth_header.lower()
        self.extra_body = dict(extra_body or {})
        super().__init__(base_url, model, **options)

    def unnamed(self) -> str:
        return f"{self.default_name}:{self.model}"

    def decoder(self) -> StreamDecoder:
        return self.decoder_type(provider=self.name, secrets=self.secrets)

    def credential_headers(self, api_key: str) -> dict[str, str]:
        if self._auth_header == "authorization":
            return {"authorization": f"Bearer {api_key}"}
        return {self._auth_header: api_key}


class OpenAICompatibleProvider(OpenAIStyleProvider):
    """Streams passes from an OpenAI-compatible ``/chat/completions`` endpoint.

    ``base_url`` is the API root (``…/v1``). ``extra_body`` is merged into every request body
    (e.g. ``{"temperature": 0}``, ``{"reasoning_effort": …}``).
    """

    path = "chat/completions"
    default_name = "openai-compatible"
    decoder_type = ChatStreamDecoder

    __slots__ = ()

    def build_body(self, request: ProviderRequest) -> dict[str, Any]:
        return build_chat_body(request, self.model, self.extra_body)


__all__ = [
    "FINISH_KINDS",
    "ChatStreamDecoder",
    "OpenAICompatibleProvider",
    "OpenAIStyleDecoderType",
    "OpenAIStyleOptions",
    "OpenAIStyleProvider",
    "ToolCallAccumulator",
    "build_chat_body",
    "build_chat_messages",
    "chat_tool",
    "history_call_id",
]
