"""The telemetry dashboards read (`toolloop_fsm.otel`, docs/telemetry.md): the values the
OpenTelemetry GenAI conventions require — well-known provider names, the operation each API
performs, the server, the response's model and id, the host's conversation id — read back
from real adapters over loopback HTTP with the SDK's in-memory span exporter, and the
conventions' client metrics read back with its in-memory metric reader, their durations
exact on the virtual clock."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from tests.providers.wire_server import Scripted
from tests.providers.wire_server import WireServer
from toolloop_fsm import Attempt
from toolloop_fsm import FunctionCall
from toolloop_fsm import LoopPolicy
from toolloop_fsm import Provider
from toolloop_fsm import ProviderError
from toolloop_fsm import TextDelta
from toolloop_fsm import Tool
from toolloop_fsm import ToolContext
from toolloop_fsm import ToolResult
from toolloop_fsm import TurnPolicy
from toolloop_fsm import TurnRequest
from toolloop_fsm import TurnStatus
from toolloop_fsm import UsageReport
from toolloop_fsm import otel
from toolloop_fsm import run_generation_turn
from toolloop_fsm import run_tool_loop
from toolloop_fsm.host import LoopClock
from toolloop_fsm.observation import identify_provider
from toolloop_fsm.providers.anthropic import AnthropicProvider
from toolloop_fsm.providers.gemini import GeminiProvider
from toolloop_fsm.providers.ollama import OllamaProvider
from toolloop_fsm.providers.openai_compat import OpenAICompatibleProvider
from toolloop_fsm.providers.openai_completions import OpenAICompletionsProvider
from toolloop_fsm.providers.openai_responses import OpenAIResponsesProvider
from toolloop_fsm.providers.verbatim import VerbatimToolCalls
from toolloop_fsm.result import TraceStep
from toolloop_fsm.testing import Fail
from toolloop_fsm.testing import Pause
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import ScriptedProvider
from toolloop_fsm.testing import VirtualClock

ROOT = Path(__file__).resolve().parent.parent
QUESTION = [{"role": "user", "content": "What's the weather in Paris?"}]
SSE = (("content-type", "text/event-stream"),)
NDJSON = (("content-type", "application/x-ndjson"),)


class Telemetry:
    """A tracer provider and a meter provider that keep what they are given."""

    def __init__(self) -> None:
        self.spans = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])

    def finished(self) -> tuple[ReadableSpan, ...]:
        return self.spans.get_finished_spans()

    def span(self, name: str) -> ReadableSpan:
        [span] = [span for span in self.finished() if span.name == name]
        return span

    def points(self, metric: str) -> list[HistogramDataPoint]:
        data = self.reader.get_metrics_data()
        found: list[HistogramDataPoint] = []
        for resource in data.resource_metrics if data is not None else ():
            for scope in resource.scope_metrics:
                for seen in scope.metrics:
                    if seen.name == metric:
                        found.extend(
                            p for p in seen.data.data_points if isinstance(p, HistogramDataPoint)
                        )
        return found

    def measured(self, metric: str) -> list[tuple[dict[str, Any], float, int]]:
        """Each point of ``metric``: its attributes, its sum and its count, sorted."""
        seen = [(dict(p.attributes or {}), p.sum, p.count) for p in self.points(metric)]
        return sorted(seen, key=repr)


@pytest.fixture
def telemetry() -> Iterator[Telemetry]:
    kept = Telemetry()
    otel.instrument(tracer_provider=kept.tracer_provider, meter_provider=kept.meter_provider)
    try:
        yield kept
    finally:
        otel.uninstrument()


def attributes(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


# --------------------------------------------------------------------------- wire streams
def sse(*events: dict[str, Any], named: bool = False, done: bool = False) -> tuple[bytes, ...]:
    """Server-sent events carrying ``events`` (named by their ``type`` when ``named``)."""
    frames = []
    for event in events:
        head = f"event: {event['type']}\n" if named else ""
        frames.append(f"{head}data: {json.dumps(event)}\n\n".encode())
    if done:
        frames.append(b"data: [DONE]\n\n")
    return tuple(frames)


def chat_stream(model: str, response_id: str) -> tuple[bytes, ...]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {
            "id": response_id,
            "object": "chat.completion.chunk",
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }

    return sse(chunk({"role": "assistant", "content": "Clear."}), chunk({}, "stop"), done=True)


def completion_stream(model: str, response_id: str) -> tuple[bytes, ...]:
    def chunk(text: str, finish: str | None = None) -> dict[str, Any]:
        return {
            "id": response_id,
            "object": "text_completion",
            "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish}],
        }

    return sse(chunk(" Clear."), chunk("", "stop"), done=True)


def anthropic_stream(model: str, response_id: str) -> tuple[bytes, ...]:
    message = {"id": response_id, "type": "message", "role": "assistant", "model": model}
    return sse(
        {"type": "message_start", "message": {**message, "usage": {"input_tokens": 12}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text"}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {}},
        {"type": "message_stop"},
        named=True,
    )


def gemini_stream(model: str, response_id: str) -> tuple[bytes, ...]:
    candidate = {"index": 0, "content": {"role": "model", "parts": [{"text": "Clear."}]}}
    return sse(
        {"candidates": [candidate], "modelVersion": model, "responseId": response_id},
        {
            "candidates": [{**candidate, "content": {"parts": []}, "finishReason": "STOP"}],
            "modelVersion": model,
            "responseId": response_id,
        },
    )


def responses_stream(model: str, response_id: str) -> tuple[bytes, ...]:
    response = {"id": response_id, "object": "response", "model": model, "status": "completed"}
    return sse(
        {"type": "response.created", "response": {**response, "status": "in_progress"}},
        {"type": "response.output_text.delta", "item_id": "msg_1", "delta": "Clear."},
        {"type": "response.completed", "response": {**response, "output": []}},
        named=True,
    )


def ollama_stream(model: str, _response_id: str) -> tuple[bytes, ...]:
    lines = [
        {"model": model, "message": {"role": "assistant", "content": "Clear."}, "done": False},
        {"model": model, "message": {"role": "assistant", "content": ""}, "done": True,
         "done_reason": "stop", "prompt_eval_count": 9, "eval_count": 2},
    ]  # fmt: skip
    return tuple(json.dumps(line).encode() + b"\n" for line in lines)


# (adapter, its stream, the provider name, the operation, whether the stream names an id)
ADAPTERS = {
    "openai-chat": (OpenAICompatibleProvider, chat_stream, "openai", "chat", True),
    "openai-completions": (
        OpenAICompletionsProvider,
        completion_stream,
        "openai",
        "text_completion",
        True,
    ),
    "openai-responses": (OpenAIResponsesProvider, responses_stream, "openai", "chat", True),
    "anthropic": (AnthropicProvider, anthropic_stream, "anthropic", "chat", True),
    "gemini": (GeminiProvider, gemini_stream, "gcp.gemini", "generate_content", True),
    "ollama": (OllamaProvider, ollama_stream, "ollama", "chat", False),
}


def root_of(adapter: type, server: WireServer) -> str:
    return server.url if adapter is OllamaProvider else server.url + "/v1"


# --------------------------------------------------------------------------- the adapters
@pytest.mark.parametrize("case", list(ADAPTERS))
async def test_each_adapter_names_its_provider_operation_server_and_response(
    case: str, telemetry: Telemetry, wire_server: WireServer
) -> None:
    adapter, stream, provider_name, operation, names_id = ADAPTERS[case]
    wire_server.serve(
        Scripted(
            headers=NDJSON if adapter is OllamaProvider else SSE,
            chunks=stream("weather-model-2026-01-15", "resp_0042"),
        )
    )
    provider = adapter(root_of(adapter, wire_server), "weather-model")
    result = await run_tool_loop(
        provider, [], RecordingChannel(), TurnRequest(QUESTION), clock=LoopClock()
    )
    assert result.status is TurnStatus.COMPLETED, result.error_message
    chat = telemetry.span(f"{operation} weather-model")
    assert chat.kind is SpanKind.CLIENT
    seen = attributes(chat)
    expected = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": provider_name,
        "gen_ai.request.model": "weather-model",
        "gen_ai.response.model": "weather-model-2026-01-15",
        "server.address": "127.0.0.1",
        "server.port": wire_server.port,
    }
    if names_id:
        expected["gen_ai.response.id"] = "resp_0042"
    assert {key: seen.get(key) for key in expected} == expected
    assert ("gen_ai.response.id" in seen) is names_id
    # the turn says whose model answered it
    assert attributes(telemetry.span("invoke_agent"))["gen_ai.provider.name"] == provider_name
    # and the pass's duration is measured under the same names
    [(measured, _sum, count)] = telemetry.measured("gen_ai.client.operation.duration")
    assert count == 1
    assert measured == {
        key: value for key, value in expected.items() if key != "gen_ai.response.id"
    }


async def test_a_compatible_server_is_named_by_the_hosts_provider_name(
    telemetry: Telemetry, wire_server: WireServer
) -> None:
    wire_server.serve(Scripted(headers=SSE, chunks=chat_stream("llama-3.3-70b", "chatcmpl-7")))
    groq = OpenAICompatibleProvider(
        wire_server.url + "/v1", "llama-3.3-70b", api_key="gsk-x", provider_name="groq"
    )
    request = TurnRequest(QUESTION, conversation_id="thread-81")
    await run_tool_loop(groq, [], RecordingChannel(), request, clock=LoopClock())
    chat = attributes(telemetry.span("chat llama-3.3-70b"))
    turn = attributes(telemetry.span("invoke_agent"))
    assert chat["gen_ai.provider.name"] == turn["gen_ai.provider.name"] == "groq"
    assert chat["gen_ai.conversation.id"] == turn["gen_ai.conversation.id"] == "thread-81"
    assert chat["gen_ai.response.id"] == "chatcmpl-7"


def test_an_adapter_says_who_it_is_without_a_request() -> None:
    cases: list[tuple[Provider, tuple[str, str, str, int]]] = [
        (
            AnthropicProvider("https://api.anthropic.com/v1", "claude-x"),
            ("anthropic", "chat", "api.anthropic.com", 443),
        ),
        (
            GeminiProvider("https://generativelanguage.googleapis.com/v1beta", "gemini-x"),
            ("gcp.gemini", "generate_content", "generativelanguage.googleapis.com", 443),
        ),
        (
            OllamaProvider("http://127.0.0.1:11434", "llama3"),
            ("ollama", "chat", "127.0.0.1", 11434),
        ),
        (
            OpenAICompletionsProvider("http://localhost/v1", "gpt-x"),
            ("openai", "text_completion", "localhost", 80),
        ),
        (
            # a wrapper is looked through to the adapter it wraps
            VerbatimToolCalls(
                OpenAICompatibleProvider(
                    "https://api.deepseek.com/v1", "deepseek-chat", provider_name="deepseek"
                )
            ),
            ("deepseek", "chat", "api.deepseek.com", 443),
        ),
    ]
    for provider, expected in cases:
        identity = identify_provider(provider)
        seen = (identity.name, identity.operation, identity.server_address, identity.server_port)
        assert seen == expected, provider


@pytest.mark.parametrize(("bad", "error"), [("", ValueError), (42, TypeError)])
def test_a_provider_name_that_is_no_text_is_refused_with_a_message(
    bad: Any, error: type[Exception]
) -> None:
    with pytest.raises(error, match="provider_name must be a non-empty text"):
        OpenAICompatibleProvider("https://api.groq.com/openai/v1", "m", provider_name=bad)


def test_a_conversation_id_that_is_blank_is_refused() -> None:
    with pytest.raises((TypeError, ValueError), match="conversation_id"):
        TurnRequest(QUESTION, conversation_id="  ")


# --------------------------------------------------------------------------- metrics
def weather_tool(clock: VirtualClock, seconds: float, behaviour: str = "ok") -> Tool:
    async def weather(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        await clock.sleep(seconds)
        if behaviour == "raise":
            raise ConnectionError("the station is down")
        return ToolResult(data={"sky": "clear"})

    return Tool("weather", "the weather", {"type": "object"}, weather, timeout=60)


class ModelProvider(ScriptedProvider):
    model = "test-model-1"


async def test_metrics_measure_each_pass_tool_and_turn_on_the_turns_clock(
    telemetry: Telemetry,
) -> None:
    clock = VirtualClock(start=1000.0)
    provider = ModelProvider(
        [
            [
                Pause(1.5),
                FunctionCall("weather", {"city": "Paris"}, "call_1"),
                UsageReport(100, 10),
            ],
            [Pause(0.25), TextDelta("Clear skies."), UsageReport(130, 5)],
        ],
        clock=clock,
    )
    result = await run_tool_loop(
        provider,
        [weather_tool(clock, 2.5)],
        RecordingChannel(clock=clock),
        TurnRequest(QUESTION, conversation_id="thread-1"),
        clock=clock,
    )
    assert result.status is TurnStatus.COMPLETED
    chat = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "scripted",
        "gen_ai.request.model": "test-model-1",
    }
    # one histogram point per set of attributes: both passes fall in the same one
    assert telemetry.measured("gen_ai.client.operation.duration") == [(chat, 1.75, 2)]
    assert telemetry.measured("gen_ai.client.token.usage") == [
        ({**chat, "gen_ai.token.type": "input"}, 230, 2),
        ({**chat, "gen_ai.token.type": "output"}, 15, 2),
    ]
    assert telemetry.measured("gen_ai.execute_tool.duration") == [
        ({"gen_ai.tool.name": "weather", "gen_ai.tool.type": "function"}, 2.5, 1)
    ]
    assert telemetry.measured("gen_ai.invoke_agent.duration") == [
        ({"gen_ai.request.model": "test-model-1"}, 4.25, 1)
    ]
    [point] = telemetry.points("gen_ai.execute_tool.duration")
    assert tuple(point.explicit_bounds) == tuple(otel.OPERATION_SECONDS)
    [point, _output] = telemetry.points("gen_ai.client.token.usage")
    assert tuple(point.explicit_bounds) == tuple(otel.TOKEN_COUNTS)


async def test_a_tool_that_raises_is_measured_and_traced_under_its_exception_class(
    telemetry: Telemetry,
) -> None:
    clock = VirtualClock()
    provider = ScriptedProvider(
        [[FunctionCall("weather", {}, "call_9")], [TextDelta("Sorry.")]], clock=clock
    )
    await run_tool_loop(
        provider,
        [weather_tool(clock, 0.5, "raise")],
        RecordingChannel(clock=clock),
        TurnRequest(QUESTION),
        clock=clock,
    )
    span = telemetry.span("execute_tool weather")
    assert attributes(span)["error.type"] == "ConnectionError"
    assert attributes(span)["gen_ai.tool.call.id"] == "call_9"
    [event] = span.events
    assert (event.name, dict(event.attributes or {})) == (
        "exception",
        {"exception.type": "ConnectionError", "exception.message": "the station is down"},
    )
    assert telemetry.measured("gen_ai.execute_tool.duration") == [
        (
            {
                "gen_ai.tool.name": "weather",
                "gen_ai.tool.type": "function",
                "error.type": "ConnectionError",
            },
            0.5,
            1,
        )
    ]


async def test_a_failed_pass_is_measured_with_its_error_type_and_no_tokens(
    telemetry: Telemetry,
) -> None:
    clock = VirtualClock()
    bad = ProviderError("400 bad request", kind="bad_request", retryable=False, status_code=400)
    provider = ScriptedProvider([[Pause(0.75), Fail(bad)]], clock=clock)
    await run_tool_loop(
        provider, [], RecordingChannel(clock=clock), TurnRequest(QUESTION), clock=clock
    )
    assert telemetry.measured("gen_ai.client.operation.duration") == [
        (
            {
                "gen_ai.operation.name": "chat",
                "gen_ai.provider.name": "scripted",
                "error.type": "bad_request",
            },
            0.75,
            1,
        )
    ]
    assert telemetry.measured("gen_ai.client.token.usage") == []
    assert telemetry.measured("gen_ai.invoke_agent.duration") == [
        ({"error.type": "provider_error"}, 0.75, 1)
    ]


async def test_usage_the_library_estimated_is_not_reported_as_the_providers(
    telemetry: Telemetry,
) -> None:
    clock = VirtualClock()
    provider = ScriptedProvider([[TextDelta("Clear skies over Paris today.")]], clock=clock)
    result = await run_tool_loop(
        provider, [], RecordingChannel(clock=clock), TurnRequest(QUESTION), clock=clock
    )
    assert result.usage.has_estimates  # the scripted provider reported none
    assert telemetry.measured("gen_ai.client.token.usage") == []
    assert len(telemetry.measured("gen_ai.client.operation.duration")) == 1


async def test_without_a_meter_provider_no_metric_is_recorded() -> None:
    kept = Telemetry()
    otel.instrument(tracer_provider=kept.tracer_provider)
    try:
        clock = VirtualClock()
        provider = ScriptedProvider([[TextDelta("Hello.")]], clock=clock)
        await run_tool_loop(
            provider, [], RecordingChannel(clock=clock), TurnRequest(QUESTION), clock=clock
        )
    finally:
        otel.uninstrument()
    assert [span.name for span in kept.finished()] == ["chat", "invoke_agent"]
    assert kept.points("gen_ai.client.operation.duration") == []


async def test_metrics_alone_are_recorded_when_no_span_is() -> None:
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    kept = Telemetry()
    unsampled = TracerProvider(sampler=ALWAYS_OFF)
    unsampled.add_span_processor(SimpleSpanProcessor(kept.spans))
    otel.instrument(tracer_provider=unsampled, meter_provider=kept.meter_provider)
    try:
        clock = VirtualClock()
        provider = ScriptedProvider([[Pause(2), TextDelta("Hello.")]], clock=clock)
        await run_tool_loop(
            provider, [], RecordingChannel(clock=clock), TurnRequest(QUESTION), clock=clock
        )
    finally:
        otel.uninstrument()
    assert kept.finished() == ()
    assert kept.measured("gen_ai.invoke_agent.duration") == [({}, 2.0, 1)]


async def test_a_cancelled_turn_is_measured_as_cancelled_up_to_its_cancellation(
    telemetry: Telemetry,
) -> None:
    clock = VirtualClock()
    provider = ScriptedProvider(
        [[TextDelta("Clear "), Pause(100), TextDelta("skies.")]], clock=clock
    )
    turn = asyncio.ensure_future(
        run_tool_loop(
            provider, [], RecordingChannel(clock=clock), TurnRequest(QUESTION), clock=clock
        )
    )

    def cancel() -> None:
        turn.cancel()

    clock.call_later(5, cancel)  # while the pass waits for its next chunk
    with pytest.raises(asyncio.CancelledError):
        await turn
    chat = {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "scripted"}
    assert telemetry.measured("gen_ai.client.operation.duration") == [
        ({**chat, "error.type": "cancelled"}, 5.0, 1)
    ]
    assert telemetry.measured("gen_ai.invoke_agent.duration") == [
        ({"error.type": "cancelled"}, 5.0, 1)
    ]


async def test_a_turn_that_raises_records_the_exception_on_its_agent_span_and_measures_it(
    telemetry: Telemetry,
) -> None:
    # a host's step observer that raises ends the run with its exception (README: on_step)
    clock = VirtualClock()
    provider = ScriptedProvider([[TextDelta("Clear skies.")]], clock=clock)
    seen: list[str] = []

    def on_step(step: TraceStep) -> None:
        seen.append(step.next_state)
        if step.next_state == "streaming":
            raise LookupError("the host's log is full")

    with pytest.raises(LookupError):
        await run_tool_loop(
            provider,
            [],
            RecordingChannel(clock=clock),
            TurnRequest(QUESTION),
            clock=clock,
            on_step=on_step,
        )
    [agent] = [s for s in telemetry.finished() if s.name.startswith("invoke_agent")]
    assert attributes(agent)["error.type"] == "LookupError"
    assert attributes(agent)["toolloop.status"] == "raised"
    exceptions = [dict(e.attributes or {}) for e in agent.events if e.name == "exception"]
    assert exceptions == [
        {"exception.type": "LookupError", "exception.message": "the host's log is full"}
    ]
    assert telemetry.measured("gen_ai.invoke_agent.duration") == [
        ({"error.type": "LookupError"}, 0.0, 1)
    ]


# --------------------------------------------------------------------------- replay
async def test_an_outcome_reused_on_a_fallback_is_not_reported_as_a_new_execution(
    telemetry: Telemetry,
) -> None:
    clock = VirtualClock()
    runs: list[str] = []

    async def roll(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        runs.append("roll")
        await clock.sleep(1)
        return ToolResult(data={"face": len(runs)})

    failing = ScriptedProvider(
        [
            [FunctionCall("roll", {}, "a1")],
            [Fail(ProviderError("503", kind="server", retryable=True, status_code=503))],
        ],
        clock=clock,
        name="first-llm",
    )
    backup = ScriptedProvider(
        [[FunctionCall("roll", {}, "b1")], [TextDelta("You rolled a one.")]],
        clock=clock,
        name="backup-llm",
    )
    result = await run_generation_turn(
        [Attempt(failing, label="first"), Attempt(backup, label="backup")],
        [Tool("roll", "a die", {"type": "object"}, roll)],
        RecordingChannel(clock=clock),
        TurnRequest(QUESTION),
        policy=TurnPolicy(loop=LoopPolicy()),
        clock=clock,
    )
    assert result.status is TurnStatus.COMPLETED
    assert runs == ["roll"]  # the backup reused the first attempt's roll
    tools = [span for span in telemetry.finished() if span.name == "execute_tool roll"]
    assert [attributes(span)["gen_ai.tool.call.id"] for span in tools] == ["a1"]
    assert telemetry.measured("gen_ai.execute_tool.duration") == [
        ({"gen_ai.tool.name": "roll", "gen_ai.tool.type": "function"}, 1.0, 1)
    ]
    # the turn is named by the provider that answered it
    assert attributes(telemetry.span("invoke_agent"))["gen_ai.provider.name"] == "backup-llm"


# --------------------------------------------------------------------------- the documented table
def documented_attributes() -> set[str]:
    text = (ROOT / "docs" / "telemetry.md").read_text(encoding="utf-8")
    text = text.split("## 4. Where each attribute comes from", 1)[1]
    return set(re.findall(r"^\| `([a-z_.]+)` \|", text, flags=re.MULTILINE))


async def test_every_attribute_a_turn_records_is_in_the_documented_table(
    telemetry: Telemetry, wire_server: WireServer
) -> None:
    clock = VirtualClock()
    failing = ScriptedProvider(
        [[FunctionCall("weather", {}, "c1"), UsageReport(5, 1)], [Fail(ProviderError(
            "429 slow down", kind="rate_limit", retryable=True, status_code=429, retry_after=3
        ))]],
        clock=clock,
    )  # fmt: skip
    backup = ModelProvider([[TextDelta("Clear."), UsageReport(9, 2)]], clock=clock)
    await run_generation_turn(
        [Attempt(failing, keys=("sk-a",), label="main"), Attempt(backup, label="backup")],
        [weather_tool(clock, 1, "raise")],
        RecordingChannel(clock=clock),
        TurnRequest(QUESTION, conversation_id="thread-2"),
        clock=clock,
    )
    wire_server.serve(Scripted(headers=SSE, chunks=chat_stream("m-2026", "chatcmpl-1")))
    provider = OpenAICompatibleProvider(wire_server.url + "/v1", "m")
    observer = otel.TracingObserver(
        tracer_provider=telemetry.tracer_provider, agent_name="weather-bot"
    )
    await run_tool_loop(provider, [], RecordingChannel(), TurnRequest(QUESTION), observer=observer)
    recorded: set[str] = set()
    for span in telemetry.finished():
        recorded |= set(span.attributes or {})
        for event in span.events:
            recorded |= set(event.attributes or {})
    for metric in (
        "gen_ai.client.operation.duration",
        "gen_ai.client.token.usage",
        "gen_ai.execute_tool.duration",
        "gen_ai.invoke_agent.duration",
    ):
        for point in telemetry.points(metric):
            recorded |= set(point.attributes or {})
    undocumented = recorded - documented_attributes()
    assert not undocumented, f"add a row to docs/telemetry.md for each of {sorted(undocumented)}"
    # the table lists no attribute nothing records
    assert documented_attributes() - recorded == set()


async def test_a_turn_resumed_from_a_snapshot_reports_no_tool_it_did_not_run_again(
    telemetry: Telemetry,
) -> None:
    from toolloop_fsm import resume_tool_loop
    from toolloop_fsm.snapshot import snapshot_from_json
    from toolloop_fsm.snapshot import snapshot_to_json

    clock = VirtualClock()
    passes: list[list[Any]] = [
        [FunctionCall("weather", {"city": "Oslo"}, "call_1")],
        [TextDelta("Clear in Oslo.")],
    ]
    saved: list[str] = []
    request = TurnRequest(QUESTION, turn_id="turn-7", conversation_id="thread-7")
    await run_tool_loop(
        ScriptedProvider(passes, clock=clock),
        [weather_tool(clock, 1)],
        RecordingChannel(clock=clock),
        request,
        clock=clock,
        on_snapshot=lambda snapshot: saved.append(snapshot_to_json(snapshot)),
    )
    assert len(telemetry.measured("gen_ai.execute_tool.duration")) == 1
    telemetry.spans.clear()
    resumed = await resume_tool_loop(
        snapshot_from_json(saved[1]),  # after the tool round, before pass 2
        ScriptedProvider(passes[1:], clock=clock),
        [weather_tool(clock, 1)],
        RecordingChannel(clock=clock),
        clock=clock,
    )
    assert resumed.final_text == "Clear in Oslo."
    assert sorted(span.name for span in telemetry.finished()) == ["chat", "invoke_agent"]
    # the resumed turn is still the host's conversation
    assert attributes(telemetry.span("invoke_agent"))["gen_ai.conversation.id"] == "thread-7"
    [(_attributes, total, count)] = telemetry.measured("gen_ai.execute_tool.duration")
    assert (total, count) == (1.0, 1)  # the first run's only
