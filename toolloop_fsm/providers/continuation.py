"""`ContinuationSession`: one continuous pass from a completion-style model that stops after a
fragment.

Continuation text models (NovelAI-style story models, and any model behind a plain
``/completions`` endpoint) write no tool calls and stop after a bounded fragment. The session
wraps such a provider and owns the continuation, so the loop keeps no continuation state of
its own: to the loop a pass with a session is one stream, ended once.

How a pass runs:

* **Fragments.** The first fragment is the wrapped provider's answer to the loop's request,
  without ``tools``. Its chunks are passed on as they arrive. A fragment whose finish reason is
  ``LENGTH`` (or ``CONTINUATION_PENDING``) was cut: the session asks for the next one with the
  same request, its ``prefill`` being the request's own prefill followed by all the text
  streamed so far, so that the text so far is the tail of the model's prompt and the model
  carries on from its last character. A fragment ending with any other finish reason, or with
  none, is the model ending naturally: that finish reason (if any) ends the pass, unchanged.
* **Endings of a cut pass.** After a cut fragment the pass ends instead of continuing when the
  total output budget is spent (``FinishReason(LENGTH)``), when it was the ``max_fragments``-th
  fragment (``FinishReason(CONTINUATION_PENDING)``: the reply is unfinished, which the loop's
  empty-response rule counts as a cut pass, never as a settled one), or when it streamed no
  text at all (``CONTINUATION_PENDING`` too: the next request would carry the same prompt and
  could only write the same nothing). When the budget and the fragment limit are reached
  together the ending is ``LENGTH``. The finish reason's ``raw`` is the model's own word.
* **The budget.** ``max_total_output`` is counted in output tokens: what the wrapped provider
  reported for a fragment (its last cumulative `UsageReport`, or the sum of incremental ones),
  or, for a fragment without a report, the estimate of the text and thoughts it streamed
  (`toolloop_fsm.result.estimate_tokens`, its weight summed chunk by chunk), marked as
  estimated. Each request asks for at most the budget left (``max_output``), and for at most
  the loop's own ``max_output`` when it has one. A provider that ignores ``max_output``
  overshoots by at most one fragment: the overshoot is counted.
* **Usage.** The wrapped provider's usage reports are not passed on as they are: each is
  turned into the pass's cumulative usage so far — input and output tokens summed over the
  fragments, the current one as far as it was reported — and a fragment that reported nothing
  but streamed something adds its estimate when it ends. Input tokens count only as reported
  (an estimated fragment adds none); ``estimated`` is set once any fragment was estimated. The
  loop keeps a pass's last cumulative report, so its ledger holds exactly the sum of what the
  provider reported plus the marked estimates, also when the pass fails or is stopped after
  some fragments.
* **Tool calls.** The session is for models without tool dispatch, so ``tools`` are never
  sent (wrap the session in `VerbatimToolCalls` for a model that writes calls in its text). A
  `FunctionCall` the wrapped provider yields anyway is passed on unchanged, with the rest of
  its fragment, and no further fragment is requested: the call hands the turn to a tool, and
  the loop's own rules decide what happens to it (allowlist, truncated or malformed
  arguments); continuing the text past it would write the reply before the tool's result.
* **Failures and closing.** A `ProviderError` of any fragment propagates unchanged; the text
  of earlier fragments was already streamed (and delivered), so the loop's rules for a failed
  pass apply to the whole pass. When the loop stops reading (stop, follow-up, deadline) the
  fragment being read is closed at once. The gap between two fragments (the next request's
  first token) is bounded by the loop's inactivity deadline like any other gap in a stream.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from collections.abc import AsyncIterator
from typing import Any

import attrs

from toolloop_fsm.events import Chunk
from toolloop_fsm.events import FinishKind
from toolloop_fsm.events import FinishReason
from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import TextDelta
from toolloop_fsm.events import ThoughtDelta
from toolloop_fsm.events import UsageReport
from toolloop_fsm.provider import Provider
from toolloop_fsm.provider import ProviderRequest
from toolloop_fsm.result import estimate_tokens
from toolloop_fsm.result import token_weight
from toolloop_fsm.result import tokens_of_weight

DEFAULT_MAX_FRAGMENTS = 8
"""How many fragments one pass may request when the caller does not say."""

_CUT_FINISHES = frozenset({FinishKind.LENGTH, FinishKind.CONTINUATION_PENDING})


class _Fragment:
    """What one fragment streamed, as far as the session's decisions need it."""

    __slots__ = ("called", "finish", "text", "text_characters", "usage", "weight")

    def __init__(self) -> None:
        self.weight = 0  # the token weight of the text and thoughts streamed
        self.text_characters = 0
        self.text: list[str] = []
        self.usage: UsageReport | None = None
        self.finish: FinishReason | None = None
        self.called = False

    def read(self, chunk: Chunk, before: UsageReport) -> Chunk | None:
        """Note what ``chunk`` tells of the fragment; what the pass streams in its place: the
        pass's usage so far for a usage report, nothing for a finish (the session decides
        on that once the fragment ends), else the chunk itself."""
        if isinstance(chunk, TextDelta):
            self.weight += token_weight(chunk.text)
            self.text_characters += len(chunk.text)
            self.text.append(chunk.text)
        elif isinstance(chunk, ThoughtDelta):
            self.weight += token_weight(chunk.text)
        elif isinstance(chunk, UsageReport):
            self.take_usage(chunk)
            return self.pass_usage(before)
        elif isinstance(chunk, FinishReason):
            self.finish = chunk
            return None
        elif isinstance(chunk, FunctionCall):
            self.called = True
        return chunk

    def take_usage(self, report: UsageReport) -> None:
        previous = self.usage
        if report.cumulative or previous is None:
            self.usage = report
        else:
            self.usage = UsageReport(
                previous.input_tokens + report.input_tokens,
                previous.output_tokens + report.output_tokens,
                estimated=previous.estimated or report.estimated,
            )

    def estimate_usage(self) -> None:
        """No report came: the fragment's output estimated from what it streamed."""
        self.usage = UsageReport(0, tokens_of_weight(self.weight), estimated=True)

    def pass_usage(self, before: UsageReport) -> UsageReport:
        """The pass's cumulative usage: ``before`` plus this fragment's usage so far."""
        usage = self.usage
        if usage is None:
            return before
        return UsageReport(
            before.input_tokens + usage.input_tokens,
            before.output_tokens + usage.output_tokens,
            estimated=before.estimated or usage.estimated,
        )


class ContinuationSession:
    """A provider that continues a completion-style model's cut fragments into one pass.

    ``max_total_output`` is the pass's total output budget in tokens; ``max_fragments`` how
    many requests one pass may make. The session is continuation-style: text it streamed
    cannot be retracted, which the loop's continuation rules take into account. See the
    module docstring for the rules.
    """

    continuation_style = True

    __slots__ = ("max_fragments", "max_total_output", "name", "provider")

    def __init__(
        self,
        provider: Provider,
        *,
        max_total_output: int,
        max_fragments: int = DEFAULT_MAX_FRAGMENTS,
    ) -> None:
        for field_name, value in (
            ("max_total_output", max_total_output),
            ("max_fragments", max_fragments),
        ):
            if type(value) is not int or value < 1:
                raise ValueError(f"{field_name} must be an integer of at least 1, got {value!r}")
        self.provider = provider
        self.name = provider.name
        self.max_total_output = max_total_output
        self.max_fragments = max_fragments

    def __repr__(self) -> str:
        return (
            f"ContinuationSession({self.provider!r}, max_total_output={self.max_total_output}, "
            f"max_fragments={self.max_fragments})"
        )

    def fragment_request(self, request: ProviderRequest, text: str, spent: int) -> ProviderRequest:
        """The request for the next fragment after ``text`` was streamed and ``spent`` output
        tokens used: no tools, the text so far after the prefill, at most the budget left."""
        left = self.max_total_output - spent
        cap = left if request.max_output is None else min(request.max_output, left)
        prefill = (request.prefill or "") + text
        return attrs.evolve(request, tools=(), prefill=prefill or None, max_output=cap)

    async def stream(self, request: ProviderRequest) -> AsyncGenerator[Chunk, None]:
        text: list[str] = []
        before = UsageReport(0, 0)  # the pass's usage before the current fragment
        fragments = 0
        while True:
            fragments += 1
            fragment = _Fragment()
            chunks = self.provider.stream(
                self.fragment_request(request, "".join(text), before.output_tokens)
            )
            try:
                async for chunk in chunks:
                    streamed = fragment.read(chunk, before)
                    if streamed is not None:
                        yield streamed
            finally:
                await _close(chunks)
            text += fragment.text

            if fragment.usage is None and fragment.weight:
                fragment.estimate_usage()
                yield fragment.pass_usage(before)
            if fragment.usage is not None:
                before = fragment.pass_usage(before)

            ends, finish = self._ending(fragment, before, fragments)
            if finish is not None:
                yield finish
            if ends:
                return

    def _ending(
        self, fragment: _Fragment, before: UsageReport, fragments: int
    ) -> tuple[bool, FinishReason | None]:
        """Whether the pass ends after its ``fragments``-th fragment (``before``: the pass's
        usage by then), and the finish it ends with: the fragment's own, unless a cut one
        asks for the next fragment; then the budget spent ends it (``length``), and so do the
        last fragment allowed and a cut fragment without text (``continuation_pending``)."""
        finish = fragment.finish
        if fragment.called or finish is None or finish.kind not in _CUT_FINISHES:
            return True, finish
        if before.output_tokens >= self.max_total_output:
            return True, FinishReason(FinishKind.LENGTH, finish.raw)
        if fragments >= self.max_fragments or not fragment.text_characters:
            return True, FinishReason(FinishKind.CONTINUATION_PENDING, finish.raw)
        return False, None


async def _close(chunks: AsyncIterator[Any]) -> None:
    """Close a fragment's stream (its HTTP response) now rather than when it is collected."""
    close = getattr(chunks, "aclose", None)
    if close is not None:
        await close()


__all__ = ["DEFAULT_MAX_FRAGMENTS", "ContinuationSession", "estimate_tokens"]
