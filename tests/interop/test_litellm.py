"""The adapters LiteLLM's proxy speaks (OpenAI chat, Anthropic messages, the Responses API)
against a real proxy process: its mocked models (a text reply, a rate limit, a server error)
and, for what its mocks cannot stream (tool calls, Anthropic and Responses replies), a model
it routes to LLMock — so the proxy's own translation between the formats is what is tested.
"""

from __future__ import annotations

import attrs
import pytest

from tests.interop.conftest import MOCK_RATE_LIMITED_MODEL
from tests.interop.conftest import MOCK_SERVER_ERROR_MODEL
from tests.interop.conftest import MOCK_TEXT
from tests.interop.conftest import MOCK_TEXT_MODEL
from tests.interop.conftest import PROXY_KEY
from tests.interop.conftest import UPSTREAM_MODEL
from tests.interop.conftest import LiteLLMProxy
from tests.interop.servers import LLMockControl
from tests.interop.turns import ANTHROPIC
from tests.interop.turns import OPENAI_CHAT
from tests.interop.turns import OPENAI_RESPONSES
from tests.interop.turns import POLICY
from tests.interop.turns import WEATHER
from tests.interop.turns import Adapter
from tests.interop.turns import WeatherTool
from tests.interop.turns import body_text
from tests.interop.turns import generation_turn
from tests.interop.turns import loop_turn
from toolloop_fsm import Attempt
from toolloop_fsm import TurnStatus
from toolloop_fsm import result_to_json
from toolloop_fsm.providers import AnthropicProvider
from toolloop_fsm.providers import OpenAICompatibleProvider
from toolloop_fsm.providers import OpenAIResponsesProvider

pytestmark = pytest.mark.interop

# every endpoint sits under the proxy's /v1; the model is chosen per test
PROXY_ADAPTERS = (
    Adapter(OPENAI_CHAT, "/v1", UPSTREAM_MODEL, OpenAICompatibleProvider),
    Adapter(ANTHROPIC, "/v1", UPSTREAM_MODEL, AnthropicProvider),
    Adapter(OPENAI_RESPONSES, "/v1", UPSTREAM_MODEL, OpenAIResponsesProvider),
)
endpoints = pytest.mark.parametrize("adapter", PROXY_ADAPTERS, ids=lambda a: a.name)

REPLY = "Clear skies over Paris, twenty-one degrees."


def on(adapter: Adapter, model: str) -> Adapter:
    return attrs.evolve(adapter, model=model)


# --------------------------------------------------------------------------- mocked models
async def test_a_mocked_reply_streams_to_the_user_over_chat_completions(
    litellm_proxy: LiteLLMProxy,
) -> None:
    adapter = on(PROXY_ADAPTERS[0], MOCK_TEXT_MODEL)

    result = await loop_turn(adapter.provider(litellm_proxy.url, PROXY_KEY))

    assert (result.status, result.final_text) == (TurnStatus.COMPLETED, MOCK_TEXT)
    [entry] = result.usage.entries
    assert entry.output_tokens > 0 and not entry.estimated


async def test_a_mocked_model_answering_anthropic_messages_with_a_document_is_a_named_failure(
    litellm_proxy: LiteLLMProxy,
) -> None:
    # LiteLLM's mock answers /v1/messages with one JSON message even when asked to stream:
    # the adapter says so instead of taking the body apart as a stream
    adapter = on(PROXY_ADAPTERS[1], MOCK_TEXT_MODEL)

    result = await loop_turn(adapter.provider(litellm_proxy.url, PROXY_KEY))

    assert (result.status, result.provider_error_kind) == (TurnStatus.ERROR, "protocol")
    assert result.error_message is not None
    assert "document instead of a stream" in result.error_message
    assert MOCK_TEXT in result.error_message  # the body is quoted, so the cause is visible


@endpoints
async def test_a_mocked_rate_limit_falls_back_to_the_next_model_and_the_user_reads_its_reply(
    litellm_proxy: LiteLLMProxy, llmock: LLMockControl, adapter: Adapter
) -> None:
    await llmock.script({"type": "reply", "text": REPLY})
    chain = [
        Attempt(
            on(adapter, MOCK_RATE_LIMITED_MODEL).factory(litellm_proxy.url),
            keys=(PROXY_KEY,),
            label="limited",
        ),
        Attempt(adapter.factory(litellm_proxy.url), keys=(PROXY_KEY,), label="upstream"),
    ]

    result = await generation_turn(chain)

    assert (result.status, result.final_text) == (TurnStatus.COMPLETED, REPLY)
    # the Responses bridge turns every mocked failure into a 500 before the stream starts
    expected = "server" if adapter.name == OPENAI_RESPONSES else "rate_limit"
    assert [(f.label, f.kind) for f in result.attempt_failures] == [("limited", expected)]
    assert PROXY_KEY not in result_to_json(result)


@endpoints
async def test_a_mocked_server_error_is_retryable_and_the_next_model_answers(
    litellm_proxy: LiteLLMProxy, llmock: LLMockControl, adapter: Adapter
) -> None:
    await llmock.script({"type": "reply", "text": REPLY})
    chain = [
        Attempt(
            on(adapter, MOCK_SERVER_ERROR_MODEL).factory(litellm_proxy.url),
            keys=(PROXY_KEY,),
            label="failing",
        ),
        Attempt(adapter.factory(litellm_proxy.url), keys=(PROXY_KEY,), label="upstream"),
    ]

    result = await generation_turn(chain)

    assert (result.status, result.final_text) == (TurnStatus.COMPLETED, REPLY)
    assert [(f.label, f.kind) for f in result.attempt_failures] == [("failing", "server")]


# --------------------------------------------------------------------------- relayed models
@endpoints
async def test_a_reply_relayed_through_the_proxy_reaches_the_user(
    litellm_proxy: LiteLLMProxy, llmock: LLMockControl, adapter: Adapter
) -> None:
    await llmock.script({"type": "reply", "text": REPLY})

    result = await loop_turn(adapter.provider(litellm_proxy.url, PROXY_KEY))

    assert (result.status, result.final_text) == (TurnStatus.COMPLETED, REPLY)
    [entry] = result.usage.entries
    assert entry.output_tokens > 0


@endpoints
async def test_a_tool_round_trip_through_the_proxy_runs_the_tool_once(
    litellm_proxy: LiteLLMProxy, llmock: LLMockControl, adapter: Adapter
) -> None:
    await llmock.script(
        {"type": "reply", "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]},
        {"type": "reply", "text": REPLY},
    )
    weather = WeatherTool()

    result = await loop_turn(adapter.provider(litellm_proxy.url, PROXY_KEY), weather.tools)

    assert (result.status, result.final_text) == (TurnStatus.COMPLETED, REPLY)
    assert weather.runs == [{"city": "Paris"}]
    assert [entry.call.name for entry in result.history] == ["get_weather"]
    # the proxy handed the tool's answer on to the model behind it
    served = await llmock.requests()
    assert len(served) == 2
    assert WEATHER["marker"] in body_text(served[1])


@endpoints
async def test_a_tool_batch_through_the_proxy_runs_every_call_and_answers_each(
    litellm_proxy: LiteLLMProxy, llmock: LLMockControl, adapter: Adapter
) -> None:
    batch = [{"name": "get_weather", "arguments": {"city": c}} for c in ("Paris", "London")]
    await llmock.script({"type": "reply", "tool_calls": batch}, {"type": "reply", "text": REPLY})
    weather = WeatherTool()

    result = await loop_turn(adapter.provider(litellm_proxy.url, PROXY_KEY), weather.tools)

    assert (result.status, result.final_text) == (TurnStatus.COMPLETED, REPLY)
    assert sorted(run["city"] for run in weather.runs) == ["London", "Paris"]
    assert [(e.call.arguments["city"], e.position) for e in result.history] == [
        ("Paris", 0),
        ("London", 1),
    ]
    # the proxy accepted the batch as sent and handed both answers on to the model behind it
    served = await llmock.requests()
    assert len(served) == 2
    assert body_text(served[1]).count(str(WEATHER["marker"])) == 2


@endpoints
async def test_the_final_answer_pass_through_the_proxy_is_accepted_and_answered(
    litellm_proxy: LiteLLMProxy, llmock: LLMockControl, adapter: Adapter
) -> None:
    batch = [{"name": "get_weather", "arguments": {"city": c}} for c in ("Paris", "London")]
    await llmock.script({"type": "reply", "tool_calls": batch}, {"type": "reply", "text": REPLY})
    weather = WeatherTool()

    result = await loop_turn(
        adapter.provider(litellm_proxy.url, PROXY_KEY),
        weather.tools,
        policy=attrs.evolve(POLICY, max_tool_calls=1),
    )

    # the limit let one call run; the proxy took the pass that asks for no call (tools still
    # declared, `tool_choice` none in each API's words) and the model behind it answered
    assert (result.status, result.reason) == (TurnStatus.COMPLETED, "answered_at_tool_call_limit")
    assert result.final_text == REPLY
    assert weather.runs == [{"city": "Paris"}]
    assert [e.response.status for e in result.history] == [None, "tool_call_limit"]
    served = await llmock.requests()
    assert len(served) == 2
    assert "tool-call limit of 1 call" in body_text(served[1])
    # whichever API the host spoke, the proxy handed "call none" on to the model behind it
    assert served[1]["body"]["tool_choice"] == "none" and served[1]["body"]["tools"]
