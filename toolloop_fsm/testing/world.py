"""The world model around one `ToolLoopMachine`: which events the outside world may report
next, read from the effects the machine has emitted alone.

A machine driven without the pump needs someone to play the provider, the tools, the
channel, the reviewer, the clock and the host: `World` is that someone. It carries out every
effect of the inner tier by the method `InnerEffectShell` names for its class (a new effect
class cannot be added to the machine without the world saying what it enables), and from what
those effects opened it knows what may happen now:

- `StartStream` opens a stream: chunks may come, then its end or its failure; `CutStream`
  (the held-prose ceiling) lets only the end come;
- `RunTool` lets that dispatch's `ToolFinished` come — several at once, the running calls
  of one tool batch (docs/behaviour.md §3.10), each under its own dispatch number;
  `CancelTool` takes one back, unless the call was cut off at its deadline (``cut_off``):
  then its outcome is still owed — the timeout, or that nobody can tell (in doubt);
- `ArmDeadline` lets that token expire, `ClearDeadline` takes it back: one token per kind,
  but one ``TOOL`` token per running call;
- `Deliver` lets that delivery be confirmed or fail; `RequestReview` lets that review's
  verdict come, `CancelReview` takes it back;
- follow-ups, stops and a failing notice may come at any time.

The alphabet is finite: `Happening` names the abstract events, and `World.events` lists the
concrete events of one of them that the world may send now — each chunk kind once
(`CHUNK_KINDS`), every outcome of every running call, every armed deadline (each running
call's own), every delivery in flight, every verdict. `World.moves` is all of them, for an
exhaustive search; `World.copy` forks a world for one branch of it. `World.draw_event`
draws the next event with Hypothesis, weighted toward progress (any running call of a batch
may finish first), chunks from the kit's wider `chunks()` menu. `World.illegal_events`
lists events the machine must refuse in a state. A property test drives a machine with it::

    world = World()
    world.take(machine.start(request))
    while not machine.is_finished:
        event = world.draw_event(data)
        effects = machine.feed(event)
        world.fed(event)
        world.take(effects)

This module needs Hypothesis (a test dependency); `toolloop_fsm.testing` imports it lazily.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence
from enum import StrEnum
from typing import Any

import attrs
from hypothesis import strategies as st

from toolloop_fsm.effect_handlers import EffectHandlers
from toolloop_fsm.effect_handlers import InnerEffectShell
from toolloop_fsm.effects import ArmDeadline
from toolloop_fsm.effects import CancelReview
from toolloop_fsm.effects import CancelStream
from toolloop_fsm.effects import CancelTool
from toolloop_fsm.effects import ClearDeadline
from toolloop_fsm.effects import CutStream
from toolloop_fsm.effects import Deliver
from toolloop_fsm.effects import Finish
from toolloop_fsm.effects import RequestReview
from toolloop_fsm.effects import RunTool
from toolloop_fsm.effects import StartStream
from toolloop_fsm.events import ContextRestart
from toolloop_fsm.events import DeadlineExpired
from toolloop_fsm.events import DeadlineKind
from toolloop_fsm.events import DeliveryFailed
from toolloop_fsm.events import DeliveryRecorded
from toolloop_fsm.events import FinishKind
from toolloop_fsm.events import FinishReason
from toolloop_fsm.events import FollowUpArrived
from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import ReviewReturned
from toolloop_fsm.events import SceneMetadata
from toolloop_fsm.events import StopRequested
from toolloop_fsm.events import StreamEnded
from toolloop_fsm.events import StreamFailed
from toolloop_fsm.events import TextDelta
from toolloop_fsm.events import ThoughtDelta
from toolloop_fsm.events import ToolFinished
from toolloop_fsm.events import ToolOutcomeKind
from toolloop_fsm.events import UsageReport
from toolloop_fsm.result import TurnStatus
from toolloop_fsm.review import Finding
from toolloop_fsm.review import FindingCategory
from toolloop_fsm.review import Pass
from toolloop_fsm.review import Revise
from toolloop_fsm.review import Unavailable
from toolloop_fsm.testing._lazy_names import WORLD_NAMES
from toolloop_fsm.testing.strategies import KNOWN_TOOLS
from toolloop_fsm.testing.strategies import UNKNOWN_TOOLS
from toolloop_fsm.testing.strategies import chunks

__all__ = [
    "CHUNK_KINDS",
    "STOP_MESSAGES",
    "TOOL_OUTCOME_KINDS",
    "TOOL_RESULTS",
    "VERDICTS",
    *WORLD_NAMES,
]


class Happening(StrEnum):
    """The abstract events of the world: what may happen next, before its details."""

    CHUNK = "chunk"
    STREAM_ENDED = "stream_ended"
    STREAM_FAILED = "stream_failed"
    TOOL_FINISHED = "tool_finished"
    REVIEW_RETURNED = "review_returned"
    DELIVERY_RECORDED = "delivery_recorded"
    DELIVERY_FAILED = "delivery_failed"
    NOTICE_FAILED = "notice_failed"
    DEADLINE = "deadline"
    FOLLOW_UP = "follow_up"
    STOP = "stop"


#: One chunk of each kind a provider streams: visible and blank text, a thought, calls to a
#: known tool, to an unknown one, with arguments that are not an object and cut short, a
#: usage report, a finish reason and scene metadata.
CHUNK_KINDS: Mapping[str, object] = {
    "text": TextDelta("Hi"),
    "blank text": TextDelta(" "),
    "thought": ThoughtDelta("hmm"),
    "known call": FunctionCall(KNOWN_TOOLS[0], {"city": "Oslo"}),
    "unknown call": FunctionCall(UNKNOWN_TOOLS[-1], {}),
    "call without an object": FunctionCall(KNOWN_TOOLS[0], [1, 2]),
    "truncated call": FunctionCall(KNOWN_TOOLS[0], {"city": "Os"}, truncated=True),
    "usage": UsageReport(10, 5),
    "finish reason": FinishReason(FinishKind.STOP),
    "scene": SceneMetadata("a rainy street"),
}
#: What a finished tool returned besides its kind: nothing, data, the end of the turn, a
#: delivery of its own, an expression, a context restart, an expression that ends the turn.
TOOL_RESULTS: tuple[Mapping[str, Any], ...] = (
    {},
    {"message": "done", "data": {"t": 3}},
    {"end_turn": True},
    {"delivered": True},
    {"expression": "sticker:wave"},
    {"context_restart": ContextRestart({"role": "system", "content": "more"}, ("memory",))},
    {"expression": "👍", "end_turn": True},
)
#: How a tool ended, success twice (draws favour the turns that go on).
TOOL_OUTCOME_KINDS: tuple[ToolOutcomeKind, ...] = (
    ToolOutcomeKind.SUCCEEDED,
    ToolOutcomeKind.SUCCEEDED,
    ToolOutcomeKind.FAILED,
    ToolOutcomeKind.RAISED,
)
#: The reviewer's three answers.
VERDICTS: tuple[object, ...] = (
    Pass(),
    Revise((Finding(FindingCategory.VOICE, "The reply sounds flat.", "Answer warmly."),)),
    Unavailable("refusal"),
)
#: A stop without a message, and one with.
STOP_MESSAGES: tuple[str | None, ...] = (None, "stop it")

_TOOL_ERROR = "it broke"
_IN_DOUBT_ERROR = "cut off at its deadline; nobody can tell what it did"
_FINAL_STATES = frozenset(status.value for status in TurnStatus)
_CHUNKS = chunks()
_OUTCOMES = st.sampled_from(TOOL_OUTCOME_KINDS)
_RESULT_FIELDS = st.sampled_from(TOOL_RESULTS)
_STOP_MESSAGES = st.sampled_from(STOP_MESSAGES)
_VERDICTS = st.sampled_from(VERDICTS)


@attrs.define
class World(InnerEffectShell[None]):
    """What the outside world may report next, read from the machine's effects alone."""

    stream_open: bool = False
    #: the armed deadline of each kind but ``TOOL``, by its token
    armed: dict[DeadlineKind, int] = attrs.field(factory=dict)
    #: the armed ``TOOL`` deadlines: one per running call of the batch
    tool_tokens: list[int] = attrs.field(factory=list)
    #: the dispatches whose `ToolFinished` may come, in the order they started
    running: list[int] = attrs.field(factory=list)
    #: the dispatches that finished (a second `ToolFinished` for one is refused)
    finished_dispatches: list[int] = attrs.field(factory=list)
    last_dispatch: int = 0
    #: why a running dispatch was cut off at its deadline: its outcome is still owed
    cut_off: dict[int, str] = attrs.field(factory=dict)
    in_flight: list[int] = attrs.field(factory=list)
    recorded: list[int] = attrs.field(factory=list)
    finished: bool = False
    #: the review being asked (drafting, the tool checkpoint), by its number
    reviewing: int | None = None
    #: the pass reached the held-prose ceiling: its stream ends before anything else happens
    cut: bool = False
    _effects: EffectHandlers[None] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        self._effects = EffectHandlers("the simulated world", self)

    # ------------------------------------------------------------------ what effects open
    def take(self, effects: Sequence[object]) -> None:
        """Carry out ``effects``, in order: note what each lets happen."""
        for effect in effects:
            self._effects(effect)

    def start_stream(self, _effect: StartStream) -> None:
        self.stream_open = True

    def cancel_stream(self, _effect: CancelStream) -> None:
        self.stream_open = False

    def cut_stream(self, _effect: CutStream) -> None:
        self.cut = True

    def request_review(self, effect: RequestReview) -> None:
        self.reviewing = effect.review

    def cancel_review(self, _effect: CancelReview) -> None:
        self.reviewing = None

    def arm_deadline(self, effect: ArmDeadline) -> None:
        if effect.kind is DeadlineKind.TOOL:
            self.tool_tokens.append(effect.token)
        else:
            self.armed[effect.kind] = effect.token

    def clear_deadline(self, effect: ClearDeadline) -> None:
        if effect.kind is DeadlineKind.TOOL:
            if effect.token in self.tool_tokens:
                self.tool_tokens.remove(effect.token)
        elif self.armed.get(effect.kind) == effect.token:
            del self.armed[effect.kind]

    def run_tool(self, effect: RunTool) -> None:
        self.running.append(effect.dispatch)
        self.last_dispatch = effect.dispatch
        self.cut_off.pop(effect.dispatch, None)

    def cancel_tool(self, effect: CancelTool) -> None:
        if effect.cut_off is None:
            if effect.dispatch in self.running:
                self.running.remove(effect.dispatch)
        else:
            self.cut_off[effect.dispatch] = effect.cut_off  # its outcome is still owed

    def deliver(self, effect: Deliver) -> None:
        self.in_flight.append(effect.seq)

    def finish(self, _effect: Finish) -> None:
        self.finished = True

    def _opens_nothing(self, _effect: object) -> None:
        """A notice's failure, the stop message and a snapshot let nothing new happen."""

    post_notice = queue_stop_response = offer_snapshot = _opens_nothing

    # ------------------------------------------------------------------ what events close
    def fed(self, event: object) -> None:
        """Note that ``event`` was reported to the machine: what it closes."""
        if isinstance(event, StreamEnded | StreamFailed):
            self.stream_open = False
            self.cut = False
        elif isinstance(event, ReviewReturned):
            self.reviewing = None
        elif isinstance(event, DeadlineExpired):
            if event.kind is DeadlineKind.TOOL:
                if event.token in self.tool_tokens:
                    self.tool_tokens.remove(event.token)
            else:
                self.armed.pop(event.kind, None)
            if event.kind is DeadlineKind.REVIEW:
                self.reviewing = None
        elif isinstance(event, ToolFinished):
            if event.dispatch in self.running:
                self.running.remove(event.dispatch)
            self.finished_dispatches.append(event.dispatch)
            self.cut_off.pop(event.dispatch, None)
        elif isinstance(event, DeliveryRecorded | DeliveryFailed) and event.seq is not None:
            self.in_flight.remove(event.seq)
            self.recorded.append(event.seq)

    # ------------------------------------------------------------------ the finite alphabet
    def enabled(self) -> tuple[Happening, ...]:
        """The abstract events the world may send now, in the alphabet's order."""
        if self.cut:
            return (Happening.STREAM_ENDED,)
        open_now = {
            Happening.CHUNK: self.stream_open,
            Happening.STREAM_ENDED: self.stream_open,
            Happening.STREAM_FAILED: self.stream_open,
            Happening.TOOL_FINISHED: bool(self.running),
            Happening.REVIEW_RETURNED: self.reviewing is not None,
            Happening.DELIVERY_RECORDED: bool(self.in_flight),
            Happening.DELIVERY_FAILED: bool(self.in_flight),
            Happening.NOTICE_FAILED: True,
            Happening.DEADLINE: bool(self.armed or self.tool_tokens),
            Happening.FOLLOW_UP: True,
            Happening.STOP: True,
        }
        return tuple(happening for happening in Happening if open_now[happening])

    def events(self, happening: Happening) -> tuple[object, ...]:
        """The concrete events of ``happening`` the world may send now (none when it is not
        enabled): one chunk of each kind, every outcome of every running call, every armed
        deadline, delivery in flight, verdict and stop."""
        if happening not in self.enabled():
            return ()
        if happening is Happening.CHUNK:
            return tuple(CHUNK_KINDS.values())
        if happening is Happening.TOOL_FINISHED:
            return self._tool_outcomes()
        if happening is Happening.REVIEW_RETURNED:
            assert self.reviewing is not None
            return tuple(ReviewReturned(self.reviewing, verdict) for verdict in VERDICTS)
        if happening is Happening.DELIVERY_RECORDED:
            return tuple(DeliveryRecorded(seq) for seq in self.in_flight)
        if happening is Happening.DELIVERY_FAILED:
            return tuple(self._delivery_failed(seq) for seq in self.in_flight)
        if happening is Happening.DEADLINE:
            return self._deadlines()
        if happening is Happening.STOP:
            return tuple(StopRequested(message) for message in STOP_MESSAGES)
        return (self._fixed_event(happening),)

    def moves(self) -> list[object]:
        """Every concrete event the world may send now: the branches of an exhaustive
        search."""
        return [event for happening in self.enabled() for event in self.events(happening)]

    def copy(self) -> World:
        """An independent world in the same position (for one branch of a search)."""
        return attrs.evolve(
            self,
            armed=dict(self.armed),
            tool_tokens=list(self.tool_tokens),
            running=list(self.running),
            finished_dispatches=list(self.finished_dispatches),
            cut_off=dict(self.cut_off),
            in_flight=list(self.in_flight),
            recorded=list(self.recorded),
        )

    def _deadlines(self) -> tuple[DeadlineExpired, ...]:
        """Every armed deadline: one of each kind, then each running call's own."""
        kinds = tuple(DeadlineExpired(kind, self.armed[kind]) for kind in sorted(self.armed))
        return kinds + tuple(DeadlineExpired(DeadlineKind.TOOL, t) for t in self.tool_tokens)

    def _tool_outcomes(self) -> tuple[object, ...]:
        """Every outcome of every running call, in the order the calls started."""
        return tuple(
            outcome for dispatch in self.running for outcome in self._outcomes_of(dispatch)
        )

    def _outcomes_of(self, dispatch: int) -> tuple[ToolFinished, ...]:
        cut_off = self.cut_off.get(dispatch)
        if cut_off is not None:
            # cut off: the timeout if it stopped within its grace, else nobody can tell
            return (
                ToolFinished(dispatch, ToolOutcomeKind.FAILED, error=cut_off),
                ToolFinished(
                    dispatch, ToolOutcomeKind.FAILED, error=_IN_DOUBT_ERROR, in_doubt=True
                ),
            )
        return tuple(
            ToolFinished(dispatch, kind, error=_TOOL_ERROR, **fields)
            for kind in dict.fromkeys(TOOL_OUTCOME_KINDS)
            for fields in TOOL_RESULTS
        )

    @staticmethod
    def _delivery_failed(seq: int | None) -> DeliveryFailed:
        """The channel refused delivery ``seq`` (``None``: a notice)."""
        refused = "channel" if seq is not None else "notice"
        return DeliveryFailed(seq, f"ConnectionError: {refused} refused")

    @staticmethod
    def _fixed_event(happening: Happening) -> object:
        if happening is Happening.STREAM_ENDED:
            return StreamEnded()
        if happening is Happening.STREAM_FAILED:
            return StreamFailed("connection reset", kind="connection", retryable=True)
        if happening is Happening.NOTICE_FAILED:
            return World._delivery_failed(None)
        assert happening is Happening.FOLLOW_UP, happening
        return FollowUpArrived()

    # ------------------------------------------------------------------ the Hypothesis draw
    def weighted(self) -> list[str]:
        """What `draw_event` draws first: the happenings of progress (chunks, the end of the
        stream, the tool's result, confirmations, verdicts) weighted so that turns get past
        their first pass, and the ways a turn is cut short as two groups of a small weight
        each — ``"signal"`` (a follow-up or a stop) and ``"failure"`` (a failed stream,
        notice or delivery, an expired deadline). Hypothesis shrinks toward the front."""
        if self.cut:
            return [Happening.STREAM_ENDED.value]
        kinds: list[str] = []
        if self.stream_open:
            kinds += [Happening.CHUNK.value] * 8 + [Happening.STREAM_ENDED.value] * 4
        if self.running:
            kinds += [Happening.TOOL_FINISHED.value] * 8
        if self.in_flight:
            kinds += [Happening.DELIVERY_RECORDED.value] * 3
        if self.reviewing is not None:
            kinds += [Happening.REVIEW_RETURNED.value] * 8
        kinds += ["signal", "failure"]
        return kinds

    def draw_event(self, data: st.DataObject) -> object:
        """Draw the next event the world sends (one of the happenings `enabled` names)."""
        kind = data.draw(st.sampled_from(self.weighted()), label="event")
        if kind == "signal":
            kind = data.draw(
                st.sampled_from(
                    (Happening.FOLLOW_UP.value, Happening.FOLLOW_UP.value, Happening.STOP.value)
                ),
                label="signal",
            )
        elif kind == "failure":
            failures = [Happening.NOTICE_FAILED.value]
            if self.stream_open:
                failures.append(Happening.STREAM_FAILED.value)
            if self.armed or self.tool_tokens:
                failures += [Happening.DEADLINE.value] * 2
            if self.in_flight:
                failures.append(Happening.DELIVERY_FAILED.value)
            kind = data.draw(st.sampled_from(failures), label="failure")
        return self._draw(Happening(kind), data)

    def _draw(self, happening: Happening, data: st.DataObject) -> object:
        if happening is Happening.CHUNK:
            return data.draw(_CHUNKS, label="chunk")
        if happening is Happening.TOOL_FINISHED:
            # any running call of the batch may finish first
            dispatch = data.draw(st.sampled_from(self.running), label="dispatch")
            if dispatch in self.cut_off:
                owed = self._outcomes_of(dispatch)
                return data.draw(st.sampled_from(owed), label="owed outcome")
            fields = data.draw(_RESULT_FIELDS, label="tool result")
            kind = data.draw(_OUTCOMES, label="outcome")
            return ToolFinished(dispatch, kind, error=_TOOL_ERROR, **fields)
        if happening is Happening.DEADLINE:
            return data.draw(st.sampled_from(self._deadlines()), label="deadline")
        if happening is Happening.DELIVERY_RECORDED:
            return DeliveryRecorded(data.draw(st.sampled_from(self.in_flight), label="seq"))
        if happening is Happening.REVIEW_RETURNED:
            assert self.reviewing is not None
            return ReviewReturned(self.reviewing, data.draw(_VERDICTS, label="verdict"))
        if happening is Happening.DELIVERY_FAILED:
            seq = data.draw(st.sampled_from(self.in_flight), label="seq")
            return self._delivery_failed(seq)
        if happening is Happening.STOP:
            return StopRequested(data.draw(_STOP_MESSAGES, label="stop message"))
        return self._fixed_event(happening)

    # ------------------------------------------------------------------ what must be refused
    def illegal_events(self, state: str) -> list[object]:
        """Events the machine must refuse in ``state``: stale or unknown tokens, dispatches
        and deliveries (a call of the batch reported finished twice among them), chunks
        outside a stream, anything after the end, non-events."""
        events: list[object] = [
            DeadlineExpired(DeadlineKind.TOOL, 10_000),
            DeadlineExpired(DeadlineKind.SETTLE, 10_001),
            ToolFinished(10_000, ToolOutcomeKind.SUCCEEDED),
            DeliveryRecorded(10_000),
            "a string is not an event",
        ]
        # a delivery reported twice would be claimed twice in the result
        events += [DeliveryRecorded(seq) for seq in self.recorded[-1:]]
        if state in ("awaiting_first_token", "streaming"):
            events.append(ToolFinished(self.last_dispatch, ToolOutcomeKind.SUCCEEDED))
        if state == "executing_tool":
            events += [
                ToolFinished(dispatch, ToolOutcomeKind.SUCCEEDED)
                for dispatch in self.finished_dispatches[-1:]
                if dispatch not in self.running
            ]
        if state in ("executing_tool", "settling"):
            events += [
                TextDelta("late"),
                FunctionCall(KNOWN_TOOLS[0], {}),
                StreamEnded(),
                StreamFailed("late failure"),
                UsageReport(1, 1),
            ]
        if state == "settling":
            events.append(ToolFinished(self.last_dispatch, ToolOutcomeKind.SUCCEEDED))
        if state in ("reviewing_draft", "reviewing_call"):
            # a verdict for a review that is not the one asked, and chunks after the pass
            events += [ReviewReturned(10_000, Pass()), TextDelta("late"), StreamEnded()]
        if state in _FINAL_STATES:
            events += [
                StopRequested(),
                FollowUpArrived(),
                TextDelta("after the end"),
                StreamEnded(),
            ]
        return events
