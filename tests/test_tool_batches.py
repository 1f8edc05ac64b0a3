"""The tool batch on the sans-IO machine (docs/behaviour.md §3.10): every call of a pass is
gated on its own, the admitted ones run concurrently (bounded, with sequential barriers),
each is answered in emitted order, and the checks after a tool call apply to the batch."""

from __future__ import annotations

from typing import Any

import pytest

from toolloop_fsm import FunctionCall
from toolloop_fsm import LoopPolicy
from toolloop_fsm import TextDelta
from toolloop_fsm import Tool
from toolloop_fsm import ToolContext
from toolloop_fsm import ToolResult
from toolloop_fsm import TurnRequest
from toolloop_fsm import TurnStatus
from toolloop_fsm.effects import ArmDeadline
from toolloop_fsm.effects import CancelTool
from toolloop_fsm.effects import ClearDeadline
from toolloop_fsm.effects import Deliver
from toolloop_fsm.effects import RequestReview
from toolloop_fsm.effects import RunTool
from toolloop_fsm.effects import StartStream
from toolloop_fsm.events import ContextRestart
from toolloop_fsm.events import DeadlineExpired
from toolloop_fsm.events import DeadlineKind
from toolloop_fsm.events import ReviewReturned
from toolloop_fsm.events import ToolOutcomeKind
from toolloop_fsm.review import Finding
from toolloop_fsm.review import FindingCategory
from toolloop_fsm.review import Pass
from toolloop_fsm.review import Revise
from toolloop_fsm.sansio import DeliveryRecorded
from toolloop_fsm.sansio import InvalidEvent
from toolloop_fsm.sansio import StopRequested
from toolloop_fsm.sansio import StreamEnded
from toolloop_fsm.sansio import ToolFinished
from toolloop_fsm.sansio import ToolLoopMachine

_REQUEST = TurnRequest(context=({"role": "user", "content": "weather in Paris and London?"},))


async def _never_called(_arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
    raise AssertionError("the machine only names the tool in a RunTool effect")


def _tool(name: str, **options: Any) -> Tool:
    return Tool(name, f"the {name} tool", {"type": "object"}, _never_called, **options)


_TOOLS = [
    _tool("get_weather"),
    _tool("get_time"),
    _tool("book", sequential=True),
    _tool("note", requires_follow_up=False),
]


def _weather(city: str, call_id: str | None = None) -> FunctionCall:
    return FunctionCall("get_weather", {"city": city}, call_id or f"call-{city}")


def _machine(policy: LoopPolicy | None = None) -> ToolLoopMachine:
    machine = ToolLoopMachine(policy or LoopPolicy(), tools=_TOOLS)
    machine.start(_REQUEST)
    return machine


def _pass(machine: ToolLoopMachine, *chunks: object) -> list[Any]:
    effects: list[Any] = []
    for chunk in chunks:
        effects += machine.feed(chunk)
    return effects + machine.feed(StreamEnded())


def _runs(effects: list[Any]) -> list[RunTool]:
    return [e for e in effects if isinstance(e, RunTool)]


def _ok(dispatch: int, **fields: Any) -> ToolFinished:
    return ToolFinished(dispatch, ToolOutcomeKind.SUCCEEDED, {"ok": dispatch}, **fields)


def _failed(dispatch: int) -> ToolFinished:
    return ToolFinished(dispatch, ToolOutcomeKind.FAILED, error="no such city")


def _settled(machine: ToolLoopMachine) -> ToolLoopMachine:
    """The machine once the channel confirmed every delivery in flight."""
    for seq in list(machine.turn.deliveries.in_flight):
        machine.feed(DeliveryRecorded(seq))
    return machine


def _next_request(effects: list[Any]) -> StartStream:
    (start,) = [e for e in effects if isinstance(e, StartStream)]
    return start


# --------------------------------------------------------------------------- rule 1, 2
def test_every_call_of_a_pass_runs_at_once_each_with_its_own_dispatch_and_deadline() -> None:
    machine = _machine()
    effects = _pass(machine, _weather("Paris"), _weather("London"), FunctionCall("get_time", {}))
    runs = _runs(effects)
    assert [(r.name, r.arguments, r.dispatch, r.position) for r in runs] == [
        ("get_weather", {"city": "Paris"}, 1, 0),
        ("get_weather", {"city": "London"}, 2, 1),
        ("get_time", {}, 3, 2),
    ]
    assert [r.call_id for r in runs] == ["call-Paris", "call-London", None]
    tokens = [
        e.token for e in effects if isinstance(e, ArmDeadline) and e.kind is DeadlineKind.TOOL
    ]
    assert len(set(tokens)) == 3
    assert machine.state == "executing_tool"


def test_outcomes_arriving_out_of_order_are_answered_in_emitted_order() -> None:
    machine = _machine()
    _pass(machine, TextDelta("Checking both. "), _weather("Paris"), _weather("London"))
    early = machine.feed(_failed(2))
    assert not [e for e in early if isinstance(e, StartStream)], "the batch is not over yet"
    assert machine.state == "executing_tool"
    history = _next_request(machine.feed(_ok(1))).request.history
    assert [(h.call.arguments["city"], h.response.success, h.position) for h in history] == [
        ("Paris", True, 0),
        ("London", False, 1),
    ]
    # the narration sits once, on the batch's first entry
    assert [h.pre_tool_text for h in history] == ["Checking both. ", None]
    assert machine.turn.dispatches == 2


def test_a_refused_call_gets_its_failure_and_does_not_stop_its_siblings() -> None:
    machine = _machine()
    effects = _pass(
        machine,
        FunctionCall("get_wether", {"city": "Paris"}, "c1"),
        FunctionCall("get_weather", ["London"], "c2"),
        _weather("Rome"),
    )
    (run,) = _runs(effects)
    assert (run.arguments, run.position) == ({"city": "Rome"}, 2)
    history = _next_request(machine.feed(_ok(run.dispatch))).request.history
    assert [h.response.success for h in history] == [False, False, True]
    assert "Did you mean 'get_weather'?" in (history[0].response.reason or "")
    assert "must be a JSON object" in (history[1].response.reason or "")


def test_a_batch_every_call_of_which_is_refused_goes_straight_to_the_next_pass() -> None:
    machine = _machine()
    effects = _pass(machine, FunctionCall("nope", {}), FunctionCall("get_time", "x"))
    assert _runs(effects) == []
    assert len(_next_request(effects).request.history) == 2


def test_a_call_without_a_name_fails_the_turn_before_any_call_of_its_batch_runs() -> None:
    machine = _machine()
    effects = _pass(machine, _weather("Paris"), FunctionCall("  ", {}))
    assert _runs(effects) == []
    assert machine.result.status is TurnStatus.ERROR
    assert machine.result.reason == "malformed_call"


def test_max_parallel_tools_bounds_the_running_calls_and_starts_the_rest_in_order() -> None:
    machine = _machine(LoopPolicy(max_parallel_tools=2))
    cities = ["Paris", "London", "Rome", "Oslo", "Lima"]
    effects = _pass(machine, *(_weather(c) for c in cities))
    assert [r.arguments["city"] for r in _runs(effects)] == ["Paris", "London"]
    assert [r.arguments["city"] for r in _runs(machine.feed(_ok(2)))] == ["Rome"]
    assert [r.arguments["city"] for r in _runs(machine.feed(_ok(1)))] == ["Oslo"]
    assert [r.arguments["city"] for r in _runs(machine.feed(_ok(3)))] == ["Lima"]
    machine.feed(_ok(4))
    history = _next_request(machine.feed(_ok(5))).request.history
    assert [h.call.arguments["city"] for h in history] == cities


def test_one_at_a_time_runs_the_batch_in_emitted_order() -> None:
    machine = _machine(LoopPolicy(max_parallel_tools=1))
    effects = _pass(machine, _weather("Paris"), _weather("London"))
    assert [r.dispatch for r in _runs(effects)] == [1]
    assert [r.arguments["city"] for r in _runs(machine.feed(_ok(1)))] == ["London"]


def test_a_sequential_tool_is_a_barrier() -> None:
    machine = _machine()
    effects = _pass(
        machine,
        _weather("Paris"),
        _weather("London"),
        FunctionCall("book", {"seat": 1}),
        _weather("Rome"),
    )
    assert [r.position for r in _runs(effects)] == [0, 1]
    assert _runs(machine.feed(_ok(1))) == []
    # the calls before it have finished: it runs alone
    assert [r.name for r in _runs(machine.feed(_ok(2)))] == ["book"]
    # it finished: the rest go on
    assert [r.arguments for r in _runs(machine.feed(_ok(3)))] == [{"city": "Rome"}]
    assert machine.state == "executing_tool"


def test_a_call_that_times_out_fails_alone_and_its_siblings_go_on() -> None:
    machine = _machine()
    effects = _pass(machine, _weather("Paris"), _weather("London"))
    arms = {
        e.token: e.seconds
        for e in effects
        if isinstance(e, ArmDeadline) and e.kind is DeadlineKind.TOOL
    }
    first, second = arms
    after = machine.feed(DeadlineExpired(DeadlineKind.TOOL, second))
    assert [e for e in after if isinstance(e, CancelTool)] == [CancelTool(2)]
    assert machine.state == "executing_tool"
    # the timed-out call's late outcome is refused; the sibling's is taken
    with pytest.raises(InvalidEvent, match="dispatch 2 is not a running one"):
        machine.feed(_ok(2))
    effects = machine.feed(_ok(1))
    assert ClearDeadline(DeadlineKind.TOOL, first) in effects
    history = _next_request(effects).request.history
    assert [h.response.reason for h in history] == [None, "timed out after 300 s"]


def test_a_stop_mid_batch_cancels_every_running_call_and_keeps_the_finished_ones() -> None:
    machine = _machine()
    _pass(machine, _weather("Paris"), _weather("London"), _weather("Rome"))
    machine.feed(_ok(2))
    effects = machine.feed(StopRequested())
    assert sorted(e.dispatch for e in effects if isinstance(e, CancelTool)) == [1, 3]
    result = machine.result
    assert result.status is TurnStatus.STOPPED_BY_USER
    assert result.reason == "stopped_during_tool"
    assert result.finished_calls == ("get_weather",)
    assert result.history == (), "nothing of the batch is shown to the model"
    # the finished call keeps its outcome: a replay reuses it
    (entry,) = machine.turn.ledger.values()
    assert entry.call_key.startswith('get_weather:{"city":"London"}')
    assert entry.outcome.success


def test_two_identical_calls_of_one_batch_are_two_occurrences() -> None:
    machine = _machine()
    effects = _pass(machine, _weather("Paris", "a"), _weather("Paris", "b"))
    assert [r.call_key.rsplit("#", 1)[1] for r in _runs(effects)] == ["1", "2"]


def test_a_replayed_batch_reuses_every_recorded_call_and_runs_only_the_new_one() -> None:
    first = _machine()
    _pass(first, _weather("Paris"), _weather("London"))
    first.feed(_ok(1))
    first.feed(_ok(2))
    ledger = dict(first.turn.ledger)
    second = ToolLoopMachine(LoopPolicy(), tools=_TOOLS)
    second.start(_REQUEST, ledger=ledger)
    effects = _pass(second, _weather("Paris"), _weather("London"), _weather("Rome"))
    assert [r.arguments["city"] for r in _runs(effects)] == ["Rome"]


# --------------------------------------------------------------------------- rule 4
def test_the_error_counter_takes_the_outcomes_in_emitted_order() -> None:
    machine = _machine(LoopPolicy(max_consecutive_tool_errors=3))
    _pass(machine, _weather("Paris"), _weather("London"))
    machine.feed(_failed(1))
    machine.feed(_ok(2))
    assert machine.turn.consecutive_tool_errors == 0  # the success came last
    _pass(machine, _weather("Oslo"), _weather("Lima"), _weather("Rome"))
    machine.feed(_ok(3))
    machine.feed(_failed(4))
    machine.feed(_failed(5))
    assert machine.turn.consecutive_tool_errors == 2
    assert machine.state == "awaiting_first_token"
    _pass(machine, _weather("Kyiv"))
    machine.feed(_failed(6))
    assert machine.result.reason == "consecutive_tool_errors"


def test_any_call_asking_to_end_the_turn_ends_it_after_the_whole_batch() -> None:
    machine = _machine()
    _pass(machine, TextDelta("Done. "), _weather("Paris"), _weather("London"))
    machine.feed(_ok(1, end_turn=True))
    assert machine.state == "executing_tool", "the sibling still runs"
    machine.feed(_ok(2))
    result = _settled(machine).result
    assert (result.status, result.reason) == (TurnStatus.COMPLETED, "end_turn")
    assert [h.call.arguments["city"] for h in result.history] == ["Paris", "London"]


def test_a_context_restart_restarts_after_the_batch_with_every_other_outcome_kept() -> None:
    machine = _machine()
    _pass(machine, _weather("Paris"), FunctionCall("get_time", {}))
    machine.feed(_ok(1))
    restart = ContextRestart({"role": "system", "content": "time zone: CET"}, ("tz",))
    effects = machine.feed(_ok(2, context_restart=restart))
    request = _next_request(effects).request
    assert request.context[-1] == {"role": "system", "content": "time zone: CET"}
    assert [h.call.name for h in request.history] == ["get_weather"]
    assert "tz" in request.disabled_enrichment_kinds


def test_the_pre_tool_text_exit_holds_only_when_it_holds_for_every_call() -> None:
    policy = LoopPolicy(suppress_followup_after_pre_tool_text=frozenset({"note"}))
    mixed = _machine(policy)
    _pass(mixed, TextDelta("Noted, and checking. "), FunctionCall("note", {}), _weather("Oslo"))
    mixed.feed(_ok(1))
    assert mixed.feed(_ok(2)) and not mixed.is_finished, "get_weather needs a follow-up"
    silent = _machine(policy)
    _pass(silent, TextDelta("Noted twice. "), FunctionCall("note", {}), FunctionCall("note", {}))
    silent.feed(_ok(1))
    silent.feed(_ok(2))
    assert _settled(silent).result.reason == "pre_tool_text_suffices"


def test_an_expression_of_a_batch_is_delivered_once() -> None:
    machine = _machine()
    _pass(machine, _weather("Paris"), _weather("London"))
    machine.feed(_ok(1, expression="sun"))
    effects = machine.feed(_ok(2, expression="rain"))
    assert [e.expression for e in effects if isinstance(e, Deliver) and e.expression] == ["sun"]


# --------------------------------------------------------------------------- rule 6: checkpoint
def test_the_checkpoint_reviews_each_new_call_of_a_batch_before_any_of_them_runs() -> None:
    machine = _machine(LoopPolicy(review_tool_calls=True))
    effects = _pass(machine, _weather("Paris"), _weather("London"), _weather("Rome"))
    (first,) = [e for e in effects if isinstance(e, RequestReview)]
    assert _runs(effects) == []
    proposed = first.packet.proposed_call
    assert proposed is not None and proposed.arguments == {"city": "Paris"}
    # London is reviewed next, still with nothing running
    effects = machine.feed(ReviewReturned(first.review, Pass()))
    (second,) = [e for e in effects if isinstance(e, RequestReview)]
    assert _runs(effects) == []
    effects = machine.feed(
        ReviewReturned(
            second.review,
            Revise((Finding(FindingCategory.TOOL_USE, "not asked for", "drop it"),)),
        )
    )
    (third,) = [e for e in effects if isinstance(e, RequestReview)]
    assert _runs(effects) == []
    # the last verdict: the two approved calls run together, the rejected one never
    effects = machine.feed(ReviewReturned(third.review, Pass()))
    assert [r.arguments["city"] for r in _runs(effects)] == ["Paris", "Rome"]
    machine.feed(_ok(1))
    history = _next_request(machine.feed(_ok(2))).request.history
    assert [(h.call.arguments["city"], h.response.status) for h in history] == [
        ("Paris", None),
        ("London", "review_rejected"),
        ("Rome", None),
    ]
