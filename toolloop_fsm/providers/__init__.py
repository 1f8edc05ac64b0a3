"""Provider adapters: the `Provider` protocol and the streams of real APIs as chunk events."""

from toolloop_fsm.providers.base import Provider, ProviderError, ProviderRequest, ToolSpec

__all__ = ["Provider", "ProviderError", "ProviderRequest", "ToolSpec"]
