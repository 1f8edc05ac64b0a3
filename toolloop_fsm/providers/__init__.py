"""Provider adapters: the `Provider` protocol and the streams of real APIs as chunk events."""

from toolloop_fsm.providers.base import Provider, ProviderError, ProviderRequest, ToolSpec

__all__ = ["Provider", "ProviderError", "ProviderRequest", "ToolSpec"]

# Native adapters for Anthropic Messages, Gemini streamGenerateContent and Ollama /api/chat.
from toolloop_fsm.providers.anthropic import AnthropicProvider
from toolloop_fsm.providers.gemini import GeminiProvider
from toolloop_fsm.providers.ollama import OllamaProvider

# OpenAI Chat Completions (and compatible servers) and the OpenAI Responses API.
from toolloop_fsm.providers.openai_compat import OpenAICompatibleProvider
from toolloop_fsm.providers.openai_responses import OpenAIResponsesProvider

# Tool calls written in the text, for models without native tool calling (SPEC §5).
from toolloop_fsm.providers.verbatim import VerbatimToolCalls

__all__ += ["AnthropicProvider", "GeminiProvider", "OllamaProvider"]

__all__ += ["VerbatimToolCalls"]

__all__ += ["OpenAICompatibleProvider", "OpenAIResponsesProvider"]
