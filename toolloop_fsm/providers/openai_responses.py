"""OpenAI Responses API adapter: `OpenAIResponsesProvider` and the pieces it is made of.

Owns, for ``POST {base_url}/responses`` with ``"stream": true`` (OpenAI and Azure OpenAI):

* `build_responses_body` — a `ProviderRequest` as a request body: context messages as input
  items, each tool batch as its pre-tool text once (an assistant message), every call as the
  reasoning items it must travel with and its ``function_call`` item, then every call's
  ``function_call_output`` item, in order; then the prefill as a trailing assistant message.
  With tools offered and ``parallel_tool_calls`` off, ``"parallel_tool_calls": false``
  (``extra_body``, merged last, can still say otherwise);
* `ResponsesStreamDecoder` — sans-IO, from the event-named SSE stream (the JSON repeats the
  name in ``type``; no ``[DONE]``) to chunk events: ``output_text.delta`` and
  ``refusal.delta`` → `TextDelta`; ``reasoning_summary_text.delta`` /
  ``reasoning_text.delta`` → `ThoughtDelta`; ``function_call`` items → `FunctionCall`
  (arguments from the deltas, replaced by the full text of ``function_call_arguments.done`` /
  ``output_item.done``; the id is the item's ``call_id``, which tool outputs must quote, not
  its ``fc_…`` item id); usage and finish from the terminal event;
* `OpenAIResponsesProvider` — the adapter on the OpenAI-style HTTP stream base.

Decisions:

* Terminal events: ``response.completed`` → finish ``TOOL_CALLS`` if the pass made calls,
  else ``STOP`` (raw ``"completed"``); ``response.incomplete`` → ``LENGTH`` for
  ``max_output_tokens``, ``CONTENT_FILTER`` for ``content_filter``, with any call still open
  decoded as cut; ``response.failed`` and ``error`` (nested ``error`` object or top-level
  ``code``/``message`` — both shapes are real) raise `ProviderError`. A stream that ends
  without a terminal event was cut: a retryable ``protocol`` error (`unfinished_stream`).
* Reasoning items (with ``encrypted_content``) that precede a call ride on the first
  `FunctionCall` as ``provider_data["reasoning"]`` and are replayed before it, because the
  API wants a reasoning model's reasoning back with its function calls.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import ClassVar

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
from toolloop_fsm.providers._stream import PassDecoder
from toolloop_fsm.providers.openai_compat import OpenAIStyleProvider
from toolloop_fsm.providers.openai_compat import history_call_id
from toolloop_fsm.result import ToolHistoryEntry

_INCOMPLETE_KINDS: Mapping[str, FinishKind] = {
    "max_output_tokens": FinishKind.LENGTH,
    "content_filter": FinishKind.CONTENT_FILTER,
}


# --------------------------------------------------------------------------- request side
def responses_tool(tool: ToolSpec) -> dict[str, Any]:
    return {
        "type": "function",
        "name": tool.name,
        "description": tool.description,
        "parameters": dict(tool.parameters) or {"type": "object", "properties": {}},
    }


def build_responses_input(request: ProviderRequest) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for item in context_items(request.context):
        if isinstance(item, ToolBatch):
            items.extend(_batch_items(item))
        else:
            items.append(dict(item))
    for batch in tool_batches(request.history):
        items.extend(_batch_items(batch))
    if request.prefill:
        items.append({"role": "assistant", "content": request.prefill})
    return items


def _batch_items(batch: ToolBatch) -> list[dict[str, Any]]:
    """One answered batch: the pre-tool text, each call (after its reasoning items), then a
    ``function_call_output`` per call, in order."""
    calls = [(history_call_id(entry, index), entry) for index, entry in batch.numbered()]
    items: list[dict[str, Any]] = []
    if batch.pre_tool_text:
        items.append({"role": "assistant", "content": batch.pre_tool_text})
    for call_id, entry in calls:
        items.extend(_reasoning_items(entry))
        items.append(
            {
                "type": "function_call",
                "call_id": call_id,
                "name": entry.call.name,
                "arguments": dump_json(dict(entry.call.arguments)),
            }
        )
    items.extend(
        {
            "type": "function_call_output",
            "call_id": call_id,
            "output": tool_response_json(entry.response),
        }
        for call_id, entry in calls
    )
    return items


def _reasoning_items(entry: ToolHistoryEntry) -> list[dict[str, Any]]:
    """The reasoning items the call travels with: those the model emitted just before it
    (the decoder puts them on the call they preceded, in a batch the first)."""
    reasoning = (entry.call.provider_data or {}).get("reasoning")
    if not isinstance(reasoning, Sequence) or isinstance(reasoning, str):
        return []
    return [dict(item) for item in reasoning if isinstance(item, Mapping)]


def build_responses_body(
    request: ProviderRequest, model: str, extra_body: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "input": build_responses_input(request),
        "stream": True,
    }
    if request.tools:
        body["tools"] = [responses_tool(tool) for tool in request.tools]
        if request.tools_withdrawn:
            # the final answer pass: the tools stay declared for the calls in the input
            body["tool_choice"] = "none"
        elif not request.parallel_tool_calls:
            body["parallel_tool_calls"] = False
    if request.max_output is not None:
        body["max_output_tokens"] = request.max_output
    if extra_body:
        body.update(extra_body)
    return body


# --------------------------------------------------------------------------- stream side
class _OpenCall:
    __slots__ = ("arguments", "call_id", "name", "parts")

    def __init__(self, name: str, call_id: str | None) -> None:
        self.name = name
        self.call_id = call_id
        self.parts: list[str] = []
        self.arguments: str | None = None  # the full text, once the server sent it


class ResponsesStreamDecoder(PassDecoder):
    """Responses API SSE events → chunk events (sans-IO); see the module docstring."""

    __slots__ = (
        "_calls_made",
        "_open",
        "_provider",
        "_reasoning",
        "_secrets",
    )

    def __init__(self, *, provider: str, secrets: Sequence[str | None] = ()) -> None:
        super().__init__()
        self._provider = provider
        self._secrets = tuple(secrets)
        self._open: dict[str, _OpenCall] = {}
        self._reasoning: list[dict[str, Any]] = []
        self._calls_made = 0

    @property
    def ended(self) -> bool:
        """A terminal event arrived."""
        return self._done

    def event(self, name: str, data: str, out: list[Chunk]) -> None:
        if self._done:
            return  # nothing after the terminal event belongs to this pass
        payload = decode_json_object(
            data, what=f"{self._provider}: stream event", secrets=self._secrets
        )
        named = payload.get("response")
        if isinstance(named, dict):  # response.created and the terminal events name it
            self.response.take(named.get("model"), named.get("id"))
        kind = payload.get("type") or name
        if name == "error" and kind == "response.failed":
            kind = "error"  # an event named error carries its error itself, whatever its type
        read = self._READERS.get(kind) if isinstance(kind, str) else None
        if read is not None:
            read(self, payload, out)
        elif name == "error":
            self._error(payload, out)

    def _text_delta(self, payload: dict[str, Any], out: list[Chunk]) -> None:
        """Output text, or a refusal's: both are the reply's text."""
        delta = payload.get("delta")
        if delta and isinstance(delta, str):
            out.append(TextDelta(delta))

    def _reasoning_delta(self, payload: dict[str, Any], out: list[Chunk]) -> None:
        delta = payload.get("delta")
        if delta and isinstance(delta, str):
            out.append(ThoughtDelta(delta))

    def _arguments_delta(self, payload: dict[str, Any], out: list[Chunk]) -> None:
        call = self._open.get(str(payload.get("item_id")))
        delta = payload.get("delta")
        if call is not None and isinstance(delta, str):
            call.parts.append(delta)

    def _arguments_done(self, payload: dict[str, Any], out: list[Chunk]) -> None:
        """The call's full arguments text, which wins over the deltas."""
        call = self._open.get(str(payload.get("item_id")))
        arguments = payload.get("arguments")
        if call is not None and isinstance(arguments, str):
            call.arguments = arguments

    def _completed(self, payload: dict[str, Any], out: list[Chunk]) -> None:
        self._terminal(payload.get("response"), out, cut=False)
        out.append(
            FinishReason(
                FinishKind.TOOL_CALLS if self._calls_made else FinishKind.STOP, "completed"
            )
        )

    def _incomplete(self, payload: dict[str, Any], out: list[Chunk]) -> None:
        """Cut off: the calls still open go out as cut, then the finish its reason names."""
        response = payload.get("response")
        self._terminal(response, out, cut=True)
        reason = None
        if isinstance(response, dict) and isinstance(response.get("incomplete_details"), dict):
            reason = response["incomplete_details"].get("reason")
        out.append(
            FinishReason(
                _INCOMPLETE_KINDS.get(str(reason), FinishKind.OTHER),
                str(reason) if reason else "incomplete",
            )
        )

    def _error(self, payload: dict[str, Any], out: list[Chunk]) -> None:
        raise error_from_payload(payload, provider=self._provider, secrets=self._secrets)

    def _failed(self, payload: dict[str, Any], out: list[Chunk]) -> None:
        response = payload.get("response")
        error = response.get("error") if isinstance(response, dict) else None
        raise error_from_payload(
            {"error": error or {"message": "response failed"}},
            provider=self._provider,
            secrets=self._secrets,
        )

    def _item_added(self, payload: dict[str, Any], out: list[Chunk]) -> None:
        """A function call opens (other items are read when they are done)."""
        item = payload.get("item")
        if not isinstance(item, dict) or item.get("type") != "function_call":
            return
        call_id = item.get("call_id") or None
        call = _OpenCall(str(item.get("name") or ""), str(call_id) if call_id else None)
        arguments = item.get("arguments")
        if isinstance(arguments, str) and arguments:
            call.parts.append(arguments)
        self._open[str(item.get("id"))] = call

    def _item_done(self, payload: dict[str, Any], out: list[Chunk]) -> None:
        """A reasoning item is kept for the next call; a function call goes out."""
        item = payload.get("item")
        if not isinstance(item, dict):
            return
        if item.get("type") == "reasoning":
            self._reasoning.append(item)
            return
        if item.get("type") != "function_call":
            return
        call = self._open.pop(str(item.get("id")), None)
        if call is None:
            call = _OpenCall(str(item.get("name") or ""), None)
        if isinstance(item.get("arguments"), str):
            call.arguments = item["arguments"]
        call.name = call.name or str(item.get("name") or "")
        call.call_id = call.call_id or (str(item["call_id"]) if item.get("call_id") else None)
        self._emit(call, out, cut=False, item_id=item.get("id"))

    # how each kind of event is read (any other kind is ignored, unless it is named "error")
    _READERS: ClassVar[
        Mapping[str, Callable[[ResponsesStreamDecoder, dict[str, Any], list[Chunk]], None]]
    ] = {
        "response.output_text.delta": _text_delta,
        "response.refusal.delta": _text_delta,
        "response.reasoning_summary_text.delta": _reasoning_delta,
        "response.reasoning_text.delta": _reasoning_delta,
        "response.function_call_arguments.delta": _arguments_delta,
        "response.function_call_arguments.done": _arguments_done,
        "response.output_item.added": _item_added,
        "response.output_item.done": _item_done,
        "response.completed": _completed,
        "response.incomplete": _incomplete,
        "error": _error,
        "response.failed": _failed,
    }

    def _emit(self, call: _OpenCall, out: list[Chunk], *, cut: bool, item_id: Any) -> None:
        text = call.arguments if call.arguments is not None else "".join(call.parts)
        arguments, truncated, parse_error = decode_arguments(text, cut=cut)
        provider_data: dict[str, Any] = {}
        if item_id:
            provider_data["item_id"] = item_id
        if self._reasoning:
            provider_data["reasoning"] = tuple(self._reasoning)
            self._reasoning = []
        out.append(
            FunctionCall(
                name=call.name,
                arguments=arguments,
                call_id=call.call_id,
                truncated=truncated,
                parse_error=parse_error,
                provider_data=provider_data or None,
            )
        )
        self._calls_made += 1

    def _terminal(self, response: Any, out: list[Chunk], *, cut: bool) -> None:
        self._done = True
        for item_id, call in list(self._open.items()):
            self._emit(call, out, cut=cut, item_id=item_id)
        self._open.clear()
        usage = response.get("usage") if isinstance(response, dict) else None
        if isinstance(usage, dict):
            input_tokens = usage.get("input_tokens")
            output_tokens = usage.get("output_tokens")
            if isinstance(input_tokens, int) or isinstance(output_tokens, int):
                out.append(
                    UsageReport(
                        input_tokens=input_tokens if isinstance(input_tokens, int) else 0,
                        output_tokens=output_tokens if isinstance(output_tokens, int) else 0,
                    )
                )

    finish_marker = "a terminal event (response.completed or response.incomplete)"

    @property
    def finished(self) -> bool:
        """A terminal event arrived (the same as `ended`)."""
        return self._done

    def finish(self, out: list[Chunk]) -> None:
        """The body ended after the terminal event, which said everything."""
        del out


# --------------------------------------------------------------------------- the provider
class OpenAIResponsesProvider(OpenAIStyleProvider):
    """Streams passes from an OpenAI Responses endpoint (``{base_url}/responses``).

    ``base_url`` is the API root (``…/v1``; for Azure ``…/openai/v1``). The key travels as a
    bearer header only (Azure-style ``api-key`` headers: pass ``api_key`` and
    ``auth_header="api-key"``) and never appears in ``repr`` or errors.
    """

    path = "responses"
    default_name = "openai-responses"
    decoder_type = ResponsesStreamDecoder

    __slots__ = ()

    def build_body(self, request: ProviderRequest) -> dict[str, Any]:
        return build_responses_body(request, self.model, self.extra_body)


__all__ = [
    "OpenAIResponsesProvider",
    "ResponsesStreamDecoder",
    "build_responses_body",
    "build_responses_input",
    "responses_tool",
]
