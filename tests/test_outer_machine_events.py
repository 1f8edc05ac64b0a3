"""The outer machine refuses malformed events: whatever a shell feeds `GenerationTurnMachine`
— an outer event with a field of the wrong type or a missing value, an event of the inner
tier, or something that is not an event at all — in any state it can wait in, the only
exception is `InvalidEvent`, its message names the state and the event, and the machine is
exactly as it was (state, trace and everything the turn has recorded).

Before the fix an `AttemptFinished` whose result was ``None`` raised `AttributeError` half
way through taking it.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import attrs
import pytest
from hypothesis import assume
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from toolloop_fsm.attempts import AttemptPlan
from toolloop_fsm.effects import Finish
from toolloop_fsm.errors import InvalidEvent
from toolloop_fsm.events import AdmissionDecided
from toolloop_fsm.events import AttemptFinished
from toolloop_fsm.events import DeadlineExpired
from toolloop_fsm.events import DeadlineKind
from toolloop_fsm.events import DeliveryFailed
from toolloop_fsm.events import DeliveryRecorded
from toolloop_fsm.events import FinishKind
from toolloop_fsm.events import FinishReason
from toolloop_fsm.events import FollowUpArrived
from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import StopRequested
from toolloop_fsm.events import StreamEnded
from toolloop_fsm.events import StreamFailed
from toolloop_fsm.events import TextDelta
from toolloop_fsm.events import ToolFinished
from toolloop_fsm.events import ToolOutcomeKind
from toolloop_fsm.events import UnreachableReported
from toolloop_fsm.events import UsageReport
from toolloop_fsm.generation import GenerationTurnMachine
from toolloop_fsm.host import TurnRequest
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.result import TurnStatus

_REQUEST = TurnRequest([{"role": "user", "content": "hi"}])
_COMPLETED = GenerationTurnResult(status=TurnStatus.COMPLETED, final_text="Hello.")
_SERVER_ERROR = GenerationTurnResult(
    status=TurnStatus.ERROR, reason="provider_error", provider_error_kind="server"
)


# --------------------------------------------------------------------------- parked machines
def _machine(*, keys: int = 2, models: int = 2, shared: bool = True) -> GenerationTurnMachine:
    plans = [AttemptPlan(f"m{i}", keys=keys if i == 0 else 0) for i in range(models)]
    routes = [AttemptPlan("s0", route="shared")] if shared else []
    return GenerationTurnMachine(plans=plans, shared=routes)


def _finished(attempt: int, result: GenerationTurnResult) -> AttemptFinished:
    return AttemptFinished(attempt, result, {}, float(attempt))


def _ready() -> GenerationTurnMachine:
    return _machine()


def _attempting() -> GenerationTurnMachine:
    machine = _machine()
    machine.start(_REQUEST)
    return machine


def _attempting_the_second_key() -> GenerationTurnMachine:
    machine = _attempting()
    machine.feed(_finished(1, _SERVER_ERROR))
    return machine


def _admitting() -> GenerationTurnMachine:
    machine = _machine(keys=0, models=1)
    machine.start(_REQUEST)
    machine.feed(_finished(1, _SERVER_ERROR))
    return machine


def _ended_by(*events: Callable[[int], object], keys: int = 0) -> GenerationTurnMachine:
    machine = _machine(keys=keys, models=1, shared=False)
    machine.start(_REQUEST)
    for event in events:
        machine.feed(event(machine.generation.attempts))
    return machine


def _after(status: TurnStatus, **fields: Any) -> Callable[[], GenerationTurnMachine]:
    result = GenerationTurnResult(status=status, **fields)
    return lambda: _ended_by(lambda attempt: _finished(attempt, result))


def _stopped_while_admitting() -> GenerationTurnMachine:
    machine = _admitting()
    machine.feed(StopRequested("stop"))
    return machine


#: Every state the outer machine can wait in (the transient states are left within one
#: feed), and each ending; the state a factory parks in is checked below.
PARKED: dict[str, Callable[[], GenerationTurnMachine]] = {
    "ready": _ready,
    "attempting": _attempting,
    "attempting the second key": _attempting_the_second_key,
    "admitting_shared_route": _admitting,
    "completed": _after(TurnStatus.COMPLETED, final_text="Hello."),
    "stopped_by_user": _stopped_while_admitting,
    "follow_up_interrupt": _after(TurnStatus.FOLLOW_UP_INTERRUPT),
    "timeout": _after(TurnStatus.TIMEOUT, reason="inactivity_timeout"),
    "error": _after(TurnStatus.ERROR, reason="provider_error", provider_error_kind="auth"),
    "empty_response": _after(TurnStatus.EMPTY_RESPONSE),
    "skipped": lambda: _ended_by(lambda _attempt: UnreachableReported()),
}


def test_each_parked_machine_waits_in_the_state_it_is_named_for() -> None:
    for name, park in PARKED.items():
        assert park().state == name.removesuffix(" the second key"), name
    assert _attempting_the_second_key().generation.attempts == 2


# --------------------------------------------------------------------------- malformed events
def _attempt_of(machine: GenerationTurnMachine) -> int:
    """The running attempt, so that a malformed `AttemptFinished` is refused for its fields,
    not for naming another attempt."""
    return machine.generation.attempts if machine.state != "ready" else 1


#: Per field of each outer event, values of the wrong type or out of range (a clock time
#: must be a finite number; ``None`` where a value is required).
WRONG_VALUES: dict[type, dict[str, tuple[object, ...]]] = {
    AttemptFinished: {
        "attempt": ("1", 1.0, None, True),
        "result": (None, "completed", {"status": "completed"}, TurnStatus.COMPLETED, object()),
        "ledger": (None, "ledger", [("k", 1)], {"call": 1}, {1: "entry"}),
        "at": (None, "10", math.nan, math.inf, -math.inf, True),
        "signals_pending": (None, "no", 1),
    },
    AdmissionDecided: {
        "admitted": (None, "yes", 1, 0.0),
        "at": (None, "0", math.nan, math.inf),
    },
    StopRequested: {"stop_message": (1, b"stop", ["stop"], object())},
    UnreachableReported: {"partial": ("gone", {"status": "skipped"}, 1, TurnStatus.SKIPPED)},
}


def _valid(cls: type, attempt: int) -> object:
    if cls is AttemptFinished:
        return _finished(attempt, _COMPLETED)
    if cls is AdmissionDecided:
        return AdmissionDecided(True, 1.0)
    if cls is StopRequested:
        return StopRequested("stop")
    return UnreachableReported(_COMPLETED)


def _malformed_outer_events(attempt: int) -> list[object]:
    return [
        attrs.evolve(_valid(cls, attempt), **{name: value})  # type: ignore[misc]
        for cls, fields in WRONG_VALUES.items()
        for name, values in fields.items()
        for value in values
    ]


class _LooksLikeAttemptFinished(AttemptFinished):
    """A subclass is not the event the machine declares."""


def _not_outer_events(attempt: int) -> list[object]:
    inner_tier = [
        TextDelta("hello"),
        FunctionCall("get_weather", {"city": "Paris"}),
        UsageReport(1, 1),
        FinishReason(FinishKind.STOP),
        StreamEnded(),
        StreamFailed("connection reset"),
        ToolFinished(1, ToolOutcomeKind.SUCCEEDED),
        DeadlineExpired(DeadlineKind.STREAM, 1),
        DeliveryRecorded(1),
        DeliveryFailed(None, "refused"),
        FollowUpArrived(),
    ]
    arbitrary: list[object] = [
        None,
        "attempt_finished",
        42,
        math.nan,
        object(),
        AttemptFinished,
        {"attempt": attempt, "result": _COMPLETED},
        (attempt, _COMPLETED),
        _COMPLETED,
        _LooksLikeAttemptFinished(attempt, _COMPLETED),
    ]
    return inner_tier + arbitrary


def _snapshot(machine: GenerationTurnMachine) -> tuple[object, ...]:
    """Everything a refused event could have touched."""
    model = copy.deepcopy(machine.generation) if machine.state != "ready" else None
    return (machine.state, machine.trace, machine.is_finished, model)


def _assert_refused_without_change(machine: GenerationTurnMachine, event: object) -> None:
    before = _snapshot(machine)
    state = machine.state
    with pytest.raises(InvalidEvent) as caught:
        machine.feed(event)
    message = str(caught.value)
    assert repr(state) in message, message
    assert type(event).__name__ in message, message
    assert _snapshot(machine) == before, f"refusing {event!r} changed the turn"


@pytest.mark.parametrize("parked", PARKED, ids=str)
def test_a_malformed_outer_event_is_refused_naming_state_and_event_and_changes_nothing(
    parked: str,
) -> None:
    probe = PARKED[parked]()
    for event in _malformed_outer_events(_attempt_of(probe)):
        _assert_refused_without_change(PARKED[parked](), event)


@pytest.mark.parametrize("parked", PARKED, ids=str)
def test_an_inner_event_or_a_non_event_is_refused_and_changes_nothing(parked: str) -> None:
    probe = PARKED[parked]()
    for event in _not_outer_events(_attempt_of(probe)):
        _assert_refused_without_change(PARKED[parked](), event)


def test_an_attempt_without_a_result_is_refused_and_the_attempt_can_still_finish() -> None:
    machine = _attempting()
    with pytest.raises(InvalidEvent, match=r"'attempting'.*result"):
        machine.feed(AttemptFinished(1, None))
    effects = machine.feed(_finished(1, _COMPLETED))
    assert machine.state == "completed"
    assert machine.result.final_text == "Hello."
    assert [e.result for e in effects if isinstance(e, Finish)] == [machine.result]


def test_the_refusal_says_which_field_is_wrong_and_never_shows_a_string_value() -> None:
    machine = _admitting()
    with pytest.raises(InvalidEvent) as caught:
        machine.feed(AdmissionDecided("sk-live-AAAA1111"))  # type: ignore[arg-type]
    message = str(caught.value)
    assert "admitted" in message and "str" in message
    assert "AAAA1111" not in message


# --------------------------------------------------------------------------- any mixture
_ANYTHING = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=5),
    st.binary(max_size=5),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.sampled_from(list(TurnStatus)),
    st.builds(object),
)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_clock_time(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_ledger(value: object) -> bool:
    # the strategy never draws a ledger entry, so only an empty mapping is a valid ledger
    return isinstance(value, Mapping) and not value


#: Which values each field accepts, written out independently of the machine's own check.
ACCEPTS: dict[type, dict[str, Callable[[object], bool]]] = {
    AttemptFinished: {
        "attempt": _is_count,
        "result": lambda v: isinstance(v, GenerationTurnResult),
        "ledger": _is_ledger,
        "at": _is_clock_time,
        "signals_pending": lambda v: isinstance(v, bool),
    },
    AdmissionDecided: {"admitted": lambda v: isinstance(v, bool), "at": _is_clock_time},
    StopRequested: {"stop_message": lambda v: v is None or isinstance(v, str)},
    UnreachableReported: {"partial": lambda v: v is None or isinstance(v, GenerationTurnResult)},
}


@st.composite
def _mangled_events(draw: st.DrawFn, attempt: int) -> object:
    """An outer event with one or more fields replaced by arbitrary values, at least one of
    which the field does not accept."""
    cls = draw(st.sampled_from(sorted(ACCEPTS, key=lambda c: c.__name__)))
    accepts = ACCEPTS[cls]
    names = draw(st.lists(st.sampled_from(sorted(accepts)), min_size=1, unique=True))
    changes = {name: draw(_ANYTHING, label=name) for name in names}
    assume(any(not accepts[name](value) for name, value in changes.items()))
    return attrs.evolve(_valid(cls, attempt), **changes)  # type: ignore[misc]


#: The table sweep above is exhaustive; this mixes fields at random on top of it.
@settings(max_examples=200)
@given(data=st.data())
def test_any_mangled_outer_event_in_any_state_is_refused_without_change(
    data: st.DataObject,
) -> None:
    machine = PARKED[data.draw(st.sampled_from(sorted(PARKED)), label="state")]()
    event = data.draw(
        st.one_of(
            _mangled_events(_attempt_of(machine)),
            st.sampled_from(_not_outer_events(_attempt_of(machine))),
            _ANYTHING,
        ),
        label="event",
    )
    _assert_refused_without_change(machine, event)
