"""The provider contract: what a pass asks for (`ProviderRequest`), what a provider streams
back (chunk events), and how it fails (`ProviderError`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from attrs import field, frozen

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
    this turn: the host's context preparation skips them.
    """

    context: Sequence[Mapping[str, Any]]
    tools: Sequence[ToolSpec] = ()
    history: Sequence[ToolHistoryEntry] = ()
    prefill: str | None = None
    max_output: int | None = None
    disabled_enrichment_kinds: frozenset[str] = frozenset()


class ProviderError(Exception):
    """A provider's stream failed.

    ``kind`` is one of ``rate_limit``, ``auth``, ``server``, ``connection``, ``bad_request``,
    ``not_found``, ``protocol``, ``provider_error``; ``retryable`` says whether another attempt
    (another key or model) may succeed; ``retry_after`` is the provider's hint in seconds.
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


__all__ = ["Provider", "ProviderError", "ProviderRequest", "ToolSpec"]
