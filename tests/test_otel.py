"""OpenTelemetry spans of turns (`toolloop_fsm.otel`), read back with the SDK's in-memory
exporter: names, parents, GenAI attributes, error statuses — and never a key."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import SpanKind
from opentelemetry.trace import StatusCode

from toolloop_fsm import Attempt
from toolloop_fsm import FunctionCall
from toolloop_fsm import Provider
from toolloop_fsm import ProviderError
from toolloop_fsm import ProviderRequest
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
from toolloop_fsm.observation import PassStarted
from toolloop_fsm.observation import TurnAborted
from toolloop_fsm.observation import TurnStarted
from toolloop_fsm.pump.observing import observe_turn
from toolloop_fsm.pump.records import TurnRecords
from toolloop_fsm.testing import EchoKey
from toolloop_fsm.testing import Fail
from toolloop_fsm.testing import HostileProvider
from toolloop_fsm.testing import KeyEcho
from toolloop_fsm.testing import Pause
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import ScriptedProvider
from toolloop_fsm.testing import VirtualClock
from toolloop_fsm.testing import leaked_runs

REQUEST = TurnRequest([{"role": "user", "content": "what's the weather in Paris?"}])
KEYS = ("sk-live-0123456789abcdefSECRET", "sk-live-fedcba9876543210SECRET")


class ModelProvider(ScriptedProvider):
    """A scripted provider that names its model, as the adapters do."""

    model = "test-model-1"


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    otel.instrument(tracer_provider=provider)
    try:
        yield exporter
    finally:
        otel.uninstrument()


def by_name(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [span for span in spans if span.name == name]


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def span_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return int(span.context.span_id)


def weather_tool(clock: VirtualClock, behaviour: str = "ok") -> Tool:
    async def weather(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        if behaviour == "raise":
            raise RuntimeError("the station is down")
        if behaviour == "hang":
            await clock.sleep(1000)
        return ToolResult(data={"sky": "clear"})

    return Tool("weather", "the weather", {"type": "object"}, weather, timeout=5)


def rate_limited() -> ProviderError:
    return ProviderError(
        "429 slow down", kind="rate_limit", retryable=True, status_code=429, retry_after=30
    )


# --------------------------------------------------------------------------- the span tree
async def test_a_turn_is_an_invoke_agent_span_with_chat_and_execute_tool_children(
    exporter: InMemorySpanExporter,
) -> None:
    clock = VirtualClock()
    provider = ModelProvider(
        [
            [FunctionCall("weather", {"city": "Paris"}, "call_1"), UsageReport(100, 10)],
            [TextDelta("Clear skies."), UsageReport(130, 5)],
        ],
        clock=clock,
    )
    result = await run_tool_loop(
        provider, [weather_tool(clock)], RecordingChannel(clock=clock), REQUEST, clock=clock
    )
    assert result.status is TurnStatus.COMPLETED
    spans = exporter.get_finished_spans()
    assert [span.name for span in spans] == [
        "chat test-model-1",
        "execute_tool weather",
        "chat test-model-1",
        "invoke_agent",
    ]
    [turn] = by_name(spans, "invoke_agent")
    assert parent_of(turn) is None
    assert all(parent_of(span) == span_id(turn) for span in spans if span is not turn)
    assert turn.attributes is not None
    assert dict(turn.attributes) == {
        "gen_ai.operation.name": "invoke_agent",
        "toolloop.tier": "tool_loop",
        "gen_ai.provider.name": "scripted",
        "gen_ai.request.model": "test-model-1",
        "toolloop.status": "completed",
        "toolloop.iterations": 2,
        "toolloop.tool_dispatches": 1,
        "gen_ai.usage.input_tokens": 230,
        "gen_ai.usage.output_tokens": 15,
        "toolloop.usage.estimated": False,
    }
    assert turn.status.status_code is StatusCode.UNSET
    first, second = by_name(spans, "chat test-model-1")
    assert first.kind is SpanKind.CLIENT
    assert first.attributes is not None and second.attributes is not None
    assert first.attributes["gen_ai.operation.name"] == "chat"
    assert first.attributes["gen_ai.provider.name"] == "scripted"
    assert first.attributes["gen_ai.request.model"] == "test-model-1"
    assert (
        first.attributes["gen_ai.usage.input_tokens"],
        first.attributes["toolloop.iteration"],
    ) == (
        100,
        1,
    )
    assert first.attributes["toolloop.pass.outcome"] == "function_call"
    assert second.attributes["gen_ai.usage.output_tokens"] == 5
    [tool] = by_name(spans, "execute_tool weather")
    assert tool.attributes is not None
    assert dict(tool.attributes) == {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": "weather",
        "gen_ai.tool.type": "function",
        "gen_ai.tool.call.id": "call_1",
        "toolloop.dispatch": 1,
        "toolloop.tool.outcome": "succeeded",
    }
    # the tool ran between the two passes
    assert first.end_time is not None and tool.start_time is not None
    assert first.end_time <= tool.start_time


async def test_each_call_of_a_batch_is_its_own_execute_tool_span_under_the_turn(
    exporter: InMemorySpanExporter,
) -> None:
    clock = VirtualClock()
    batch = [
        FunctionCall("weather", {"city": "Paris"}, "call_Paris"),
        FunctionCall("weather", {"city": "Oslo"}, "call_Oslo"),
        FunctionCall("weather_b", {"city": "Rome"}, "call_Rome"),
    ]
    provider = ModelProvider([batch, [TextDelta("Clear in both.")]], clock=clock)
    failing = weather_tool(clock, "raise")
    tools = [weather_tool(clock), Tool("weather_b", "fails", {"type": "object"}, failing.handler)]
    result = await run_tool_loop(
        provider, tools, RecordingChannel(clock=clock), REQUEST, clock=clock
    )
    assert result.status is TurnStatus.COMPLETED
    spans = exporter.get_finished_spans()
    tool_spans = [s for s in spans if s.name.startswith("execute_tool")]
    assert len(tool_spans) == 3
    [turn] = by_name(spans, "invoke_agent")
    assert all(parent_of(span) == span_id(turn) for span in tool_spans)
    seen = sorted(
        (
            span.attributes["toolloop.dispatch"],
            span.attributes["gen_ai.tool.call.id"],
            span.attributes["toolloop.tool.outcome"],
        )
        for span in tool_spans
        if span.attributes is not None
    )
    assert seen == [
        (1, "call_Paris", "succeeded"),
        (2, "call_Oslo", "succeeded"),
        (3, "call_Rome", "raised"),
    ]
    [failed] = by_name(spans, "execute_tool weather_b")
    assert failed.status.status_code is StatusCode.ERROR


async def test_a_fallback_after_a_429_nests_passes_under_attempts_and_marks_the_failure(
    exporter: InMemorySpanExporter,
) -> None:
    clock = VirtualClock()
    failing = ModelProvider([[TextDelta("Par"), Fail(rate_limited())]], clock=clock)
    backup = ScriptedProvider([[TextDelta("Paris is clear.")]], clock=clock, name="backup-llm")
    result = await run_generation_turn(
        [Attempt(failing, label="main"), Attempt(backup, label="backup")],
        [],
        RecordingChannel(clock=clock),
        REQUEST,
        clock=clock,
    )
    assert result.status is TurnStatus.COMPLETED
    spans = exporter.get_finished_spans()
    [turn] = by_name(spans, "invoke_agent")
    [main] = by_name(spans, "attempt main")
    [fallback] = by_name(spans, "attempt backup")
    [failed_pass] = by_name(spans, "chat test-model-1")
    [good_pass] = by_name(spans, "chat")
    assert parent_of(main) == parent_of(fallback) == span_id(turn)
    assert parent_of(failed_pass) == span_id(main)
    assert parent_of(good_pass) == span_id(fallback)
    for span in (main, failed_pass):
        assert span.status.status_code is StatusCode.ERROR
        assert span.attributes is not None
        assert span.attributes["error.type"] == "rate_limit"
        assert span.attributes["http.response.status_code"] == 429
        assert span.attributes["toolloop.retry_after"] == 30.0
    assert failed_pass.status.description == "429 slow down"
    assert main.attributes is not None and fallback.attributes is not None
    assert main.attributes["toolloop.status"] == "error"
    assert main.attributes["toolloop.reason"] == "provider_error"
    assert fallback.attributes["toolloop.status"] == "completed"
    assert fallback.attributes["gen_ai.provider.name"] == "backup-llm"
    assert turn.attributes is not None
    assert turn.attributes["toolloop.tier"] == "generation"
    assert turn.attributes["toolloop.attempts"] == 2
    assert turn.status.status_code is StatusCode.UNSET


async def test_a_failed_turn_has_an_error_status_and_its_sub_reason(
    exporter: InMemorySpanExporter,
) -> None:
    clock = VirtualClock()
    bad = ProviderError("400 bad request", kind="bad_request", retryable=False, status_code=400)
    provider = ScriptedProvider([[Fail(bad)]], clock=clock)
    result = await run_tool_loop(provider, [], RecordingChannel(clock=clock), REQUEST, clock=clock)
    assert (result.status, result.reason) == (TurnStatus.ERROR, "provider_error")
    [turn] = by_name(exporter.get_finished_spans(), "invoke_agent")
    assert turn.attributes is not None
    assert (turn.attributes["toolloop.status"], turn.attributes["toolloop.reason"]) == (
        "error",
        "provider_error",
    )
    assert turn.attributes["error.type"] == "provider_error"
    assert turn.status.status_code is StatusCode.ERROR
    assert turn.status.description == "400 bad request"


@pytest.mark.parametrize(
    ("behaviour", "outcome", "error_type"),
    [("raise", "raised", "RuntimeError"), ("hang", "timeout", "timeout")],
    ids=["raises", "hangs"],
)
async def test_a_tool_that_raises_or_runs_past_its_deadline_is_an_error_span(
    behaviour: str, outcome: str, error_type: str, exporter: InMemorySpanExporter
) -> None:
    clock = VirtualClock()
    provider = ScriptedProvider(
        [[FunctionCall("weather", {}, "c1")], [TextDelta("Sorry.")]], clock=clock
    )
    await run_tool_loop(
        provider,
        [weather_tool(clock, behaviour)],
        RecordingChannel(clock=clock),
        REQUEST,
        clock=clock,
    )
    [tool] = by_name(exporter.get_finished_spans(), "execute_tool weather")
    assert tool.attributes is not None
    assert tool.attributes["toolloop.tool.outcome"] == outcome
    assert tool.attributes["error.type"] == error_type
    assert tool.status.status_code is StatusCode.ERROR
    # a raised exception is recorded on the span; a deadline is no exception
    exceptions = [dict(e.attributes or {}) for e in tool.events if e.name == "exception"]
    if behaviour == "raise":
        assert exceptions == [
            {"exception.type": "RuntimeError", "exception.message": "the station is down"}
        ]
    else:
        assert exceptions == []


async def test_the_chat_span_is_current_while_the_provider_streams(
    exporter: InMemorySpanExporter,
) -> None:
    # what an HTTP client's own instrumentation relies on to nest its spans under the pass
    from opentelemetry import trace

    class TracedClient:
        name = "traced"

        async def stream(self, request: ProviderRequest) -> AsyncIterator[Any]:
            tracer = trace.get_tracer("an.http.client", tracer_provider=tracer_provider)
            with tracer.start_as_current_span("POST /v1/chat"):
                yield TextDelta("Hello.")

    tracer_provider = otel._installed.tracer_provider if otel._installed else None
    clock = VirtualClock()
    await run_tool_loop(TracedClient(), [], RecordingChannel(clock=clock), REQUEST, clock=clock)
    spans = exporter.get_finished_spans()
    [request] = by_name(spans, "POST /v1/chat")
    [chat] = by_name(spans, "chat")
    assert parent_of(request) == span_id(chat)


async def test_a_cancelled_turn_ends_every_span_it_opened(
    exporter: InMemorySpanExporter,
) -> None:
    clock = VirtualClock()
    provider = ScriptedProvider([[FunctionCall("weather", {}, "c1")]], clock=clock)
    started = asyncio.Event()

    async def slow(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        started.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    tool = Tool("weather", "the weather", {"type": "object"}, slow)
    turn = asyncio.ensure_future(
        run_tool_loop(provider, [tool], RecordingChannel(clock=clock), REQUEST, clock=clock)
    )
    await started.wait()
    turn.cancel()
    with pytest.raises(asyncio.CancelledError):
        await turn
    spans = exporter.get_finished_spans()
    assert sorted(span.name for span in spans) == ["chat", "execute_tool weather", "invoke_agent"]
    [root] = by_name(spans, "invoke_agent")
    assert root.attributes is not None and root.attributes["toolloop.status"] == "cancelled"
    [tool_span] = by_name(spans, "execute_tool weather")
    assert tool_span.attributes is not None
    assert tool_span.attributes["toolloop.tool.outcome"] == "cancelled"


async def test_a_turn_cancelled_while_its_provider_streams_ends_the_chat_span_cancelled(
    exporter: InMemorySpanExporter,
) -> None:
    clock = VirtualClock()
    provider = ModelProvider([[TextDelta("Clear "), Pause(100), TextDelta("skies.")]], clock=clock)
    turn = asyncio.ensure_future(
        run_tool_loop(provider, [], RecordingChannel(clock=clock), REQUEST, clock=clock)
    )

    def cancel() -> None:
        turn.cancel()

    clock.call_later(5, cancel)  # while the pass waits for its next chunk
    with pytest.raises(asyncio.CancelledError):
        await turn
    spans = exporter.get_finished_spans()
    assert sorted(span.name for span in spans) == ["chat test-model-1", "invoke_agent"]
    [chat] = by_name(spans, "chat test-model-1")
    [root] = by_name(spans, "invoke_agent")
    assert parent_of(chat) == span_id(root)
    assert chat.attributes is not None
    assert chat.attributes["toolloop.pass.outcome"] == "cancelled"
    assert not any(name.startswith("gen_ai.usage.") for name in chat.attributes)
    assert root.attributes is not None and root.attributes["toolloop.status"] == "cancelled"


async def test_a_chat_span_still_open_when_the_turn_is_cancelled_is_ended_and_let_go() -> None:
    # the observer's own backstop, driven directly: the pass never reported its end
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    observer = otel.TracingObserver(tracer_provider=provider)
    observer.turn_started(TurnStarted("tool_loop", 0.0, "scripted", "m"))
    observer.pass_started(PassStarted(0, 1, "scripted", "m", 0.0))
    assert trace.get_current_span().get_span_context().is_valid  # current while it streams
    observer.turn_aborted(TurnAborted(5.0, cancelled=True))
    spans = exporter.get_finished_spans()
    assert sorted(span.name for span in spans) == ["chat m", "invoke_agent"]
    [chat] = by_name(spans, "chat m")
    assert chat.attributes is not None
    assert chat.attributes["toolloop.status"] == "cancelled"
    assert chat.attributes["toolloop.reason"] == "the turn was cancelled"
    assert not trace.get_current_span().get_span_context().is_valid  # no longer current


async def test_usage_is_recorded_on_a_chat_span_only_when_its_pass_has_some(
    exporter: InMemorySpanExporter,
) -> None:
    clock = VirtualClock()
    provider = ModelProvider(
        [[FunctionCall("weather", {"city": "Paris"}, "call_1"), UsageReport(100, 10)], []],
        clock=clock,
    )
    await run_tool_loop(
        provider, [weather_tool(clock)], RecordingChannel(clock=clock), REQUEST, clock=clock
    )
    reported, empty = by_name(exporter.get_finished_spans(), "chat test-model-1")
    assert reported.attributes is not None and empty.attributes is not None
    assert (
        reported.attributes["gen_ai.usage.input_tokens"],
        reported.attributes["gen_ai.usage.output_tokens"],
        reported.attributes["toolloop.usage.estimated"],
    ) == (100, 10, False)
    # the empty pass produced nothing and no usage was reported for it: none is recorded
    assert empty.attributes["toolloop.pass.outcome"] == "empty_response"
    assert not any("usage" in name for name in empty.attributes)


async def test_a_turn_without_any_usage_has_no_usage_on_its_span(
    exporter: InMemorySpanExporter,
) -> None:
    clock = VirtualClock()
    result = await run_tool_loop(
        ModelProvider([[]], clock=clock), [], RecordingChannel(clock=clock), REQUEST, clock=clock
    )
    assert result.usage.entries == ()
    [root] = by_name(exporter.get_finished_spans(), "invoke_agent")
    assert root.attributes is not None
    assert root.attributes["toolloop.status"] == "empty_response"
    assert not any("usage" in name for name in root.attributes)


# --------------------------------------------------------------------------- secrecy
@pytest.mark.parametrize("echo", list(KeyEcho))
async def test_no_key_in_any_span_with_a_key_echoing_provider(
    echo: KeyEcho, exporter: InMemorySpanExporter
) -> None:
    clock = VirtualClock()

    def provider_for(key: str | None) -> Provider:
        return HostileProvider([[TextDelta("par"), EchoKey(echo)]], clock=clock, api_key=key)

    result = await run_generation_turn(
        [Attempt(provider_for, keys=KEYS, label="leaky")],
        [],
        RecordingChannel(clock=clock),
        REQUEST,
        clock=clock,
        policy=TurnPolicy(max_key_attempts_per_model=2),
    )
    assert result.status is TurnStatus.ERROR
    spans = exporter.get_finished_spans()
    assert len(spans) == 5  # the turn, two attempts, a pass in each
    seen = "\n".join(
        f"{span.name} {dict(span.attributes or {})} {span.status.description}" for span in spans
    )
    assert leaked_runs(KEYS, {"the spans": seen}) == []
    assert sum(span.status.status_code is StatusCode.ERROR for span in spans) == 5


# --------------------------------------------------------------------------- zero cost
async def test_a_tracer_that_records_nothing_leaves_turns_unobserved() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_OFF)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    otel.instrument(tracer_provider=provider)
    try:
        clock = VirtualClock()
        # the turn gets no observation at all: the pumps run their unobserved path
        assert observe_turn(None, clock, TurnRecords()) is None
        scripted = ScriptedProvider([[TextDelta("Hello.")]], clock=clock)
        await run_tool_loop(scripted, [], RecordingChannel(clock=clock), REQUEST, clock=clock)
    finally:
        otel.uninstrument()
    assert exporter.get_finished_spans() == ()


async def test_uninstrument_stops_tracing_new_turns(exporter: InMemorySpanExporter) -> None:
    otel.uninstrument()
    assert not otel.is_instrumented()
    clock = VirtualClock()
    assert observe_turn(None, clock, TurnRecords()) is None
    provider = ScriptedProvider([[TextDelta("Hello.")]], clock=clock)
    await run_tool_loop(provider, [], RecordingChannel(clock=clock), REQUEST, clock=clock)
    assert exporter.get_finished_spans() == ()


async def test_one_turn_can_be_traced_by_passing_an_observer() -> None:
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    clock = VirtualClock()
    provider = ScriptedProvider([[TextDelta("Hello.")]], clock=clock)
    observer = otel.TracingObserver(tracer_provider=tracer_provider, agent_name="weather-bot")
    await run_tool_loop(
        provider, [], RecordingChannel(clock=clock), REQUEST, clock=clock, observer=observer
    )
    names = [span.name for span in exporter.get_finished_spans()]
    assert names == ["chat", "invoke_agent weather-bot"]


def test_the_core_never_imports_opentelemetry() -> None:
    probe = (
        "import sys, asyncio, toolloop_fsm, toolloop_fsm.stream\n"
        "from toolloop_fsm.testing import ScriptedProvider, RecordingChannel\n"
        "from toolloop_fsm import TextDelta, TurnRequest, run_tool_loop\n"
        "asyncio.run(run_tool_loop(ScriptedProvider([[TextDelta('hi')]]), [],"
        " RecordingChannel(), TurnRequest([{'role': 'user', 'content': 'hi'}])))\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
