"""Google Gemini adapter (Gemini API and Vertex): `GeminiProvider` and its pieces.

This module owns, for ``POST {base_url}/models/{model}:streamGenerateContent?alt=sse``:

* `build_gemini_body` — a `ProviderRequest` as a ``GenerateContentRequest`` (``contents`` with
  roles ``user`` / ``model``, ``systemInstruction``, each tool batch as one model turn of
  ``functionCall`` parts with their ``thoughtSignature`` echoed back and one user turn of
  ``functionResponse`` parts, ``tools`` as ``functionDeclarations``; on the final answer pass,
  tools withdrawn, ``toolConfig.functionCallingConfig.mode`` ``NONE``). Gemini has no option
  asking for one call per response: ``parallel_tool_calls`` is not sent, and a batch it makes
  anyway is run whole;
* `GeminiStreamDecoder` — the sans-IO decoder from SSE ``data:`` payloads to chunk events
  (text, ``thought: true`` parts, whole function calls, Vertex streamed ``partialArgs``,
  running ``usageMetadata``, the finish reason);
* `GeminiProvider` — the adapter on the shared HTTP stream base: its URL, and the key in the
  ``x-goog-api-key`` header, never in a ``key=`` query parameter (a URL ends up in logs and
  exception messages).

Wire facts are in docs/wire-formats.md §1.1, §1.3 and §6.
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
from toolloop_fsm.providers._history import ToolBatch
from toolloop_fsm.providers._history import tool_batches
from toolloop_fsm.providers._history import tool_response_payload
from toolloop_fsm.providers._http import error_from_payload
from toolloop_fsm.providers._sse import decode_json_object
from toolloop_fsm.providers._stream import HTTPStreamProvider
from toolloop_fsm.providers._stream import KeyedStreamOptions
from toolloop_fsm.providers._stream import PassDecoder
from toolloop_fsm.providers._turns import append_turn
from toolloop_fsm.providers._turns import content_parts

# There is no tool-call finish reason: STOP ends a turn with calls too (§6.2), so the decoder
# turns STOP into TOOL_CALLS itself when it saw a call.
_FINISH_REASONS: Mapping[str, FinishKind] = {
    "STOP": FinishKind.STOP,
    "MAX_TOKENS": FinishKind.LENGTH,
    "SAFETY": FinishKind.CONTENT_FILTER,
    "IMAGE_SAFETY": FinishKind.CONTENT_FILTER,
    "RECITATION": FinishKind.CONTENT_FILTER,
    "BLOCKLIST": FinishKind.CONTENT_FILTER,
    "PROHIBITED_CONTENT": FinishKind.CONTENT_FILTER,
    "SPII": FinishKind.CONTENT_FILTER,
    "MALFORMED_FUNCTION_CALL": FinishKind.OTHER,
    "FINISH_REASON_UNSPECIFIED": FinishKind.OTHER,
    "OTHER": FinishKind.OTHER,
}

# Google's documented stand-in for a function call that did not come from this model (a call
# replayed from another provider after a fallback): Gemini 3 rejects a model turn whose
# function call carries no signature ("missing thought_signature", §6.2).
SKIP_SIGNATURE = "skip_thought_signature_validator"

# `$.a.b[0]['c d']` — the RFC 9535 subset Vertex uses in partialArgs.jsonPath.
_PATH_TOKEN = re.compile(
    r"\.([A-Za-z_][\w-]*)|\[(\d+)\]|\['((?:[^'\\]|\\.)*)'\]|\[\"((?:[^\"\\]|\\.)*)\"\]"
)


# --------------------------------------------------------------------------- request body
def _text_part(text: str) -> dict[str, Any]:
    return {"text": text}


def _declaration(tool: ToolSpec) -> dict[str, Any]:
    declaration: dict[str, Any] = {"name": tool.name, "description": tool.description}
    if tool.parameters:
        # parametersJsonSchema takes full JSON Schema; the older `parameters` field takes an
        # OpenAPI subset and rejects keywords such as additionalProperties.
        declaration["parametersJsonSchema"] = dict(tool.parameters)
    return declaration


def _history_contents(contents: list[dict[str, Any]], batch: ToolBatch) -> None:
    """One answered batch: a model turn (the pre-tool text, then every ``functionCall`` part
    with its signature), then one user turn of a ``functionResponse`` part per call."""
    model_parts: list[dict[str, Any]] = []
    if batch.pre_tool_text:
        model_parts.append({"text": batch.pre_tool_text})
    # Gemini signs only the first call of a parallel batch and wants the others back as it
    # sent them, unsigned; a batch whose first call is unsigned did not come from a signing
    # model, and each of its calls takes the stand-in as a lone call does.
    signed = bool((batch.entries[0].call.provider_data or {}).get("thoughtSignature"))
    for number, entry in enumerate(batch.entries):
        function_call: dict[str, Any] = {
            "name": entry.call.name,
            "args": dict(entry.call.arguments),
        }
        if entry.call.call_id:
            function_call["id"] = entry.call.call_id
        part: dict[str, Any] = {"functionCall": function_call}
        signature = (entry.call.provider_data or {}).get("thoughtSignature")
        if signature:
            part["thoughtSignature"] = signature
        elif number == 0 or not signed:
            part["thoughtSignature"] = SKIP_SIGNATURE
        model_parts.append(part)
    append_turn(contents, "model", model_parts, key="parts")
    responses: list[dict[str, Any]] = []
    for entry in batch.entries:
        function_response: dict[str, Any] = {
            "name": entry.call.name,
            # functionResponse.response must be a JSON object (a Struct), which the payload is.
            "response": tool_response_payload(entry.response),
        }
        if entry.call.call_id:
            function_response["id"] = entry.call.call_id
        responses.append({"functionResponse": function_response})
    append_turn(contents, "user", responses, key="parts")


def build_gemini_body(request: ProviderRequest) -> dict[str, Any]:
    """The ``streamGenerateContent`` request body for one pass."""
    system: list[dict[str, Any]] = []
    contents: list[dict[str, Any]] = []
    for message in context_items(request.context):
        if isinstance(message, ToolBatch):
            _history_contents(contents, message)
            continue
        role = str(message.get("role", "user"))
        parts = content_parts(message.get("content", ""), _text_part)
        if role == "system":
            system.extend(parts)
        else:
            role = "model" if role in ("assistant", "model") else "user"
            append_turn(contents, role, parts, key="parts")
    for batch in tool_batches(request.history):
        _history_contents(contents, batch)
    if request.prefill:
        # A trailing model turn is continued by the model rather than answered.
        append_turn(contents, "model", [_text_part(request.prefill)], key="parts")

    body: dict[str, Any] = {"contents": contents}
    if system:
        body["systemInstruction"] = {"parts": system}
    if request.tools:
        body["tools"] = [{"functionDeclarations": [_declaration(t) for t in request.tools]}]
        if request.tools_withdrawn:
            # the final answer pass: declared, but no function may be called
            body["toolConfig"] = {"functionCallingConfig": {"mode": "NONE"}}
    if request.max_output:
        body["generationConfig"] = {"maxOutputTokens": request.max_output}
    return body


# --------------------------------------------------------------------------- stream decoding
def _parse_path(path: str) -> list[str | int] | None:
    if not path.startswith("$"):
        return None
    steps: list[str | int] = []
    position = 1
    while position < len(path):
        match = _PATH_TOKEN.match(path, position)
        if match is None:
            return None
        name, index, single, double = match.groups()
        if index is not None:
            steps.append(int(index))
        else:
            quoted = single if single is not None else double
            steps.append(name if name is not None else re.sub(r"\\(.)", r"\1", quoted or ""))
        position = match.end()
    return steps


class _StreamedCall:
    """A Vertex function call whose arguments arrive as ``partialArgs`` (§6.2)."""

    __slots__ = ("args", "call_id", "name", "open_strings", "signature")

    def __init__(self, name: str, call_id: str | None, signature: str | None) -> None:
        self.name = name
        self.call_id = call_id
        self.signature = signature
        self.args: dict[str, Any] = {}
        # jsonPaths whose string value said willContinue: the next piece is appended.
        self.open_strings: set[str] = set()

    def apply(self, partial: Mapping[str, Any]) -> None:
        path = str(partial.get("jsonPath") or "")
        steps = _parse_path(path)
        if not steps:
            return
        value: Any
        if "stringValue" in partial:
            piece = str(partial["stringValue"])
            if path in self.open_strings:
                previous = _get(self.args, steps)
                value = (previous if isinstance(previous, str) else "") + piece
            else:
                value = piece
        elif "numberValue" in partial:
            number = partial["numberValue"]
            value = int(number) if isinstance(number, float) and number.is_integer() else number
        elif "boolValue" in partial:
            value = bool(partial["boolValue"])
        elif "nullValue" in partial:
            value = None
        elif "structValue" in partial:
            value = partial["structValue"]
        elif "listValue" in partial:
            value = partial["listValue"]
        else:
            return
        if partial.get("willContinue") and "stringValue" in partial:
            self.open_strings.add(path)
        else:
            self.open_strings.discard(path)
        _set(self.args, steps, value)


def _get(root: Any, steps: Sequence[str | int]) -> Any:
    node = root
    for step in steps:
        if isinstance(step, int):
            if not isinstance(node, list) or step >= len(node):
                return None
            node = node[step]
        else:
            if not isinstance(node, dict):
                return None
            node = node.get(step)
    return node


def _set(root: dict[str, Any], steps: Sequence[str | int], value: Any) -> None:
    node: Any = root
    for step, following in zip(steps, [*steps[1:], None], strict=True):
        container: Any = [] if isinstance(following, int) else {}
        if following is None:
            container = value
        if isinstance(step, int):
            if not isinstance(node, list):
                return
            while len(node) <= step:
                node.append(None)
            if following is None or not isinstance(node[step], (dict, list)):
                node[step] = container
            node = node[step]
        else:
            if not isinstance(node, dict):
                return
            if following is None or not isinstance(node.get(step), (dict, list)):
                node[step] = container
            node = node[step]


class GeminiStreamDecoder(PassDecoder):
    """SSE ``data:`` payloads of one ``streamGenerateContent`` stream → chunk events: a
    `StreamDecoder`, sans-IO.

    `event` takes the event name (unused: Gemini sends none) and the data text; `finish` is
    called when the body ended — Gemini has no terminal event, the connection just closes
    after the chunk carrying ``finishReason`` (§6.1), so that is where the finish reason and
    any still-open streamed call come out, and only then is the decoder `done`. Raises
    `ProviderError` for an error object in the stream, a payload that is not JSON, or a body
    that ended without a finish reason.
    """

    __slots__ = (
        "_blocked",
        "_calls",
        "_finish_raw",
        "_secrets",
        "_streamed",
        "_usage",
    )

    def __init__(self, *, secrets: Sequence[str] = ()) -> None:
        super().__init__()
        # Values no error message may contain (the API key), however a server words it.
        self._secrets = tuple(secrets)
        self._calls = 0
        self._blocked = False
        self._streamed: _StreamedCall | None = None
        self._finish_raw: str | None = None
        self._usage: tuple[int, int] | None = None

    def event(self, name: str, data: str, out: list[Chunk]) -> None:
        del name  # Gemini's SSE has no event names
        if self._done:
            return
        payload = decode_json_object(data, what="Gemini stream event", secrets=self._secrets)
        if isinstance(payload.get("error"), Mapping):
            # An error object in place of a chunk (§6.3): classify it by its status word
            # (UNAVAILABLE, RESOURCE_EXHAUSTED, …) and keep any RetryInfo delay.
            raise error_from_payload(payload, provider="Gemini", secrets=self._secrets)
        self.response.take(payload.get("modelVersion"), payload.get("responseId"))
        candidates = payload.get("candidates") or []
        candidate = next(
            (c for c in candidates if isinstance(c, Mapping) and c.get("index", 0) == 0), None
        )
        if candidate is not None:
            content = candidate.get("content") or {}
            for part in content.get("parts") or ():
                if isinstance(part, Mapping):
                    out.extend(self._part(part))
            reason = candidate.get("finishReason")
            if reason:
                self._finish_raw = str(reason)
        else:
            feedback = payload.get("promptFeedback") or {}
            if feedback.get("blockReason"):
                # The prompt itself was blocked: no candidates at all.
                self._finish_raw = str(feedback["blockReason"])
                self._blocked = True
        usage = self._usage_report(payload.get("usageMetadata"))
        if usage is not None:
            out.append(usage)

    finish_marker = "a finishReason"

    @property
    def finished(self) -> bool:
        """A candidate carried a ``finishReason`` (or a blocked prompt its block reason)."""
        return self._finish_raw is not None

    def finish(self, out: list[Chunk]) -> None:
        raw = self._finish_raw
        if self._done or raw is None:
            return
        self._done = True
        if self._streamed is not None:
            # A streamed call never got its closing `{}`: complete only if the model stopped
            # on its own, cut if it ran out of tokens.
            out.append(self._emit_streamed(truncated=raw == "MAX_TOKENS"))
        kind = _FINISH_REASONS.get(raw, FinishKind.OTHER)
        if self._blocked:
            # promptFeedback.blockReason: the prompt itself was refused, whatever the word.
            kind = FinishKind.CONTENT_FILTER
        elif kind is FinishKind.STOP and self._calls:
            kind = FinishKind.TOOL_CALLS
        out.append(FinishReason(kind, raw))

    # ---- parts
    def _part(self, part: Mapping[str, Any]) -> list[Chunk]:
        signature = part.get("thoughtSignature") or None
        function_call = part.get("functionCall")
        if isinstance(function_call, Mapping):
            return self._function_call(function_call, signature)
        chunks: list[Chunk] = []
        if self._streamed is not None and "text" in part and part.get("text"):
            # Text after a streamed call means the call is over even without its `{}`.
            chunks.append(self._emit_streamed(truncated=False))
        text = part.get("text")
        if isinstance(text, str):
            if part.get("thought"):
                if text or signature:
                    chunks.append(ThoughtDelta(text, signature=signature))
                return chunks
            if text:
                chunks.append(TextDelta(text))
        if signature:
            # A signature on a text part (often an empty final one, §6.2) must be echoed back
            # with the turn; it travels as a text-less thought so the loop keeps it.
            chunks.append(ThoughtDelta("", signature=signature))
        return chunks

    def _function_call(self, call: Mapping[str, Any], signature: str | None) -> list[Chunk]:
        chunks: list[Chunk] = []
        name = call.get("name")
        will_continue = bool(call.get("willContinue"))
        partials = call.get("partialArgs") or ()
        args = call.get("args")
        if name:
            if self._streamed is not None:
                chunks.append(self._emit_streamed(truncated=False))
            if not will_continue and not partials:
                # The Gemini API form: the whole call in one part; `args` may be absent for a
                # function without parameters (§6.2).
                chunks.append(self._emit(str(name), args, call.get("id"), signature))
                return chunks
            self._streamed = _StreamedCall(str(name), call.get("id") or None, signature)
        streamed = self._streamed
        if streamed is None:
            # partialArgs or a terminator with no call open: nothing can be named from it.
            return chunks
        if signature and not streamed.signature:
            streamed.signature = signature
        if isinstance(args, Mapping):
            streamed.args.update(args)
        for partial in partials:
            if isinstance(partial, Mapping):
                streamed.apply(partial)
        if not will_continue:
            # `{"functionCall": {}}` (or the last partial) closes the call.
            chunks.append(self._emit_streamed(truncated=False))
        return chunks

    def _emit_streamed(self, *, truncated: bool) -> FunctionCall:
        streamed = self._streamed
        assert streamed is not None
        self._streamed = None
        call = self._emit(streamed.name, streamed.args, streamed.call_id, streamed.signature)
        if truncated:
            return FunctionCall(
                call.name,
                call.arguments,
                call_id=call.call_id,
                truncated=True,
                provider_data=call.provider_data,
            )
        return call

    def _emit(self, name: str, args: Any, call_id: Any, signature: str | None) -> FunctionCall:
        self._calls += 1
        arguments = dict(args) if isinstance(args, Mapping) else {}
        return FunctionCall(
            name,
            arguments,
            call_id=str(call_id) if call_id else None,
            provider_data={"thoughtSignature": signature} if signature else None,
        )

    def _usage_report(self, metadata: Any) -> UsageReport | None:
        if not isinstance(metadata, Mapping):
            return None
        if "promptTokenCount" not in metadata and "candidatesTokenCount" not in metadata:
            # Vertex's intermediate chunks carry only {"trafficType": …} (§6.2).
            return None
        # Running totals, the last one wins. Thinking tokens are billed as output, as they are
        # in Anthropic's and OpenAI's output figures; tool-use prompt tokens are input.
        input_tokens = _count(metadata, "promptTokenCount") + _count(
            metadata, "toolUsePromptTokenCount"
        )
        output_tokens = _count(metadata, "candidatesTokenCount") + _count(
            metadata, "thoughtsTokenCount"
        )
        usage = (input_tokens, output_tokens)
        if usage == self._usage:
            return None
        self._usage = usage
        return UsageReport(input_tokens, output_tokens)


def _count(metadata: Mapping[str, Any], key: str) -> int:
    value = metadata.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


# --------------------------------------------------------------------------- the provider
class GeminiProvider(HTTPStreamProvider):
    """Streams one pass from Gemini's ``streamGenerateContent`` (Gemini API or Vertex).

    ``base_url`` is the API root (``https://generativelanguage.googleapis.com/v1beta``); the
    request goes to ``{base_url}/models/{model}:streamGenerateContent?alt=sse``. ``api_key``
    travels only in the ``x-goog-api-key`` header — never as a ``key=`` query parameter, which
    would put it in every URL that is logged or quoted in an error — and appears in no message
    or repr. ``client`` is an optional shared ``httpx.AsyncClient`` (never closed here).
    """

    default_name = "gemini"
    known_provider = "gcp.gemini"
    operation_name = "generate_content"

    __slots__ = ()

    def __init__(self, base_url: str, model: str, **options: Unpack[KeyedStreamOptions]) -> None:
        # "models/gemini-…" (the name the models list returns) and "gemini-…" both work.
        super().__init__(base_url, model.removeprefix("models/"), **options)

    @property
    def url(self) -> str:
        return f"{self.base_url}/models/{self.model}:streamGenerateContent?alt=sse"

    @property
    def label(self) -> str:
        return "Gemini"

    def credential_headers(self, api_key: str) -> dict[str, str]:
        return {"x-goog-api-key": api_key}

    def build_body(self, request: ProviderRequest) -> dict[str, Any]:
        return build_gemini_body(request)

    def decoder(self) -> GeminiStreamDecoder:
        return GeminiStreamDecoder(secrets=self.secrets)


__all__ = ["SKIP_SIGNATURE", "GeminiProvider", "GeminiStreamDecoder", "build_gemini_body"]
