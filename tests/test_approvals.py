"""Approval of tool calls (docs/behaviour.md §3.13): a call whose tool needs approval does not
run; the rest of its batch runs and the turn ends ``awaiting_approval`` with the pending
calls and a snapshot; a resume with bound (and, with a key, signed) decisions approves,
edits or denies each, runs what was approved once, and goes on. Time is virtual."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.inner_kit import USER
from tests.inner_kit import Executions
from tests.inner_kit import Turn
from tests.inner_kit import make_tool
from tests.inner_kit import run_turn
from tests.inner_kit import scripted_turn
from toolloop_fsm import FunctionCall
from toolloop_fsm import LoopPolicy
from toolloop_fsm import TextDelta
from toolloop_fsm import Tool
from toolloop_fsm import ToolContext
from toolloop_fsm import ToolResult
from toolloop_fsm import TurnRequest
from toolloop_fsm import TurnStatus
from toolloop_fsm import resume_tool_loop
from toolloop_fsm import snapshot_from_json
from toolloop_fsm.approvals import ApprovalError
from toolloop_fsm.approvals import Decision
from toolloop_fsm.approvals import PendingApproval
from toolloop_fsm.decisions import decide
from toolloop_fsm.decisions import pending_approvals
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.snapshot import SnapshotError
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import ScriptedProvider
from toolloop_fsm.testing import VirtualClock

KEY = b"host approval key"


def transfer(amount: int, to: str = "Bob", call_id: str | None = "call-t") -> FunctionCall:
    return FunctionCall("transfer", {"amount": amount, "to": to}, call_id)


def weather(city: str, call_id: str | None = "call-w") -> FunctionCall:
    return FunctionCall("get_weather", {"city": city}, call_id)


ANSWER = [TextDelta("Done: sent and looked up.")]


def _tools(turn: Turn, **transfer_options: Any) -> list[Tool]:
    options = {"needs_approval": True, **transfer_options}
    return [
        make_tool("transfer", turn.executions, turn.clock, **options),
        make_tool("get_weather", turn.executions, turn.clock),
    ]


async def _paused(
    passes: list[list[Any]] | None = None,
    policy: LoopPolicy | None = None,
    **transfer_options: Any,
) -> tuple[Turn, list[Tool], GenerationTurnResult]:
    script: list[list[Any]] = (
        passes
        if passes is not None
        else [[TextDelta("Sending it now. "), transfer(50), weather("Paris")], ANSWER]
    )
    turn = scripted_turn(script)
    tools = _tools(turn, **transfer_options)
    request = TurnRequest(USER, turn_id="turn-1")
    result = await run_turn(turn, tools, request=request, policy=policy)
    return turn, tools, result


async def _resume(
    turn: Turn,
    tools: list[Tool],
    snapshot_json: str,
    decisions: list[Decision],
    passes: list[list[Any]] | None = None,
    **options: Any,
) -> GenerationTurnResult:
    return await resume_tool_loop(
        snapshot_from_json(snapshot_json),
        ScriptedProvider(passes if passes is not None else [ANSWER], clock=turn.clock),
        tools,
        turn.channel,
        clock=turn.clock,
        decisions=decisions,
        **options,
    )


def _ran(executions: Executions) -> list[tuple[str, dict[str, Any]]]:
    return [(name, args) for name, args, _ in executions.calls]


# --------------------------------------------------------------------------- the pause
async def test_a_call_that_needs_approval_pauses_the_turn_after_the_rest_of_its_batch() -> None:
    turn, _, result = await _paused()
    assert result.status is TurnStatus.AWAITING_APPROVAL and result.reason is None
    # the weather call ran; the transfer did not
    assert _ran(turn.executions) == [("get_weather", {"city": "Paris"})]
    approval = result.approval
    assert approval is not None
    [pending] = approval.calls
    assert (pending.tool, pending.arguments, pending.call_id, pending.position) == (
        "transfer",
        {"amount": 50, "to": "Bob"},
        "call-t",
        0,
    )
    assert (pending.turn_id, pending.attempt, pending.iteration) == ("turn-1", 1, 1)
    # the narration before the calls reached the user; nothing of the batch is in the history
    assert turn.channel.text == "Sending it now. "
    assert result.history == ()
    # the snapshot names the same calls
    assert pending_approvals(snapshot_from_json(approval.snapshot)) == approval.calls
    assert result.trace[-1].next_state == "awaiting_approval"


async def test_an_approved_call_runs_once_and_the_batch_is_answered_in_emitted_order() -> None:
    turn, tools, paused = await _paused()
    assert paused.approval is not None
    [pending] = paused.approval.calls
    result = await _resume(turn, tools, paused.approval.snapshot, [pending.approve()])
    assert result.status is TurnStatus.COMPLETED
    assert _ran(turn.executions) == [
        ("get_weather", {"city": "Paris"}),
        ("transfer", {"amount": 50, "to": "Bob"}),
    ]
    assert [(e.position, e.call.name, e.response.success) for e in result.history] == [
        (0, "transfer", True),
        (1, "get_weather", True),
    ]
    assert result.history[0].pre_tool_text == "Sending it now. "
    assert turn.channel.text == "Sending it now. Done: sent and looked up."
    assert result.final_text == "Done: sent and looked up."
    assert result.approval is None


async def test_an_edited_approval_runs_the_edit_and_the_history_shows_what_ran() -> None:
    turn, tools, paused = await _paused()
    assert paused.approval is not None
    [pending] = paused.approval.calls
    edit = pending.approve(arguments={"amount": 20, "to": "Bob"})
    result = await _resume(turn, tools, paused.approval.snapshot, [edit])
    assert ("transfer", {"amount": 20, "to": "Bob"}) in _ran(turn.executions)
    assert dict(result.history[0].call.arguments) == {"amount": 20, "to": "Bob"}


async def test_a_denial_is_the_calls_result_and_counts_as_no_failure() -> None:
    turn, tools, paused = await _paused()
    assert paused.approval is not None
    [pending] = paused.approval.calls
    result = await _resume(
        turn, tools, paused.approval.snapshot, [pending.deny("Bob is not a known payee.")]
    )
    assert result.status is TurnStatus.COMPLETED
    assert _ran(turn.executions) == [("get_weather", {"city": "Paris"})]  # the transfer never ran
    denied = result.history[0].response
    assert (denied.success, denied.status) == (False, "approval_denied")
    assert denied.reason is not None and "Bob is not a known payee." in denied.reason
    assert not [n for n in result.notices if n.key == "tool_failed"]  # no failure notice


async def test_a_denial_is_sent_to_the_model_as_the_calls_response() -> None:
    turn, tools, paused = await _paused()
    assert paused.approval is not None
    [pending] = paused.approval.calls
    provider = ScriptedProvider([ANSWER], clock=turn.clock)
    await resume_tool_loop(
        snapshot_from_json(paused.approval.snapshot),
        provider,
        tools,
        turn.channel,
        clock=turn.clock,
        decisions=[pending.deny("No.")],
    )
    [request] = provider.requests
    assert request.history is not None
    sent = {entry.call.name: entry.response for entry in request.history}
    assert sent["transfer"].status == "approval_denied" and "No." in (sent["transfer"].reason or "")
    assert sent["get_weather"].success


async def test_a_predicate_decides_per_call_and_a_raising_one_makes_the_call_wait() -> None:
    def over_100(arguments: Any) -> bool:
        return bool(arguments["amount"] > 100)

    turn, _, result = await _paused(
        [[transfer(50, call_id="a"), transfer(500, call_id="b")], ANSWER],
        needs_approval=over_100,
    )
    assert _ran(turn.executions) == [("transfer", {"amount": 50, "to": "Bob"})]
    assert result.approval is not None
    assert [c.arguments["amount"] for c in result.approval.calls] == [500]

    def broken(_arguments: Any) -> bool:
        raise KeyError("amount")

    turn, _, result = await _paused([[transfer(50)], ANSWER], needs_approval=broken)
    assert turn.executions.calls == []
    assert result.approval is not None
    [pending] = result.approval.calls
    assert pending.predicate_error == "KeyError: 'amount'"


async def test_every_call_of_a_batch_may_wait_and_none_runs() -> None:
    turn, tools, paused = await _paused(
        [[transfer(1, call_id="a"), transfer(2, call_id="b")], ANSWER]
    )
    assert turn.executions.calls == []
    assert paused.approval is not None
    first, second = paused.approval.calls
    result = await _resume(
        turn, tools, paused.approval.snapshot, [second.deny("not this one"), first.approve()]
    )
    assert _ran(turn.executions) == [("transfer", {"amount": 1, "to": "Bob"})]
    assert [e.response.success for e in result.history] == [True, False]


async def test_a_waiting_call_counts_toward_the_tool_call_limit() -> None:
    turn, _, result = await _paused(
        [[transfer(1, call_id="a"), weather("Paris"), weather("Rome", call_id="r")], ANSWER],
        policy=LoopPolicy(max_tool_calls=2),
    )
    assert _ran(turn.executions) == [("get_weather", {"city": "Paris"})]  # Rome was over the limit
    assert result.approval is not None and len(result.approval.calls) == 1


async def test_a_refused_call_is_never_asked_about() -> None:
    # an unknown tool and unparseable arguments are refused at the gate before approval
    bad = FunctionCall("transfer", "{not json", "x", parse_error="Expecting property name")
    _, _, result = await _paused([[bad, weather("Paris")], ANSWER])
    assert result.status is TurnStatus.COMPLETED  # nothing waited
    assert result.approval is None


async def test_the_call_after_the_resume_is_asked_about_again() -> None:
    turn, tools, paused = await _paused([[transfer(5)], [transfer(6, call_id="t2")], ANSWER])
    assert paused.approval is not None
    [pending] = paused.approval.calls
    again = await _resume(
        turn,
        tools,
        paused.approval.snapshot,
        [pending.approve()],
        passes=[[transfer(6, call_id="t2")], ANSWER],
    )
    assert again.status is TurnStatus.AWAITING_APPROVAL
    assert again.approval is not None
    [second] = again.approval.calls
    assert (second.arguments["amount"], second.iteration) == (6, 2)
    # the first pause's decision does not answer the second pause's call
    with pytest.raises(ApprovalError, match="answers no call"):
        await _resume(turn, tools, again.approval.snapshot, [pending.approve()])
    done = await _resume(turn, tools, again.approval.snapshot, [second.approve()])
    assert done.status is TurnStatus.COMPLETED
    assert [args["amount"] for name, args in _ran(turn.executions)] == [5, 6]
    assert [e.call.arguments["amount"] for e in done.history] == [5, 6]


# --------------------------------------------------------------------------- binding
async def test_a_decision_on_a_changed_snapshot_is_refused() -> None:
    turn, tools, paused = await _paused()
    assert paused.approval is not None
    [pending] = paused.approval.calls
    approval = pending.approve()
    data = json.loads(paused.approval.snapshot)
    [transfer_call] = [c for c in data["loop"]["paused"] if c["awaiting"]]
    transfer_call["arguments"]["amount"] = 5000  # the snapshot was changed after the decision
    with pytest.raises(ApprovalError, match="answers no call"):
        await _resume(turn, tools, json.dumps(data), [approval])
    assert ("transfer", {"amount": 5000, "to": "Bob"}) not in _ran(turn.executions)


async def test_a_decision_from_another_turn_is_refused() -> None:
    turn, tools, paused = await _paused()
    assert paused.approval is not None
    [pending] = paused.approval.calls
    other = PendingApproval(
        "turn-2",
        1,
        1,
        0,
        "call-t",
        "transfer",
        {"amount": 50, "to": "Bob"},
        _digest_of("turn-2", pending),
    )
    with pytest.raises(ApprovalError, match="answers no call"):
        await _resume(turn, tools, paused.approval.snapshot, [other.approve()])


def _digest_of(turn_id: str, pending: PendingApproval) -> str:
    from toolloop_fsm.approvals import call_digest

    return call_digest(
        turn_id,
        pending.attempt,
        pending.iteration,
        pending.position,
        pending.call_id,
        pending.tool,
        pending.arguments,
    )


async def test_missing_extra_and_double_decisions_are_refused_before_anything_runs() -> None:
    turn, tools, paused = await _paused()
    assert paused.approval is not None
    [pending] = paused.approval.calls
    snapshot = paused.approval.snapshot
    with pytest.raises(ApprovalError, match="no decision on 'transfer' at position 0"):
        await _resume(turn, tools, snapshot, [])
    with pytest.raises(ApprovalError, match="two decisions"):
        await _resume(turn, tools, snapshot, [pending.approve(), pending.deny("no")])
    assert turn.executions.calls == [("get_weather", {"city": "Paris"}, 0.0)]
    # a turn that waits on nothing takes no decisions
    done = await _resume(turn, tools, snapshot, [pending.approve()])
    assert done.status is TurnStatus.COMPLETED


async def test_an_undecided_snapshot_is_refused_by_the_machine_itself() -> None:
    from toolloop_fsm.machine import ToolLoopMachine

    _, tools, paused = await _paused()
    assert paused.approval is not None
    snapshot = snapshot_from_json(paused.approval.snapshot)
    assert snapshot.loop is not None
    with pytest.raises(SnapshotError, match="waits for a decision"):
        ToolLoopMachine(tools=tools).resume(snapshot.loop)


async def test_signed_decisions_are_checked_with_the_hosts_key() -> None:
    turn, tools, paused = await _paused()
    assert paused.approval is not None
    [pending] = paused.approval.calls
    snapshot = paused.approval.snapshot
    with pytest.raises(ApprovalError, match="is not signed"):
        await _resume(turn, tools, snapshot, [pending.approve()], approval_key=KEY)
    with pytest.raises(ApprovalError, match="bad signature"):
        await _resume(
            turn, tools, snapshot, [pending.approve(key=b"another key")], approval_key=KEY
        )
    forged = Decision(
        **{**_fields(pending.approve(key=KEY)), "arguments": {"amount": 9999, "to": "Eve"}}
    )
    with pytest.raises(ApprovalError, match="bad signature"):
        await _resume(turn, tools, snapshot, [forged], approval_key=KEY)
    with pytest.raises(ApprovalError, match="give approval_key"):
        await _resume(turn, tools, snapshot, [pending.approve(key=KEY)])
    assert _ran(turn.executions) == [("get_weather", {"city": "Paris"})]
    result = await _resume(
        turn, tools, snapshot, [pending.approve(key="host approval key")], approval_key=KEY
    )
    assert result.status is TurnStatus.COMPLETED


def _fields(decision: Decision) -> dict[str, Any]:
    fields: dict[str, Any] = json.loads(decision.to_json())
    return fields


def test_a_decision_travels_as_json_and_bad_json_is_refused_by_name() -> None:
    pending = PendingApproval("t", 1, 1, 0, None, "transfer", {"amount": 1}, "a" * 64)
    decision = pending.approve(arguments={"amount": 2}, key=KEY)
    assert Decision.from_json(decision.to_json()) == decision
    assert Decision.from_json(decision.to_json()).signed_by(KEY)
    with pytest.raises(ApprovalError, match="JSON"):
        Decision.from_json("{")
    with pytest.raises(ApprovalError, match="position has the wrong type"):
        Decision.from_json(decision.to_json().replace('"position":0', '"position":"0"'))
    with pytest.raises(ApprovalError, match="unknown"):
        Decision.from_json(decision.to_json()[:-1] + ',"extra":1}')
    with pytest.raises(ValueError, match="needs a reason"):
        pending.deny("  ")


# --------------------------------------------------------------------------- twice
async def test_a_snapshot_resumed_twice_gives_one_result_and_the_side_effect_happens_once() -> None:
    paid: dict[str, int] = {}

    async def pay(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        assert ctx.idempotency_key is not None
        paid.setdefault(ctx.idempotency_key, arguments["amount"])  # the bank keys on it
        return ToolResult(data={"paid": arguments["amount"]})

    clock = VirtualClock()
    tools = [Tool("transfer", "pay", {"type": "object"}, pay, needs_approval=True)]
    channel = RecordingChannel(clock=clock)
    from toolloop_fsm import run_tool_loop

    paused = await run_tool_loop(
        ScriptedProvider([[transfer(50)], ANSWER], clock=clock),
        tools,
        channel,
        TurnRequest(USER, turn_id="turn-9"),
        clock=clock,
    )
    assert paused.approval is not None
    [pending] = paused.approval.calls
    results = [
        await resume_tool_loop(
            snapshot_from_json(paused.approval.snapshot),
            ScriptedProvider([ANSWER], clock=clock),
            tools,
            channel,
            clock=clock,
            decisions=[pending.approve()],
        )
        for _ in range(2)
    ]
    assert results[0] == results[1]
    assert list(paid.values()) == [50] and len(paid) == 1
    assert channel.text == "Done: sent and looked up."  # the keyed channel showed it once
    assert channel.duplicates_dropped == 1


async def test_decide_is_pure_and_the_decided_snapshot_resumes_without_decisions() -> None:
    turn, tools, paused = await _paused()
    assert paused.approval is not None
    [pending] = paused.approval.calls
    snapshot = snapshot_from_json(paused.approval.snapshot)
    decided = decide(snapshot, [pending.approve()])
    assert pending_approvals(decided) == ()
    assert pending_approvals(snapshot) == paused.approval.calls  # the original is unchanged
    result = await resume_tool_loop(
        decided, ScriptedProvider([ANSWER], clock=turn.clock), tools, turn.channel, clock=turn.clock
    )
    assert result.status is TurnStatus.COMPLETED


# --------------------------------------------------------------------------- generation turns
async def test_a_generation_turn_pauses_in_its_attempt_and_resumes_there() -> None:
    """Model A fails; model B's batch runs the weather call and waits on the transfer; the
    turn pauses, A's failure standing. Resumed with the approval, B goes on in attempt 2:
    the transfer runs once, the weather call is not run again."""
    from toolloop_fsm import Attempt
    from toolloop_fsm import ProviderError
    from toolloop_fsm import resume_generation_turn
    from toolloop_fsm import run_generation_turn
    from toolloop_fsm.testing import Fail

    clock = VirtualClock()
    executions = Executions()
    tools = [
        make_tool("transfer", executions, clock, needs_approval=True),
        make_tool("get_weather", executions, clock),
    ]
    failing = [[Fail(ProviderError("overloaded", kind="server", retryable=True))]]
    batch = [TextDelta("On it. "), transfer(50), weather("Paris")]

    def chain(passes: list[list[Any]]) -> list[Attempt]:
        return [
            Attempt(ScriptedProvider(failing, clock=clock), label="A"),
            Attempt(ScriptedProvider(passes, clock=clock), label="B"),
        ]

    channel = RecordingChannel(clock=clock)
    paused = await run_generation_turn(
        chain([batch, ANSWER]), tools, channel, TurnRequest(USER, turn_id="g-1"), clock=clock
    )
    assert paused.status is TurnStatus.AWAITING_APPROVAL
    assert [a.label for a in paused.attempts] == ["A", "B"]
    assert paused.approval is not None
    [pending] = paused.approval.calls
    assert (pending.attempt, pending.tool) == (2, "transfer")
    snapshot = snapshot_from_json(paused.approval.snapshot)
    assert snapshot.tier == "generation" and snapshot.chain is not None
    assert snapshot.chain.attempts == 2 and [f.label for f in snapshot.chain.failures] == ["A"]
    assert _ran(executions) == [("get_weather", {"city": "Paris"})]

    resumed = await resume_generation_turn(
        snapshot, chain([ANSWER]), tools, channel, clock=clock, decisions=[pending.approve()]
    )
    assert resumed.status is TurnStatus.COMPLETED
    assert _ran(executions) == [
        ("get_weather", {"city": "Paris"}),
        ("transfer", {"amount": 50, "to": "Bob"}),
    ]
    assert [a.label for a in resumed.attempts] == ["A", "B"]
    assert [f.label for f in resumed.attempt_failures] == ["A"]
    assert channel.text == "On it. Done: sent and looked up."
    assert resumed.approval is None
    # a decision taken for attempt 2 answers no other attempt's call
    with pytest.raises(ApprovalError):
        decide(snapshot, [attrs_evolve_digest(pending)])


def attrs_evolve_digest(pending: PendingApproval) -> Decision:
    import attrs

    from toolloop_fsm.approvals import call_digest

    digest = call_digest(
        pending.turn_id,
        1,
        pending.iteration,
        pending.position,
        pending.call_id,
        pending.tool,
        pending.arguments,
    )
    return attrs.evolve(pending, digest=digest).approve()
