"""Transition coverage: the property-test workload fires every declared transition.

The same bodies the property tests run — whole turns through `run_tool_loop` drawn from
`turn_scripts()` × `loop_policies()` (and, for drafting and the tool checkpoint, from
`turn_scripts(drafting=True)` × policies with either or both on), and the sans-IO
`ToolLoopMachine` driven by the effects simulator — are run over a fixed, deterministic
sample (derandomized under every Hypothesis profile) with the machine's coverage switch on.
Every id of `declared_transition_ids(TRANSITIONS)` must fire at least once; a failure lists the ones
that did not. A transition that no random turn reaches is either a gap in the strategies
(fix them), dead code in the declaration (report it), or a rare path driven explicitly here
(`_rare_paths`), never something to leave uncovered.

Invariants are not checked here (that is tests/test_properties_inner.py's job), so a
known invariant bug cannot hide a coverage regression and vice versa.
"""

from __future__ import annotations

import attrs
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from tests.test_properties_inner import TOOLS
from tests.test_properties_inner import drive_machine
from tests.test_properties_inner import run_turn
from toolloop_fsm.decisions import decide
from toolloop_fsm.declaration import declared_transition_ids
from toolloop_fsm.effects import ArmDeadline
from toolloop_fsm.effects import CancelTool
from toolloop_fsm.effects import Deliver
from toolloop_fsm.effects import Effect
from toolloop_fsm.effects import OfferSnapshot
from toolloop_fsm.effects import RequestReview
from toolloop_fsm.events import DeadlineExpired
from toolloop_fsm.events import DeadlineKind
from toolloop_fsm.events import DeliveryFailed
from toolloop_fsm.events import DeliveryRecorded
from toolloop_fsm.events import FollowUpArrived
from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import MessageHeld
from toolloop_fsm.events import ReviewReturned
from toolloop_fsm.events import StopRequested
from toolloop_fsm.events import StreamEnded
from toolloop_fsm.events import TextDelta
from toolloop_fsm.events import ToolFinished
from toolloop_fsm.events import ToolOutcomeKind
from toolloop_fsm.host import Tool
from toolloop_fsm.host import ToolResult
from toolloop_fsm.host import TurnRequest
from toolloop_fsm.machine import TRANSITIONS
from toolloop_fsm.machine import ToolLoopMachine
from toolloop_fsm.messages import HeldMessage
from toolloop_fsm.policy import Budget
from toolloop_fsm.policy import LoopPolicy
from toolloop_fsm.policy import Price
from toolloop_fsm.result import TurnStatus
from toolloop_fsm.review import Finding
from toolloop_fsm.review import FindingCategory
from toolloop_fsm.review import Pass
from toolloop_fsm.review import Revise
from toolloop_fsm.review import Unavailable
from toolloop_fsm.snapshot import snapshot_from_json
from toolloop_fsm.stepping import Coverage
from toolloop_fsm.testing import TurnScript
from toolloop_fsm.testing import loop_policies
from toolloop_fsm.testing import turn_scripts

#: Measured: 400 turns plus 300 driven machines already fire every declared transition;
#: these counts leave a margin of 2.5x and 1.7x (about 15 s together on one core).
PUMP_EXAMPLES = 1000
#: The sans-IO driver reaches orders of events the pump reaches rarely.
MACHINE_EXAMPLES = 500
#: Drafted and checkpointed turns, through the pump and driven sans-IO (about 10 s together
#: on one core). Between them they fire all but a dozen transitions of drafting and the
#: checkpoint; those (a call rejected twice, corrections, budgets spent, signals and failing
#: notices under review) are driven in `_rare_review_paths`.
DRAFTING_PUMP_EXAMPLES = 400
DRAFTING_MACHINE_EXAMPLES = 250
_REVIEW = DeadlineKind.REVIEW
_TOOL = DeadlineKind.TOOL
#: Drafting, the tool checkpoint or both (never neither).
REVIEWED_POLICIES = st.one_of(
    loop_policies(drafting=True, review_tool_calls=None),
    loop_policies(drafting=False, review_tool_calls=True),
)


# derandomize under every profile: coverage is a property of this fixed sample, not of luck
@settings(max_examples=PUMP_EXAMPLES, derandomize=True, database=None)
@given(script=turn_scripts(), policy=loop_policies())
def _pump_workload(script: TurnScript, policy: LoopPolicy) -> None:
    run_turn(script, policy)


@settings(max_examples=MACHINE_EXAMPLES, derandomize=True, database=None)
@given(policy=loop_policies(), data=st.data())
def _machine_workload(policy: LoopPolicy, data: st.DataObject) -> None:
    drive_machine(policy, data, probe=False)


@settings(max_examples=DRAFTING_PUMP_EXAMPLES, derandomize=True, database=None)
@given(script=turn_scripts(drafting=True), policy=REVIEWED_POLICIES)
def _drafting_pump_workload(script: TurnScript, policy: LoopPolicy) -> None:
    run_turn(script, policy)


@settings(max_examples=DRAFTING_MACHINE_EXAMPLES, derandomize=True, database=None)
@given(policy=REVIEWED_POLICIES, data=st.data())
def _drafting_machine_workload(policy: LoopPolicy, data: st.DataObject) -> None:
    drive_machine(policy, data, probe=False)


def _rare_paths() -> None:
    """Sans-IO drives of the paths the random workloads reach rarely: a host call that does
    not return while the machine awaits the first token, streams or runs a tool (the channel
    failing by raising is common; by hanging, only while settling), and a stop while a stalled
    stream's deliveries settle."""
    request = TurnRequest([{"role": "user", "content": "hi"}])
    hung = DeliveryFailed(None, "TimeoutError: send_notice", timed_out=True)
    for before in ((), (TextDelta("Hi"),), (FunctionCall("get_weather", {}), StreamEnded())):
        machine = ToolLoopMachine(tools=TOOLS)
        machine.start(request)
        for event in before:
            machine.feed(event)
        machine.feed(hung)
        assert machine.result.reason == "host_timeout"
    machine = ToolLoopMachine(LoopPolicy(delivery_flush_chars=1))
    token = next(e.token for e in machine.start(request) if isinstance(e, ArmDeadline))
    machine.feed(TextDelta("Hello"))  # handed to the channel at once: in flight
    machine.feed(DeadlineExpired(DeadlineKind.INACTIVITY, token))
    assert machine.state == "settling"
    machine.feed(StopRequested())
    assert machine.result.reason == "stopped_while_settling"
    _settled_cut_off_path(request)
    _rare_review_paths(request)
    _ceiling_paths(request)
    _approval_paths(request)
    _stop_while_a_call_is_reviewed(request)
    _rare_endings(request)


def _rare_endings(request: TurnRequest) -> None:
    """Paths the random workloads reach by luck: a pass the cost ceiling does not let start
    (docs/behaviour.md §2.8 rule 2), an answer on the pass at the ceiling with
    ``at_ceiling="answer"`` (§2.1), and a drafted reply confirmed while the reply that
    answers a message held meanwhile is reviewed (§8.5 rule 3)."""
    priced = LoopPolicy(price=Price(1.0, 4.0), budget=Budget(cost=0.0000001))
    machine = ToolLoopMachine(priced, tools=TOOLS)
    machine.start(request)  # what the first pass is expected to read costs more
    assert machine.result.reason == "cost_budget"
    answer = LoopPolicy(max_function_call_iterations=1, at_ceiling="answer")
    machine = ToolLoopMachine(answer, tools=TOOLS)
    machine.start(request)
    _pass(machine, TextDelta("It is 3 °C in Oslo."))
    assert machine.turn.reason == "answered_at_iteration_ceiling"
    machine = ToolLoopMachine(LoopPolicy(drafting=True, delivery_flush_chars=1))
    machine.start(request)
    machine.feed(MessageHeld(HeldMessage("queue", "And Lima?")))
    asked = _asked(_pass(machine, TextDelta("Clear in Oslo.")))
    delivered = machine.feed(ReviewReturned(asked.review, Pass()))
    (first,) = [e for e in delivered if isinstance(e, Deliver)]
    asked = _asked(_pass(machine, TextDelta("Rain in Lima.")))
    assert machine.state == "reviewing_draft"
    machine.feed(DeliveryRecorded(first.seq))
    assert machine.state == "reviewing_draft"


def _stop_while_a_call_is_reviewed(request: TurnRequest) -> None:
    """A stop while the checkpoint's reviewer is asked about a call (docs/behaviour.md
    §14.5): the random workloads mostly stop while streaming or running a tool."""
    machine = ToolLoopMachine(_CHECKPOINT, tools=TOOLS)
    machine.start(request)
    _pass(machine, _WEATHER)
    assert machine.state == "reviewing_call"
    machine.feed(StopRequested())
    assert machine.result.reason == "stopped_during_review"


def _approval_paths(request: TurnRequest) -> None:
    """Approval by a person (docs/behaviour.md §3.13): a batch whose only call waits pauses at
    once; one whose other call finishes, or times out, pauses then; and a resumed turn goes
    on with its decided batch."""
    waits = Tool("pay", "pay", {"type": "object"}, _never_run, needs_approval=True)
    tools = [*TOOLS, waits]
    pay = FunctionCall("pay", {"amount": 5}, "p")
    machine = ToolLoopMachine(tools=tools)
    machine.start(request)
    _pass(machine, pay)
    assert machine.result.status is TurnStatus.AWAITING_APPROVAL
    for last in ("finished", "deadline"):
        machine = ToolLoopMachine(tools=tools)
        machine.start(request)
        effects = _pass(machine, pay, _WEATHER)
        if last == "finished":
            machine.feed(ToolFinished(machine.turn.dispatches, ToolOutcomeKind.SUCCEEDED))
        else:
            token = next(e.token for e in effects if isinstance(e, ArmDeadline))
            machine.feed(DeadlineExpired(DeadlineKind.TOOL, token))
        paused = machine.result
        assert paused.status is TurnStatus.AWAITING_APPROVAL and paused.approval is not None
    approval = paused.approval
    assert approval is not None
    decided = decide(snapshot_from_json(approval.snapshot), [approval.calls[0].approve()]).loop
    assert decided is not None
    resumed = ToolLoopMachine(tools=tools)
    resumed.resume(decided)
    assert resumed.state == "executing_tool"


async def _never_run(_arguments: dict[str, object], _ctx: object) -> ToolResult:
    raise AssertionError("a call that waits for approval does not run")


def _settled_cut_off_path(request: TurnRequest) -> None:
    """A tool with a reconcile hook past its deadline: cancelled, and its outcome awaited
    (docs/behaviour.md §3.9 rule 2) rather than timed out at once."""
    (weather,) = [tool for tool in TOOLS if tool.name == "get_weather"]
    machine = ToolLoopMachine(tools=[attrs.evolve(weather, reconcile=lambda _a, _c: None)])
    machine.start(request)
    effects = _pass(machine, _WEATHER)
    token = next(e.token for e in effects if isinstance(e, ArmDeadline) and e.kind is _TOOL)
    (cancel,) = [
        e for e in machine.feed(DeadlineExpired(_TOOL, token)) if isinstance(e, CancelTool)
    ]
    assert (machine.state, cancel.cut_off) == ("executing_tool", "timed out after 300 s")
    machine.feed(ToolFinished(cancel.dispatch, ToolOutcomeKind.RAISED, error=cancel.cut_off))
    assert machine.state == "awaiting_first_token"


_CHECKPOINT = LoopPolicy(review_tool_calls=True)
_DRAFTING = LoopPolicy(drafting=True)
_WEATHER = FunctionCall("get_weather", {"city": "Oslo"})
_LIMA = FunctionCall("get_weather", {"city": "Lima"})
_FLAT = Revise((Finding(FindingCategory.VOICE, "The reply sounds flat.", "Answer warmly."),))


def _asked(effects: list[Effect]) -> RequestReview:
    (asked,) = [e for e in effects if isinstance(e, RequestReview)]
    return asked


def _review_token(effects: list[Effect]) -> int:
    return next(e.token for e in effects if isinstance(e, ArmDeadline) and e.kind is _REVIEW)


def _pass(machine: ToolLoopMachine, *chunks: object) -> list[Effect]:
    """Stream one pass of ``chunks`` and end it; the effects of its end."""
    for chunk in chunks:
        machine.feed(chunk)
    return machine.feed(StreamEnded())


def _rare_review_paths(request: TurnRequest) -> None:
    """Drafting and the tool checkpoint, driven sans-IO where a random turn rarely goes: a
    call rejected again and corrections refused, approved or left without a verdict; a
    reviewer given up on before a reply is completed, or a review or revision budget spent; a
    follow-up and the host's channel failing while a reviewer is asked."""
    # a rejected call, the identical call again, a correction without a verdict, then one
    # that cannot be approved any more
    machine = ToolLoopMachine(_CHECKPOINT, tools=TOOLS)
    machine.start(request)
    asked = _asked(_pass(machine, _WEATHER))
    machine.feed(ReviewReturned(asked.review, _FLAT))
    assert machine.state == "awaiting_first_token"
    _pass(machine, _WEATHER)  # rejected before: no review
    asked = _asked(_pass(machine, _LIMA))
    assert asked.packet.proposed_call is not None and asked.packet.proposed_call.correction
    machine.feed(ReviewReturned(asked.review, Unavailable("refusal")))
    _pass(machine, FunctionCall("get_weather", {}))  # a correction no reviewer can approve
    assert [e.response.status for e in machine.turn.history or ()] == ["review_rejected"] * 4
    # a correction whose review times out; a follow-up and failing notices while a call or
    # a reply is reviewed
    for failure in (None, False, True):
        machine = ToolLoopMachine(attrs.evolve(_CHECKPOINT, drafting=True), tools=TOOLS)
        machine.start(request)
        machine.feed(ReviewReturned(_asked(_pass(machine, _WEATHER)).review, _FLAT))
        effects = _pass(machine, _LIMA)
        machine.feed(FollowUpArrived())
        if failure is None:
            machine.feed(DeadlineExpired(_REVIEW, _review_token(effects)))
        else:
            machine.feed(DeliveryFailed(None, "TimeoutError: send_notice", timed_out=failure))
            assert machine.result.reason == ("host_timeout" if failure else "host_error")
            machine = ToolLoopMachine(_DRAFTING, tools=TOOLS)
            machine.start(request)
            _pass(machine, TextDelta("Hi"))
            assert machine.state == "reviewing_draft"
            machine.feed(DeliveryFailed(None, "ConnectionError: send_notice", timed_out=failure))
            assert machine.result.reason == ("host_timeout" if failure else "host_error")
    # a reply completed after the reviewer gave no verdict on a call
    machine = ToolLoopMachine(attrs.evolve(_CHECKPOINT, drafting=True), tools=TOOLS)
    machine.start(request)
    machine.feed(ReviewReturned(_asked(_pass(machine, _WEATHER)).review, Unavailable("x")))
    machine.feed(ToolFinished(machine.turn.dispatches, ToolOutcomeKind.SUCCEEDED))
    _pass(machine, TextDelta("It is 3 °C."))
    assert machine.turn.reason == "draft_unreviewed"
    # the one review of a reply spent on a draft the reviewer sent back
    machine = ToolLoopMachine(attrs.evolve(_DRAFTING, max_reviews=1), tools=TOOLS)
    machine.start(request)
    machine.feed(ReviewReturned(_asked(_pass(machine, TextDelta("Hi"))).review, _FLAT))
    _pass(machine, TextDelta("Hello."))
    assert machine.turn.reason == "reviews_exhausted"
    # a second draft sent back with no revision left: delivered as it is
    machine = ToolLoopMachine(attrs.evolve(_DRAFTING, max_revisions=1), tools=TOOLS)
    machine.start(request)
    machine.feed(ReviewReturned(_asked(_pass(machine, TextDelta("Hi"))).review, _FLAT))
    machine.feed(ReviewReturned(_asked(_pass(machine, TextDelta("Hello."))).review, _FLAT))
    assert machine.turn.reason == "revisions_exhausted"
    # a stop while a reply is reviewed; the narration before a call confirmed while the call
    # is reviewed (random turns reach both, but too rarely to count on)
    machine = ToolLoopMachine(_DRAFTING, tools=TOOLS)
    machine.start(request)
    _pass(machine, TextDelta("Hi"))
    assert machine.state == "reviewing_draft"
    machine.feed(StopRequested())
    assert machine.turn.reason == "stopped_during_review"
    machine = ToolLoopMachine(_CHECKPOINT, tools=TOOLS)
    machine.start(request)
    effects = _pass(machine, TextDelta("Checking. "), _WEATHER)
    assert machine.state == "reviewing_call"
    (sent,) = [e for e in effects if isinstance(e, Deliver)]
    machine.feed(DeliveryRecorded(sent.seq))
    assert machine.state == "reviewing_call"
    # a new call's review that times out (the call runs unreviewed), and a follow-up while a
    # reply is reviewed (random turns reach both, but too rarely to count on)
    machine.feed(DeadlineExpired(_REVIEW, _review_token(effects)))
    assert machine.state == "executing_tool"
    machine = ToolLoopMachine(_DRAFTING, tools=TOOLS)
    machine.start(request)
    _pass(machine, TextDelta("Hi"))
    assert machine.state == "reviewing_draft"
    machine.feed(FollowUpArrived())
    assert machine.turn.status is TurnStatus.FOLLOW_UP_INTERRUPT


def _ceiling_paths(request: TurnRequest) -> None:
    """The final answer pass after the tool-call limit answering with text (docs/behaviour.md
    §3.12 rule 6): the random scripts' passes after a batch mostly call again; and a pass cut
    as it writes past what a cost ceiling pays for (§2.8 rule 5): the drawn budgets are
    mostly of tokens."""
    priced = LoopPolicy(price=Price(1.0, 4.0), budget=Budget(cost=0.00002))
    machine = ToolLoopMachine(priced, tools=TOOLS)
    machine.start(request)
    _pass(machine, TextDelta("It is 3 °C in Oslo, and clear all day."))
    assert machine.turn.reason == "cost_budget"
    machine = ToolLoopMachine(LoopPolicy(max_tool_calls=1), tools=TOOLS)
    machine.start(request)
    _pass(machine, _WEATHER)
    machine.feed(ToolFinished(machine.turn.dispatches, ToolOutcomeKind.SUCCEEDED))
    _pass(machine, TextDelta("It is 3 °C in Oslo."))
    assert machine.turn.reason == "answered_at_tool_call_limit"


def _resume_paths() -> None:
    """Durable turns: a fresh machine resumes a snapshot's turn (``ready --resume-->``)."""
    request = TurnRequest([{"role": "user", "content": "hi"}])
    machine = ToolLoopMachine(snapshots=True)
    offered = [e for e in machine.start(request) if isinstance(e, OfferSnapshot)]
    resumed = ToolLoopMachine()
    resumed.resume(offered[0].snapshot)
    assert resumed.state == "awaiting_first_token"


def test_the_property_workload_fires_every_declared_transition() -> None:
    fired: set[str] = set()
    previous = Coverage.fired
    Coverage.fired = fired
    try:
        _pump_workload()
        _machine_workload()
        _drafting_pump_workload()
        _drafting_machine_workload()
        _rare_paths()
        _resume_paths()
    finally:
        Coverage.fired = previous
    declared = declared_transition_ids(TRANSITIONS)
    missing = [ident for ident in declared if ident not in fired]
    assert not missing, (
        f"{len(missing)} of {len(declared)} declared transitions never fired:\n  "
        + "\n  ".join(missing)
    )
    undeclared = sorted(fired - set(declared))
    assert not undeclared, f"transitions fired that are not declared: {undeclared}"
