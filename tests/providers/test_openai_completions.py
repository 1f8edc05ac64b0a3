"""OpenAICompletionsProvider over real loopback HTTP: the prompt it sends, the text deltas,
finish reasons and usage it reads, the failures it classifies; and whole continuation turns,
`ContinuationSession(OpenAICompletionsProvider(...))` through `run_tool_loop`."""

from __future__ import annotations

import json
from collections.abc import Mapping
from collections.abc import Sequence
from contextlib import aclosing
from typing import Any

import pytest

from tests.providers.replay import collect
from tests.providers.wire_server import Scripted
from tests.providers.wire_server import WireServer
from toolloop_fsm import FinishKind
from toolloop_fsm import FinishReason
from toolloop_fsm import LoopPolicy
from toolloop_fsm import TextDelta
from toolloop_fsm import TurnRequest
from toolloop_fsm import TurnSignals
from toolloop_fsm import TurnStatus
from toolloop_fsm import UsageReport
from toolloop_fsm import run_tool_loop
from toolloop_fsm.host import LoopClock
from toolloop_fsm.provider import ProviderError
from toolloop_fsm.provider import ProviderRequest
from toolloop_fsm.provider import ToolSpec
from toolloop_fsm.providers import ContinuationSession
from toolloop_fsm.providers import OpenAICompletionsProvider
from toolloop_fsm.result import Delivered
from toolloop_fsm.result import ToolCallRecord
from toolloop_fsm.result import ToolHistoryEntry
from toolloop_fsm.result import ToolResponseRecord
from toolloop_fsm.testing import RecordingChannel

API_KEY = "sk-test-completions-0123456789-SECRET"
SSE = (("content-type", "text/event-stream"),)
STORY = [{"role": "user", "content": "Tell me a story."}]
STORY_PROMPT = "User: Tell me a story.\n\nAssistant:"
DONE = b"data: [DONE]\n\n"


def make(server: WireServer, **options: Any) -> OpenAICompletionsProvider:
    return OpenAICompletionsProvider(server.url + "/v1", "story-model", api_key=API_KEY, **options)


def event(payload: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def piece(text: str, finish: str | None = None) -> bytes:
    """One completions stream chunk, shaped as vLLM and llama.cpp send it."""
    return event(
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 1730000000,
            "model": "story-model",
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
        }
    )


def usage(prompt_tokens: int, completion_tokens: int) -> bytes:
    """The closing usage chunk that ``stream_options.include_usage`` asks for."""
    return event(
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 1730000000,
            "model": "story-model",
            "choices": [],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }
    )


def fragment(
    texts: Sequence[str], finish: str, tokens: tuple[int, int] | None = None
) -> tuple[bytes, ...]:
    body = [piece(text) for text in texts] + [piece("", finish)]
    if tokens is not None:
        body.append(usage(*tokens))
    return (*body, DONE)


def sent(server: WireServer) -> list[dict[str, Any]]:
    return [json.loads(request.body) for request in server.requests]


# ----------------------------------------------------------------------------- the stream
@pytest.mark.parametrize("cut_every", [None, 1, 7, 64])
async def test_text_deltas_finish_and_usage_arrive_however_the_bytes_are_split(
    wire_server: WireServer, cut_every: int | None
) -> None:
    body = b"".join(fragment(["Once", " upon", " a time"], "stop", (9, 3)))
    step = cut_every or len(body)
    wire_server.serve(
        Scripted(headers=SSE, chunks=tuple(body[i : i + step] for i in range(0, len(body), step)))
    )
    chunks = await collect(make(wire_server), ProviderRequest(STORY))

    assert "".join(c.text for c in chunks if isinstance(c, TextDelta)) == "Once upon a time"
    assert [c for c in chunks if not isinstance(c, TextDelta)] == [
        FinishReason(FinishKind.STOP, "stop"),
        UsageReport(input_tokens=9, output_tokens=3),
    ]


async def test_a_fragment_cut_by_max_tokens_finishes_length(wire_server: WireServer) -> None:
    wire_server.serve(Scripted(headers=SSE, chunks=fragment(["It was a dark"], "length")))
    chunks = await collect(make(wire_server), ProviderRequest(STORY))
    assert chunks == [TextDelta("It was a dark"), FinishReason(FinishKind.LENGTH, "length")]


# ----------------------------------------------------------------------------- the request
async def test_the_request_is_a_streamed_prompt_with_max_tokens_and_never_tools(
    wire_server: WireServer,
) -> None:
    wire_server.serve(Scripted(headers=SSE, chunks=fragment(["."], "stop")))
    provider = make(wire_server, extra_body={"temperature": 0.8})
    request = ProviderRequest(
        [{"role": "system", "content": "You tell tales."}, *STORY],
        tools=[ToolSpec("get_weather", "weather", {"type": "object"})],
        prefill=" Once",
        max_output=64,
    )
    await collect(provider, request)

    (received,) = wire_server.requests
    assert (received.method, received.target) == ("POST", "/v1/completions")
    assert received.header("authorization") == f"Bearer {API_KEY}"
    assert sent(wire_server) == [
        {
            "model": "story-model",
            "prompt": "System: You tell tales.\n\nUser: Tell me a story.\n\nAssistant: Once",
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": 64,
            "temperature": 0.8,
        }
    ]


async def test_tool_history_is_written_into_the_prompt_as_plain_messages(
    wire_server: WireServer,
) -> None:
    wire_server.serve(Scripted(headers=SSE, chunks=fragment(["."], "stop")))
    history = (
        ToolHistoryEntry(
            call=ToolCallRecord("roll_die", {"sides": 6}),
            response=ToolResponseRecord(success=True, data=4, message="rolled"),
            pre_tool_text="Rolling. ",
        ),
    )
    await collect(make(wire_server), ProviderRequest(STORY, history=history))

    assert sent(wire_server)[0]["prompt"] == (
        "User: Tell me a story.\n\n"
        'Assistant: Rolling. roll_die({"sides": 6})\n\n'
        'User: [result of roll_die] {"success": true, "data": 4, "message": "rolled"}\n\n'
        "Assistant:"
    )


async def test_a_host_renderer_writes_the_prompt(wire_server: WireServer) -> None:
    wire_server.serve(Scripted(headers=SSE, chunks=fragment(["."], "stop")))

    def bare_story(messages: Sequence[Mapping[str, Any]]) -> str:
        return "".join(str(message["content"]) for message in messages)

    context = [{"role": "user", "content": "The lighthouse keeper"}]
    request = ProviderRequest(context, prefill=" woke")
    await collect(make(wire_server, render_prompt=bare_story), request)
    assert sent(wire_server)[0]["prompt"] == "The lighthouse keeper woke"


@pytest.mark.parametrize(
    ("message", "named"),
    [
        ({"content": "no role"}, "context message 1 has no role"),
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
            "context message 1 has a 'image_url' part",
        ),
        ({"role": "user", "content": {"text": "a dict"}}, "context message 1 has content of type"),
    ],
)
async def test_a_context_the_prompt_cannot_show_fails_as_a_bad_request_before_sending(
    wire_server: WireServer, message: dict[str, Any], named: str
) -> None:
    with pytest.raises(ProviderError) as caught:
        await collect(make(wire_server), ProviderRequest([*STORY, message]))
    assert (caught.value.kind, caught.value.retryable) == ("bad_request", False)
    assert named in caught.value.message
    assert wire_server.requests == []


# ----------------------------------------------------------------------------- failures
@pytest.mark.parametrize(
    ("status", "headers", "kind", "retryable", "retry_after"),
    [
        (429, (("retry-after", "7"),), "rate_limit", True, 7.0),
        (401, (), "auth", False, None),
        (503, (), "server", True, None),
        (400, (), "bad_request", False, None),
    ],
)
async def test_http_errors_are_classified_as_for_every_adapter(
    wire_server: WireServer,
    status: int,
    headers: tuple[tuple[str, str], ...],
    kind: str,
    retryable: bool,
    retry_after: float | None,
) -> None:
    body = b'{"error": {"message": "Refused: ' + API_KEY.encode() + b'", "type": "x"}}'
    wire_server.serve(
        Scripted(
            status=status,
            headers=(("content-type", "application/json"), *headers),
            chunks=(body,),
            framing="length",
        )
    )
    with pytest.raises(ProviderError) as caught:
        await collect(make(wire_server), ProviderRequest(STORY))
    error = caught.value
    assert (error.kind, error.retryable, error.status_code) == (kind, retryable, status)
    assert error.retry_after == retry_after
    assert "Refused" in error.message and API_KEY not in error.message


async def test_an_error_inside_the_stream_raises_after_the_text_before_it(
    wire_server: WireServer,
) -> None:
    overloaded = event({"error": {"message": "Overloaded", "type": "overloaded_error"}})
    wire_server.serve(Scripted(headers=SSE, chunks=(piece("Half a "), overloaded)))
    received: list[Any] = []
    with pytest.raises(ProviderError, match="Overloaded") as caught:
        async for chunk in make(wire_server).stream(ProviderRequest(STORY)):
            received.append(chunk)
    assert (caught.value.kind, caught.value.retryable) == ("server", True)
    assert received == [TextDelta("Half a ")]


async def test_a_stream_closed_before_it_finished_is_a_retryable_protocol_error(
    wire_server: WireServer,
) -> None:
    wire_server.serve(Scripted(headers=SSE, chunks=(piece("Half"),), framing="close"))
    with pytest.raises(ProviderError, match="ended without a finish_reason") as caught:
        await collect(make(wire_server), ProviderRequest(STORY))
    assert (caught.value.kind, caught.value.retryable) == ("protocol", True)


def test_the_api_key_is_never_in_repr() -> None:
    provider = OpenAICompletionsProvider("http://127.0.0.1:1/v1", "m", api_key=API_KEY)
    session = ContinuationSession(provider, max_total_output=10)
    assert API_KEY not in repr(provider) and API_KEY not in repr(session)
    assert "OpenAICompletionsProvider" in repr(session)


# ----------------------------------------------------------------------------- whole turns
async def test_a_continuation_turn_over_http_continues_until_the_model_stops(
    wire_server: WireServer,
) -> None:
    wire_server.serve(
        Scripted(headers=SSE, chunks=fragment([" Once", " upon a time"], "length", (10, 4))),
        Scripted(headers=SSE, chunks=fragment([" there was", " a fox"], "length", (14, 4))),
        Scripted(headers=SSE, chunks=fragment([" who found a key."], "stop", (18, 5))),
    )
    session = ContinuationSession(make(wire_server), max_total_output=50, max_fragments=5)
    channel = RecordingChannel()
    result = await run_tool_loop(session, [], channel, TurnRequest(STORY), clock=LoopClock())

    story = " Once upon a time there was a fox who found a key."
    assert result.status is TurnStatus.COMPLETED
    assert result.final_text == story
    assert channel.delivered_text == story
    # one pass of the loop, ended by the model itself
    assert [(s.outcome, s.finish) for s in result.stream_results] == [
        ("completed", FinishKind.STOP)
    ]
    # each request's prompt ends with the text so far; each asks for the budget left
    bodies = sent(wire_server)
    assert [body["prompt"] for body in bodies] == [
        STORY_PROMPT,
        STORY_PROMPT + " Once upon a time",
        STORY_PROMPT + " Once upon a time there was a fox",
    ]
    assert [body["max_tokens"] for body in bodies] == [50, 46, 42]
    # the ledger is the sum of what the server reported
    assert [(e.input_tokens, e.output_tokens, e.estimated) for e in result.usage.entries] == [
        (42, 13, False)
    ]


async def test_a_continuation_turn_over_http_stops_at_the_total_budget(
    wire_server: WireServer,
) -> None:
    wire_server.serve(
        Scripted(headers=SSE, chunks=fragment([" The sea"], "length", (10, 6))),
        Scripted(headers=SSE, chunks=fragment([" was calm"], "length", (12, 4))),
        Scripted(headers=SSE, chunks=fragment([" never asked for"], "stop", (14, 3))),
    )
    session = ContinuationSession(make(wire_server), max_total_output=10)
    result = await run_tool_loop(
        session, [], RecordingChannel(), TurnRequest(STORY), clock=LoopClock()
    )

    assert result.final_text == " The sea was calm"
    assert result.stream_results[-1].finish is FinishKind.LENGTH
    assert [body["max_tokens"] for body in sent(wire_server)] == [10, 4]


async def test_stopping_a_continuation_turn_mid_fragment_closes_the_connection(
    wire_server: WireServer,
) -> None:
    wire_server.serve(
        Scripted(headers=SSE, chunks=fragment([" The door"], "length", (10, 3))),
        Scripted(headers=SSE, chunks=(piece(" creaked"), piece(" open")), stall_after=1),
    )
    signals = TurnSignals()

    def stop_after_creak(delivered: Delivered) -> None:
        if delivered.text is not None and "creaked" in delivered.text:
            signals.request_stop()

    channel = RecordingChannel(on_delivery=stop_after_creak)
    session = ContinuationSession(make(wire_server), max_total_output=50)
    result = await run_tool_loop(
        session,
        [],
        channel,
        TurnRequest(STORY),
        policy=LoopPolicy(delivery_flush_chars=1),
        signals=signals,
        clock=LoopClock(),
    )

    assert result.status is TurnStatus.STOPPED_BY_USER
    assert channel.delivered_text == " The door creaked"
    await wire_server.client_gone.wait()
    assert len(wire_server.requests) == 2


async def test_closing_a_session_stream_early_disconnects_promptly(
    wire_server: WireServer,
) -> None:
    wire_server.serve(Scripted(headers=SSE, chunks=(piece("Never"), piece(" ends")), stall_after=1))
    session = ContinuationSession(make(wire_server), max_total_output=50)
    async with aclosing(session.stream(ProviderRequest(STORY))) as stream:
        async for _chunk in stream:
            break
    await wire_server.client_gone.wait()
