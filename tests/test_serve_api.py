"""What `toolloop-fsm serve`'s scripted model answers over HTTP: OpenAI-shaped errors for a
request it cannot take, only the tools a request offers, real token totals, and the last
question (not drafting's revision instruction) as the one it answers."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from toolloop_fsm.demo import ANSWERING_MODEL
from toolloop_fsm.demo import QUESTION
from toolloop_fsm.demo import DemoServer
from toolloop_fsm.demo import demo_tools
from toolloop_fsm.host import TurnRequest
from toolloop_fsm.providers.openai_compat import OpenAICompatibleProvider
from toolloop_fsm.pump import run_tool_loop
from toolloop_fsm.states.drafting import revision_instruction

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
MEMORY = {"type": "function", "function": {"name": "update_short_term_memory", "parameters": {}}}


@pytest.fixture
async def server() -> AsyncIterator[DemoServer]:
    async with DemoServer(record_requests=True) as running:
        yield running


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as opened:
        yield opened


def asking(*messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "model": ANSWERING_MODEL,
        "stream": True,
        "messages": list(messages) or [{"role": "user", "content": QUESTION}],
        **extra,
    }


async def streamed(
    client: httpx.AsyncClient, server: DemoServer, body: dict[str, Any]
) -> list[dict[str, Any]]:
    """The chunks of a streamed answer, ``[DONE]`` checked and left out."""
    response = await client.post(f"{server.base_url}/chat/completions", json=body)
    assert response.status_code == 200, response.text
    lines = [line[6:] for line in response.text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def calls_in(chunks: list[dict[str, Any]]) -> list[str]:
    return [
        call["function"]["name"]
        for chunk in chunks
        for choice in chunk["choices"]
        for call in choice["delta"].get("tool_calls", [])
        if call["function"].get("name")
    ]


def finish_of(chunks: list[dict[str, Any]]) -> str:
    (finish,) = [
        c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]
    ]
    return str(finish)


def text_of(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["delta"].get("content") or "" for chunk in chunks for c in chunk["choices"])


async def error(
    client: httpx.AsyncClient, url: str, status: int, *, method: str = "POST", **sent: Any
) -> dict[str, Any]:
    response = await client.request(method, url, **sent)
    assert response.status_code == status, response.text
    found = response.json()["error"]
    assert set(found) == {"message", "type", "param", "code"}, found
    return dict(found)


# --------------------------------------------------------------------------- refused requests
@pytest.mark.parametrize(
    "body",
    [b"{not json", b'{"model": "steady-2", "messages": [', b"\xff\xfe", b""],
    ids=["garbage", "cut short", "not utf-8", "empty"],
)
async def test_a_body_that_is_not_json_gets_a_400_that_says_so(
    server: DemoServer, client: httpx.AsyncClient, body: bytes
) -> None:
    found = await error(client, f"{server.base_url}/chat/completions", 400, content=body)
    assert found["type"] == "invalid_request_error"
    assert "could not parse the JSON body" in found["message"]
    assert server.requests == []


@pytest.mark.parametrize(
    ("body", "param", "said"),
    [
        ([1, 2], None, "JSON object"),
        ({"stream": True, "messages": [{"role": "user", "content": "hi"}]}, "model", "model"),
        (asking(messages="hi"), "messages", "messages"),
        (asking(messages=[]), "messages", "messages"),
        (asking(messages=[{"content": "no role"}]), "messages", "role"),
        (asking(stream=False), "stream", "only streams"),
        (asking(tools={"get_weather": {}}), "tools", "array"),
        (asking(tools=[{"type": "function"}]), "tools[0]", "function"),
    ],
    ids=[
        "not an object",
        "no model",
        "messages not a list",
        "no messages",
        "a message without a role",
        "not streamed",
        "tools not a list",
        "a tool without a name",
    ],
)
async def test_a_malformed_request_gets_a_400_naming_the_parameter(
    server: DemoServer, client: httpx.AsyncClient, body: Any, param: str | None, said: str
) -> None:
    found = await error(client, f"{server.base_url}/chat/completions", 400, json=body)
    assert found["param"] == param
    assert said in found["message"]
    assert found["type"] == "invalid_request_error"


async def test_an_unknown_model_gets_openais_404(
    server: DemoServer, client: httpx.AsyncClient
) -> None:
    body = asking(model="gpt-4o")
    found = await error(client, f"{server.base_url}/chat/completions", 404, json=body)
    assert found == {
        "message": "The model `gpt-4o` does not exist or you do not have access to it.",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }


@pytest.mark.parametrize(
    "path", ["/v2/chat/completions", "/anything/chat/completions", "/v1/chat/completions/x", "/"]
)
async def test_a_path_it_does_not_serve_gets_a_404(
    server: DemoServer, client: httpx.AsyncClient, path: str
) -> None:
    url = f"http://{server.host}:{server.port}{path}"
    found = await error(client, url, 404, json=asking())
    assert found["code"] == "unknown_url"
    assert found["message"] == f"Invalid URL (POST {path})"
    assert server.requests == []


async def test_the_wrong_method_gets_a_405_that_names_the_right_one(
    server: DemoServer, client: httpx.AsyncClient
) -> None:
    response = await client.get(f"{server.base_url}/chat/completions")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert response.json()["error"]["code"] == "method_not_allowed"


async def test_a_query_string_does_not_change_the_route(
    server: DemoServer, client: httpx.AsyncClient
) -> None:
    chunks = await streamed_at(client, f"{server.base_url}/chat/completions?api-version=1")
    assert calls_in(chunks) == ["get_weather"]


async def streamed_at(client: httpx.AsyncClient, url: str) -> list[dict[str, Any]]:
    response = await client.post(url, json=asking(tools=[WEATHER]))
    assert response.status_code == 200, response.text
    lines = [line[6:] for line in response.text.split("\n\n") if line.startswith("data: ")]
    return [json.loads(line) for line in lines[:-1]]


# --------------------------------------------------------------------------- the offered tools
async def test_no_tools_offered_no_tool_calls_streamed(
    server: DemoServer, client: httpx.AsyncClient
) -> None:
    chunks = await streamed(client, server, asking())
    assert calls_in(chunks) == []
    assert finish_of(chunks) == "stop"
    assert "no forecast tool" in text_of(chunks)


async def test_tool_choice_none_streams_no_tool_calls(
    server: DemoServer, client: httpx.AsyncClient
) -> None:
    chunks = await streamed(client, server, asking(tools=[WEATHER, MEMORY], tool_choice="none"))
    assert calls_in(chunks) == [] and finish_of(chunks) == "stop"


async def test_an_offered_tool_is_called(server: DemoServer, client: httpx.AsyncClient) -> None:
    chunks = await streamed(client, server, asking(tools=[WEATHER, MEMORY]))
    assert calls_in(chunks) == ["get_weather"] and finish_of(chunks) == "tool_calls"


ANSWERED = (
    {"role": "user", "content": QUESTION},
    {
        "role": "assistant",
        "content": "Let me check the forecast for Paris. ",
        "tool_calls": [
            {
                "id": "call_0_0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {
        "role": "tool",
        "tool_call_id": "call_0_0",
        "content": json.dumps({"data": {"city": "Paris", "sky": "hazy", "temp_c": 17}}),
    },
)


async def test_without_the_memory_tool_the_answer_neither_calls_it_nor_promises_to_remember(
    server: DemoServer, client: httpx.AsyncClient
) -> None:
    chunks = await streamed(client, server, asking(*ANSWERED, tools=[WEATHER]))
    assert calls_in(chunks) == [] and finish_of(chunks) == "stop"
    assert "17 °C and hazy" in text_of(chunks)
    assert "remember" not in text_of(chunks)
    with_memory = await streamed(client, server, asking(*ANSWERED, tools=[WEATHER, MEMORY]))
    assert calls_in(with_memory) == ["update_short_term_memory"]
    assert "I'll remember" in text_of(with_memory)


async def test_a_tool_loop_offered_no_tools_completes_with_the_models_text(
    server: DemoServer,
) -> None:
    provider = OpenAICompatibleProvider(server.base_url, ANSWERING_MODEL, api_key="any")
    result = await run_tool_loop(
        provider, [], _Channel(), TurnRequest([{"role": "user", "content": QUESTION}])
    )
    assert result.status.value == "completed", result
    assert "no forecast tool" in result.delivered_text
    assert "tools" not in server.requests[0]


class _Channel:
    async def send_text(self, text: str) -> None:
        pass

    async def send_expression(self, expression: str) -> None:
        pass

    async def send_notice(self, notice: Any) -> None:
        pass

    async def queue_front(self, stop_message: str) -> None:
        pass


# --------------------------------------------------------------------------- usage
@pytest.mark.parametrize(
    "body",
    [asking(tools=[WEATHER]), asking(*ANSWERED, tools=[WEATHER, MEMORY]), asking()],
    ids=["a tool call", "an answer", "no tools"],
)
async def test_the_usage_total_is_prompt_plus_completion(
    server: DemoServer, client: httpx.AsyncClient, body: dict[str, Any]
) -> None:
    chunks = await streamed(client, server, body)
    (usage,) = [chunk["usage"] for chunk in chunks if chunk.get("usage")]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def test_a_longer_prompt_counts_more_prompt_tokens(
    server: DemoServer, client: httpx.AsyncClient
) -> None:
    short = await streamed(client, server, asking(tools=[WEATHER]))
    long = await streamed(client, server, asking(*ANSWERED, tools=[WEATHER]))
    assert _prompt(long) > _prompt(short)


def _prompt(chunks: list[dict[str, Any]]) -> int:
    (usage,) = [chunk["usage"] for chunk in chunks if chunk.get("usage")]
    return int(usage["prompt_tokens"])


# --------------------------------------------------------------------------- the last question
async def test_a_new_question_is_answered_from_its_own_forecast_not_the_last_ones(
    server: DemoServer, client: httpx.AsyncClient
) -> None:
    answered = (*ANSWERED, {"role": "assistant", "content": "It's 17 °C and hazy in Paris."})
    again = {"role": "user", "content": "And what about London and Rome?"}
    chunks = await streamed(client, server, asking(*answered, again, tools=[WEATHER, MEMORY]))
    assert calls_in(chunks) == ["get_weather", "get_weather"]  # asked afresh, as a batch
    assert text_of(chunks) == "Let me check London and Rome. "


async def test_drafting_s_revision_instruction_is_not_a_new_question(
    server: DemoServer, client: httpx.AsyncClient
) -> None:
    draft = {"role": "assistant", "content": "Paris: 17 °C, hazy."}
    revise = {"role": "user", "content": revision_instruction("Paris: 17 °C, hazy.", ())}
    chunks = await streamed(client, server, asking(*ANSWERED, draft, revise, tools=[WEATHER]))
    assert calls_in(chunks) == []  # the forecast already fetched is the one it uses
    assert "hazy today, a mild 17 °C" in text_of(chunks)


def test_the_demo_tools_are_the_ones_the_scripted_model_knows() -> None:
    names = {tool.name for tool in demo_tools([])}
    assert names == {"get_weather", "update_short_term_memory"}  # WEATHER and MEMORY above
