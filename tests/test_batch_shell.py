"""The inner pump runs the calls of a tool batch at once, each under its own dispatch
(docs/behaviour.md §3.10 rules 2 and 5): calls finishing out of order each feed their own
outcome, cancelling one leaves its siblings running, a call that ignores its cancellation
is abandoned after ``cancel_grace`` while a sibling finishes, and a stop cancels them all.
The observers (and the OpenTelemetry spans) keep one open tool per dispatch.

The machine is a test double (`BatchMachine`) with the feed/effects surface the pump uses:
it emits a whole batch of `RunTool` effects at once, each with its own ``TOOL`` deadline,
as the real machine is being taught to. Time is virtual: no test waits on the real clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any
from typing import cast

import attrs
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from toolloop_fsm.effects import ArmDeadline
from toolloop_fsm.effects import CancelTool
from toolloop_fsm.effects import ClearDeadline
from toolloop_fsm.effects import Effect
from toolloop_fsm.effects import Finish
from toolloop_fsm.effects import RunTool
from toolloop_fsm.events import DeadlineExpired
from toolloop_fsm.events import DeadlineKind
from toolloop_fsm.events import StopRequested
from toolloop_fsm.events import ToolFinished
from toolloop_fsm.host import Tool
from toolloop_fsm.host import ToolContext
from toolloop_fsm.host import ToolRegistry
from toolloop_fsm.host import ToolResult
from toolloop_fsm.host import TurnRequest
from toolloop_fsm.host import TurnSignals
from toolloop_fsm.machine import ToolLoopMachine
from toolloop_fsm.observation import ToolEnded
from toolloop_fsm.observation import ToolStarted
from toolloop_fsm.observation import TurnObserver
from toolloop_fsm.otel import TracingObserver
from toolloop_fsm.policy import LoopPolicy
from toolloop_fsm.pump.inner import EventPump
from toolloop_fsm.pump.observing import Observation
from toolloop_fsm.pump.records import TurnRecords
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.result import InDoubtCall
from toolloop_fsm.result import InDoubtCause
from toolloop_fsm.result import TurnStatus
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import ScriptedProvider
from toolloop_fsm.testing import Stragglers
from toolloop_fsm.testing import VirtualClock

REQUEST = TurnRequest([{"role": "user", "content": "weather in Paris, London and Rome?"}])
OBJECT = {"type": "object"}


# --------------------------------------------------------------------------- the machine
@attrs.frozen
class BatchedCall:
    """One call of the double's batch, as the provider emitted it."""

    name: str
    arguments: dict[str, Any]
    call_id: str


class StrayOutcome(AssertionError):
    """The pump fed an outcome the machine does not wait for (a cancelled call's)."""


@attrs.define
class _Turn:
    disabled_enrichment_kinds: frozenset[str] = frozenset()
    request: TurnRequest = attrs.field(
        factory=lambda: TurnRequest([{"role": "user", "content": "hi"}], turn_id="batch")
    )


class BatchMachine:
    """A stand-in for the machine of issue 24: every call of its batch starts at once, each
    with its own dispatch and ``TOOL`` deadline; it takes one `ToolFinished` per running
    dispatch and refuses any other (raising, which ends the run with it); a deadline cancels
    that call alone (cut off, its outcome still owed, for a tool with a reconcile hook); a
    stop cancels every running call; the turn ends when no call is owed."""

    def __init__(
        self,
        policy: LoopPolicy,
        tools: Sequence[Tool],
        batch: Sequence[BatchedCall],
        *,
        order: str = "interleaved",
    ):
        self.policy = policy
        # how it emits the batch's calls and their deadlines: each call then its deadline
        # (``interleaved``), each deadline then its call (``deadlines_first``), or every
        # call, then every deadline (``grouped``)
        self.order = order
        self.tools = ToolRegistry(tools)
        self.turn = _Turn()
        self.batch = tuple(batch)
        self.is_finished = False
        # dispatch -> the token of its armed deadline (None: cut off, its outcome owed)
        self.running: dict[int, int | None] = {}
        self.taken: list[ToolFinished] = []  # the outcomes, in the order they came
        self.timed_out: list[int] = []
        self.cancelled: list[int] = []

    def start(self, request: TurnRequest, **_carried: object) -> list[Effect]:
        calls: list[Effect] = []
        deadlines: list[Effect] = []
        token = 40  # deadline tokens count on from the turn's other deadlines
        for position, call in enumerate(self.batch):
            dispatch = position + 1
            tool = self.tools.get(call.name)
            assert tool is not None
            timeout = tool.timeout if tool.timeout is not None else self.policy.tool_timeout
            key = f"{call.name}#{dispatch}"
            calls.append(
                RunTool(dispatch, call.name, call.arguments, key, call.call_id, position, timeout)
            )
            token += 3
            deadlines.append(ArmDeadline(DeadlineKind.TOOL, token, timeout))
            self.running[dispatch] = token
        if self.order == "grouped":
            return [*calls, *deadlines]
        if self.order == "deadlines_first":
            pairs = zip(deadlines, calls, strict=True)
        else:
            pairs = zip(calls, deadlines, strict=True)
        return [effect for pair in pairs for effect in pair]

    def feed(self, event: object, *, now: float | None = None) -> list[Effect]:
        effects: list[Effect] = []
        if isinstance(event, ToolFinished):
            if event.dispatch not in self.running:
                raise StrayOutcome(f"dispatch {event.dispatch} is not running")
            token = self.running.pop(event.dispatch)
            if token is not None:
                effects.append(ClearDeadline(DeadlineKind.TOOL, token))
            self.taken.append(event)
        elif isinstance(event, DeadlineExpired) and event.kind is DeadlineKind.TOOL:
            dispatch = next(d for d, token in self.running.items() if token == event.token)
            tool = self.tools.get(self.batch[dispatch - 1].name)
            assert tool is not None
            if tool.reconcile is not None:
                self.running[dispatch] = None
                effects.append(CancelTool(dispatch, cut_off=f"timed out after {tool.timeout:g} s"))
            else:
                del self.running[dispatch]
                self.timed_out.append(dispatch)
                effects.append(CancelTool(dispatch))
        elif isinstance(event, StopRequested):
            for dispatch, token in self.running.items():
                if token is not None:
                    effects.append(ClearDeadline(DeadlineKind.TOOL, token))
                effects.append(CancelTool(dispatch))
                self.cancelled.append(dispatch)
            self.running.clear()
            return [*effects, self._finish(TurnStatus.STOPPED_BY_USER, "stopped_during_tool")]
        if not self.running and not self.is_finished:
            effects.append(self._finish(TurnStatus.COMPLETED, "end_turn"))
        return effects

    def _finish(self, status: TurnStatus, reason: str) -> Finish:
        self.is_finished = True
        return Finish(GenerationTurnResult(status, reason, tool_dispatches=len(self.batch)))


# --------------------------------------------------------------------------- the turn
class Phases(TurnObserver):
    """Records the tool phases, with the virtual time of each."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.seen: list[ToolStarted | ToolEnded] = []

    def tool_started(self, event: ToolStarted) -> None:
        self.seen.append(event)

    def tool_ended(self, event: ToolEnded) -> None:
        self.seen.append(event)

    def ended(self) -> list[tuple[int, str | None, str, float]]:
        return [
            (event.dispatch, event.call_id, event.outcome, event.at)
            for event in self.seen
            if isinstance(event, ToolEnded)
        ]


class Timeline(logging.Handler):
    """The turn's WARNING records, each with the virtual time it was written at."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__(logging.WARNING)
        self.clock = clock
        self.lines: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((self.clock.now(), record.getMessage()))


@pytest.fixture
def clock() -> VirtualClock:
    return VirtualClock()


@pytest.fixture
def timeline(clock: VirtualClock) -> Iterator[Timeline]:
    handler = Timeline(clock)
    log = logging.getLogger("toolloop_fsm.turn")
    log.addHandler(handler)
    try:
        yield handler
    finally:
        log.removeHandler(handler)


async def run_batch(
    machine: BatchMachine,
    clock: VirtualClock,
    *,
    observer: TurnObserver | None = None,
    signals: TurnSignals | None = None,
) -> GenerationTurnResult:
    """Run the double's turn in the inner pump, observed as `run_tool_loop` observes one."""
    records = TurnRecords()
    observation = Observation([observer], clock, records) if observer is not None else None
    pump = EventPump(
        cast(ToolLoopMachine, machine),
        ScriptedProvider([]),
        RecordingChannel(clock=clock),
        signals=signals,
        clock=clock,
        observation=observation,
        records=records,
    )
    run = pump.run(REQUEST)
    if observation is None:
        return await run
    return await observation.watching(run, "tool_loop", REQUEST.conversation_id)


def weather(clock: VirtualClock, cancelled: list[str] | None = None) -> Tool:
    """Answers for the call's city after the call's ``wait`` seconds of virtual time."""

    async def handler(arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        try:
            await clock.sleep(arguments["wait"])
        except asyncio.CancelledError:
            if cancelled is not None:
                cancelled.append(arguments["city"])
            raise
        return ToolResult(data={"city": arguments["city"]})

    return Tool("weather", "the weather", OBJECT, handler, timeout=10)


def city(name: str, wait: float, call_id: str) -> BatchedCall:
    return BatchedCall("weather", {"city": name, "wait": wait}, call_id)


def taken(machine: BatchMachine) -> list[tuple[int, Any]]:
    return [(event.dispatch, event.data) for event in machine.taken]


# --------------------------------------------------------------------------- out of order
async def test_calls_finishing_out_of_order_each_feed_their_own_outcome(
    clock: VirtualClock,
) -> None:
    machine = BatchMachine(
        LoopPolicy(),
        [weather(clock)],
        [city("Paris", 3, "c1"), city("London", 1, "c2"), city("Rome", 2, "c3")],
    )
    phases = Phases(clock)

    result = await run_batch(machine, clock, observer=phases)

    assert result.status is TurnStatus.COMPLETED
    assert taken(machine) == [
        (2, {"city": "London"}),
        (3, {"city": "Rome"}),
        (1, {"city": "Paris"}),
    ]
    assert clock.now() == 3.0  # at once: the slowest call's time, not the sum
    started = [(e.dispatch, e.call_id) for e in phases.seen if isinstance(e, ToolStarted)]
    assert started == [(1, "c1"), (2, "c2"), (3, "c3")]
    assert phases.ended() == [
        (2, "c2", "succeeded", 1.0),
        (3, "c3", "succeeded", 2.0),
        (1, "c1", "succeeded", 3.0),
    ]
    assert result.abandoned_calls == ()


# --------------------------------------------------------------------------- cancelling one
@pytest.mark.parametrize("order", ["interleaved", "deadlines_first", "grouped"])
async def test_a_call_cancelled_at_its_deadline_leaves_its_siblings_running(
    clock: VirtualClock, timeline: Timeline, order: str
) -> None:
    cancelled: list[str] = []

    async def slow(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        try:
            await clock.sleep(60)
        except asyncio.CancelledError:
            cancelled.append("slow")
            raise
        return ToolResult(data="too late")

    machine = BatchMachine(
        LoopPolicy(),
        [weather(clock, cancelled), Tool("slow", "slow", OBJECT, slow, timeout=1.5)],
        [city("Paris", 3, "c1"), BatchedCall("slow", {}, "c2"), city("Rome", 2, "c3")],
        order=order,
    )
    phases = Phases(clock)

    result = await run_batch(machine, clock, observer=phases)

    assert machine.timed_out == [2]
    assert cancelled == ["slow"]  # the one call, not its siblings
    assert taken(machine) == [(3, {"city": "Rome"}), (1, {"city": "Paris"})]
    assert phases.ended() == [
        (2, "c2", "timeout", 1.5),
        (3, "c3", "succeeded", 2.0),
        (1, "c1", "succeeded", 3.0),
    ]
    # the record names the dispatch whose deadline expired, not the latest one started
    assert (1.5, "tool slow (dispatch 2) did not finish within 1.5 s; it was cancelled") in (
        timeline.lines
    )
    assert result.status is TurnStatus.COMPLETED
    assert result.abandoned_calls == ()


async def test_a_cancelled_calls_late_outcome_is_dropped_and_its_siblings_are_taken(
    clock: VirtualClock,
) -> None:
    async def defiant(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        with contextlib.suppress(asyncio.CancelledError):  # then returns, too late
            await clock.sleep(60)
        return ToolResult(data="late")

    machine = BatchMachine(
        LoopPolicy(),
        [weather(clock), Tool("defiant", "defiant", OBJECT, defiant, timeout=1)],
        [BatchedCall("defiant", {}, "c1"), city("Paris", 2, "c2")],
    )

    result = await run_batch(machine, clock)  # a stray outcome would raise StrayOutcome

    assert machine.timed_out == [1]
    assert taken(machine) == [(2, {"city": "Paris"})]
    assert result.status is TurnStatus.COMPLETED


# --------------------------------------------------------------------------- abandoned
async def test_a_call_ignoring_its_cancellation_is_abandoned_after_the_grace_as_a_sibling_runs(
    clock: VirtualClock, timeline: Timeline
) -> None:
    stragglers = Stragglers()

    async def stubborn(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        await stragglers.ignore_cancellation("stubborn")
        return ToolResult(data="never")

    machine = BatchMachine(
        LoopPolicy(cancel_grace=2),
        [weather(clock), Tool("stubborn", "stubborn", OBJECT, stubborn, timeout=1)],
        [BatchedCall("stubborn", {}, "c1"), city("Paris", 5, "c2"), city("Rome", 0.5, "c3")],
    )
    try:
        result = await run_batch(machine, clock)
    finally:
        stragglers.release()
        await asyncio.sleep(0)

    assert stragglers.cancel_ignored == ["stubborn"]
    assert machine.timed_out == [1]
    assert taken(machine) == [(3, {"city": "Rome"}), (2, {"city": "Paris"})]
    abandoned = "tool stubborn (dispatch 1) ignored its cancellation for 2 s and was abandoned"
    assert [(at, line) for at, line in timeline.lines if "abandoned" in line] == [
        (3.0, f"{abandoned}; its outcome is in doubt")
    ]
    assert clock.now() == 5.0  # the sibling ran on past the abandonment
    assert result.abandoned_calls == ("tool stubborn (dispatch 1)",)
    assert result.in_doubt_calls == (InDoubtCall("stubborn", 1, "c1", InDoubtCause.ABANDONED),)


async def test_a_cut_off_call_is_settled_by_its_hook_while_its_sibling_runs(
    clock: VirtualClock,
) -> None:
    stragglers = Stragglers()

    async def pay(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        await stragglers.ignore_cancellation("pay")
        return ToolResult(data="never")

    async def paid(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        return ToolResult(data={"paid": arguments["amount"], "dispatch": ctx.dispatch})

    machine = BatchMachine(
        LoopPolicy(cancel_grace=2),
        [weather(clock), Tool("pay", "pay", OBJECT, pay, timeout=1, reconcile=paid)],
        [city("Paris", 5, "c1"), BatchedCall("pay", {"amount": 12}, "c2")],
    )
    try:
        result = await run_batch(machine, clock)
    finally:
        stragglers.release()
        await asyncio.sleep(0)

    # the cut-off call's outcome is its hook's answer, fed for its own dispatch
    assert taken(machine) == [(2, {"paid": 12, "dispatch": 2}), (1, {"city": "Paris"})]
    assert machine.timed_out == []
    assert result.abandoned_calls == ("tool pay (dispatch 2)",)
    assert result.in_doubt_calls == (
        InDoubtCall("pay", 2, "c2", InDoubtCause.ABANDONED, reconciled=True),
    )


# --------------------------------------------------------------------------- stops
async def test_a_stop_cancels_every_running_call(clock: VirtualClock) -> None:
    cancelled: list[str] = []
    signals = TurnSignals()
    machine = BatchMachine(
        LoopPolicy(),
        [weather(clock, cancelled)],
        [city("Paris", 0.5, "c1"), city("London", 8, "c2"), city("Rome", 9, "c3")],
    )
    phases = Phases(clock)
    clock.call_later(1, signals.request_stop)

    result = await run_batch(machine, clock, observer=phases, signals=signals)

    assert result.status is TurnStatus.STOPPED_BY_USER
    assert machine.cancelled == [2, 3]
    assert sorted(cancelled) == ["London", "Rome"]
    assert taken(machine) == [(1, {"city": "Paris"})]  # finished before the stop: kept
    assert phases.ended() == [
        (1, "c1", "succeeded", 0.5),
        (2, "c2", "cancelled", 1.0),
        (3, "c3", "cancelled", 1.0),
    ]
    ended = [e for e in phases.seen if isinstance(e, ToolEnded) and e.outcome == "cancelled"]
    assert {e.error for e in ended} == {"the user stopped the turn"}
    assert clock.now() == 1.0
    assert result.abandoned_calls == ()


async def test_a_stop_abandons_each_call_that_ignores_it_after_the_grace(
    clock: VirtualClock,
) -> None:
    stragglers = Stragglers()
    cancelled: list[str] = []
    signals = TurnSignals()

    async def stubborn(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        await stragglers.ignore_cancellation("stubborn")
        return ToolResult(data="never")

    machine = BatchMachine(
        LoopPolicy(cancel_grace=2),
        [weather(clock, cancelled), Tool("stubborn", "stubborn", OBJECT, stubborn, timeout=30)],
        [
            BatchedCall("stubborn", {}, "c1"),
            city("London", 8, "c2"),
            BatchedCall("stubborn", {}, "c3"),
        ],
    )
    clock.call_later(1, signals.request_stop)
    try:
        result = await run_batch(machine, clock, signals=signals)
    finally:
        stragglers.release()
        await asyncio.sleep(0)

    assert result.status is TurnStatus.STOPPED_BY_USER
    assert machine.cancelled == [1, 2, 3]
    assert cancelled == ["London"]
    assert stragglers.cancel_ignored == ["stubborn", "stubborn"]
    assert clock.now() == 3.0  # the grace, once, for both
    assert result.abandoned_calls == ("tool stubborn (dispatch 1)", "tool stubborn (dispatch 3)")
    assert [call.dispatch for call in result.in_doubt_calls] == [1, 3]


# --------------------------------------------------------------------------- spans
def _spans_named(spans: Sequence[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [span for span in spans if span.name == name]


async def test_each_call_of_a_batch_is_its_own_execute_tool_span_ended_as_it_ends(
    clock: VirtualClock,
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    async def slow(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        await clock.sleep(60)
        return ToolResult(data="too late")

    machine = BatchMachine(
        LoopPolicy(),
        [weather(clock), Tool("slow", "slow", OBJECT, slow, timeout=2)],
        [city("Paris", 3, "c1"), city("London", 1, "c2"), BatchedCall("slow", {}, "c3")],
    )

    await run_batch(machine, clock, observer=TracingObserver(tracer_provider=provider))

    spans = exporter.get_finished_spans()
    (turn,) = _spans_named(spans, "invoke_agent")
    assert turn.context is not None
    tools = [span for span in spans if span.name.startswith("execute_tool")]
    # exported as each ended: London at 1 s, the slow call at its deadline, Paris at 3 s
    assert [
        (
            span.name,
            span.attributes["toolloop.dispatch"] if span.attributes else None,
            span.attributes["gen_ai.tool.call.id"] if span.attributes else None,
            span.attributes["toolloop.tool.outcome"] if span.attributes else None,
        )
        for span in tools
    ] == [
        ("execute_tool weather", 2, "c2", "succeeded"),
        ("execute_tool slow", 3, "c3", "timeout"),
        ("execute_tool weather", 1, "c1", "succeeded"),
    ]
    for span in tools:
        assert span.parent is not None
        assert span.parent.span_id == turn.context.span_id
    (timed_out,) = [span for span in tools if span.name == "execute_tool slow"]
    assert timed_out.attributes is not None
    assert timed_out.attributes["error.type"] == "timeout"


async def test_spans_of_calls_still_running_when_the_turn_ends_are_each_closed(
    clock: VirtualClock,
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    signals = TurnSignals()
    machine = BatchMachine(
        LoopPolicy(),
        [weather(clock)],
        [city("Paris", 8, "c1"), city("London", 9, "c2")],
    )
    clock.call_later(1, signals.request_stop)

    await run_batch(
        machine, clock, observer=TracingObserver(tracer_provider=provider), signals=signals
    )

    tools = [span for span in exporter.get_finished_spans() if span.name == "execute_tool weather"]
    assert [(span.attributes or {}).get("toolloop.dispatch") for span in tools] == [1, 2]
    assert {(span.attributes or {}).get("toolloop.tool.outcome") for span in tools} == {"cancelled"}
