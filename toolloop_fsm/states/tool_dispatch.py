"""Execute tool call (docs/behaviour.md §3) and the record-keeping after it (§4.2):
refusals at the gate, dispatch under the tool deadline, outcomes, expressions, failure
notices, history entries, the ledger and the error counters."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from toolloop_fsm.effects import CancelTool
from toolloop_fsm.effects import RunTool
from toolloop_fsm.events import DeadlineKind
from toolloop_fsm.events import FollowUpArrived
from toolloop_fsm.events import StopRequested
from toolloop_fsm.events import ToolFinished
from toolloop_fsm.guards.tool_gate import allowed_tool_names
from toolloop_fsm.ledger import LedgerEntry
from toolloop_fsm.ledger import ToolOutcome
from toolloop_fsm.result import REVIEW_REJECTED_STATUS
from toolloop_fsm.result import Notice
from toolloop_fsm.result import ToolCallRecord
from toolloop_fsm.result import ToolHistoryEntry
from toolloop_fsm.result import ToolResponseRecord
from toolloop_fsm.states.delivery import arm_deadline
from toolloop_fsm.states.delivery import clear_deadline
from toolloop_fsm.states.delivery import deliver_expression
from toolloop_fsm.states.delivery import disarm_deadline
from toolloop_fsm.states.delivery import hold_expression
from toolloop_fsm.states.delivery import post_notice
from toolloop_fsm.states.stream_once import close_pass_with_call
from toolloop_fsm.states.stream_once import queue_stop_message
from toolloop_fsm.turn import TurnState
from toolloop_fsm.turn import call_key_of_pending
from toolloop_fsm.turn import take_occurrence

TRUNCATED_ARGUMENTS_REASON = (
    "The provider truncated the arguments of this call before they were complete; "
    "the tool was not run and nothing was updated. Call it again with complete arguments."
)


# --------------------------------------------------------------------------- the gate
def refuse_truncated_call(turn: TurnState, _event: Any = None) -> None:
    close_pass_with_call(turn)
    turn.tool_round.outcome = ToolOutcome(
        success=False, reason=TRUNCATED_ARGUMENTS_REASON, dispatched=False
    )


def refuse_unparseable_call(turn: TurnState, _event: Any = None) -> None:
    close_pass_with_call(turn)
    call = turn.tool_round.pending_call
    detail = call.parse_error if call is not None else "unknown"
    turn.tool_round.outcome = ToolOutcome(
        success=False,
        reason=f"The arguments were not valid JSON ({detail}); the tool was not run.",
        dispatched=False,
    )


def refuse_outside_allowlist(turn: TurnState, _event: Any = None) -> None:
    close_pass_with_call(turn)
    call = turn.tool_round.pending_call
    name = str(call.name) if call is not None else ""
    allowed = allowed_tool_names(turn)
    allowed_text = ", ".join(allowed) if allowed else "none"
    if turn.registry.get(name) is None:
        closest = turn.registry.closest_name(name)
        hint = f" Did you mean {closest!r}?" if closest is not None else ""
        reason = f"There is no tool named {name!r}.{hint} Tools you may call: {allowed_text}."
    else:
        reason = (
            f"The tool {name!r} is not available in this turn. Tools you may call: {allowed_text}."
        )
    turn.tool_round.outcome = ToolOutcome(success=False, reason=reason, dispatched=False)


def reuse_recorded_outcome(turn: TurnState, _event: Any = None) -> None:
    """A replayed call whose recorded occurrence succeeded, or is in doubt: reuse its outcome
    instead of running the tool again. A reused restart does not restart (its context is
    already there)."""
    close_pass_with_call(turn)
    call = turn.tool_round.pending_call
    assert call is not None
    key = take_occurrence(turn, call_key_of_pending(turn, call))
    recorded = turn.ledger[key].outcome
    turn.tool_round.current_call_key = key
    turn.tool_round.outcome = ToolOutcome(
        success=recorded.success,
        data=recorded.data,
        message=recorded.message,
        reason=recorded.reason,
        in_doubt=recorded.in_doubt,
        end_turn=recorded.end_turn,
        delivered=recorded.delivered,
        expression=recorded.expression,
        restart_item=None,
        dispatched=False,
        reused=True,
    )


def dispatch_tool(turn: TurnState, _event: Any = None) -> None:
    close_pass_with_call(turn)
    start_dispatch(turn)


def start_dispatch(turn: TurnState) -> None:
    """Run the pending call under its deadline (the pass is already closed)."""
    call = turn.tool_round.pending_call
    assert call is not None
    tool = turn.registry.get(call.name)
    assert tool is not None
    turn.dispatches += 1
    key = take_occurrence(turn, call_key_of_pending(turn, call))
    turn.tool_round.current_call_key = key
    timeout = tool.timeout if tool.timeout is not None else turn.policy.tool_timeout
    turn.effects.append(
        RunTool(
            turn.dispatches, call.name, dict(call.arguments), key, call.call_id, timeout=timeout
        )
    )
    arm_deadline(turn, DeadlineKind.TOOL, timeout)


# --------------------------------------------------------------------------- while a tool runs
def take_tool_outcome(turn: TurnState, event: ToolFinished) -> None:
    clear_deadline(turn, DeadlineKind.TOOL)
    turn.tool_round.outcome = ToolOutcome.from_event(event)


def time_out_tool(turn: TurnState, _event: Any = None) -> None:
    disarm_deadline(turn, DeadlineKind.TOOL)
    turn.effects.append(CancelTool(turn.dispatches))
    turn.tool_round.outcome = ToolOutcome(success=False, reason=timed_out_reason(turn))


def cut_off_tool(turn: TurnState, _event: Any = None) -> None:
    """§3.9 rule 2: the deadline of a tool with a reconcile hook passed. It is cancelled and
    the machine waits for its outcome: the timeout (``cut_off``) if it stops within its
    grace, else what the hook says really happened, or that nobody can tell."""
    disarm_deadline(turn, DeadlineKind.TOOL)
    turn.effects.append(CancelTool(turn.dispatches, cut_off=timed_out_reason(turn)))


def timed_out_reason(turn: TurnState) -> str:
    """What the model is told of the running call when its deadline passed."""
    call = turn.tool_round.pending_call
    tool = turn.registry.get(call.name) if call is not None else None
    seconds = tool.timeout if tool is not None and tool.timeout is not None else None
    if seconds is None:
        seconds = turn.policy.tool_timeout
    return f"timed out after {seconds:g} s"


def stop_during_tool(turn: TurnState, event: StopRequested) -> None:
    """/kill while a tool runs: cancel it; its (killed) result is never shown to the model."""
    clear_deadline(turn, DeadlineKind.TOOL)
    turn.effects.append(CancelTool(turn.dispatches))
    queue_stop_message(turn, event)


def clear_stale_follow_up(turn: TurnState, _event: FollowUpArrived) -> None:
    """A follow-up during a tool chain waits for the next turn; the chain continues."""
    turn.produced.follow_ups_cleared += 1


# --------------------------------------------------------------------------- after the outcome
def announce_tool_outcome(turn: TurnState, _event: Any = None) -> None:
    """docs/behaviour.md §3.8: deliver the tool's expression (once per turn) and post the
    hidden failure notice with redacted arguments."""
    outcome = turn.tool_round.outcome
    assert outcome is not None
    if (
        outcome.success
        and outcome.expression is not None
        and not turn.expression_delivered
        and not outcome.reused
    ):
        if turn.draft is not None and turn.policy.drafting:
            hold_expression(turn, outcome.expression)  # shown with the reviewed reply
        else:
            deliver_expression(turn, outcome.expression)
            # the expression is the tool's own reply: an empty follow-up may settle on it
            turn.tool_response_delivered = True
    if not outcome.success and not outcome.rejected:
        post_notice(turn, tool_failure_notice(turn, outcome))


def tool_failure_notice(turn: TurnState, outcome: ToolOutcome) -> Notice:
    call = turn.tool_round.pending_call
    name = str(call.name) if call is not None else "?"
    arguments: Any = {} if call is None or call.truncated else call.arguments
    tool = turn.registry.get(name)
    if tool is not None and tool.redact is not None and isinstance(arguments, Mapping):
        arguments = tool.redact(arguments)
    try:
        arguments_text = json.dumps(arguments, ensure_ascii=False, sort_keys=True, default=str)
    except (TypeError, ValueError):
        arguments_text = repr(arguments)
    summary = f"tool {name} failed: {outcome.reason}\narguments: {arguments_text}"
    limit = turn.policy.tool_failure_notice_limit
    if len(summary) > limit:
        summary = summary[: limit - 1] + "…"
    return Notice("tool_failed", {"tool": name, "summary": summary}, hidden=True)


def record_tool_outcome(turn: TurnState, _event: Any = None) -> None:
    """docs/behaviour.md §4.2: push the history entry, remember the tool, update
    the ledger and the error counters, and clear the prefill the entry now carries."""
    outcome = turn.tool_round.outcome
    call = turn.tool_round.pending_call
    assert outcome is not None and call is not None
    name = str(call.name)
    arguments: Mapping[str, Any] = (
        {} if call.truncated or not isinstance(call.arguments, Mapping) else call.arguments
    )
    if outcome.success:
        response = ToolResponseRecord(
            success=True, data=outcome.data, message=outcome.message, tool_name=name
        )
    else:
        response = ToolResponseRecord(
            success=False,
            data=outcome.data,
            message=outcome.message,
            status=REVIEW_REJECTED_STATUS if outcome.rejected else "tool_execution_failed",
            reason=outcome.reason,
            tool_name=name,
        )
    if turn.history is None:
        turn.history = []
    turn.history.append(
        ToolHistoryEntry(
            call=ToolCallRecord(name, dict(arguments), call.call_id, call.provider_data),
            response=response,
            pre_tool_text=turn.pre_tool_text,
            iteration=turn.iterations,
        )
    )
    turn.prefill = None
    turn.last_tool = name
    if turn.draft is not None:
        # the narration held so far belongs to the function history from here on
        turn.draft.committed_segments = len(turn.draft.segments)
    if outcome.success and outcome.delivered:
        turn.tool_response_delivered = True
    if outcome.dispatched and turn.tool_round.current_call_key is not None:
        # failures are recorded too, so that occurrences line up; only a success is reused
        turn.ledger[turn.tool_round.current_call_key] = LedgerEntry(
            turn.tool_round.current_call_key, outcome
        )
    if outcome.success:
        turn.consecutive_tool_errors = 0
        turn.continuation_failures = 0
        # a success lifts a continuation-style provider's suppression of further text
        turn.suppress_text = False
        if name == turn.policy.memory_tool_name:
            turn.disabled_tools = turn.disabled_tools | {name}
    elif not outcome.rejected:  # a rejection by the tool checkpoint is no failure
        turn.consecutive_tool_errors += 1
        if turn.continuation_style and turn.pre_tool_text is not None:
            turn.continuation_failures += 1
            turn.suppress_text = True
