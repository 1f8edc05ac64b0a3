"""The inner machine refuses malformed events: whatever a shell feeds `ToolLoopMachine` — a
chunk or a signal with a field of the wrong type or a missing value, an event of the outer
tier, or something that is not an event at all — in any state it can wait in, the only
exception is `InvalidEvent`, its message names the state and the event, and the machine is
exactly as it was (state, trace and the whole turn it has recorded).

Stream chunks run through the machine's fast path; they are checked all the same.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import attrs
import pytest
from hypothesis import assume
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from toolloop_fsm.effects import Deliver
from toolloop_fsm.errors import InvalidEvent
from toolloop_fsm.events import AdmissionDecided
from toolloop_fsm.events import AttemptFinished
from toolloop_fsm.events import ContextRestart
from toolloop_fsm.events import DeadlineExpired
from toolloop_fsm.events import DeadlineKind
from toolloop_fsm.events import DeliveryFailed
from toolloop_fsm.events import DeliveryRecorded
from toolloop_fsm.events import FinishKind
from toolloop_fsm.events import FinishReason
from toolloop_fsm.events import FollowUpArrived
from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import SceneMetadata
from toolloop_fsm.events import StopRequested
from toolloop_fsm.events import StreamEnded
from toolloop_fsm.events import StreamFailed
from toolloop_fsm.events import TextDelta
from toolloop_fsm.events import ThoughtDelta
from toolloop_fsm.events import ToolFinished
from toolloop_fsm.events import ToolOutcomeKind
from toolloop_fsm.events import UnreachableReported
from toolloop_fsm.events import UsageReport
from toolloop_fsm.host import Tool
from toolloop_fsm.host import ToolContext
from toolloop_fsm.host import ToolResult
from toolloop_fsm.host import TurnRequest
from toolloop_fsm.machine import ToolLoopMachine
from toolloop_fsm.policy import LoopPolicy
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.result import TurnStatus
from toolloop_fsm.states.delivery import armed_tokens

_POLICY = LoopPolicy(delivery_flush_chars=1)
_REQUEST = TurnRequest([{"role": "user", "content": "what's the weather in Paris?"}])


async def _never_called(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
    raise AssertionError("the machine only names the tool in a RunTool effect")


_TOOLS = [Tool("get_weather", "the weather in a city", {"type": "object"}, _never_called)]


# --------------------------------------------------------------------------- parked machines
def _started(*events: object) -> ToolLoopMachine:
    machine = ToolLoopMachine(_POLICY, tools=_TOOLS)
    machine.start(_REQUEST)
    for event in events:
        machine.feed(event)
    return machine


def _ready() -> ToolLoopMachine:
    return ToolLoopMachine(_POLICY, tools=_TOOLS)


def _executing_tool() -> ToolLoopMachine:
    return _started(FunctionCall("get_weather", {"city": "Paris"}, "call-1"), StreamEnded())


def _settling() -> ToolLoopMachine:
    return _started(TextDelta("Sunny."), StreamEnded())


def _completed() -> ToolLoopMachine:
    machine = _settling()
    for seq in list(machine.turn.deliveries.in_flight):
        machine.feed(DeliveryRecorded(seq))
    return machine


def _timed_out() -> ToolLoopMachine:
    machine = _started()
    (token,) = armed_tokens(machine.turn, DeadlineKind.STREAM)
    return _fed(machine, DeadlineExpired(DeadlineKind.STREAM, token))


def _fed(machine: ToolLoopMachine, event: object) -> ToolLoopMachine:
    machine.feed(event)
    return machine


#: Every state the inner machine can wait in (the transient states are left within one
#: feed), and each ending; the state a factory parks in is checked below.
PARKED: dict[str, Callable[[], ToolLoopMachine]] = {
    "ready": _ready,
    "awaiting_first_token": _started,
    "streaming": lambda: _started(TextDelta("Sun")),
    "executing_tool": _executing_tool,
    "settling": _settling,
    "completed": _completed,
    "stopped_by_user": lambda: _started(StopRequested()),
    "follow_up_interrupt": lambda: _started(FollowUpArrived()),
    "timeout": _timed_out,
    "error": lambda: _started(StreamFailed("connection reset", kind="connection")),
    "empty_response": lambda: _started(StreamEnded()),
}


def test_each_parked_machine_waits_in_the_state_it_is_named_for() -> None:
    for name, park in PARKED.items():
        assert park().state == name
    assert _settling().turn.deliveries.in_flight, "settling waits for a delivery in flight"


# --------------------------------------------------------------------------- malformed events
def _current(machine: ToolLoopMachine) -> dict[str, int]:
    """The dispatch, deadline token and delivery the machine expects now, so that a
    malformed event is refused for its fields, not for naming something stale."""
    if machine.state == "ready":
        return {"dispatch": 1, "token": 1, "seq": 1}
    turn = machine.turn
    return {
        "dispatch": turn.dispatches,
        "token": next((token for kind in DeadlineKind for token in armed_tokens(turn, kind)), 1),
        "seq": next(iter(turn.deliveries.in_flight), 1),
    }


def _valid(cls: type, current: dict[str, int]) -> object:
    valid: dict[type, object] = {
        TextDelta: TextDelta("Sunny."),
        ThoughtDelta: ThoughtDelta("thinking", "sig"),
        UsageReport: UsageReport(10, 5),
        FunctionCall: FunctionCall("get_weather", {"city": "Paris"}, "call-2"),
        FinishReason: FinishReason(FinishKind.STOP, "stop"),
        SceneMetadata: SceneMetadata("a sunny day"),
        StreamFailed: StreamFailed("connection reset", "connection", True, 503, 1.0),
        ToolFinished: ToolFinished(current["dispatch"], ToolOutcomeKind.SUCCEEDED, {"ok": True}),
        DeadlineExpired: DeadlineExpired(DeadlineKind.TOOL, current["token"]),
        StopRequested: StopRequested("stop"),
        DeliveryRecorded: DeliveryRecorded(current["seq"]),
        DeliveryFailed: DeliveryFailed(current["seq"], "ConnectionError: refused"),
    }
    return valid[cls]


#: Per field of each inner event, values of the wrong type or out of range.
WRONG_VALUES: dict[type, dict[str, tuple[object, ...]]] = {
    TextDelta: {"text": (None, 5, b"Sunny", ["Sunny"])},
    ThoughtDelta: {"text": (None, 5), "signature": (5, b"sig")},
    UsageReport: {
        "input_tokens": (None, "10", 1.5, True, math.nan, -1),
        "output_tokens": (None, "5", math.inf, -5),
        "cumulative": (None, "yes"),
        "estimated": (1,),
    },
    FunctionCall: {
        "name": (None, 5, b"get_weather"),
        "call_id": (5,),
        "truncated": (None, "no"),
        "parse_error": (5,),
        "provider_data": ("signature", {1: "a"}, [("a", 1)]),
    },
    FinishReason: {"kind": ("stop", None, 1), "raw": (5,)},
    SceneMetadata: {"text": (None, 5)},
    StreamFailed: {
        "message": (None, 5),
        "kind": (None, 5),
        "retryable": (None, "yes"),
        "status_code": ("429", 429.0, True),
        "retry_after": ("5", math.nan, math.inf),
    },
    ToolFinished: {
        "dispatch": ("1", None, 1.0),
        "kind": ("succeeded", None),
        "message": (5,),
        "end_turn": ("yes",),
        "delivered": (None,),
        "expression": (5,),
        "context_restart": ({"item": {}}, "restart"),
        "error": (5,),
    },
    DeadlineExpired: {"kind": ("stream", None), "token": ("1", None, 1.0)},
    StopRequested: {"stop_message": (1, b"stop")},
    DeliveryRecorded: {"seq": (None, "1", 1.0)},
    DeliveryFailed: {"seq": ("1", 1.0), "error": (None, 5)},
}


def _malformed_inner_events(current: dict[str, int]) -> list[object]:
    return [
        attrs.evolve(_valid(cls, current), **{name: value})  # type: ignore[misc]
        for cls, fields in WRONG_VALUES.items()
        for name, values in fields.items()
        for value in values
    ]


class _LooksLikeTextDelta(TextDelta):
    """A subclass is not the event the machine declares."""


def _not_inner_events() -> list[object]:
    result = GenerationTurnResult(status=TurnStatus.COMPLETED)
    return [
        AttemptFinished(1, result),
        AdmissionDecided(True),
        UnreachableReported(),
        None,
        "Sunny.",
        42,
        object(),
        TextDelta,
        {"text": "Sunny."},
        _LooksLikeTextDelta("Sunny."),
        ContextRestart({"kind": "memory"}),
    ]


def _snapshot(machine: ToolLoopMachine) -> tuple[object, ...]:
    """Everything a refused event could have touched."""
    turn = None
    if machine.state != "ready":
        registry = machine.turn.registry  # compared by identity: the tools are not the turn's
        turn = copy.deepcopy(machine.turn, {id(registry): registry})
    return (machine.state, machine.trace, machine.is_finished, turn, dict(machine.chunk_handlers))


def _assert_refused_without_change(machine: ToolLoopMachine, event: object) -> None:
    before = _snapshot(machine)
    state = machine.state
    with pytest.raises(InvalidEvent) as caught:
        machine.feed(event)
    message = str(caught.value)
    assert repr(state) in message, message
    assert type(event).__name__ in message, message
    assert _snapshot(machine) == before, f"refusing {event!r} changed the turn"


@pytest.mark.parametrize("parked", PARKED, ids=str)
def test_a_malformed_inner_event_is_refused_naming_state_and_event_and_changes_nothing(
    parked: str,
) -> None:
    for event in _malformed_inner_events(_current(PARKED[parked]())):
        _assert_refused_without_change(PARKED[parked](), event)


@pytest.mark.parametrize("parked", PARKED, ids=str)
def test_an_outer_event_or_a_non_event_is_refused_and_changes_nothing(parked: str) -> None:
    for event in _not_inner_events():
        _assert_refused_without_change(PARKED[parked](), event)


def test_a_chunk_without_text_is_refused_while_streaming_and_the_stream_goes_on() -> None:
    machine = PARKED["streaming"]()
    with pytest.raises(InvalidEvent, match=r"'streaming'.*text must be a str, got NoneType"):
        machine.feed(TextDelta(None))  # type: ignore[arg-type]
    effects = machine.feed(TextDelta("ny."))
    assert [e.text for e in effects if isinstance(e, Deliver)] == ["ny."]


def test_a_deadline_of_an_unknown_kind_is_refused_naming_the_field() -> None:
    machine = PARKED["awaiting_first_token"]()
    (token,) = armed_tokens(machine.turn, DeadlineKind.STREAM)
    with pytest.raises(InvalidEvent, match="kind must be a DeadlineKind, got str"):
        machine.feed(DeadlineExpired("stream", token))  # type: ignore[arg-type]
    assert machine.state == "awaiting_first_token"


@pytest.mark.parametrize("parked", ["awaiting_first_token", "streaming"])
def test_a_negative_usage_count_is_an_invalid_event_naming_the_field(parked: str) -> None:
    machine = PARKED[parked]()
    with pytest.raises(InvalidEvent) as caught:
        machine.feed(UsageReport(-1, 5))
    assert str(caught.value) == (
        f"ToolLoopMachine cannot take UsageReport in state {parked!r}: "
        "input_tokens must be a whole number >= 0, got -1"
    )


def test_a_trigger_the_state_cannot_take_is_named_not_called_str() -> None:
    machine = PARKED["awaiting_first_token"]()
    with pytest.raises(InvalidEvent) as caught:
        machine.start(_REQUEST)
    assert str(caught.value) == (
        "ToolLoopMachine cannot take the start trigger in state 'awaiting_first_token': "
        "the machine was already started"
    )
    assert caught.value.trigger == "start"


# --------------------------------------------------------------------------- any mixture
_ANYTHING = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-2, 3),
    st.floats(),
    st.text(max_size=5),
    st.binary(max_size=5),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.sampled_from(list(DeadlineKind) + list(FinishKind) + list(ToolOutcomeKind)),
    st.builds(object),
)


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(value: object) -> bool:
    return _int(value) and value >= 0  # type: ignore[operator]


def _text(value: object) -> bool:
    return isinstance(value, str)


def _optional(accepts: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda value: value is None or accepts(value)


def _flag(value: object) -> bool:
    return isinstance(value, bool)


def _seconds(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


#: Which values each field accepts, written out independently of the machine's own check
#: (an integer in range may still be refused as stale; that is refused all the same).
ACCEPTS: dict[type, dict[str, Callable[[object], bool]]] = {
    TextDelta: {"text": _text},
    ThoughtDelta: {"text": _text, "signature": _optional(_text)},
    UsageReport: {
        "input_tokens": _count,
        "output_tokens": _count,
        "cumulative": _flag,
        "estimated": _flag,
    },
    FunctionCall: {
        "name": _text,
        "call_id": _optional(_text),
        "truncated": _flag,
        "parse_error": _optional(_text),
        "provider_data": _optional(
            lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v)
        ),
    },
    FinishReason: {"kind": lambda v: isinstance(v, FinishKind), "raw": _optional(_text)},
    SceneMetadata: {"text": _text},
    StreamFailed: {
        "message": _text,
        "kind": _text,
        "retryable": _flag,
        "status_code": _optional(_int),
        "retry_after": _optional(_seconds),
    },
    ToolFinished: {
        "dispatch": _int,
        "kind": lambda v: isinstance(v, ToolOutcomeKind),
        "message": _optional(_text),
        "end_turn": _flag,
        "delivered": _flag,
        "expression": _optional(_text),
        "error": _optional(_text),
    },
    DeadlineExpired: {"kind": lambda v: isinstance(v, DeadlineKind), "token": _int},
    StopRequested: {"stop_message": _optional(_text)},
    DeliveryRecorded: {"seq": _int},
    DeliveryFailed: {"seq": _optional(_int), "error": _text},
}


@st.composite
def _mangled_events(draw: st.DrawFn, current: dict[str, int]) -> object:
    """An inner event with one or more fields replaced by arbitrary values, at least one of
    which the field does not accept."""
    cls = draw(st.sampled_from(sorted(ACCEPTS, key=lambda c: c.__name__)))
    accepts = ACCEPTS[cls]
    names = draw(st.lists(st.sampled_from(sorted(accepts)), min_size=1, unique=True))
    changes = {name: draw(_ANYTHING, label=name) for name in names}
    assume(any(not accepts[name](value) for name, value in changes.items()))
    return attrs.evolve(_valid(cls, current), **changes)  # type: ignore[misc]


#: The table sweep above is exhaustive; this mixes fields at random on top of it.
@settings(max_examples=200)
@given(data=st.data())
def test_any_mangled_inner_event_in_any_state_is_refused_without_change(
    data: st.DataObject,
) -> None:
    machine = PARKED[data.draw(st.sampled_from(sorted(PARKED)), label="state")]()
    event = data.draw(
        st.one_of(
            _mangled_events(_current(machine)),
            st.sampled_from(_not_inner_events()),
            _ANYTHING,
        ),
        label="event",
    )
    _assert_refused_without_change(machine, event)
