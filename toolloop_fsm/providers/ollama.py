"""Ollama native adapter: `OllamaProvider` for ``POST {base_url}/api/chat`` (NDJSON).

This module owns:

* `build_ollama_body` — a `ProviderRequest` as an ``/api/chat`` request (messages with tool
  calls and ``tool`` results, the prefill as a trailing assistant message, ``options``);
* `OllamaStreamDecoder` — the sans-IO decoder from NDJSON objects to chunk events
  (``message.content`` / ``message.thinking`` / ``message.tool_calls``, the ``done`` line's
  usage and ``done_reason``, an ``{"error": …}`` line);
* `OllamaProvider` — the async shell.

**The decoder also takes ``/api/generate`` lines.** They carry the text in ``response`` (and
reasoning in ``thinking``) instead of ``message``; everything else — ``done``, ``done_reason``,
``prompt_eval_count``, ``eval_count``, ``error`` — is the same. Accepting both lets the one real
Ollama capture we have (an ``/api/generate`` transcript, docs/wire-formats.md §5.1) replay
through the same code as ``/api/chat``; the provider itself only ever calls ``/api/chat``.

Wire facts are in docs/wire-formats.md §1.2 and §5.1.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from contextlib import aclosing
from typing import Any, cast

import httpx

from toolloop_fsm.events import (
    Chunk,
    FinishKind,
    FinishReason,
    FunctionCall,
    TextDelta,
    ThoughtDelta,
    UsageReport,
)
from toolloop_fsm.provider import ProviderError, ProviderRequest, ToolSpec
from toolloop_fsm.providers._arguments import decode_arguments
from toolloop_fsm.providers._history import tool_response_json
from toolloop_fsm.providers._http import error_from_payload, post_stream
from toolloop_fsm.providers._secrecy import header_secrets, redact, redacted_error
from toolloop_fsm.providers._sse import aiter_ndjson

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


def build_ollama_body(request: ProviderRequest, *, model: str) -> dict[str, Any]:
    """The ``/api/chat`` request body for one pass."""
    messages: list[dict[str, Any]] = []
    for message in request.context:
        role = str(message.get("role", "user"))
        if role not in ("system", "user", "assistant", "tool"):
            role = "user"
        messages.append({"role": role, "content": _content_text(message.get("content", ""))})
    for entry in request.history:
        call: dict[str, Any] = {
            "function": {"name": entry.call.name, "arguments": dict(entry.call.arguments)}
        }
        if entry.call.call_id:
            call["id"] = entry.call.call_id
        messages.append(
            {"role": "assistant", "content": entry.pre_tool_text or "", "tool_calls": [call]}
        )
        result: dict[str, Any] = {
            "role": "tool",
            "content": tool_response_json(entry.response),
            # Which call this answers: by name (all servers since tool results existed) and by
            # id (newer servers); unknown fields are ignored by older ones.
            "tool_name": entry.call.name,
        }
        if entry.call.call_id:
            result["tool_call_id"] = entry.call.call_id
        messages.append(result)
    if request.prefill:
        # Ollama's chat templates leave a trailing assistant message open, so the model
        # continues it instead of starting a new reply.
        messages.append({"role": "assistant", "content": request.prefill})

    body: dict[str, Any] = {"model": model, "messages": messages, "stream": True}
    if request.tools:
        body["tools"] = [_tool(tool) for tool in request.tools]
    if request.max_output:
        body["options"] = {"num_predict": request.max_output}
    return body


# --------------------------------------------------------------------------- stream decoding
class OllamaStreamDecoder:
    """Decoded NDJSON objects of one ``/api/chat`` (or ``/api/generate``) stream → chunks.

    `feed` takes one decoded line; `finish` is called when the body ended. Raises
    `ProviderError` for an ``error`` line (Ollama reports mid-stream failures that way on a
    200 response, §5.1), a line that is not an object, or a body without a ``done`` line.
    """

    __slots__ = ("_calls", "_done", "_secrets")

    def __init__(self, *, secrets: Sequence[str] = ()) -> None:
        self._secrets = tuple(secrets)
        self._calls = 0
        self._done = False

    def feed(self, line: Any) -> list[Chunk]:
        if self._done:
            return []
        if not isinstance(line, Mapping):
            raise ProviderError(
                "Ollama stream sent a line that is not a JSON object",
                kind="protocol",
                retryable=True,
            )
        if line.get("error"):
            # "the status code of the response will not be changed" (§5.1): a 200 whose model
            # run failed on the server, worth another attempt — unless the error says more.
            raise error_from_payload(
                line, provider="Ollama", secrets=self._secrets, unknown=("server", True)
            )
        chunks: list[Chunk] = []
        message = line.get("message")
        if isinstance(message, Mapping):
            chunks.extend(self._message(message))
        else:
            # /api/generate shape (see the module docstring).
            thinking = line.get("thinking")
            if isinstance(thinking, str) and thinking:
                chunks.append(ThoughtDelta(thinking))
            response = line.get("response")
            if isinstance(response, str) and response:
                chunks.append(TextDelta(response))
        if line.get("done"):
            self._done = True
            chunks.append(
                UsageReport(_count(line, "prompt_eval_count"), _count(line, "eval_count"))
            )
            raw = line.get("done_reason")
            raw_text = str(raw) if raw else None
            kind = _DONE_REASONS.get(raw_text or "stop", FinishKind.OTHER)
            if kind is FinishKind.STOP and self._calls:
                kind = FinishKind.TOOL_CALLS
            chunks.append(FinishReason(kind, raw_text))
        return chunks

    def finish(self) -> list[Chunk]:
        if not self._done:
            raise ProviderError(
                "Ollama stream ended without a done line", kind="connection", retryable=True
            )
        return []

    def _message(self, message: Mapping[str, Any]) -> list[Chunk]:
        chunks: list[Chunk] = []
        # Reasoning first: a chunk can carry thinking, content and tool calls at once, and
        # that is the order the model produced them in.
        thinking = message.get("thinking")
        if isinstance(thinking, str) and thinking:
            chunks.append(ThoughtDelta(thinking))
        content = message.get("content")
        if isinstance(content, str) and content:
            chunks.append(TextDelta(content))
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


def _count(line: Mapping[str, Any], key: str) -> int:
    value = line.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


# --------------------------------------------------------------------------- the provider
class OllamaProvider:
    """Streams one pass from Ollama's native ``/api/chat``.

    ``base_url`` is the server root (``http://127.0.0.1:11434``), not the ``/v1`` root of its
    OpenAI-compatible API. ``client`` is an optional shared ``httpx.AsyncClient`` (never
    closed here). Ollama has no API key; ``headers`` can carry one for a proxy in front of it.
    """

    tool_calling = "native"

    __slots__ = ("_client", "_headers", "_timeout", "base_url", "model", "name")

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        client: httpx.AsyncClient | None = None,
        name: str = "ollama",
        headers: Mapping[str, str] | None = None,
        timeout: httpx.Timeout | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.name = name
        self._client = client
        self._headers = dict(headers or {})
        self._timeout = timeout

    def __repr__(self) -> str:
        base_url = redact(self.base_url, self.secrets)
        return f"OllamaProvider(base_url={base_url!r}, model={self.model!r})"

    @property
    def secrets(self) -> tuple[str, ...]:
        """What no text from this provider may contain: a proxy's credentials in `headers`."""
        return header_secrets(self._headers)

    async def stream(self, request: ProviderRequest) -> AsyncIterator[Chunk]:
        secrets = self.secrets
        decoder = OllamaStreamDecoder(secrets=secrets)
        raw = post_stream(
            f"{self.base_url}/api/chat",
            build_ollama_body(request, model=self.model),
            provider="Ollama",
            framing="ndjson",
            headers={**self._headers, "accept": "application/x-ndjson"},
            client=self._client,
            secrets=secrets,
            timeout=self._timeout,
        )
        # aclosing both generators: a cancelled or abandoned pass closes the response at once.
        # aiter_ndjson is an async generator typed as AsyncIterator; aclosing needs aclose().
        lines_iter = cast("AsyncGenerator[Any, None]", aiter_ndjson(raw, secrets=secrets))
        failure: ProviderError | None = None
        try:
            async with aclosing(raw), aclosing(lines_iter) as lines:
                async for line in lines:
                    for chunk in decoder.feed(line):
                        yield chunk
            for chunk in decoder.finish():
                yield chunk
        except ProviderError as error:
            failure = redacted_error(error, secrets)
        if failure is not None:
            raise failure  # outside the `except`: nothing chained to it


__all__ = ["OllamaProvider", "OllamaStreamDecoder", "build_ollama_body"]
