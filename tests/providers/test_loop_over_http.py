"""The whole loop over real loopback HTTP: `run_tool_loop` / `run_generation_turn` driving a
real `OpenAICompatibleProvider` against the `wire_server`, the engine's deadlines on a
`VirtualClock` (no test waits out or bounds real time).

Issue #4's fault "a stream that stalls": the loop's inactivity deadline fires, what streamed
before the stall is kept (and was delivered), and the HTTP connection is closed — the server
sees the client go. And a full generation turn whose first model answers 429 with
``retry-after`` and whose second model calls a tool and then answers.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.providers.wire_server import Scripted
from tests.providers.wire_server import WireServer
from toolloop_fsm import Attempt
from toolloop_fsm import LoopPolicy
from toolloop_fsm import Tool
from toolloop_fsm import ToolContext
from toolloop_fsm import ToolResult
from toolloop_fsm import TurnPolicy
from toolloop_fsm import TurnRequest
from toolloop_fsm import TurnStatus
from toolloop_fsm import result_to_json
from toolloop_fsm import run_generation_turn
from toolloop_fsm import run_tool_loop
from toolloop_fsm.attempts import KeyHealth
from toolloop_fsm.providers._http import DEFAULT_TIMEOUT
from toolloop_fsm.providers.openai_compat import OpenAICompatibleProvider
from toolloop_fsm.result import Delivered
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import VirtualClock

QUESTION = TurnRequest([{"role": "user", "content": "What's the weather in Paris?"}])
SSE = (("content-type", "text/event-stream"),)


def frame(delta: dict[str, Any], finish: str | None = None) -> bytes:
    """One Chat Completions SSE event carrying ``delta``."""
    body = {
        "id": "chatcmpl-test",
        "object": "chat.completion.chunk",
        "model": "test-model",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(body).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def text_stream(*pieces: str) -> tuple[bytes, ...]:
    return (
        frame({"role": "assistant", "content": ""}),
        *(frame({"content": piece}) for piece in pieces),
        frame({}, "stop"),
        DONE,
    )


def tool_call_stream(text: str, name: str, arguments: dict[str, Any]) -> tuple[bytes, ...]:
    encoded = json.dumps(arguments)
    head = {
        "index": 0,
        "id": "call_1",
        "type": "function",
        "function": {"name": name, "arguments": ""},
    }
    return (
        frame({"role": "assistant", "content": ""}),
        frame({"content": text}),
        frame({"tool_calls": [head]}),
        # the arguments arrive in two fragments, as they do on the wire
        frame({"tool_calls": [{"index": 0, "function": {"arguments": encoded[:6]}}]}),
        frame({"tool_calls": [{"index": 0, "function": {"arguments": encoded[6:]}}]}),
        frame({}, "tool_calls"),
        DONE,
    )


# ----------------------------------------------------------------------------- a stalled stream
#: The engine's deadlines run on a `VirtualClock`. While the provider waits on the socket, the
#: HTTP client's own read timeout (a real loop timer) holds virtual time still, so the silence
#: after the stall lasts exactly as long as the test says: `VirtualClock.advance` by the window.
INACTIVITY = 0.3
FIRST_TOKEN = 5.0


def step_times(trace: Any, event: str) -> list[float | None]:
    return [step.at for step in trace if step.event == event]


async def until_delivered(
    channel_text: Callable[[], str], delivered: asyncio.Event, turn: asyncio.Task[Any]
) -> str:
    """Wait until ``delivered`` is set or the turn ends (then it cannot be set any more); the
    text the channel shows then."""
    waiter = asyncio.ensure_future(delivered.wait())
    await asyncio.wait([waiter, turn], return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    return channel_text()


def delivery_watch(expected: str) -> tuple[RecordingChannel, asyncio.Event]:
    """A channel, and an event set once it has shown the user ``expected``."""
    delivered = asyncio.Event()

    def seen(_delivery: Delivered) -> None:
        if channel.text == expected:
            delivered.set()

    channel = RecordingChannel(on_delivery=seen)
    return channel, delivered


async def test_a_stalled_stream_times_out_keeps_its_text_and_closes_the_connection(
    wire_server: WireServer,
) -> None:
    chunks = (
        frame({"role": "assistant", "content": ""}),
        frame({"content": "Checking "}),
        frame({"content": "the sky over Paris"}),
        frame({"content": " — never sent"}),
        frame({}, "stop"),
        DONE,
    )
    wire_server.serve(Scripted(headers=SSE, chunks=chunks, stall_after=3))
    streamed = "Checking the sky over Paris"
    channel, delivered = delivery_watch(streamed)
    # no API key: the key mask would hold back the final "s" as a possible start of "sk-…"
    provider = OpenAICompatibleProvider(wire_server.url + "/v1", "test-model")
    policy = LoopPolicy(
        inactivity_timeout=INACTIVITY, first_token_timeout=FIRST_TOKEN, delivery_flush_chars=1
    )
    clock = VirtualClock()
    turn = asyncio.ensure_future(
        run_tool_loop(provider, [], channel, QUESTION, policy=policy, clock=clock)
    )

    # the user has read everything sent before the stall, and the turn still waits for more
    assert await until_delivered(lambda: channel.text, delivered, turn) == streamed
    assert not turn.done(), turn.result()
    clock.advance(INACTIVITY)
    result = await turn

    assert (result.status, result.reason) == (TurnStatus.TIMEOUT, "inactivity_timeout")
    # it ended when the window of silence after the last chunk ran out: not before, not later
    last_chunk = step_times(result.trace, "text_delta")[-1]
    assert last_chunk is not None
    assert step_times(result.trace, "inactivity_deadline") == [last_chunk + INACTIVITY]
    assert result.stream_results[-1].text == streamed
    assert result.delivered_text == streamed
    assert channel.text == streamed
    # the user is told why the reply stopped
    assert [(n.key, dict(n.params)) for n in channel.notices] == [
        ("timeout", {"reason": "inactivity_timeout"})
    ]
    # the loop closed the HTTP response: the stalled server sees its client go
    await wire_server.client_gone.wait()
    assert len(wire_server.requests) == 1


async def test_a_stall_after_a_slow_first_token_ends_one_inactivity_window_later(
    wire_server: WireServer,
) -> None:
    chunks = (frame({"content": "Slow "}), frame({"content": "start"}), DONE)
    wire_server.serve(Scripted(headers=SSE, chunks=chunks, stall_after=2))
    clock = VirtualClock()
    slow = 0.5  # after the inactivity window, well inside the first-token window

    async def slow_headers(_response: httpx.Response) -> None:
        # the server's answer reaches the loop late, on the turn's clock
        await clock.sleep(slow)

    channel, delivered = delivery_watch("Slow start")
    policy = LoopPolicy(
        inactivity_timeout=INACTIVITY, first_token_timeout=FIRST_TOKEN, delivery_flush_chars=1
    )
    # the client's read timeout is a real timer: it holds virtual time still while the
    # stalled response is read (the default client's 600 s, not httpx's 5 s)
    async with httpx.AsyncClient(
        timeout=DEFAULT_TIMEOUT, event_hooks={"response": [slow_headers]}
    ) as client:
        provider = OpenAICompatibleProvider(wire_server.url + "/v1", "test-model", client=client)
        turn = asyncio.ensure_future(
            run_tool_loop(provider, [], channel, QUESTION, policy=policy, clock=clock)
        )
        assert await until_delivered(lambda: channel.text, delivered, turn) == "Slow start"
        assert not turn.done(), turn.result()
        # the first chunk came after the inactivity window had passed: that did not end it
        assert clock.now() == slow
        clock.advance(INACTIVITY)
        result = await turn

    assert (result.status, result.reason) == (TurnStatus.TIMEOUT, "inactivity_timeout")
    assert result.delivered_text == "Slow start"
    # first chunk at 0.5 s, then 0.3 s of silence: the turn ends at 0.8 s, not at 5 s
    assert step_times(result.trace, "inactivity_deadline") == [slow + INACTIVITY]
    await wire_server.client_gone.wait()


# ----------------------------------------------------------------------------- a generation turn
async def test_generation_turn_falls_back_after_a_429_and_runs_the_tool_once(
    wire_server: WireServer,
) -> None:
    rate_limited = Scripted(
        status=429,
        headers=(("content-type", "application/json"), ("retry-after", "3")),
        chunks=(
            b'{"error": {"message": "Rate limit reached", "type": "requests",'
            b' "code": "rate_limit_exceeded"}}',
        ),
        framing="length",
    )
    wire_server.serve(
        rate_limited,
        Scripted(
            headers=SSE, chunks=tool_call_stream("Let me look. ", "get_weather", {"city": "Paris"})
        ),
        Scripted(headers=SSE, chunks=text_stream("It is clear ", "and 21 °C.")),
    )
    runs: list[dict[str, Any]] = []

    async def get_weather(arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        runs.append(dict(arguments))
        return ToolResult(data={"city": arguments["city"], "sky": "clear", "temp_c": 21})

    parameters = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = [Tool("get_weather", "Current weather for a city.", parameters, get_weather)]

    def model(name: str) -> Any:
        return lambda key: OpenAICompatibleProvider(wire_server.url + "/v1", name, api_key=key)

    attempts = [
        Attempt(model("fast-model"), keys=("sk-fast-key",), label="fast"),
        Attempt(model("backup-model"), keys=("sk-backup-key",), label="backup"),
    ]
    channel = RecordingChannel()
    key_book: dict[tuple[str, int], KeyHealth] = {}
    policy = TurnPolicy(loop=LoopPolicy(first_token_timeout=5, inactivity_timeout=5))

    clock = VirtualClock()
    before = clock.now()
    result = await run_generation_turn(
        attempts, tools, channel, QUESTION, policy=policy, clock=clock, key_book=key_book
    )
    after = clock.now()

    assert result.status is TurnStatus.COMPLETED
    assert result.delivered_text == "Let me look. It is clear and 21 °C."
    assert [(a.label, a.superseded) for a in result.attempts] == [
        ("fast", True),
        ("backup", False),
    ]
    assert runs == [{"city": "Paris"}]  # the tool ran once
    assert [entry.call.name for entry in result.history] == ["get_weather"]

    # the first key cools for the server's Retry-After (3 s), on the turn's clock
    cooled = key_book[("fast", 0)]
    assert not cooled.retired
    assert before + 3 <= cooled.cooldown_until <= after + 3
    assert key_book[("backup", 0)].usable_at(after)

    # over the wire: one request per pass, each model with its own key and name
    requests = wire_server.requests
    assert len(requests) == 3
    assert [r.header("authorization") for r in requests] == [
        "Bearer sk-fast-key",
        "Bearer sk-backup-key",
        "Bearer sk-backup-key",
    ]
    assert [json.loads(r.body)["model"] for r in requests] == [
        "fast-model",
        "backup-model",
        "backup-model",
    ]
    # the tool's result went back to the model in the follow-up request
    follow_up = json.loads(requests[2].body)["messages"]
    tool_messages = [m for m in follow_up if m.get("role") == "tool"]
    assert len(tool_messages) == 1 and "clear" in tool_messages[0]["content"]
    # no key reached what the user sees
    assert "sk-fast-key" not in repr(result) and "sk-backup-key" not in repr(result)


# ----------------------------------------------------------------------------- a wild Retry-After
@pytest.mark.parametrize(
    ("header", "retry_after"),
    [("inf", 86400.0), ("1e400", 86400.0), ("nan", None), ("-30", 0.0)],
)
async def test_a_wild_retry_after_cools_the_key_at_most_a_day_and_the_result_stays_json(
    wire_server: WireServer, header: str, retry_after: float | None
) -> None:
    wire_server.serve(
        Scripted(
            status=429,
            headers=(("content-type", "application/json"), ("retry-after", header)),
            chunks=(b'{"error": {"message": "Rate limit reached", "type": "rate_limit_error"}}',),
            framing="length",
        )
    )

    def provider(key: str | None) -> OpenAICompatibleProvider:
        return OpenAICompatibleProvider(wire_server.url + "/v1", "m", api_key=key)

    key_book: dict[tuple[str, int], KeyHealth] = {}
    clock = VirtualClock()
    before = clock.now()
    result = await run_generation_turn(
        [Attempt(provider, keys=("sk-only-key",), label="only")],
        [],
        RecordingChannel(),
        QUESTION,
        clock=clock,
        key_book=key_book,
    )

    assert (result.status, result.provider_error_kind) == (TurnStatus.ERROR, "rate_limit")
    assert result.retry_after == retry_after
    # the key is back within a day (NaN is no hint: the policy's own rate-limit pause applies)
    assert key_book[("only", 0)].cooldown_until <= before + 86400.0 + 60
    # the result is strict JSON: no NaN, no Infinity
    json.loads(result_to_json(result), parse_constant=lambda token: pytest.fail(token))
