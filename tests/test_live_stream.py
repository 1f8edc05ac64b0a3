"""The live event stream (`toolloop_fsm.stream`): what a UI iterating a turn sees, in what
order, and that leaving early cancels the turn cleanly."""

from __future__ import annotations

import asyncio
import gc
import inspect
import re
import subprocess
import sys
import warnings
from collections.abc import AsyncIterator
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from toolloop_fsm import Attempt
from toolloop_fsm import FunctionCall
from toolloop_fsm import LoopPolicy
from toolloop_fsm import ProviderError
from toolloop_fsm import TextDelta
from toolloop_fsm import ThoughtDelta
from toolloop_fsm import Tool
from toolloop_fsm import ToolContext
from toolloop_fsm import ToolResult
from toolloop_fsm import TurnPolicy
from toolloop_fsm import TurnRequest
from toolloop_fsm import TurnStatus
from toolloop_fsm import UsageReport
from toolloop_fsm import run_generation_turn
from toolloop_fsm import run_tool_loop
from toolloop_fsm.observation import ObservedChunk
from toolloop_fsm.observation import TurnAborted
from toolloop_fsm.observation import TurnObserver
from toolloop_fsm.review import Pass
from toolloop_fsm.sansio import TraceStep
from toolloop_fsm.stream import AttemptEnded
from toolloop_fsm.stream import AttemptStarted
from toolloop_fsm.stream import LiveEvent
from toolloop_fsm.stream import PassEnded
from toolloop_fsm.stream import PassStarted
from toolloop_fsm.stream import ToolEnded
from toolloop_fsm.stream import ToolStarted
from toolloop_fsm.stream import TurnEnded
from toolloop_fsm.stream import TurnStarted
from toolloop_fsm.stream import stream_generation_turn
from toolloop_fsm.stream import stream_tool_loop
from toolloop_fsm.testing import Fail
from toolloop_fsm.testing import Pause
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import ScriptedProvider
from toolloop_fsm.testing import ScriptedReviewer
from toolloop_fsm.testing import VirtualClock

REQUEST = TurnRequest([{"role": "user", "content": "what's the weather in Paris?"}])
ROOT = Path(__file__).resolve().parent.parent


def weather_script() -> list[list[Any]]:
    return [
        [
            ThoughtDelta("They want the weather."),
            TextDelta("Let me check. "),
            FunctionCall("weather", {"city": "Paris"}, "call_1"),
            UsageReport(10, 5),
        ],
        [TextDelta("Clear "), TextDelta("skies."), UsageReport(20, 3)],
    ]


def weather_tool() -> Tool:
    async def weather(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        return ToolResult(data={"sky": "clear"})

    return Tool("weather", "the weather", {"type": "object"}, weather)


def summary(event: LiveEvent) -> tuple[Any, ...]:
    """What a UI reads of each event."""
    if isinstance(event, TextDelta | ThoughtDelta):
        return (type(event).__name__, event.text)
    if isinstance(event, FunctionCall):
        return ("FunctionCall", event.name)
    if isinstance(event, PassStarted):
        return ("PassStarted", event.iteration)
    if isinstance(event, PassEnded):
        return ("PassEnded", event.iteration, event.outcome)
    if isinstance(event, ToolStarted):
        return ("ToolStarted", event.name, event.call_id)
    if isinstance(event, ToolEnded):
        return ("ToolEnded", event.name, event.outcome)
    if isinstance(event, AttemptStarted):
        return ("AttemptStarted", event.attempt, event.label)
    if isinstance(event, AttemptEnded):
        return ("AttemptEnded", event.attempt, event.status.value, event.http_status)
    if isinstance(event, TurnStarted):
        return ("TurnStarted", event.tier)
    assert isinstance(event, TurnEnded)
    return ("TurnEnded", event.result.status.value)


@pytest.fixture
async def loop_errors() -> AsyncIterator[list[dict[str, Any]]]:
    """What the event loop reports (a task destroyed while pending, an exception never
    retrieved) and every warning, during the test: a clean turn leaves none."""
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield errors
            for _ in range(3):  # let anything left behind run, then collect it
                await asyncio.sleep(0)
            gc.collect()
            await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
    errors.extend({"warning": str(w.message)} for w in caught)
    assert errors == [], "the turn left something behind"


# --------------------------------------------------------------------------- what it yields
async def test_a_turn_streams_its_chunks_and_phases_in_order_then_its_result() -> None:
    clock = VirtualClock()
    provider = ScriptedProvider(weather_script(), clock=clock)
    channel = RecordingChannel(clock=clock)
    async with stream_tool_loop(
        provider, [weather_tool()], channel, REQUEST, clock=clock
    ) as events:
        seen = [event async for event in events]
    assert [summary(event) for event in seen] == [
        ("TurnStarted", "tool_loop"),
        ("PassStarted", 1),
        ("ThoughtDelta", "They want the weather."),
        ("TextDelta", "Let me check. "),
        ("FunctionCall", "weather"),
        ("PassEnded", 1, "function_call"),
        ("ToolStarted", "weather", "call_1"),
        ("ToolEnded", "weather", "succeeded"),
        ("PassStarted", 2),
        ("TextDelta", "Clear "),
        ("TextDelta", "skies."),
        ("PassEnded", 2, "completed"),
        ("TurnEnded", "completed"),
    ]
    final = seen[-1]
    assert isinstance(final, TurnEnded)
    # the stream changes nothing about the turn: the same script run plainly gives the same
    again = VirtualClock()
    plain = await run_tool_loop(
        ScriptedProvider(weather_script(), clock=again),
        [weather_tool()],
        RecordingChannel(clock=again),
        REQUEST,
        clock=again,
    )
    assert final.result == plain
    assert channel.texts == ["Let me check. ", "Clear skies."]
    tool_started = next(event for event in seen if isinstance(event, ToolStarted))
    assert tool_started.arguments == {"city": "Paris"}


async def test_each_call_of_a_batch_starts_and_ends_once_told_apart_by_dispatch_and_id() -> None:
    clock = VirtualClock()
    waits = {"Paris": 3.0, "Oslo": 1.0, "Rome": 2.0}

    async def weather(arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        await clock.sleep(waits[arguments["city"]])
        return ToolResult(data={"sky": "clear"})

    batch = [FunctionCall("weather", {"city": c}, f"call_{c}") for c in waits]
    provider = ScriptedProvider([batch, [TextDelta("Clear in all three.")]], clock=clock)
    tool = Tool("weather", "the weather", {"type": "object"}, weather)
    async with stream_tool_loop(
        provider, [tool], RecordingChannel(clock=clock), REQUEST, clock=clock
    ) as events:
        seen = [event async for event in events]
    started = [(e.dispatch, e.call_id, e.at) for e in seen if isinstance(e, ToolStarted)]
    ended = [(e.dispatch, e.call_id, e.outcome, e.at) for e in seen if isinstance(e, ToolEnded)]
    # all three start together; each ends when its own tool returns, the quickest first
    assert started == [(1, "call_Paris", 0.0), (2, "call_Oslo", 0.0), (3, "call_Rome", 0.0)]
    assert ended == [
        (2, "call_Oslo", "succeeded", 1.0),
        (3, "call_Rome", "succeeded", 2.0),
        (1, "call_Paris", "succeeded", 3.0),
    ]
    final = seen[-1]
    assert isinstance(final, TurnEnded) and final.result.final_text == "Clear in all three."


async def test_every_text_delta_arrives_before_the_delivery_holding_it_is_sent() -> None:
    clock = VirtualClock()
    timeline: list[tuple[str, str]] = []

    class TimelineChannel(RecordingChannel):
        async def send_text(  # completes at once, like a buffer
            self, text: str, *, idempotency_key: str | None = None
        ) -> None:
            timeline.append(("sent", text))
            await super().send_text(text, idempotency_key=idempotency_key)

    words = [f"word{i:03d} " for i in range(120)]  # 1,080 characters: five batches and a rest
    provider = ScriptedProvider([[TextDelta(word) for word in words]], clock=clock)
    async with stream_tool_loop(
        provider, [], TimelineChannel(clock=clock), REQUEST, clock=clock
    ) as events:
        async for event in events:
            if isinstance(event, TextDelta):
                timeline.append(("received", event.text))
    batches = [text for kind, text in timeline if kind == "sent"]
    assert len(batches) >= 5 and "".join(batches) == "".join(words)
    received = ""
    sent = ""
    for kind, text in timeline:
        if kind == "received":
            received += text
        else:
            sent += text
            assert received.startswith(sent), "a batch was sent before the UI had its text"


async def test_a_generation_turn_frames_each_attempt_and_names_its_failure() -> None:
    clock = VirtualClock()
    failing = ScriptedProvider(
        [
            [
                TextDelta("Par"),
                Fail(
                    ProviderError(
                        "429 slow down", kind="rate_limit", retryable=True, status_code=429
                    )
                ),
            ]
        ],
        clock=clock,
    )
    backup = ScriptedProvider([[TextDelta("Paris: clear.")]], clock=clock)
    async with stream_generation_turn(
        [Attempt(failing, label="main"), Attempt(backup, label="backup")],
        [],
        RecordingChannel(clock=clock),
        REQUEST,
        clock=clock,
    ) as events:
        seen = [summary(event) async for event in events]
    assert seen == [
        ("TurnStarted", "generation"),
        ("AttemptStarted", 1, "main"),
        ("PassStarted", 1),
        ("TextDelta", "Par"),
        ("PassEnded", 1, "error"),
        ("AttemptEnded", 1, "error", 429),
        ("AttemptStarted", 2, "backup"),
        ("PassStarted", 1),
        ("TextDelta", "Paris: clear."),
        ("PassEnded", 1, "completed"),
        ("AttemptEnded", 2, "completed", None),
        ("TurnEnded", "completed"),
    ]


async def test_a_slow_consumer_never_holds_the_turn_back() -> None:
    clock = VirtualClock()
    chunks: list[Any] = []
    for i in range(6):
        chunks += [Pause(1), TextDelta(f"part {i} ")]
    provider = ScriptedProvider([chunks], clock=clock)
    policy = LoopPolicy(inactivity_timeout=5, first_token_timeout=5)
    async with stream_tool_loop(
        provider, [], RecordingChannel(clock=clock), REQUEST, policy=policy, clock=clock
    ) as events:
        async for event in events:
            await clock.sleep(60)  # far past the inactivity budget, per event
            last = event
    assert isinstance(last, TurnEnded)
    assert last.result.status is TurnStatus.COMPLETED
    assert last.result.final_text == "".join(f"part {i} " for i in range(6))


async def test_the_callers_own_observer_sees_the_turn_too() -> None:
    clock = VirtualClock()
    passes: list[int] = []

    class Passes(TurnObserver):
        def pass_ended(self, event: PassEnded) -> None:
            passes.append(event.iteration)

    provider = ScriptedProvider(weather_script(), clock=clock)
    async with stream_tool_loop(
        provider,
        [weather_tool()],
        RecordingChannel(clock=clock),
        REQUEST,
        clock=clock,
        observer=Passes(),
    ) as events:
        async for _event in events:
            pass
    assert passes == [1, 2]
    assert events.result.status is TurnStatus.COMPLETED


class EveryPhase(TurnObserver):
    """Records each call it gets, by the observer method called."""

    def __init__(self, *, wants_chunks: bool = False) -> None:
        self.wants_chunks = wants_chunks
        self.calls: list[tuple[str, object]] = []

    def turn_started(self, event: TurnStarted) -> None:
        self.calls.append(("turn_started", event))

    def turn_ended(self, event: TurnEnded) -> None:
        self.calls.append(("turn_ended", event))

    def turn_aborted(self, event: TurnAborted) -> None:
        self.calls.append(("turn_aborted", event))

    def attempt_started(self, event: AttemptStarted) -> None:
        self.calls.append(("attempt_started", event))

    def attempt_ended(self, event: AttemptEnded) -> None:
        self.calls.append(("attempt_ended", event))

    def pass_started(self, event: PassStarted) -> None:
        self.calls.append(("pass_started", event))

    def pass_ended(self, event: PassEnded) -> None:
        self.calls.append(("pass_ended", event))

    def tool_started(self, event: ToolStarted) -> None:
        self.calls.append(("tool_started", event))

    def tool_ended(self, event: ToolEnded) -> None:
        self.calls.append(("tool_ended", event))

    def chunk(self, event: ObservedChunk) -> None:
        self.calls.append(("chunk", event))


#: The observer method each event the stream yields is given to.
METHOD_OF = {
    TurnStarted: "turn_started",
    TurnEnded: "turn_ended",
    AttemptStarted: "attempt_started",
    AttemptEnded: "attempt_ended",
    PassStarted: "pass_started",
    PassEnded: "pass_ended",
    ToolStarted: "tool_started",
    ToolEnded: "tool_ended",
    TextDelta: "chunk",
    ThoughtDelta: "chunk",
    FunctionCall: "chunk",
}


@pytest.mark.parametrize("wants_chunks", [False, True])
async def test_the_callers_own_observer_is_told_every_phase_by_its_own_method(
    wants_chunks: bool,
) -> None:
    clock = VirtualClock()
    failing = ScriptedProvider(
        [[Fail(ProviderError("503", kind="server", retryable=True, status_code=503))]],
        clock=clock,
    )
    backup = ScriptedProvider(weather_script(), clock=clock)
    own = EveryPhase(wants_chunks=wants_chunks)
    async with stream_generation_turn(
        [Attempt(failing, label="main"), Attempt(backup, label="backup")],
        [weather_tool()],
        RecordingChannel(clock=clock),
        REQUEST,
        clock=clock,
        observer=own,
    ) as events:
        yielded = [event async for event in events]
    told = [(METHOD_OF[type(event)], event) for event in yielded]
    if not wants_chunks:
        told = [call for call in told if call[0] != "chunk"]
    assert own.calls == told
    every = set(METHOD_OF.values()) if wants_chunks else set(METHOD_OF.values()) - {"chunk"}
    assert {method for method, _event in own.calls} == every  # the turn had every phase


async def test_the_callers_own_observer_is_told_of_a_turn_that_raised() -> None:
    clock = VirtualClock()

    def broken_hook(step: TraceStep) -> None:
        if step.event == "stream_ended":
            raise RuntimeError("the host's step hook broke")

    own = EveryPhase()
    with pytest.raises(RuntimeError, match="step hook broke"):
        async with stream_tool_loop(
            ScriptedProvider([[TextDelta("Hello.")]], clock=clock),
            [],
            RecordingChannel(clock=clock),
            REQUEST,
            clock=clock,
            on_step=broken_hook,
            observer=own,
        ) as events:
            async for _event in events:
                pass
    method, aborted = own.calls[-1]
    assert method == "turn_aborted"
    assert isinstance(aborted, TurnAborted) and not aborted.cancelled
    assert aborted.error is not None and "step hook broke" in aborted.error


# --------------------------------------------------------------------------- its parameters
@pytest.mark.parametrize(
    ("stream", "run"),
    [(stream_tool_loop, run_tool_loop), (stream_generation_turn, run_generation_turn)],
)
def test_a_stream_takes_exactly_the_parameters_of_its_run_function(
    stream: Callable[..., object], run: Callable[..., object]
) -> None:
    assert inspect.signature(stream).parameters == inspect.signature(run).parameters
    assert inspect.signature(stream).return_annotation == "TurnStream"


@pytest.mark.parametrize("tier", ["tool_loop", "generation"])
async def test_a_drafting_turn_streams_with_the_reviewer_it_needs(tier: str) -> None:
    clock = VirtualClock()
    provider = ScriptedProvider([[TextDelta("Paris is clear.")]], clock=clock)
    channel = RecordingChannel(clock=clock)
    reviewer = ScriptedReviewer([Pass()])
    drafting = LoopPolicy(drafting=True)
    if tier == "tool_loop":
        stream = stream_tool_loop(
            provider, [], channel, REQUEST, policy=drafting, clock=clock, reviewer=reviewer
        )
    else:
        stream = stream_generation_turn(
            [Attempt(provider, label="main")],
            [],
            channel,
            REQUEST,
            policy=TurnPolicy(loop=drafting),
            clock=clock,
            reviewer=reviewer,
        )
    async with stream as events:
        seen = [summary(event) async for event in events]
    assert seen[-1] == ("TurnEnded", "completed")
    assert len(reviewer.packets) == 1  # the held reply was reviewed, then delivered
    assert channel.texts == ["Paris is clear."]


@pytest.mark.parametrize("stream", [stream_tool_loop, stream_generation_turn])
def test_a_stream_called_wrongly_is_a_type_error_at_the_call(
    stream: Callable[..., object],
) -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'reveiwer'"):
        stream(ScriptedProvider([]), [], RecordingChannel(), REQUEST, reveiwer=None)
    with pytest.raises(TypeError, match=r"missing .*'request'"):
        stream(ScriptedProvider([]), [], RecordingChannel())


# --------------------------------------------------------------------------- leaving early
async def test_breaking_out_early_cancels_the_turn_cleanly(
    loop_errors: list[dict[str, Any]],
) -> None:
    clock = VirtualClock()
    provider = ScriptedProvider(
        [[TextDelta("Hello"), Pause(1000), TextDelta(" never seen")]], clock=clock
    )
    channel = RecordingChannel(clock=clock)
    stream = stream_tool_loop(provider, [], channel, REQUEST, clock=clock)
    async with stream as events:
        async for event in events:
            if isinstance(event, TextDelta):
                break
    assert stream._task is not None and stream._task.cancelled()
    assert provider.streams_closed == 1
    assert channel.texts == []  # the buffered text was never delivered
    with pytest.raises(RuntimeError, match="has not returned"):
        _ = stream.result
    assert [e async for e in events] == []  # a closed stream yields nothing more
    assert loop_errors == []


async def test_the_consumers_cancellation_cancels_the_running_tool(
    loop_errors: list[dict[str, Any]],
) -> None:
    clock = VirtualClock()
    tool_cancelled = asyncio.Event()
    tool_running = asyncio.Event()

    async def slow(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        tool_running.set()
        try:
            await asyncio.Event().wait()
        finally:
            tool_cancelled.set()
        raise AssertionError("unreachable")

    provider = ScriptedProvider([[FunctionCall("slow", {}, "c1")]], clock=clock)
    tools = [Tool("slow", "slow", {"type": "object"}, slow)]
    seen: list[Any] = []

    async def consume() -> None:
        async with stream_tool_loop(
            provider, tools, RecordingChannel(clock=clock), REQUEST, clock=clock
        ) as events:
            async for event in events:
                seen.append(summary(event))

    consumer = asyncio.ensure_future(consume())
    await tool_running.wait()
    consumer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await consumer
    assert tool_cancelled.is_set()
    assert seen[-1] == ("ToolStarted", "slow", "c1")
    assert loop_errors == []


async def test_aclose_cancels_a_stream_iterated_without_async_with(
    loop_errors: list[dict[str, Any]],
) -> None:
    clock = VirtualClock()
    provider = ScriptedProvider([[TextDelta("Hello"), Pause(1000)]], clock=clock)
    stream = stream_tool_loop(provider, [], RecordingChannel(clock=clock), REQUEST, clock=clock)
    first = await anext(stream)
    assert isinstance(first, TurnStarted)
    await stream.aclose()
    assert stream._task is not None and stream._task.done()
    assert provider.streams_closed in (0, 1)  # closed if it had started, never left open
    assert loop_errors == []


async def test_a_turn_that_raises_raises_from_the_iteration_after_its_events() -> None:
    clock = VirtualClock()
    provider = ScriptedProvider([[TextDelta("Hello.")]], clock=clock)

    def broken_hook(step: TraceStep) -> None:
        if step.event == "stream_ended":
            raise RuntimeError("the host's step hook broke")

    seen: list[Any] = []
    with pytest.raises(RuntimeError, match="step hook broke"):
        async with stream_tool_loop(
            provider,
            [],
            RecordingChannel(clock=clock),
            REQUEST,
            clock=clock,
            on_step=broken_hook,
        ) as events:
            async for event in events:
                seen.append(summary(event))
    assert seen[:3] == [("TurnStarted", "tool_loop"), ("PassStarted", 1), ("TextDelta", "Hello.")]
    assert ("TurnEnded", "completed") not in seen


def test_the_readme_example_runs_and_prints_tokens_tools_and_the_ending() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Live events") :]
    found = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert found is not None
    done = subprocess.run(
        [sys.executable, "-c", found.group(1)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == (
        "Let me look. \n[calling get_weather]\n[get_weather: succeeded]\n\n"
        "Clear skies in Paris.\ncompleted\n"
    )
