"""Every adapter LLMock speaks (OpenAI chat, the Responses API, Anthropic, Gemini) against a
real LLMock process: scripted replies and tool calls, and each fault it scripts — HTTP
errors with ``Retry-After``, dropped connections, streams that end early, corrupted chunks,
stalls, broken tool calls.
"""

from __future__ import annotations

import time
from typing import Any

import attrs
import pytest

from tests.interop.servers import LLMockControl
from tests.interop.turns import ANTHROPIC
from tests.interop.turns import GEMINI
from tests.interop.turns import LLMOCK_ADAPTERS
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
from toolloop_fsm import LoopPolicy
from toolloop_fsm import TurnStatus
from toolloop_fsm import result_to_json
from toolloop_fsm.attempts import KeyHealth
from toolloop_fsm.policy import Budget
from toolloop_fsm.providers import VerbatimToolCalls
from toolloop_fsm.result import estimate_tokens
from toolloop_fsm.testing import RecordingChannel

pytestmark = pytest.mark.interop

adapters = pytest.mark.parametrize("adapter", LLMOCK_ADAPTERS, ids=lambda a: a.name)

REPLY = "The sky over Paris is clear, twenty-one degrees, with a light breeze from the west."
KEYS = ("sk-interop-first-3b9f1c2e", "sk-interop-second-8d4a6e0b")


def reply(text: str = REPLY) -> dict[str, object]:
    return {"type": "reply", "text": text}


def weather_call(city: str = "Paris") -> dict[str, object]:
    return {"type": "reply", "tool_calls": [{"name": "get_weather", "arguments": {"city": city}}]}


# --------------------------------------------------------------------------- replies
@adapters
async def test_a_scripted_reply_reaches_the_user_with_the_usage_the_server_reported(
    llmock: LLMockControl, adapter: Adapter
) -> None:
    await llmock.script(reply())
    channel = RecordingChannel()

    result = await loop_turn(adapter.provider(llmock.url, KEYS[0]), channel=channel)

    assert (result.status, result.reason) == (TurnStatus.COMPLETED, None)
    assert result.final_text == REPLY
    assert "".join(channel.texts) == REPLY
    [entry] = result.usage.entries
    assert entry.output_tokens > 0 and not entry.estimated


@adapters
async def test_a_tool_round_trip_runs_the_tool_once_and_the_model_reads_its_result(
    llmock: LLMockControl, adapter: Adapter
) -> None:
    await llmock.script(weather_call(), reply("Clear and 21 °C in Paris."))
    weather = WeatherTool()

    result = await loop_turn(adapter.provider(llmock.url, KEYS[0]), weather.tools)

    assert result.status is TurnStatus.COMPLETED
    assert result.final_text == "Clear and 21 °C in Paris."
    assert weather.runs == [{"city": "Paris"}]
    [entry] = result.history
    assert (entry.call.name, dict(entry.call.arguments)) == ("get_weather", {"city": "Paris"})
    served = await llmock.requests()
    assert [r["status"] for r in served] == [200, 200]
    # the follow-up request carries the call and the tool's answer
    assert WEATHER["marker"] not in body_text(served[0])
    assert WEATHER["marker"] in body_text(served[1])


async def test_a_tool_call_without_text_goes_back_with_empty_content_as_strict_servers_need(
    llmock: LLMockControl,
) -> None:
    await llmock.script(weather_call(), reply())
    adapter = next(a for a in LLMOCK_ADAPTERS if a.name == OPENAI_CHAT)

    result = await loop_turn(adapter.provider(llmock.url, KEYS[0]), WeatherTool().tools)

    assert result.status is TurnStatus.COMPLETED
    follow_up = (await llmock.requests())[1]["body"]["messages"]
    [assistant] = [m for m in follow_up if m["role"] == "assistant"]
    assert assistant["content"] == ""  # not null, which llama.cpp's server answers with a 500


async def test_a_verbatim_call_is_replayed_where_the_model_wrote_it(
    llmock: LLMockControl,
) -> None:
    said = 'Let me check. get_weather({"city": "Paris"}) One moment, please.'
    await llmock.script(reply(said), reply("Clear and 21 °C in Paris."))
    adapter = next(a for a in LLMOCK_ADAPTERS if a.name == OPENAI_CHAT)
    weather = WeatherTool()

    result = await loop_turn(
        VerbatimToolCalls(adapter.provider(llmock.url, KEYS[0])), weather.tools
    )

    assert result.final_text == "Clear and 21 °C in Paris."
    assert weather.runs == [{"city": "Paris"}]
    follow_up = (await llmock.requests())[1]["body"]["messages"]
    assert {"role": "assistant", "content": said} in follow_up


async def test_a_server_that_reports_no_usage_leaves_marked_estimates_in_the_ledger(
    llmock: LLMockControl,
) -> None:
    # like llama.cpp's server: no usage chunk (the request does not ask for one)
    await llmock.script(weather_call(), reply())
    adapter = next(a for a in LLMOCK_ADAPTERS if a.name == OPENAI_CHAT)
    provider = adapter.provider(
        llmock.url, KEYS[0], extra_body={"stream_options": {"include_usage": False}}
    )

    result = await loop_turn(provider, WeatherTool().tools)

    assert (result.status, result.final_text) == (TurnStatus.COMPLETED, REPLY)
    call_pass, text_pass = result.usage.entries
    assert call_pass.estimated and text_pass.estimated
    assert text_pass.output_tokens == estimate_tokens(REPLY)
    assert 0 < call_pass.input_tokens < text_pass.input_tokens


# --------------------------------------------------------------------------- HTTP errors
@adapters
async def test_a_rate_limit_cools_the_key_for_its_retry_after_and_the_next_key_answers(
    llmock: LLMockControl, adapter: Adapter
) -> None:
    await llmock.script({"type": "fail", "status": 429, "retry_after": 7}, reply())
    key_book: dict[tuple[str, int], KeyHealth] = {}

    before = time.monotonic()
    result = await generation_turn(
        [Attempt(adapter.factory(llmock.url), keys=KEYS, label="model")], key_book=key_book
    )
    after = time.monotonic()

    assert result.status is TurnStatus.COMPLETED
    assert result.final_text == REPLY
    assert [(a.key_index, a.status) for a in result.attempts] == [
        (0, TurnStatus.ERROR),
        (1, TurnStatus.COMPLETED),
    ]
    assert [(f.kind, f.key_index) for f in result.attempt_failures] == [("rate_limit", 0)]
    cooled = key_book[("model", 0)]
    assert before + 7 <= cooled.cooldown_until <= after + 7
    assert not any(key in result_to_json(result) for key in KEYS)


@adapters
async def test_a_server_error_is_retried_on_the_next_key(
    llmock: LLMockControl, adapter: Adapter
) -> None:
    await llmock.script({"type": "fail", "status": 503}, reply())

    result = await generation_turn([Attempt(adapter.factory(llmock.url), keys=KEYS)])

    assert result.status is TurnStatus.COMPLETED
    assert result.final_text == REPLY
    assert [(f.kind, f.key_index) for f in result.attempt_failures] == [("server", 0)]


@adapters
async def test_a_rejected_request_goes_to_the_next_model_without_trying_another_key(
    llmock: LLMockControl, adapter: Adapter
) -> None:
    await llmock.script({"type": "fail", "status": 400}, reply())

    result = await generation_turn(
        [
            Attempt(adapter.factory(llmock.url), keys=KEYS, label="first"),
            Attempt(adapter.factory(llmock.url), keys=KEYS[:1], label="second"),
        ]
    )

    assert result.status is TurnStatus.COMPLETED
    assert [(a.label, a.key_index) for a in result.attempts] == [("first", 0), ("second", 0)]
    assert [f.kind for f in result.attempt_failures] == ["bad_request"]
    assert len(await llmock.requests()) == 2


# --------------------------------------------------------------------------- broken streams
@adapters
async def test_a_connection_dropped_mid_reply_is_a_retryable_failure_keeping_what_was_delivered(
    llmock: LLMockControl, adapter: Adapter
) -> None:
    await llmock.script(reply(), {"type": "stream_fault", "kind": "disconnect", "after_chunks": 8})
    channel = RecordingChannel()
    policy = LoopPolicy(first_token_timeout=30, inactivity_timeout=30, delivery_flush_chars=1)

    result = await loop_turn(adapter.provider(llmock.url, KEYS[0]), policy=policy, channel=channel)

    assert (result.status, result.provider_error_kind, result.retryable) == (
        TurnStatus.ERROR,
        "connection",
        True,
    )
    # part of the reply arrived and was shown; it stays shown, and nothing more was
    assert "".join(channel.texts) == result.delivered_text
    assert result.delivered_text and REPLY.startswith(result.delivered_text)
    assert result.delivered_text != REPLY


@adapters
async def test_a_stream_that_ends_early_is_a_failure_not_a_short_reply(
    llmock: LLMockControl, adapter: Adapter
) -> None:
    await llmock.script(reply(), {"type": "stream_fault", "kind": "truncate", "after_chunks": 8})

    result = await loop_turn(adapter.provider(llmock.url, KEYS[0]))

    # the body ended cleanly but without its format's finish marker: a cut reply, retryable
    assert (result.status, result.provider_error_kind, result.retryable) == (
        TurnStatus.ERROR,
        "protocol",
        True,
    )
    assert result.error_message is not None and "cut short" in result.error_message
    assert result.final_text == ""  # the cut text was never taken as the answer


@adapters
async def test_a_corrupted_chunk_ends_the_pass_as_a_protocol_failure_naming_it(
    llmock: LLMockControl, adapter: Adapter
) -> None:
    await llmock.script(reply(), {"type": "stream_fault", "kind": "malformed", "after_chunks": 8})

    result = await loop_turn(adapter.provider(llmock.url, KEYS[0]))

    assert (result.status, result.provider_error_kind) == (TurnStatus.ERROR, "protocol")
    assert result.error_message is not None and "not JSON" in result.error_message


@adapters
async def test_a_stalled_stream_ends_at_the_inactivity_deadline_and_the_server_sees_it_go(
    llmock: LLMockControl, adapter: Adapter
) -> None:
    await llmock.script(
        reply(), {"type": "stream_fault", "kind": "stall", "after_chunks": 8, "stall_seconds": 60}
    )
    # Real time: LLMock journals a request only once it ends and tells nothing while it
    # stalls, so no test can know when to move a virtual clock past the inactivity window.
    # Nothing here bounds how long the turn takes.
    policy = LoopPolicy(first_token_timeout=30, inactivity_timeout=0.5)

    result = await loop_turn(adapter.provider(llmock.url, KEYS[0]), policy=policy)

    assert (result.status, result.reason) == (TurnStatus.TIMEOUT, "inactivity_timeout")
    [served] = await llmock.requests()
    # the stall began, and the client closed the stalled response: LLMock never got to send
    # the rest of the reply after its 60 s
    assert served["stall_waited"] is not None
    assert not served["completed"]


# --------------------------------------------------------------------------- broken tool calls
# Gemini's wire format carries arguments as an object, not as JSON text: LLMock cannot cut
# them in half there (it sends ``{}`` instead), so this fault has nothing to show on Gemini.
@pytest.mark.parametrize(
    "adapter", [a for a in LLMOCK_ADAPTERS if a.name != GEMINI], ids=lambda a: a.name
)
async def test_arguments_cut_in_half_never_run_the_tool_and_the_model_is_told(
    llmock: LLMockControl, adapter: Adapter
) -> None:
    await llmock.script(
        weather_call(), {"type": "tool_fault", "kind": "malformed_arguments"}, reply()
    )
    weather = WeatherTool()

    result = await loop_turn(adapter.provider(llmock.url, KEYS[0]), weather.tools)

    assert result.status is TurnStatus.COMPLETED
    assert weather.runs == []
    [entry] = result.history
    assert not entry.response.success
    served = await llmock.requests()
    assert "tool_execution_failed" in body_text(served[1])


@adapters
async def test_a_call_to_a_tool_never_offered_is_refused_and_the_model_is_told(
    llmock: LLMockControl, adapter: Adapter
) -> None:
    await llmock.script(weather_call(), {"type": "tool_fault", "kind": "unknown_tool"}, reply())
    weather = WeatherTool()

    result = await loop_turn(adapter.provider(llmock.url, KEYS[0]), weather.tools)

    assert result.status is TurnStatus.COMPLETED
    assert result.final_text == REPLY
    assert weather.runs == []
    [entry] = result.history
    assert (entry.call.name, entry.response.success) == ("llmock_unknown_tool", False)


# --------------------------------------------------------------------------- tool batches
def _batch_shape(adapter: str, body: dict[str, Any]) -> tuple[int, int, int]:
    """How the follow-up ``body`` carries a tool batch, in the adapter's native form: the
    number of assistant turns holding calls, the calls in them, and the responses."""
    if adapter == OPENAI_CHAT:
        turns = [m for m in body["messages"] if m.get("tool_calls")]
        answers = [m for m in body["messages"] if m["role"] == "tool"]
        return len(turns), sum(len(m["tool_calls"]) for m in turns), len(answers)
    if adapter == OPENAI_RESPONSES:
        items = body["input"]
        calls = [i for i in items if i.get("type") == "function_call"]
        answers = [i for i in items if i.get("type") == "function_call_output"]
        return 1 if calls else 0, len(calls), len(answers)
    if adapter == ANTHROPIC:
        messages = body["messages"]
        turns = [m for m in messages if any(b.get("type") == "tool_use" for b in m["content"])]
        answers = [b for m in messages for b in m["content"] if b.get("type") == "tool_result"]
        calls = [b for m in turns for b in m["content"] if b.get("type") == "tool_use"]
        return len(turns), len(calls), len(answers)
    contents = body["contents"]
    turns = [c for c in contents if any("functionCall" in p for p in c["parts"])]
    calls = [p for c in turns for p in c["parts"] if "functionCall" in p]
    answers = [p for c in contents for p in c["parts"] if "functionResponse" in p]
    return len(turns), len(calls), len(answers)


@adapters
async def test_every_call_of_a_batch_runs_and_the_next_request_answers_each_natively(
    llmock: LLMockControl, adapter: Adapter
) -> None:
    cities = ["Paris", "London", "Rome"]
    batch = [{"name": "get_weather", "arguments": {"city": city}} for city in cities]
    await llmock.script({"type": "reply", "tool_calls": batch}, reply("Clear everywhere."))
    weather = WeatherTool()

    result = await loop_turn(adapter.provider(llmock.url, KEYS[0]), weather.tools)

    assert (result.status, result.final_text) == (TurnStatus.COMPLETED, "Clear everywhere.")
    assert sorted(run["city"] for run in weather.runs) == sorted(cities)
    assert [(e.call.arguments["city"], e.position) for e in result.history] == [
        ("Paris", 0),
        ("London", 1),
        ("Rome", 2),
    ]
    served = await llmock.requests()
    assert [r["status"] for r in served] == [200, 200]
    # one assistant turn with the three calls, then the three answers
    assert _batch_shape(adapter.name, served[1]["body"]) == (1, 3, 3)
    assert body_text(served[1]).count(str(WEATHER["marker"])) == 3


# --------------------------------------------------------------------------- the tool-call limit
#: How each API says "no call" on the final answer pass (docs/behaviour.md §3.12 rule 4).
NO_CALL = {
    OPENAI_CHAT: ("tool_choice", "none"),
    OPENAI_RESPONSES: ("tool_choice", "none"),
    ANTHROPIC: ("tool_choice", {"type": "none"}),
    GEMINI: ("toolConfig", {"functionCallingConfig": {"mode": "NONE"}}),
}


@adapters
async def test_past_the_tool_call_limit_the_batch_is_answered_and_the_model_asked_for_no_call(
    llmock: LLMockControl, adapter: Adapter
) -> None:
    cities = ["Paris", "London", "Rome"]
    batch = [{"name": "get_weather", "arguments": {"city": city}} for city in cities]
    await llmock.script({"type": "reply", "tool_calls": batch}, reply("Clear in two of them."))
    weather = WeatherTool()

    result = await loop_turn(
        adapter.provider(llmock.url, KEYS[0]),
        weather.tools,
        policy=attrs.evolve(POLICY, max_tool_calls=2),
    )

    assert (result.status, result.reason) == (TurnStatus.COMPLETED, "answered_at_tool_call_limit")
    assert [run["city"] for run in weather.runs] == ["Paris", "London"]
    assert [e.response.status for e in result.history] == [None, None, "tool_call_limit"]
    served = await llmock.requests()
    # the server took the final answer pass: the whole batch answered, the tools still
    # declared, and the API's own words for "call none"
    assert [r["status"] for r in served] == [200, 200]
    follow_up = served[1]["body"]
    assert _batch_shape(adapter.name, follow_up) == (1, 3, 3)
    key, value = NO_CALL[adapter.name]
    assert follow_up[key] == value and follow_up["tools"]
    assert "tool-call limit of 2 calls" in body_text(served[1])


@adapters
async def test_a_model_that_calls_on_the_final_answer_pass_ends_the_turn_at_the_limit(
    llmock: LLMockControl, adapter: Adapter
) -> None:
    await llmock.script(weather_call("Paris"), weather_call("London"))
    weather = WeatherTool()

    result = await loop_turn(
        adapter.provider(llmock.url, KEYS[0]),
        weather.tools,
        policy=attrs.evolve(POLICY, max_tool_calls=1),
    )

    assert (result.status, result.reason) == (TurnStatus.TIMEOUT, "tool_call_limit")
    assert weather.runs == [{"city": "Paris"}]  # the call made anyway never ran
    assert result.stream_results[-1].ignored_calls == ("get_weather",)


# --------------------------------------------------------------------------- budgets
#: Where each API's request carries the output ceiling (docs/behaviour.md §2.8 rule 4).
MAX_OUTPUT = {
    OPENAI_CHAT: ("max_tokens",),
    OPENAI_RESPONSES: ("max_output_tokens",),
    ANTHROPIC: ("max_tokens",),
    GEMINI: ("generationConfig", "maxOutputTokens"),
}


@adapters
async def test_a_reply_past_the_output_budget_is_cut_and_its_request_aborted(
    llmock: LLMockControl, adapter: Adapter
) -> None:
    # the server ignores the ceiling it is sent, then stalls: only a cut ends the read early
    await llmock.script(
        reply(), {"type": "stream_fault", "kind": "stall", "after_chunks": 8, "stall_seconds": 60}
    )
    channel = RecordingChannel()
    policy = attrs.evolve(POLICY, delivery_flush_chars=1, budget=Budget(output_tokens=2))

    result = await loop_turn(adapter.provider(llmock.url, KEYS[0]), policy=policy, channel=channel)

    assert (result.status, result.reason) == (TurnStatus.TIMEOUT, "token_budget")
    # what fits was delivered, a prefix of the reply, and no more
    assert result.delivered_text and REPLY.startswith(result.delivered_text)
    assert estimate_tokens(result.delivered_text) <= 2
    [served] = await llmock.requests()
    ceiling: Any = served["body"]
    for key in MAX_OUTPUT[adapter.name]:
        ceiling = ceiling[key]
    assert ceiling == 2  # the request asked for no more than the budget left
    # the client closed the response before the stall's end: the request was aborted
    assert not served["completed"]
