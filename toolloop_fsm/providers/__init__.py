"""Provider adapters: the streams of real APIs as chunk events.

Each adapter implements the provider contract (`toolloop_fsm.provider`), re-exported here
beside them. The adapters load on first use, so importing this package never pulls in httpx.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING
from typing import Any

from toolloop_fsm.provider import Provider
from toolloop_fsm.provider import ProviderError
from toolloop_fsm.provider import ProviderRequest
from toolloop_fsm.provider import ToolSpec

if TYPE_CHECKING:
    from toolloop_fsm.providers.anthropic import AnthropicProvider
    from toolloop_fsm.providers.continuation import ContinuationSession
    from toolloop_fsm.providers.gemini import GeminiProvider
    from toolloop_fsm.providers.ollama import OllamaProvider
    from toolloop_fsm.providers.openai_compat import OpenAICompatibleProvider
    from toolloop_fsm.providers.openai_completions import OpenAICompletionsProvider
    from toolloop_fsm.providers.openai_responses import OpenAIResponsesProvider
    from toolloop_fsm.providers.verbatim import VerbatimToolCalls

_ADAPTERS = {
    "AnthropicProvider": "anthropic",
    "ContinuationSession": "continuation",
    "GeminiProvider": "gemini",
    "OllamaProvider": "ollama",
    "OpenAICompatibleProvider": "openai_compat",
    "OpenAICompletionsProvider": "openai_completions",
    "OpenAIResponsesProvider": "openai_responses",
    "VerbatimToolCalls": "verbatim",
}

__all__ = [
    "AnthropicProvider",
    "ContinuationSession",
    "GeminiProvider",
    "OllamaProvider",
    "OpenAICompatibleProvider",
    "OpenAICompletionsProvider",
    "OpenAIResponsesProvider",
    "Provider",
    "ProviderError",
    "ProviderRequest",
    "ToolSpec",
    "VerbatimToolCalls",
]


def __getattr__(name: str) -> Any:
    module = _ADAPTERS.get(name)
    if module is None:
        raise AttributeError(f"module 'toolloop_fsm.providers' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"toolloop_fsm.providers.{module}"), name)
    globals()[name] = value
    return value
