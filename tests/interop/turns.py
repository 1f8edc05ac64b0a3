"""What the interop tests share: the adapters each server speaks, a tool that records its
runs, and turns run on the real clock (no bound on how long they take: a loaded machine is
slow, not wrong; pytest's ``faulthandler_timeout`` catches a hang)."""

from __future__ import annotations

import json
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

from attrs import frozen

from toolloop_fsm import Attempt
from toolloop_fsm import GenerationTurnResult
from toolloop_fsm import LoopPolicy
from toolloop_fsm import Tool
from toolloop_fsm import ToolContext
from toolloop_fsm import ToolResult
from toolloop_fsm import TurnPolicy
from toolloop_fsm import TurnRequest
from toolloop_fsm import run_generation_turn
from toolloop_fsm import run_tool_loop
from toolloop_fsm.attempts import KeyHealth
from toolloop_fsm.host import LoopClock
from toolloop_fsm.provider import Provider
from toolloop_fsm.providers import AnthropicProvider
from toolloop_fsm.providers import GeminiProvider
from toolloop_fsm.providers import OpenAICompatibleProvider
from toolloop_fsm.providers import OpenAIResponsesProvider
from toolloop_fsm.testing import RecordingChannel

QUESTION = TurnRequest([{"role": "user", "content": "What's the weather in Paris?"}])

#: Generous budgets: a real server on a busy two-core machine, and no test waits on them
#: unless it is about a stall.
POLICY = LoopPolicy(first_token_timeout=30, inactivity_timeout=30)

WEATHER: dict[str, Any] = {
    "city": "Paris",
    "sky": "clear",
    "temp_c": 21,
    "marker": "tool-result-7f3a",
}
"""What the tool answers; ``marker`` lets a test find the result in a request body."""


@frozen
class Adapter:
    """One of this project's adapters pointed at one server's endpoint for it."""

    name: str
    path: str
    model: str
    build: Callable[..., Provider]

    def provider(self, root: str, key: str | None, **options: Any) -> Provider:
        return self.build(f"{root}{self.path}", self.model, api_key=key, **options)

    def factory(self, root: str, **options: Any) -> Callable[[str | None], Provider]:
        return lambda key: self.provider(root, key, **options)


class WeatherTool:
    """``get_weather``: answers `WEATHER` and records the arguments of every run."""

    def __init__(self) -> None:
        self.runs: list[dict[str, Any]] = []

    async def __call__(self, arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        self.runs.append(dict(arguments))
        return ToolResult(data=WEATHER)

    @property
    def tools(self) -> list[Tool]:
        parameters = {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        }
        return [Tool("get_weather", "Current weather for a city", parameters, self)]


async def loop_turn(
    provider: Provider,
    tools: Sequence[Tool] = (),
    *,
    policy: LoopPolicy = POLICY,
    channel: RecordingChannel | None = None,
) -> GenerationTurnResult:
    """One `run_tool_loop` turn on the real clock."""
    return await run_tool_loop(
        provider,
        list(tools),
        channel or RecordingChannel(),
        QUESTION,
        policy=policy,
        clock=LoopClock(),
    )


async def generation_turn(
    attempts: Sequence[Attempt],
    tools: Sequence[Tool] = (),
    *,
    policy: LoopPolicy = POLICY,
    key_book: dict[tuple[str, int], KeyHealth] | None = None,
    channel: RecordingChannel | None = None,
) -> GenerationTurnResult:
    """One `run_generation_turn` turn on the real clock."""
    return await run_generation_turn(
        list(attempts),
        list(tools),
        channel or RecordingChannel(),
        QUESTION,
        policy=TurnPolicy(loop=policy),
        clock=LoopClock(),
        key_book=key_book if key_book is not None else {},
    )


def body_text(request: dict[str, Any]) -> str:
    """A served request's body as JSON text, to look for what the client sent."""
    return json.dumps(request.get("body"), ensure_ascii=False)


ANTHROPIC = "anthropic"
GEMINI = "gemini"
OPENAI_CHAT = "openai-chat"
OPENAI_RESPONSES = "openai-responses"

LLMOCK_ADAPTERS = (
    Adapter(OPENAI_CHAT, "/v1", "gpt-4o", OpenAICompatibleProvider),
    Adapter(OPENAI_RESPONSES, "/v1", "gpt-4o", OpenAIResponsesProvider),
    Adapter(ANTHROPIC, "/anthropic/v1", "claude-sonnet-4-6", AnthropicProvider),
    Adapter(GEMINI, "/gemini/v1beta", "gemini-2.0-flash", GeminiProvider),
)
"""Every adapter LLMock speaks, at the paths it serves them."""
