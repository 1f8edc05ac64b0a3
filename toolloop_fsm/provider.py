"""The provider contract: what a pass asks for (`ProviderRequest`, with the tools as
`ToolSpec`), what a provider streams back (chunk events), and how it fails (`ProviderError`,
whose wait hint `bounded_retry_after` keeps usable).

Values only, like the rest of the value layer: the machines build requests with it, and the
adapters in `toolloop_fsm.providers` implement it; it imports neither them nor any I/O.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from collections.abc import Mapping
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any
from typing import Protocol
from typing import runtime_checkable

from attrs import field
from attrs import frozen

from toolloop_fsm.events import Chunk

if TYPE_CHECKING:
    from toolloop_fsm.result import ToolHistoryEntry


@frozen
class ToolSpec:
    """A tool as exposed to a provider: name, description, JSON-schema parameters."""

    name: str
    description: str
    parameters: Mapping[str, Any] = field(factory=dict)


@frozen
class ProviderRequest:
    """Everything one provider pass needs.

    ``context`` is the provider-neutral message list (``{"role": …, "content": …}``);
    ``history`` the tool calls made so far this turn with their responses; ``prefill`` text
    the assistant already said that the provider must continue rather than repeat.
    ``disabled_enrichment_kinds`` are the enrichment kinds a context restart already used
    this turn: the host's context preparation skips them. ``max_response_bytes`` bounds the
    response body an HTTP adapter reads for the pass: past it the pass fails with a
    `ProviderError` of kind ``too_large`` (`ModelReviewer` sets it; a turn's passes do not).
    """

    context: Sequence[Mapping[str, Any]]
    tools: Sequence[ToolSpec] = ()
    history: Sequence[ToolHistoryEntry] = ()
    prefill: str | None = None
    max_output: int | None = None
    disabled_enrichment_kinds: frozenset[str] = frozenset()
    max_response_bytes: int | None = None
    #: ``False`` asks the provider for at most one tool call per response, where its API
    #: has the option (OpenAI's ``parallel_tool_calls``, Anthropic's
    #: ``disable_parallel_tool_use``); a provider that batches anyway has every call run
    parallel_tool_calls: bool = True
    #: the final answer pass (docs/behaviour.md §3.12): the tools stay declared (a history
    #: holding calls needs them, for Anthropic) but the model is asked to call none — each
    #: adapter says so in its API's words (``tool_choice: "none"``, ``mode: "NONE"``)
    tools_withdrawn: bool = False


MAX_RETRY_AFTER = 24 * 60 * 60.0
"""The longest wait hint taken from a provider, in seconds (a day)."""


def bounded_retry_after(seconds: float | None) -> float | None:
    """A provider's wait hint as a usable number of seconds in ``[0, MAX_RETRY_AFTER]``.

    A server can send anything in ``Retry-After``; the hint decides how long a key cools down
    and is written to JSON results, where NaN and infinity are not valid. So NaN counts as no
    hint at all (``None``: it says nothing), a negative wait as none (``0``), and anything
    longer than a day — ``inf`` included — as a day. ``None`` stays ``None``; a value that is
    not a number raises `TypeError` naming ``retry_after``.
    """
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise TypeError(f"retry_after must be a number of seconds or None, got {seconds!r}")
    if isinstance(seconds, int):
        return float(min(max(seconds, 0), MAX_RETRY_AFTER))  # ints beyond float range too
    if math.isnan(seconds):
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER)


class ProviderError(Exception):
    """A provider's stream failed.

    ``kind`` is one of ``rate_limit``, ``auth``, ``server``, ``connection``, ``bad_request``,
    ``not_found``, ``protocol``, ``provider_error``; ``retryable`` says whether another attempt
    (another key or model) may succeed; ``retry_after`` is the provider's hint in seconds,
    always `bounded_retry_after` (on construction and on assignment): never NaN, infinite,
    negative or longer than a day.
    """

    def __init__(
        self,
        message: str,
        *,
        kind: str,
        retryable: bool,
        status_code: int | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.retryable = retryable
        self.status_code = status_code
        self.retry_after = retry_after

    @property
    def retry_after(self) -> float | None:
        return self._retry_after

    @retry_after.setter
    def retry_after(self, seconds: float | None) -> None:
        self._retry_after = bounded_retry_after(seconds)

    def __repr__(self) -> str:
        return (
            f"ProviderError({self.message!r}, kind={self.kind!r}, retryable={self.retryable!r}, "
            f"status_code={self.status_code!r}, retry_after={self.retry_after!r})"
        )


@runtime_checkable
class Provider(Protocol):
    """Anything that can stream one pass. ``stream`` raises `ProviderError` on failure."""

    name: str

    def stream(self, request: ProviderRequest) -> AsyncIterator[Chunk]: ...


__all__ = [
    "MAX_RETRY_AFTER",
    "Provider",
    "ProviderError",
    "ProviderRequest",
    "ToolSpec",
    "bounded_retry_after",
]
