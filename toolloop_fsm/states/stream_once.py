"""Stream once (docs/behaviour.md §2): one provider pass — awaiting the first token, streaming,
and every way a pass ends (text, tool call, empty, failure, deadline, stop, follow-up). The
ending each exit decides is declared on its transition (`toolloop_fsm.machine`); the actions
here do what the ending needs."""

from __future__ import annotations

import json
from collections.abc import Callable
from collections.abc import Mapping
from operator import is_
from typing import Any
from typing import TypeVar

from toolloop_fsm.budgets import Room
from toolloop_fsm.budgets import cut_report
from toolloop_fsm.budgets import price_of
from toolloop_fsm.effects import CancelStream
from toolloop_fsm.effects import CutStream
from toolloop_fsm.effects import QueueStopResponse
from toolloop_fsm.effects import StartStream
from toolloop_fsm.event_checks import event_shapes
from toolloop_fsm.event_checks import malformation
from toolloop_fsm.events import DeadlineKind
from toolloop_fsm.events import FinishReason
from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import SceneMetadata
from toolloop_fsm.events import StopRequested
from toolloop_fsm.events import StreamFailed
from toolloop_fsm.events import TextDelta
from toolloop_fsm.events import ThoughtDelta
from toolloop_fsm.events import UsageReport
from toolloop_fsm.guards.ceilings import allowance_of_next_pass
from toolloop_fsm.guards.ceilings import tools_withdrawn_by
from toolloop_fsm.guards.tool_gate import offered_tools
from toolloop_fsm.ledger import canonical_call_key
from toolloop_fsm.provider import ProviderRequest
from toolloop_fsm.provider import ToolSpec
from toolloop_fsm.result import TOKEN_WEIGHT_UNIT
from toolloop_fsm.result import BudgetExceeded
from toolloop_fsm.result import Notice
from toolloop_fsm.result import StreamResult
from toolloop_fsm.result import ToolHistoryEntry
from toolloop_fsm.result import UsageEntry
from toolloop_fsm.result import token_weight
from toolloop_fsm.result import tokens_of_weight
from toolloop_fsm.states.delivery import arm_deadline
from toolloop_fsm.states.delivery import clear_deadline
from toolloop_fsm.states.delivery import disarm_deadline
from toolloop_fsm.states.delivery import discard_buffer
from toolloop_fsm.states.delivery import flush_buffer
from toolloop_fsm.states.delivery import post_notice
from toolloop_fsm.states.held_messages import take_steered_messages
from toolloop_fsm.turn import BatchCall
from toolloop_fsm.turn import PassRecord
from toolloop_fsm.turn import ReadCount
from toolloop_fsm.turn import ToolRound
from toolloop_fsm.turn import TurnState

Item = TypeVar("Item")


# --------------------------------------------------------------------------- pass start
def begin_pass(turn: TurnState, _event: Any = None) -> None:
    """Open an ordinary pass, offering the turn's tools (`open_pass`)."""
    turn.tools_withdrawn = None
    open_pass(turn)


def begin_final_answer_pass(turn: TurnState, _event: Any = None) -> None:
    """Open the final answer pass (docs/behaviour.md §3.12, §2.1): the tools stay declared
    but the model is asked to call none, and the turn remembers which ceiling withdrew them
    (the pass's ending names it)."""
    turn.tools_withdrawn = tools_withdrawn_by(turn)
    open_pass(turn)


def _history_to_send(turn: TurnState) -> tuple[ToolHistoryEntry, ...]:
    """The history the context does not hold yet, copied once (a held message moved the
    rest into the context; most turns take none, and send the whole history)."""
    history = turn.history
    if not history:
        return ()
    moved = turn.history_in_context
    return tuple(history) if not moved else tuple(history[moved:])


def open_pass(turn: TurnState) -> None:
    """Open pass number ``iterations + 1``: the steered messages held join its context
    (docs/behaviour.md §8.5 rule 2); reset the accumulators, start the stream, arm the
    first-token budget, and post the one-time *still working* notice."""
    if turn.held_messages:
        take_steered_messages(turn)
    # the one-time notice goes out as the pass after the soft-warn count begins (with the
    # default 20: before the 21st pass)
    if turn.iterations == turn.policy.soft_warn_iteration:
        post_notice(turn, Notice("still_working", {"iteration": turn.iterations + 1}))
    turn.iterations += 1
    turn.pass_text.clear()
    turn.buffer_start = 0
    turn.buffer_len = 0
    turn.tool_round = ToolRound()
    allowance = allowance_of_next_pass(turn)
    room = allowance if isinstance(allowance, Room) else None
    max_output = turn.request.max_output
    if room is None:
        turn.write_room = None
    else:
        # the pass's worst case is reserved: it is asked for no more than the budgets leave
        max_output = room.tokens if max_output is None else min(max_output, room.tokens)
        turn.write_room = room.tokens * TOKEN_WEIGHT_UNIT
    request = ProviderRequest(
        context=tuple(turn.context),
        tools=offered_tools(turn),
        history=_history_to_send(turn),
        prefill=turn.prefill,
        max_output=max_output,
        disabled_enrichment_kinds=turn.disabled_enrichment_kinds,
        parallel_tool_calls=turn.policy.parallel_tool_calls,
        tools_withdrawn=turn.tools_withdrawn is not None,
    )
    turn.current_pass = PassRecord(request=request, room=room)
    turn.effects.append(StartStream(turn.iterations, request))
    # one deadline per pass: the first-token budget until the first chunk, then the rolling
    # inactivity budget (the pump measures both from the same timer)
    policy = turn.policy
    arm_deadline(
        turn,
        DeadlineKind.STREAM,
        policy.inactivity_timeout,
        rolling=True,
        first_seconds=policy.effective_first_token_timeout,
        total_seconds=policy.max_pass_duration,
    )


# --------------------------------------------------------------------------- chunks (fast path)
def take_text(turn: TurnState, event: TextDelta) -> None:
    text = event.text
    if turn.write_room is not None and text:  # under a budget: weighed as it streams
        text = _within_room(turn, text)
        if not text:
            return
    turn.pass_text.append(text)
    buffered = turn.buffer_len + len(text)
    turn.buffer_len = buffered
    if buffered >= turn.flush_chars:  # pass_rules.flush_due, inlined: it runs per chunk
        flush_buffer(turn, mid_stream=True)


def take_thought(turn: TurnState, event: ThoughtDelta) -> None:
    text = event.text
    if turn.write_room is not None:
        text = _within_room(turn, text)
        if not text:
            return
    thoughts = turn.current_pass.thoughts
    if thoughts is None:
        turn.current_pass.thoughts = [text]
    else:
        thoughts.append(text)


def _within_room(turn: TurnState, text: str) -> str:
    """docs/behaviour.md §2.8 rule 4: what of ``text`` the pass may still write. The piece
    that reaches the room is cut on a character boundary; the stream is then cut
    (`CutStream`: its request is aborted) and nothing more of the pass is taken."""
    room = turn.write_room
    assert room is not None
    if turn.budget_exceeded is not None:
        return ""  # cut already: what still arrives before the stream closes is not taken
    weight = token_weight(text)
    if weight <= room:
        turn.write_room = room - weight
        return text
    kept = 0
    for index, char in enumerate(text):
        kept += token_weight(char)
        if kept > room:
            text = text[:index]
            break
    allowed = turn.current_pass.room
    assert allowed is not None
    written = allowed.tokens  # the pass wrote its whole room
    turn.write_room = 0
    turn.budget_exceeded = cut_report(allowed, written, price_of(turn.policy, turn.attempt_budget))
    turn.effects.append(CutStream())
    return text


#: The declared checks of a usage report's fields (built once, at import).
_USAGE_SHAPE = event_shapes((UsageReport,))


def take_usage(turn: TurnState, event: UsageReport) -> None:
    """Fold a usage report into the pass's entry. A count that is not a whole number >= 0
    is refused by the event's own declaration (`feed` has refused it as an `InvalidEvent`
    already; a stream reader calling this handler directly gets the `ValueError`, which the
    pump turns into the provider's protocol failure)."""
    problem = malformation(_USAGE_SHAPE, event)
    if problem is not None:
        raise ValueError(problem)
    previous = turn.current_pass.usage
    if event.cumulative or previous is None:
        turn.current_pass.usage = UsageEntry(
            turn.iterations, event.input_tokens, event.output_tokens, event.estimated
        )
    else:
        turn.current_pass.usage = UsageEntry(
            turn.iterations,
            previous.input_tokens + event.input_tokens,
            previous.output_tokens + event.output_tokens,
            previous.estimated or event.estimated,
        )


def take_function_call(turn: TurnState, event: FunctionCall) -> None:
    """Every call of a pass joins its tool batch, in emitted order (docs/behaviour.md
    §3.10)."""
    calls = turn.tool_round.calls
    calls.append(BatchCall(event, len(calls)))


def take_finish_reason(turn: TurnState, event: FinishReason) -> None:
    turn.current_pass.finish = event.kind


def take_scene_metadata(turn: TurnState, event: SceneMetadata) -> None:
    if turn.produced.scene_metadata is None:
        turn.produced.scene_metadata = [event.text]
    else:
        turn.produced.scene_metadata.append(event.text)


CHUNK_HANDLERS: dict[type, Callable[[TurnState, Any], None]] = {
    TextDelta: take_text,
    ThoughtDelta: take_thought,
    UsageReport: take_usage,
    FunctionCall: take_function_call,
    FinishReason: take_finish_reason,
    SceneMetadata: take_scene_metadata,
}


def take_first_chunk(turn: TurnState, event: Any) -> None:
    """The first chunk: from here the pass's stream deadline is the rolling inactivity
    budget (the pump sees the chunk; the deadline need not be re-armed), and the pass was
    answered (its usage is recorded, estimated if the provider reports none)."""
    turn.current_pass.answered = True
    CHUNK_HANDLERS[type(event)](turn, event)


# --------------------------------------------------------------------------- pass end
def close_pass(turn: TurnState, outcome: str, *, error: str | None = None) -> str:
    """Record the pass's stream result, usage and thoughts; returns the pass's text."""
    clear_deadline(turn, DeadlineKind.STREAM)
    text = "".join(turn.pass_text)
    calls = turn.tool_round.calls
    if turn.produced.stream_results is None:
        turn.produced.stream_results = []
    turn.produced.stream_results.append(
        StreamResult(
            iteration=turn.iterations,
            outcome=outcome,
            text=text,
            finish=turn.current_pass.finish,
            function_call=str(calls[0].call.name) if calls else None,
            ignored_calls=tuple(turn.current_pass.ignored_calls or ()),
            error=error,
        )
    )
    usage = turn.current_pass.usage
    if usage is None and turn.current_pass.answered:
        usage = estimate_usage(turn, text)
    if usage is not None:
        if turn.produced.usage is None:
            turn.produced.usage = []
        turn.produced.usage.append(usage)
        turn.current_pass.usage = None
    if turn.current_pass.thoughts:
        thoughts = "".join(turn.current_pass.thoughts)
        if thoughts.strip():
            turn.produced.thought_log = thoughts
    if text.strip():
        turn.produced.last_text = text
    return text


def estimate_usage(turn: TurnState, text: str) -> UsageEntry:
    """docs/behaviour.md §2.2 rule 3: the usage of a pass the provider answered without a
    report — the script-aware estimate (`toolloop_fsm.result.token_weight`), rounded up,
    marked ``estimated``. Output: the text, thoughts and call the pass streamed; input: what
    the request gave the model to read, a running count over the turn's requests
    (`read_weight`)."""
    written = token_weight(text) + sum(map(token_weight, turn.current_pass.thoughts or ()))
    for batch_call in turn.tool_round.calls:
        call = batch_call.call
        written += token_weight(canonical_call_key(str(call.name), call.arguments))
    request = turn.current_pass.request
    read = 0
    if request is not None:
        count = turn.read_count
        if count is None:
            count = turn.read_count = ReadCount()
        read = read_weight(count, request)
    return UsageEntry(turn.iterations, tokens_of_weight(read), tokens_of_weight(written), True)


def read_weight(count: ReadCount, request: ProviderRequest) -> int:
    """The token weight of what ``request`` gives the model to read — its prefill, each
    message's text, each history entry, and the tools offered — counted on from what
    ``count`` counted of the turn's earlier requests (a request is a value no one changes:
    its own tuples are kept as what was counted)."""
    context = tuple(request.context)
    count.context_weight = _count_on(count.context, count.context_weight, context, message_weight)
    count.context = context
    history = tuple(request.history)
    count.history_weight = _count_on(
        count.history, count.history_weight, history, history_entry_weight
    )
    count.history = history
    # the tools a turn offers are one tuple until the set changes (`offered_tools`)
    tools = tuple(request.tools)
    if tools is not count.tools:
        count.tools_weight = sum(map(tool_weight, tools))
        count.tools = tools
    return (
        token_weight(request.prefill or "")
        + count.context_weight
        + count.history_weight
        + count.tools_weight
    )


def _count_on(
    counted: tuple[Item, ...],
    weight: int,
    current: tuple[Item, ...],
    measure: Callable[[Item], int],
) -> int:
    """The weight of ``current``: that of ``counted`` plus what follows it, when ``current``
    starts with the very items counted; otherwise all of ``current`` afresh."""
    if current is counted:
        return weight
    seen = len(counted)
    if len(current) >= seen and all(map(is_, counted, current)):
        return weight + sum(map(measure, current[seen:]))
    return sum(map(measure, current))


def message_weight(message: Mapping[str, Any]) -> int:
    """A message's text: a string, or the text parts of a list of parts."""
    content = message.get("content")
    if isinstance(content, str):
        return token_weight(content)
    if isinstance(content, list):
        total = 0
        for part in content:
            if isinstance(part, str):
                total += token_weight(part)
            elif isinstance(part, Mapping) and isinstance(part.get("text"), str):
                total += token_weight(part["text"])
        return total
    return 0


def history_entry_weight(entry: ToolHistoryEntry) -> int:
    """One tool round: the pre-tool text, the call's name and compact arguments, and the
    response as JSON."""
    response = entry.response
    return (
        token_weight(entry.pre_tool_text or "")
        + token_weight(canonical_call_key(entry.call.name, entry.call.arguments))
        + token_weight(_json_text([response.data, response.message, response.reason]))
    )


def tool_weight(tool: ToolSpec) -> int:
    """A tool offered: its name, description and parameter schema as JSON."""
    return (
        token_weight(tool.name)
        + token_weight(tool.description)
        + token_weight(_json_text(tool.parameters))
    )


def _json_text(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):  # a circular structure
        return repr(value)


def close_pass_with_call(turn: TurnState) -> None:
    """A pass that asked for a tool: its text so far is the pre-tool text, delivered now."""
    text = close_pass(turn, "function_call")
    turn.pre_tool_text = text if text.strip() else None
    flush_buffer(turn)


def complete_with_text(turn: TurnState, _event: Any = None) -> None:
    close_pass(turn, "completed")
    flush_buffer(turn)


def complete_settled_after_tool(turn: TurnState, _event: Any = None) -> None:
    close_pass(turn, "empty_response")
    flush_buffer(turn)


def end_empty_response(turn: TurnState, _event: Any = None) -> None:
    close_pass(turn, "empty_response")
    flush_buffer(turn)


def end_at_budget(turn: TurnState, _event: Any = None) -> None:
    """The pass about to open would break a ceiling (docs/behaviour.md §2.8 rule 2): it does
    not start, and the ceiling's notice names it."""
    exceeded = allowance_of_next_pass(turn)
    assert isinstance(exceeded, BudgetExceeded)
    turn.budget_exceeded = exceeded
    post_notice(turn, budget_notice(exceeded))


def end_pass_cut_at_budget(turn: TurnState, _event: Any = None) -> None:
    """The pass was cut as it wrote past its room (§2.8 rule 4): what it wrote within the
    room is delivered, its calls never run (they are named in its ignored calls)."""
    _close_pass_unrun(turn, "budget")
    exceeded = turn.budget_exceeded
    assert exceeded is not None
    post_notice(turn, budget_notice(exceeded))


def budget_notice(exceeded: BudgetExceeded) -> Notice:
    """The ``budget_exceeded`` notice: which ceiling of which budget the turn reached."""
    return Notice(
        "budget_exceeded",
        {"scope": exceeded.scope, "limit": exceeded.limit, "allowed": exceeded.allowed},
    )


def end_malformed_call(turn: TurnState, _event: Any = None) -> None:
    """A call of the batch has no name: nothing of the batch runs (§3.1)."""
    close_pass(turn, "function_call", error="malformed tool call")
    flush_buffer(turn)
    turn.error_message = "the model asked for a tool call without a name"


def end_calls_after_tool_call_limit(turn: TurnState, _event: Any = None) -> None:
    """The final answer pass of the tool-call limit asked for tools anyway (§3.12): none
    runs, and the calls are named in the pass's ignored calls."""
    _close_pass_unrun(turn, "function_call")
    post_notice(turn, Notice("tool_call_limit", {"calls": turn.tool_calls_used}))


def end_calls_at_iteration_ceiling(turn: TurnState, _event: Any = None) -> None:
    """The final answer pass at the iteration ceiling asked for tools anyway (§2.1): none
    runs, and the turn ends as the ceiling ends it, with its notice."""
    _close_pass_unrun(turn, "function_call")
    post_notice(turn, Notice("max_iterations", {"iterations": turn.iterations}))


def _close_pass_unrun(turn: TurnState, outcome: str) -> None:
    """Close a pass whose calls never run, naming them in its ignored calls, and deliver
    what it streamed."""
    calls = turn.tool_round.calls
    if calls:
        turn.current_pass.ignored_calls = [str(c.call.name) for c in calls]
    close_pass(turn, outcome)  # the calls were streamed: the usage estimate counts them
    calls.clear()
    flush_buffer(turn)


def fail_stream(turn: TurnState, event: StreamFailed) -> None:
    """The provider's stream raised: what was buffered is not delivered (another attempt
    continues from what was), and the turn ends ``error`` with the provider's facts."""
    close_pass(turn, "error", error=event.message)
    discard_buffer(turn)
    turn.error_message = event.message
    turn.provider_error_kind = event.kind
    turn.provider_error_retryable = event.retryable
    turn.provider_retry_after = event.retry_after


def stop_stream(turn: TurnState, event: StopRequested) -> None:
    """/kill while streaming: abort the stream, keep the pass's text in the result (nothing
    more is sent), queue the stop message at the front."""
    turn.effects.append(CancelStream())
    close_pass(turn, "stopped_by_user")
    discard_buffer(turn)
    queue_stop_message(turn, event)


def end_stream(turn: TurnState, _event: Any = None) -> None:
    """Every pass's stream ends here. Under drafting, what is still buffered is held now, so
    the ceiling is known before the pass's way out is chosen; otherwise the buffer waits for
    the way out (flushed, or discarded) to be chosen."""
    if turn.draft is not None and turn.policy.drafting:
        flush_buffer(turn)


def queue_stop_message(turn: TurnState, event: StopRequested) -> None:
    if event.stop_message is not None:
        turn.stop_message = event.stop_message
        turn.effects.append(QueueStopResponse(event.stop_message))


def interrupt_for_follow_up(turn: TurnState, _event: Any = None) -> None:
    """A new user message while streaming: discard the undelivered buffer and yield."""
    turn.effects.append(CancelStream())
    close_pass(turn, "follow_up_interrupt")
    discard_buffer(turn)


def time_out_stream(turn: TurnState, _event: Any = None) -> None:
    """The pass's stream deadline expired: abort the stream, discard what was not delivered,
    and post (or hold, for the outer tier) the timeout notice naming the budget that ran out —
    the sub-reason the transition declared."""
    reason = turn.reason
    disarm_deadline(turn, DeadlineKind.STREAM)
    turn.effects.append(CancelStream())
    close_pass(turn, "timeout", error=reason)
    discard_buffer(turn)
    notice = Notice("timeout", {"reason": reason})
    if turn.hold_timeout_notice:
        turn.produced.held_notice = notice
    else:
        post_notice(turn, notice)
