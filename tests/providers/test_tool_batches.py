"""A tool batch goes back to the model in each provider's native form, and the host can ask
for no batches (docs/behaviour.md §3.10 rules 3 and 7, §10.6).

Each adapter is read off the request it sends over loopback HTTP, for the history a turn
records after a single-call round and then a two-call batch (one success, one failure): one
assistant turn with every call of the batch, its pre-tool text once, then one response per
call in emitted order, each answering its own call.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest

from tests.providers import wire
from tests.providers.native import anthropic_tool_result
from tests.providers.native import anthropic_tool_use
from tests.providers.native import openai_tool_call
from tests.providers.replay import ADAPTERS
from tests.providers.replay import FINISHED_PASS
from tests.providers.replay import adapter
from tests.providers.replay import collect
from tests.providers.wire_server import Scripted
from tests.providers.wire_server import WireServer
from toolloop_fsm.events import Chunk
from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import TextDelta
from toolloop_fsm.provider import ProviderRequest
from toolloop_fsm.provider import ToolSpec
from toolloop_fsm.providers import VerbatimToolCalls
from toolloop_fsm.providers.gemini import SKIP_SIGNATURE
from toolloop_fsm.providers.openai_compat import history_call_id
from toolloop_fsm.result import ToolCallRecord
from toolloop_fsm.result import ToolHistoryEntry
from toolloop_fsm.result import ToolResponseRecord

KEY = "sk-batches-0123456789abcdef"
CONTEXT = ({"role": "user", "content": "Weather in Paris, then London, and book Monday."},)
TOOLS = (
    ToolSpec("get_weather", "Weather by city", {"type": "object"}),
    ToolSpec("book", "Book a table", {"type": "object"}),
)

SUNNY = ToolResponseRecord(True, data={"temp": 21}, message="sunny")
RAINY = ToolResponseRecord(True, data={"temp": 14})
NO_SEATS = ToolResponseRecord(False, reason="no seats", tool_name="book")
SUNNY_JSON = '{"success": true, "data": {"temp": 21}, "message": "sunny"}'
RAINY_JSON = '{"success": true, "data": {"temp": 14}}'
NO_SEATS_JSON = (
    '{"success": false, "status": "tool_execution_failed", "reason": "no seats", '
    '"tool_name": "book"}'
)


def _history(
    *,
    ids: Sequence[str | None] = ("call_1", "call_2", "call_3"),
    data: Sequence[dict[str, Any] | None] = (None, None, None),
) -> tuple[ToolHistoryEntry, ...]:
    """A single-call round (pass 1), then a batch of two (pass 2): London's weather, which
    worked, and a booking, which failed. Only the batch's first call carries its text."""
    return (
        ToolHistoryEntry(
            ToolCallRecord("get_weather", {"city": "Paris"}, ids[0], data[0]),
            SUNNY,
            pre_tool_text="Let me check.",
            iteration=1,
        ),
        ToolHistoryEntry(
            ToolCallRecord("get_weather", {"city": "London"}, ids[1], data[1]),
            RAINY,
            pre_tool_text="Now London, and the booking.",
            iteration=2,
            position=0,
        ),
        ToolHistoryEntry(
            ToolCallRecord("book", {"day": "mon"}, ids[2], data[2]),
            NO_SEATS,
            iteration=2,
            position=1,
        ),
    )


async def _sent(wire_server: WireServer, kind: str, request: ProviderRequest) -> dict[str, Any]:
    """The body adapter ``kind`` sends for ``request``."""
    wire_server.serve(FINISHED_PASS[kind])
    await collect(adapter(kind, wire_server.url, KEY), request)
    sent = wire_server.requests[-1]
    body: dict[str, Any] = json.loads(sent.body)
    return body


# ----------------------------------------------------------------------------- each adapter
async def test_openai_chat_sends_a_batch_as_one_assistant_message_and_a_tool_message_each(
    wire_server: WireServer,
) -> None:
    # the batch's calls came without ids: each gets its own, and its answer quotes it
    history = _history(ids=("call_1", None, None))
    body = await _sent(wire_server, "openai-chat", ProviderRequest(CONTEXT, history=history))
    london, booking = (call["id"] for call in body["messages"][3]["tool_calls"])
    assert london != booking
    assert (london, booking) == (history_call_id(history[1], 1), history_call_id(history[2], 2))
    assert body["messages"] == [
        *CONTEXT,
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [openai_tool_call("call_1", "get_weather", '{"city": "Paris"}')],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": SUNNY_JSON},
        {
            "role": "assistant",
            "content": "Now London, and the booking.",
            "tool_calls": [
                openai_tool_call(london, "get_weather", '{"city": "London"}'),
                openai_tool_call(booking, "book", '{"day": "mon"}'),
            ],
        },
        {"role": "tool", "tool_call_id": london, "content": RAINY_JSON},
        {"role": "tool", "tool_call_id": booking, "content": NO_SEATS_JSON},
    ]


async def test_openai_responses_sends_a_batch_as_its_calls_then_their_outputs(
    wire_server: WireServer,
) -> None:
    reasoning_1 = {"type": "reasoning", "id": "rs_1", "encrypted_content": "e1", "summary": []}
    reasoning_2 = {"type": "reasoning", "id": "rs_2", "encrypted_content": "e2", "summary": []}
    history = _history(
        data=({"reasoning": [reasoning_1]}, {"reasoning": [reasoning_2], "item_id": "fc_2"}, None)
    )
    body = await _sent(wire_server, "openai-responses", ProviderRequest(CONTEXT, history=history))
    assert body["input"] == [
        *CONTEXT,
        {"role": "assistant", "content": "Let me check."},
        reasoning_1,
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": SUNNY_JSON},
        {"role": "assistant", "content": "Now London, and the booking."},
        reasoning_2,
        {
            "type": "function_call",
            "call_id": "call_2",
            "name": "get_weather",
            "arguments": '{"city": "London"}',
        },
        {
            "type": "function_call",
            "call_id": "call_3",
            "name": "book",
            "arguments": '{"day": "mon"}',
        },
        {"type": "function_call_output", "call_id": "call_2", "output": RAINY_JSON},
        {"type": "function_call_output", "call_id": "call_3", "output": NO_SEATS_JSON},
    ]


async def test_anthropic_sends_a_batch_as_its_tool_uses_then_one_message_of_results(
    wire_server: WireServer,
) -> None:
    thinking = {"type": "thinking", "thinking": "Two lookups.", "signature": "sig-t"}
    # the batch came from a provider without ids: each call gets its own, valid for Anthropic
    history = _history(
        ids=("toolu_1", None, None), data=(None, {"anthropic_thinking": [thinking]}, None)
    )
    body = await _sent(wire_server, "anthropic", ProviderRequest(CONTEXT, history=history))
    assert body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": CONTEXT[0]["content"]}]},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me check."},
                anthropic_tool_use("toolu_1", "get_weather", {"city": "Paris"}),
            ],
        },
        {
            "role": "user",
            "content": [anthropic_tool_result("toolu_1", SUNNY_JSON, is_error=False)],
        },
        {
            "role": "assistant",
            "content": [
                thinking,
                {"type": "text", "text": "Now London, and the booking."},
                anthropic_tool_use("toolu_loop_2_1", "get_weather", {"city": "London"}),
                anthropic_tool_use("toolu_loop_2_2", "book", {"day": "mon"}),
            ],
        },
        {
            "role": "user",
            "content": [
                anthropic_tool_result("toolu_loop_2_1", RAINY_JSON, is_error=False),
                anthropic_tool_result("toolu_loop_2_2", NO_SEATS_JSON, is_error=True),
            ],
        },
    ]


async def test_gemini_sends_a_batch_as_its_function_calls_then_its_function_responses(
    wire_server: WireServer,
) -> None:
    # Gemini signs only the first call of a parallel batch; the second goes back unsigned
    history = _history(
        ids=(None, None, None),
        data=({"thoughtSignature": "sig-1"}, {"thoughtSignature": "sig-2"}, None),
    )
    body = await _sent(wire_server, "gemini", ProviderRequest(CONTEXT, history=history))
    assert body["contents"] == [
        {"role": "user", "parts": [{"text": CONTEXT[0]["content"]}]},
        {
            "role": "model",
            "parts": [
                {"text": "Let me check."},
                {
                    "functionCall": {"name": "get_weather", "args": {"city": "Paris"}},
                    "thoughtSignature": "sig-1",
                },
            ],
        },
        {
            "role": "user",
            "parts": [
                {
                    "functionResponse": {
                        "name": "get_weather",
                        "response": json.loads(SUNNY_JSON),
                    }
                }
            ],
        },
        {
            "role": "model",
            "parts": [
                {"text": "Now London, and the booking."},
                {
                    "functionCall": {"name": "get_weather", "args": {"city": "London"}},
                    "thoughtSignature": "sig-2",
                },
                {"functionCall": {"name": "book", "args": {"day": "mon"}}},
            ],
        },
        {
            "role": "user",
            "parts": [
                {
                    "functionResponse": {
                        "name": "get_weather",
                        "response": json.loads(RAINY_JSON),
                    }
                },
                {"functionResponse": {"name": "book", "response": json.loads(NO_SEATS_JSON)}},
            ],
        },
    ]


async def test_gemini_gives_every_call_of_a_batch_from_another_provider_the_stand_in_signature(
    wire_server: WireServer,
) -> None:
    # a batch made by another model before a fallback: no call of it is signed
    body = await _sent(wire_server, "gemini", ProviderRequest(CONTEXT, history=_history()))
    batch_turn = body["contents"][3]
    assert [part.get("thoughtSignature") for part in batch_turn["parts"]] == [
        None,
        SKIP_SIGNATURE,
        SKIP_SIGNATURE,
    ]
    assert [part["functionCall"]["id"] for part in batch_turn["parts"][1:]] == [
        "call_2",
        "call_3",
    ]
    answers = body["contents"][4]["parts"]
    assert [part["functionResponse"]["id"] for part in answers] == ["call_2", "call_3"]


async def test_ollama_sends_a_batch_as_one_assistant_message_and_a_tool_message_each(
    wire_server: WireServer,
) -> None:
    history = _history(ids=(None, None, None))
    body = await _sent(wire_server, "ollama", ProviderRequest(CONTEXT, history=history))
    assert body["messages"] == [
        *CONTEXT,
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": SUNNY_JSON, "tool_name": "get_weather"},
        {
            "role": "assistant",
            "content": "Now London, and the booking.",
            "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": "London"}}},
                {"function": {"name": "book", "arguments": {"day": "mon"}}},
            ],
        },
        {"role": "tool", "content": RAINY_JSON, "tool_name": "get_weather"},
        {"role": "tool", "content": NO_SEATS_JSON, "tool_name": "book"},
    ]


async def test_verbatim_shows_a_batch_as_the_message_the_model_wrote_and_one_of_results(
    wire_server: WireServer,
) -> None:
    text = "Paris: \nLondon: \nThat is all."
    history = (
        ToolHistoryEntry(
            ToolCallRecord(
                "get_weather", {"city": "Paris"}, "verbatim_1", {"verbatim": True, "text_before": 7}
            ),
            SUNNY,
            pre_tool_text=text,
            iteration=1,
        ),
        ToolHistoryEntry(
            ToolCallRecord(
                "book", {"day": "mon"}, "verbatim_2", {"verbatim": True, "text_before": 16}
            ),
            NO_SEATS,
            iteration=1,
            position=1,
        ),
    )
    wire_server.serve(FINISHED_PASS["openai-chat"])
    provider = VerbatimToolCalls(adapter("openai-chat", wire_server.url, KEY))
    chunks = await collect(provider, ProviderRequest(CONTEXT, tools=TOOLS, history=history))
    assert chunks[0] == TextDelta("ok")
    body = json.loads(wire_server.requests[-1].body)
    assert "tools" not in body
    assert body["messages"] == [
        *CONTEXT,
        {
            "role": "assistant",
            "content": 'Paris: get_weather({"city": "Paris"})\nLondon: book({"day": "mon"})\n'
            "That is all.",
        },
        {
            "role": "user",
            "content": f"[result of get_weather] {SUNNY_JSON}\n[result of book] {NO_SEATS_JSON}",
        },
    ]


# ----------------------------------------------------------------------------- all at once
@pytest.mark.parametrize("kind", ADAPTERS)
async def test_identical_calls_of_one_batch_are_told_apart(
    wire_server: WireServer, kind: str
) -> None:
    # two identical calls without ids, one answered with a success and one with a failure:
    # each answer must land on its own call, in order
    call = ToolCallRecord("get_weather", {"city": "Rome"})
    history = (
        ToolHistoryEntry(call, RAINY, iteration=1, position=0),
        ToolHistoryEntry(call, NO_SEATS, iteration=1, position=1),
    )
    body = await _sent(wire_server, kind, ProviderRequest(CONTEXT, history=history))
    pairs = _calls_and_answers(kind, body)
    assert [answer for _, answer in pairs] == [RAINY_JSON, NO_SEATS_JSON]
    call_ids = [call_id for call_id, _ in pairs]
    if kind in ("openai-chat", "openai-responses", "anthropic"):
        assert len(set(call_ids)) == 2 and None not in call_ids


def _calls_and_answers(kind: str, body: dict[str, Any]) -> list[tuple[str | None, str]]:
    """Each call of the request's one batch with the answer it got, in emitted order; the
    answer is found by the call's id where the format pairs them by id, else by place."""
    if kind == "openai-chat":
        [assistant] = [m for m in body["messages"] if m.get("tool_calls")]
        answers = {m["tool_call_id"]: m["content"] for m in body["messages"] if m["role"] == "tool"}
        return [(c["id"], answers[c["id"]]) for c in assistant["tool_calls"]]
    if kind == "openai-responses":
        items = body["input"]
        outputs = {
            i["call_id"]: i["output"] for i in items if i.get("type") == "function_call_output"
        }
        calls = [i["call_id"] for i in items if i.get("type") == "function_call"]
        return [(call_id, outputs[call_id]) for call_id in calls]
    if kind == "anthropic":
        assistant, results = body["messages"][1:]
        answers = {b["tool_use_id"]: b["content"] for b in results["content"]}
        uses = [b["id"] for b in assistant["content"] if b["type"] == "tool_use"]
        return [(use, answers[use]) for use in uses]
    if kind == "gemini":
        calls, responses = body["contents"][1:]
        assert len(calls["parts"]) == len(responses["parts"]) == 2
        return [
            (None, json.dumps(r["functionResponse"]["response"], ensure_ascii=False))
            for r in responses["parts"]
        ]
    assert kind == "ollama"
    assistant, *tools = body["messages"][1:]
    assert len(assistant["tool_calls"]) == 2
    return [(None, m["content"]) for m in tools]


@pytest.mark.parametrize("kind", ADAPTERS)
async def test_a_history_of_single_calls_is_sent_as_one_round_per_call(
    wire_server: WireServer, kind: str
) -> None:
    # every entry at position 0: as many assistant turns as calls, each with one call
    history = tuple(
        ToolHistoryEntry(entry.call, entry.response, entry.pre_tool_text, entry.iteration)
        for entry in _history()
    )
    body = await _sent(wire_server, kind, ProviderRequest(CONTEXT, history=history))
    assert _calls_per_turn(kind, body) == [1, 1, 1]
    batched = await _sent(wire_server, kind, ProviderRequest(CONTEXT, history=_history()))
    assert _calls_per_turn(kind, batched) == [1, 2]


def _calls_per_turn(kind: str, body: dict[str, Any]) -> list[int]:
    if kind in ("openai-chat", "ollama"):
        return [len(m["tool_calls"]) for m in body["messages"] if m.get("tool_calls")]
    if kind == "anthropic":
        return [
            sum(block["type"] == "tool_use" for block in m["content"])
            for m in body["messages"]
            if m["role"] == "assistant"
        ]
    if kind == "gemini":
        return [
            sum("functionCall" in part for part in c["parts"])
            for c in body["contents"]
            if c["role"] == "model"
        ]
    # Responses: a run of function_call items is one turn
    runs: list[int] = []
    previous = None
    for item in body["input"]:
        kind_of = item.get("type")
        if kind_of == "function_call":
            if previous == "function_call":
                runs[-1] += 1
            else:
                runs.append(1)
        if kind_of != "reasoning":
            previous = kind_of
    return runs


# ----------------------------------------------------------------------------- no batches
ASKED_NOT_TO_BATCH: dict[str, dict[str, Any]] = {
    "openai-chat": {"parallel_tool_calls": False},
    "openai-responses": {"parallel_tool_calls": False},
    "anthropic": {"tool_choice": {"type": "auto", "disable_parallel_tool_use": True}},
    # neither API has the option: the body is the same
    "gemini": {},
    "ollama": {},
}


@pytest.mark.parametrize("kind", ADAPTERS)
async def test_asking_for_no_batches_adds_each_apis_own_option_and_nothing_else(
    wire_server: WireServer, kind: str
) -> None:
    request = ProviderRequest(CONTEXT, tools=TOOLS, history=_history())
    batching = await _sent(wire_server, kind, request)
    not_batching = await _sent(
        wire_server,
        kind,
        ProviderRequest(CONTEXT, tools=TOOLS, history=_history(), parallel_tool_calls=False),
    )
    assert not_batching == {**batching, **ASKED_NOT_TO_BATCH[kind]}
    assert "parallel_tool_calls" not in batching and "tool_choice" not in batching


@pytest.mark.parametrize("kind", ADAPTERS)
async def test_asking_for_no_batches_without_tools_sends_nothing_of_it(
    wire_server: WireServer, kind: str
) -> None:
    # no tools offered: there is nothing to call, so no option about calls either
    plain = await _sent(wire_server, kind, ProviderRequest(CONTEXT, history=_history()))
    asked = await _sent(
        wire_server, kind, ProviderRequest(CONTEXT, history=_history(), parallel_tool_calls=False)
    )
    assert asked == plain


async def _verbatim_body(wire_server: WireServer, request: ProviderRequest) -> dict[str, Any]:
    """The body a verbatim-calls model (over OpenAI chat) is sent for ``request``."""
    wire_server.serve(FINISHED_PASS["openai-chat"])
    provider = VerbatimToolCalls(adapter("openai-chat", wire_server.url, KEY))
    await collect(provider, request)
    body: dict[str, Any] = json.loads(wire_server.requests[-1].body)
    return body


@pytest.mark.parametrize(
    "request_",
    [
        ProviderRequest(CONTEXT, tools=TOOLS, parallel_tool_calls=False),
        ProviderRequest(CONTEXT, tools=TOOLS, tools_withdrawn=True),
    ],
    ids=["no-batches", "final-answer-pass"],
)
async def test_a_verbatim_model_is_sent_no_tool_option(
    wire_server: WireServer, request_: ProviderRequest
) -> None:
    # its tools are described in its prompt, not declared: no API option about calls applies
    body = await _verbatim_body(wire_server, request_)
    assert not {"parallel_tool_calls", "tool_choice", "tools"} & body.keys()


# ----------------------------------------------------------------------------- tools withdrawn
#: What the final answer pass (docs/behaviour.md §3.12) adds to a body that offers tools: each
#: API's own way of asking for no call, the tools still declared (Anthropic refuses
#: `tool_use` blocks in the messages without them) — but Ollama's, which has no tool choice.
WITHDRAWN: dict[str, dict[str, Any]] = {
    "openai-chat": {"tool_choice": "none"},
    "openai-responses": {"tool_choice": "none"},
    "anthropic": {"tool_choice": {"type": "none"}},
    "gemini": {"toolConfig": {"functionCallingConfig": {"mode": "NONE"}}},
    "ollama": {},
}


@pytest.mark.parametrize("kind", ADAPTERS)
async def test_the_final_answer_pass_asks_each_api_for_no_call_in_its_own_words(
    wire_server: WireServer, kind: str
) -> None:
    offered = await _sent(
        wire_server, kind, ProviderRequest(CONTEXT, tools=TOOLS, history=_history())
    )
    withdrawn = await _sent(
        wire_server,
        kind,
        ProviderRequest(CONTEXT, tools=TOOLS, history=_history(), tools_withdrawn=True),
    )
    if kind == "ollama":
        assert "tools" in offered
        assert withdrawn == {key: value for key, value in offered.items() if key != "tools"}
    else:
        assert withdrawn == {**offered, **WITHDRAWN[kind]}
        assert withdrawn["tools"] == offered["tools"]


@pytest.mark.parametrize("kind", ADAPTERS)
async def test_the_final_answer_pass_drops_the_no_batches_option(
    wire_server: WireServer, kind: str
) -> None:
    # no call may be made: asking for at most one is moot, and Anthropic's "none" takes no
    # `disable_parallel_tool_use`
    both = await _sent(
        wire_server,
        kind,
        ProviderRequest(
            CONTEXT,
            tools=TOOLS,
            history=_history(),
            parallel_tool_calls=False,
            tools_withdrawn=True,
        ),
    )
    withdrawn = await _sent(
        wire_server,
        kind,
        ProviderRequest(CONTEXT, tools=TOOLS, history=_history(), tools_withdrawn=True),
    )
    assert both == withdrawn


# ----------------------------------------------------------------------------- round trips
def _answered(calls: Sequence[FunctionCall]) -> tuple[ToolHistoryEntry, ...]:
    """The calls of one recorded pass as the loop records them: one batch, every other call
    failing."""
    return tuple(
        ToolHistoryEntry(
            ToolCallRecord(call.name, call.arguments, call.call_id, call.provider_data),
            RAINY if position % 2 == 0 else NO_SEATS,
            iteration=1,
            position=position,
        )
        for position, call in enumerate(calls)
    )


def _function_calls(chunks: Sequence[Chunk]) -> list[FunctionCall]:
    return [chunk for chunk in chunks if isinstance(chunk, FunctionCall)]


async def test_the_calls_of_a_recorded_openai_batch_go_back_as_one_assistant_message(
    wire_server: WireServer,
) -> None:
    [recorded] = wire.load("openai-chat__tool-calls-parallel.sse")
    wire_server.serve(Scripted.recorded(recorded), FINISHED_PASS["openai-chat"])
    provider = adapter("openai-chat", wire_server.url, KEY)
    calls = _function_calls(await collect(provider, ProviderRequest(CONTEXT, tools=TOOLS)))
    assert len(calls) == 2
    await collect(provider, ProviderRequest(CONTEXT, tools=TOOLS, history=_answered(calls)))
    messages = json.loads(wire_server.requests[-1].body)["messages"]
    assistant, *answers = messages[1:]
    assert [c["id"] for c in assistant["tool_calls"]] == [c.call_id for c in calls]
    assert [c["function"]["name"] for c in assistant["tool_calls"]] == [c.name for c in calls]
    assert [(m["tool_call_id"], m["content"]) for m in answers] == [
        (calls[0].call_id, RAINY_JSON),
        (calls[1].call_id, NO_SEATS_JSON),
    ]


async def test_the_calls_of_a_recorded_gemini_batch_go_back_signed_as_they_came(
    wire_server: WireServer,
) -> None:
    recorded = wire.load("gemini-vertex__thought-parallel-calls-partial-args.jsonl")[0]
    wire_server.serve(Scripted.recorded(recorded), FINISHED_PASS["gemini"])
    provider = adapter("gemini", wire_server.url, KEY)
    calls = _function_calls(await collect(provider, ProviderRequest(CONTEXT, tools=TOOLS)))
    assert [c.name for c in calls] == ["read_theme", "read_screen", "read_screen", "read_screen"]
    await collect(provider, ProviderRequest(CONTEXT, tools=TOOLS, history=_answered(calls)))
    contents = json.loads(wire_server.requests[-1].body)["contents"]
    model, answers = contents[1:]
    signature = (calls[0].provider_data or {})["thoughtSignature"]
    # only the first call came signed, and only it goes back signed
    assert model["parts"] == [
        {"functionCall": {"name": "read_theme", "args": {}}, "thoughtSignature": signature},
        {"functionCall": {"name": "read_screen", "args": {"id": "A"}}},
        {"functionCall": {"name": "read_screen", "args": {"id": "B"}}},
        {"functionCall": {"name": "read_screen", "args": {"id": "C"}}},
    ]
    assert [p["functionResponse"]["name"] for p in answers["parts"]] == [c.name for c in calls]
    assert [p["functionResponse"]["response"]["success"] for p in answers["parts"]] == [
        True,
        False,
        True,
        False,
    ]


async def test_a_history_that_opens_mid_batch_is_still_sent_whole(
    wire_server: WireServer,
) -> None:
    # a host's own history whose first entry says it is a batch's second call: no batch
    # stands before it, so it opens one, and the entry after it joins that batch
    first, second = _history()[1:]
    history = (
        ToolHistoryEntry(first.call, first.response, first.pre_tool_text, 2, position=1),
        second,
    )
    body = await _sent(wire_server, "openai-chat", ProviderRequest(CONTEXT, history=history))
    assert _calls_per_turn("openai-chat", body) == [2]
    assert body["messages"][1]["content"] == "Now London, and the booking."
