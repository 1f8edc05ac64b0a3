"""Execute tool call (docs/behaviour.md §3) and the record-keeping after it (§4.2):
refusals at the gate, dispatch under the tool deadline, outcomes, expressions, failure
notices, history entries, the ledger and the error counters."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from toolloop_fsm.effects import CancelTool
from toolloop_fsm.effects import RunTool
from toolloop_fsm.events import DeadlineExpired
from toolloop_fsm.events import FollowUpArrived
from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import StopRequested
from toolloop_fsm.events import ToolFinished
from toolloop_fsm.guards.tool_gate import allowed_tool_names
from toolloop_fsm.ledger import LedgerEntry
from toolloop_fsm.ledger import ToolOutcome
from toolloop_fsm.result import APPROVAL_DENIED_STATUS
from toolloop_fsm.result import REVIEW_REJECTED_STATUS
from toolloop_fsm.result import TOOL_CALL_LIMIT_STATUS
from toolloop_fsm.result import Notice
from toolloop_fsm.result import ToolCallRecord
from toolloop_fsm.result import ToolHistoryEntry
from toolloop_fsm.result import ToolResponseRecord
from toolloop_fsm.states.delivery import arm_call_deadline
from toolloop_fsm.states.delivery import clear_call_deadline
from toolloop_fsm.states.delivery import deliver_expression
from toolloop_fsm.states.delivery import hold_expression
from toolloop_fsm.states.delivery import post_notice
from toolloop_fsm.states.stream_once import close_pass_with_call
from toolloop_fsm.states.stream_once import queue_stop_message
from toolloop_fsm.turn import BatchCall
from toolloop_fsm.turn import TurnState
from toolloop_fsm.turn import call_key_of_pending
from toolloop_fsm.turn import call_with_deadline
from toolloop_fsm.turn import occurrence_key
from toolloop_fsm.turn import take_occurrence

TRUNCATED_ARGUMENTS_REASON = (
    "The provider truncated the arguments of this call before they were complete; "
    "the tool was not run and nothing was updated. Call it again with complete arguments."
)


# --------------------------------------------------------------------------- the batch
def open_batch(turn: TurnState, _event: Any = None) -> None:
    """The pass asked for tools: it is closed (its text so far is the pre-tool text,
    delivered now) and its first call goes to the gate (docs/behaviour.md §3.10 rule 1)."""
    close_pass_with_call(turn)
    tool_round = turn.tool_round
    tool_round.gated = 0
    tool_round.pending_call = tool_round.calls[0].call


def gate_next_call(turn: TurnState, _event: Any = None) -> None:
    """The next call of the batch, in emitted order, goes to the gate."""
    tool_round = turn.tool_round
    tool_round.gated += 1
    tool_round.pending_call = tool_round.calls[tool_round.gated].call


def at_gate(turn: TurnState) -> BatchCall:
    """The call of the batch the gate is deciding."""
    tool_round = turn.tool_round
    return tool_round.calls[tool_round.gated]


# --------------------------------------------------------------------------- the gate
def refuse_non_object_arguments(turn: TurnState, _event: Any = None) -> None:
    call = turn.tool_round.pending_call
    kind = type(call.arguments).__name__ if call is not None else "nothing"
    at_gate(turn).outcome = ToolOutcome(
        success=False,
        reason=f"The arguments must be a JSON object, not {kind}; the tool was not run.",
        dispatched=False,
    )


def refuse_truncated_call(turn: TurnState, _event: Any = None) -> None:
    at_gate(turn).outcome = ToolOutcome(
        success=False, reason=TRUNCATED_ARGUMENTS_REASON, dispatched=False
    )


def refuse_unparseable_call(turn: TurnState, _event: Any = None) -> None:
    call = turn.tool_round.pending_call
    detail = call.parse_error if call is not None else "unknown"
    at_gate(turn).outcome = ToolOutcome(
        success=False,
        reason=f"The arguments were not valid JSON ({detail}); the tool was not run.",
        dispatched=False,
    )


def refuse_outside_allowlist(turn: TurnState, _event: Any = None) -> None:
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
    at_gate(turn).outcome = ToolOutcome(success=False, reason=reason, dispatched=False)


def reuse_recorded_outcome(turn: TurnState, _event: Any = None) -> None:
    """A replayed call whose recorded occurrence succeeded, or is in doubt: reuse its outcome
    instead of running the tool again. A reused restart does not restart (its context is
    already there)."""
    call = turn.tool_round.pending_call
    assert call is not None
    key = take_occurrence(turn, call_key_of_pending(turn, call))
    recorded = turn.ledger[key].outcome
    batch_call = at_gate(turn)
    batch_call.occurrence = key
    batch_call.outcome = ToolOutcome(
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


def refuse_repeated_call(turn: TurnState, _event: Any = None) -> None:
    """The repeated-call guard (docs/behaviour.md §3.11): the call does not run and takes no
    occurrence; the model is told it repeats an identical call, and what that call's
    outcome was (or that it is in this batch, when it has not run yet)."""
    call = turn.tool_round.pending_call
    assert call is not None
    key = call_key_of_pending(turn, call)
    occurrences = turn.occurrences
    assert occurrences is not None
    seen = occurrences[key]
    at_gate(turn).outcome = ToolOutcome(
        success=False,
        reason=repeated_call_reason(turn, str(call.name), occurrence_key(key, seen), seen),
        dispatched=False,
    )


def repeated_call_reason(turn: TurnState, name: str, last: str, seen: int) -> str:
    """What the model is told of a refused repeat: the repeat, the limit, and the outcome of
    the last identical call (``last``, its occurrence)."""
    times = "once" if seen == 1 else f"{seen} times"
    head = (
        f"Not run: this call repeats an identical call of {name!r} (same arguments) already "
        f"made {times} in this turn, as often as identical calls are allowed "
        f"(max_identical_calls={turn.policy.max_identical_calls})."
    )
    in_batch = any(
        batch_call.occurrence == last and batch_call.outcome is None
        for batch_call in turn.tool_round.calls
    )
    entry = turn.ledger.get(last)
    if in_batch or entry is None:
        earlier = "The identical call is in this same batch: its result is the one to use."
    elif entry.outcome.success:
        shown = entry.outcome.message if entry.outcome.data is None else entry.outcome.data
        earlier = f"The last identical call succeeded: {_summary(shown)}. Use that result."
    else:
        earlier = f"The last identical call failed: {entry.outcome.reason}."
    return f"{head} {earlier} Call it again only with different arguments."


_SUMMARY_LIMIT = 400


def _summary(value: Any) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= _SUMMARY_LIMIT else text[: _SUMMARY_LIMIT - 1] + "…"


def refuse_call_over_limit(turn: TurnState, _event: Any = None) -> None:
    """The tool-call limit (docs/behaviour.md §3.12): the call does not run, takes no
    occurrence and counts as no tool error; the model is told to answer with what it has
    (the next pass offers it no tools)."""
    limit = turn.policy.max_tool_calls
    at_gate(turn).outcome = ToolOutcome(
        success=False,
        reason=tool_call_limit_reason(limit if limit is not None else 0),
        dispatched=False,
        limited=True,
    )


def _failure_status(outcome: ToolOutcome) -> str:
    if outcome.rejected:
        return REVIEW_REJECTED_STATUS
    if outcome.limited:
        return TOOL_CALL_LIMIT_STATUS
    if outcome.denied:
        return APPROVAL_DENIED_STATUS
    return "tool_execution_failed"


def tool_call_limit_reason(limit: int) -> str:
    """What the model is told of a call refused by the tool-call limit."""
    calls = "call" if limit == 1 else "calls"
    return (
        f"Not run: the tool-call limit of {limit} {calls} for this turn was reached; "
        "answer with what you have."
    )


def admit_call(turn: TurnState, _event: Any = None) -> None:
    """The call passed the gate: it takes its occurrence (in emitted order, so two identical
    calls of one batch are two occurrences), counts toward the tool-call limit and waits for
    its start."""
    call = turn.tool_round.pending_call
    assert call is not None
    batch_call = at_gate(turn)
    batch_call.occurrence = take_occurrence(turn, call_key_of_pending(turn, call))
    batch_call.admitted = True
    turn.tool_round.queued += 1
    turn.tool_calls_used += 1


def hold_for_approval(turn: TurnState, _event: Any = None) -> None:
    """The call waits for a person (docs/behaviour.md §3.13): it takes its occurrence and
    counts toward the tool-call limit as an admitted call would, but does not run in this
    batch; the rest of the batch runs, then the turn pauses."""
    call = turn.tool_round.pending_call
    assert call is not None
    batch_call = at_gate(turn)
    batch_call.occurrence = take_occurrence(turn, call_key_of_pending(turn, call))
    batch_call.awaiting = True
    batch_call.predicate_error = turn.tool_round.approval_error
    turn.tool_round.awaiting += 1
    turn.tool_calls_used += 1


# --------------------------------------------------------------------------- dispatch
def dispatch_batch(turn: TurnState, _event: Any = None) -> None:
    """The whole batch has passed the gate: its admitted calls start (§3.10 rule 2)."""
    start_ready_calls(turn)


def start_ready_calls(turn: TurnState) -> None:
    """Start the admitted calls that may start now, in emitted order: at most
    ``max_parallel_tools`` running, and a ``sequential`` tool alone (the calls before it
    finish first, the ones after it wait for it)."""
    tool_round = turn.tool_round
    calls = tool_round.calls
    limit = turn.policy.max_parallel_tools
    while tool_round.queued and not tool_round.barrier and tool_round.running < limit:
        batch_call = calls[tool_round.next_start]
        if not batch_call.admitted:
            tool_round.next_start += 1
            continue
        tool = turn.registry.get(batch_call.call.name)
        assert tool is not None
        if tool.sequential:
            if tool_round.running:
                return
            tool_round.barrier = True
        tool_round.next_start += 1
        tool_round.queued -= 1
        tool_round.running += 1
        _start_call(turn, batch_call, tool.timeout)


def _start_call(turn: TurnState, batch_call: BatchCall, seconds: float | None) -> None:
    call = batch_call.call
    assert batch_call.occurrence is not None
    turn.dispatches += 1
    batch_call.dispatch = turn.dispatches
    timeout = seconds if seconds is not None else turn.policy.tool_timeout
    turn.effects.append(
        RunTool(
            turn.dispatches,
            call.name,
            dict(call.arguments),
            batch_call.occurrence,
            call.call_id,
            batch_call.position,
            timeout,
        )
    )
    arm_call_deadline(turn, batch_call, timeout)


# --------------------------------------------------------------------------- while tools run
def running_call(turn: TurnState, dispatch: int) -> BatchCall | None:
    """The running call of the batch with ``dispatch``."""
    for batch_call in turn.tool_round.calls:
        if batch_call.dispatch == dispatch and batch_call.outcome is None:
            return batch_call
    return None


def _finish_call(turn: TurnState, batch_call: BatchCall, outcome: ToolOutcome) -> None:
    """A running call has its outcome: it is kept in the ledger at once (a stop later in
    the batch, a replay or a resume reuses it), and the calls waiting start."""
    batch_call.outcome = outcome
    batch_call.cut_off = False
    tool_round = turn.tool_round
    tool_round.running -= 1
    tool = turn.registry.get(batch_call.call.name)
    if tool is not None and tool.sequential:
        tool_round.barrier = False
    if batch_call.occurrence is not None:
        # failures are recorded too, so that occurrences line up; only a success is reused
        turn.ledger[batch_call.occurrence] = LedgerEntry(batch_call.occurrence, outcome)
    start_ready_calls(turn)


def take_tool_outcome(turn: TurnState, event: ToolFinished) -> None:
    batch_call = running_call(turn, event.dispatch)
    assert batch_call is not None
    clear_call_deadline(turn, batch_call)
    _finish_call(turn, batch_call, ToolOutcome.from_event(event))


def _expired_call(turn: TurnState, event: Any) -> BatchCall:
    token = event.token if isinstance(event, DeadlineExpired) else None
    batch_call = call_with_deadline(turn, token) if token is not None else None
    assert batch_call is not None, "a tool deadline expires for a running call"
    return batch_call


def time_out_tool(turn: TurnState, event: DeadlineExpired) -> None:
    batch_call = _expired_call(turn, event)
    batch_call.deadline = None
    assert batch_call.dispatch is not None
    turn.effects.append(CancelTool(batch_call.dispatch))
    _finish_call(
        turn, batch_call, ToolOutcome(success=False, reason=timed_out_reason(turn, batch_call))
    )


def cut_off_tool(turn: TurnState, event: DeadlineExpired) -> None:
    """§3.9 rule 2: the deadline of a tool with a reconcile hook passed. It is cancelled and
    the machine waits for its outcome: the timeout (``cut_off``) if it stops within its
    grace, else what the hook says really happened, or that nobody can tell."""
    batch_call = _expired_call(turn, event)
    batch_call.deadline = None
    batch_call.cut_off = True
    assert batch_call.dispatch is not None
    turn.effects.append(CancelTool(batch_call.dispatch, cut_off=timed_out_reason(turn, batch_call)))


def timed_out_reason(turn: TurnState, batch_call: BatchCall) -> str:
    """What the model is told of a running call when its deadline passed."""
    tool = turn.registry.get(batch_call.call.name)
    seconds = tool.timeout if tool is not None and tool.timeout is not None else None
    if seconds is None:
        seconds = turn.policy.tool_timeout
    return f"timed out after {seconds:g} s"


def cancel_running_calls(turn: TurnState) -> None:
    """Cancel every running call of the batch (a stop, a failing channel): what they would
    return is never shown to the model; the calls that finished keep their ledger entry."""
    for batch_call in turn.tool_round.calls:
        if batch_call.running:
            clear_call_deadline(turn, batch_call)
            assert batch_call.dispatch is not None
            turn.effects.append(CancelTool(batch_call.dispatch))


def stop_during_tool(turn: TurnState, event: StopRequested) -> None:
    """/kill while tools run: cancel them; their (killed) results are never shown to the
    model."""
    cancel_running_calls(turn)
    queue_stop_message(turn, event)


def clear_stale_follow_up(turn: TurnState, _event: FollowUpArrived) -> None:
    """A follow-up during a tool chain waits for the next turn; the chain continues."""
    turn.produced.follow_ups_cleared += 1


# --------------------------------------------------------------------------- after the outcome
def announce_tool_outcome(turn: TurnState, _event: Any = None) -> None:
    """docs/behaviour.md §3.8, for each call of the batch in emitted order: deliver a tool's
    expression (once per turn) and post the hidden failure notice with redacted
    arguments."""
    for batch_call in turn.tool_round.calls:
        outcome = batch_call.outcome
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
        if outcome.is_failure:
            post_notice(turn, tool_failure_notice(turn, batch_call.call, outcome))


def tool_failure_notice(turn: TurnState, call: FunctionCall, outcome: ToolOutcome) -> Notice:
    name = str(call.name)
    arguments: Any = {} if call.truncated else call.arguments
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
    """docs/behaviour.md §4.2, for every call of the batch in emitted order: push its
    history entry (the pre-tool text on the first only), remember the tools, and update the
    error counters; then clear the prefill the entries now carry."""
    record_calls(turn, turn.tool_round.calls)


def record_calls(turn: TurnState, calls: list[BatchCall]) -> None:
    """Record ``calls`` (the batch, or the calls of a restarting batch that did not ask for
    the restart) as §4.2 says."""
    turn.tool_round.recorded = True
    if turn.history is None:
        turn.history = []
    pre_tool_text = turn.pre_tool_text
    for position, batch_call in enumerate(calls):
        outcome = batch_call.outcome
        assert outcome is not None
        call = batch_call.call
        name = str(call.name)
        _append_entry(turn, call, name, outcome, pre_tool_text if position == 0 else None, position)
        if outcome.success and outcome.delivered:
            turn.tool_response_delivered = True
        _count_outcome(turn, name, outcome)
    if calls:
        turn.prefill = None
        turn.last_tools = tuple(str(batch_call.call.name) for batch_call in calls)
        turn.last_tool = turn.last_tools[-1]
    if turn.draft is not None:
        # the narration held so far belongs to the function history from here on
        turn.draft.committed_segments = len(turn.draft.segments)


def _append_entry(
    turn: TurnState,
    call: FunctionCall,
    name: str,
    outcome: ToolOutcome,
    pre_tool_text: str | None,
    position: int,
) -> None:
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
            status=_failure_status(outcome),
            reason=outcome.reason,
            tool_name=name,
        )
    assert turn.history is not None
    turn.history.append(
        ToolHistoryEntry(
            call=ToolCallRecord(name, dict(arguments), call.call_id, call.provider_data),
            response=response,
            pre_tool_text=pre_tool_text,
            iteration=turn.iterations,
            position=position,
        )
    )


def _count_outcome(turn: TurnState, name: str, outcome: ToolOutcome) -> None:
    """The error counters take one outcome (the batch's, in emitted order)."""
    if outcome.success:
        turn.consecutive_tool_errors = 0
        turn.continuation_failures = 0
        # a success lifts a continuation-style provider's suppression of further text
        turn.suppress_text = False
        if name == turn.policy.memory_tool_name:
            turn.disabled_tools = turn.disabled_tools | {name}
    # a rejection by the tool checkpoint is no failure, nor a refusal by the tool-call limit
    # or a person's denial
    elif outcome.is_failure:
        turn.consecutive_tool_errors += 1
        if turn.continuation_style and turn.pre_tool_text is not None:
            turn.continuation_failures += 1
            turn.suppress_text = True
