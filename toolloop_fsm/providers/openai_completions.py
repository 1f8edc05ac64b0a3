"""OpenAI-compatible text completions: `OpenAICompletionsProvider` and the pieces it is made of.

Owns, for ``POST {base_url}/completions`` with ``"stream": true`` — the completions endpoint
that llama.cpp's server, vLLM, LM Studio and most local servers speak for completion-style
models, and OpenAI for its instruct models:

* `render_transcript` — the default way a provider-neutral context becomes a prompt;
* `build_completion_body` — a `ProviderRequest` as a request body;
* `CompletionStreamDecoder` — sans-IO, from SSE events to chunk events;
* `OpenAICompletionsProvider` — the adapter, an `OpenAIStyleProvider` like the chat adapter
  (the key only in a header, a shared client, the SSE loop, errors classified and redacted
  the same way).

Decisions:

* **The prompt is the rendered context followed by the prefill, with nothing between.** The
  prefill is text the model already wrote after that very prompt, so the model carries on from
  its last character; this is how `ContinuationSession` asks for the next fragment.
* **A completion model has no chat format**, so the context is rendered by a callable,
  ``render_prompt``. The default, `render_transcript`, writes each message as
  ``Role: content`` with a blank line between messages and ends with ``Assistant:``, the cue
  for the reply; a host whose model expects a template of its own (or bare story text) passes
  its own renderer.
* **No tool calling.** ``tools`` are never sent (the endpoint has no such field); tool history
  is rendered as plain messages, the same rendering every model without native tool calling
  gets (`as_verbatim_request`). Wrap the provider in `VerbatimToolCalls` to let the model write
  its calls in text.
* **A context the prompt cannot show is a bad request.** A message without a role, or content
  that is neither text nor a list of text parts (an image, say), fails the pass with a
  `ProviderError` of kind ``bad_request``, not retryable, naming the message — before anything
  is sent. A custom renderer reports such a context the same way by raising `ValueError`;
  its message is redacted of the key like any other text that leaves an adapter.
* **The stream** is read exactly as the chat adapter reads its own (`ChatStreamDecoder`): only
  choice 0 counts, usage comes from any chunk, a finish reason repeated on later chunks is
  reported once, in-stream errors and non-JSON lines raise, and a stream that ends without
  a finish (``[DONE]`` alone included) is a retryable ``protocol`` error. Only the text
  differs: it is ``choices[0].text``, not a delta. ``stop`` finishes ``STOP``, ``length``
  ``LENGTH``.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import Unpack

from toolloop_fsm.events import Chunk
from toolloop_fsm.events import FinishKind
from toolloop_fsm.events import FinishReason
from toolloop_fsm.events import TextDelta
from toolloop_fsm.provider import ProviderError
from toolloop_fsm.provider import ProviderRequest
from toolloop_fsm.providers.openai_compat import FINISH_KINDS
from toolloop_fsm.providers.openai_compat import ChatStreamDecoder
from toolloop_fsm.providers.openai_compat import OpenAIStyleOptions
from toolloop_fsm.providers.openai_compat import OpenAIStyleProvider
from toolloop_fsm.providers.verbatim import as_verbatim_request

PromptRenderer = Callable[[Sequence[Mapping[str, Any]]], str]
"""Renders the provider-neutral context messages as the head of a completion prompt; raises
`ValueError` for a context it cannot show."""

REPLY_CUE = "Assistant:"
"""What `render_transcript` ends with: the model's reply (and any prefill) follows it."""


# --------------------------------------------------------------------------- request side
def message_text(message: Mapping[str, Any], position: int) -> str:
    """A context message's content as prompt text: a string, or a list of text parts."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        pieces: list[str] = []
        for part in content:
            if isinstance(part, str):
                pieces.append(part)
            elif (
                isinstance(part, Mapping)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                pieces.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(
                    f"context message {position} has a {kind!r} part, which a text prompt "
                    "cannot show"
                )
        return "".join(pieces)
    raise ValueError(
        f"context message {position} has content of type {type(content).__name__}, which a "
        "text prompt cannot show"
    )


def render_transcript(messages: Sequence[Mapping[str, Any]]) -> str:
    """The default prompt: each message as ``Role: content`` (the role capitalised), a blank
    line between messages, and `REPLY_CUE` last."""
    blocks: list[str] = []
    for position, message in enumerate(messages):
        role = message.get("role")
        if not isinstance(role, str) or not role.strip():
            raise ValueError(f"context message {position} has no role")
        blocks.append(f"{role.strip().capitalize()}: {message_text(message, position)}")
    blocks.append(REPLY_CUE)
    return "\n\n".join(blocks)


def build_completion_body(
    request: ProviderRequest,
    model: str,
    render_prompt: PromptRenderer = render_transcript,
    extra_body: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The request body: the rendered context and the prefill as ``prompt``, streamed with
    usage, ``max_tokens`` from ``max_output``; ``extra_body`` merged last."""
    plain = as_verbatim_request(request)
    body: dict[str, Any] = {
        "model": model,
        "prompt": render_prompt(plain.context) + (plain.prefill or ""),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if plain.max_output is not None:
        body["max_tokens"] = plain.max_output
    if extra_body:
        body.update(extra_body)
    return body


# --------------------------------------------------------------------------- stream side
class CompletionStreamDecoder(ChatStreamDecoder):
    """Completions SSE events → chunk events (sans-IO): the chat decoder's framing, errors,
    usage and endings, with each choice's text in ``text`` instead of a ``delta``."""

    __slots__ = ()

    def _choice(self, choice: dict[str, Any], out: list[Chunk]) -> None:
        text = choice.get("text")
        if text and isinstance(text, str):
            self._text_seen = True
            out.append(TextDelta(text))
        finish = choice.get("finish_reason")
        if finish and self._finish is None:
            self._finish = str(finish)
            out.append(FinishReason(FINISH_KINDS.get(self._finish, FinishKind.OTHER), self._finish))


# --------------------------------------------------------------------------- the provider
class OpenAICompletionsProvider(OpenAIStyleProvider):
    """Streams passes from an OpenAI-compatible ``/completions`` endpoint.

    ``base_url`` is the API root (``…/v1``); ``render_prompt`` turns the context into the
    prompt's head (default `render_transcript`); ``extra_body`` is merged into every request
    body (e.g. ``{"temperature": 0.8, "stop": ["\\nUser:"]}``). Wrap it in `ContinuationSession`
    to continue fragments cut by ``max_tokens`` into one pass.
    """

    path = "completions"
    default_name = "openai-completions"
    operation_name = "text_completion"
    decoder_type = CompletionStreamDecoder

    __slots__ = ("render_prompt",)

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        render_prompt: PromptRenderer = render_transcript,
        **options: Unpack[OpenAIStyleOptions],
    ) -> None:
        self.render_prompt = render_prompt
        super().__init__(base_url, model, **options)

    def build_body(self, request: ProviderRequest) -> dict[str, Any]:
        try:
            return build_completion_body(request, self.model, self.render_prompt, self.extra_body)
        except ValueError as error:
            raise ProviderError(
                f"{self.name}: the context cannot be written as a completion prompt: {error}",
                kind="bad_request",
                retryable=False,
            ) from error


__all__ = [
    "REPLY_CUE",
    "CompletionStreamDecoder",
    "OpenAICompletionsProvider",
    "PromptRenderer",
    "build_completion_body",
    "message_text",
    "render_transcript",
]
