"""Build result (docs/behaviour.md §4.3–§4.6, §6): the terminal decisions that end a turn after
a tool round, the bounded wait for deliveries in flight, and assembling
`GenerationTurnResult`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from toolloop_fsm.approvals import ApprovalRequest
from toolloop_fsm.budgets import BUDGET_REASONS
from toolloop_fsm.budgets import price_of
from toolloop_fsm.budgets import spent_by
from toolloop_fsm.decisions import pending_approvals
from toolloop_fsm.effects import CancelStream
from toolloop_fsm.events import DeadlineKind
from toolloop_fsm.events import DeliveryFailed
from toolloop_fsm.events import DeliveryRecorded
from toolloop_fsm.events import StopRequested
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.result import Notice
from toolloop_fsm.result import TurnStatus
from toolloop_fsm.result import UsageLedger
from toolloop_fsm.snapshot import TurnSnapshot
from toolloop_fsm.snapshot import snapshot_to_json
from toolloop_fsm.snapshot_capture import capture_loop
from toolloop_fsm.states.delivery import arm_deadline
from toolloop_fsm.states.delivery import clear_deadline
from toolloop_fsm.states.delivery import post_notice
from toolloop_fsm.states.delivery import record_delivery
from toolloop_fsm.states.stream_once import close_pass
from toolloop_fsm.states.stream_once import queue_stop_message
from toolloop_fsm.states.tool_dispatch import cancel_running_calls
from toolloop_fsm.turn import TurnState


# --------------------------------------------------------------------------- terminal decisions
def end_tool_error_loop(turn: TurnState, _event: Any = None) -> None:
    post_notice(turn, Notice("tool_error_loop", {"failures": turn.consecutive_tool_errors}))


def complete_end_turn(turn: TurnState, _event: Any = None) -> None:
    _final_text_is_pre_tool_text(turn)


def complete_retry_exhausted(turn: TurnState, _event: Any = None) -> None:
    post_notice(turn, Notice("retry_exhausted", {"failures": turn.continuation_failures}))
    _final_text_is_pre_tool_text(turn)


def complete_after_pre_tool_text(turn: TurnState, _event: Any = None) -> None:
    _final_text_is_pre_tool_text(turn)


def _final_text_is_pre_tool_text(turn: TurnState) -> None:
    turn.produced.last_text = turn.pre_tool_text or ""


def end_iteration_ceiling(turn: TurnState, _event: Any = None) -> None:
    post_notice(turn, Notice("max_iterations", {"iterations": turn.iterations}))


def fail_delivery_while_streaming(turn: TurnState, event: DeliveryFailed) -> None:
    """The host's channel failed during a pass: the stream is cancelled and the pass closed
    (its usage kept)."""
    turn.effects.append(CancelStream())
    close_pass(turn, "error", error="the host's channel raised")
    _fail_delivery(turn, event)


def fail_delivery_during_tool(turn: TurnState, event: DeliveryFailed) -> None:
    """The host's channel failed while tools run: every running call is cancelled."""
    cancel_running_calls(turn)
    _fail_delivery(turn, event)


def fail_delivery_while_settling(turn: TurnState, event: DeliveryFailed) -> None:
    """The host's channel failed while the ended turn waits for its deliveries."""
    _fail_delivery(turn, event)


def _fail_delivery(turn: TurnState, event: DeliveryFailed) -> None:
    """Host code failed: the turn ends ``error`` (no fallback; the ending is declared) and
    nothing else runs."""
    if event.seq is not None:
        turn.deliveries.in_flight.pop(event.seq, None)
    if event.timed_out:
        turn.error_message = f"the host's channel did not return: {event.error}"
    else:
        turn.error_message = f"the host's channel raised while delivering: {event.error}"


# --------------------------------------------------------------------------- settling
def begin_settling(turn: TurnState, _event: Any = None) -> None:
    """Wait (bounded) for deliveries in flight. After a genuine timeout the window is the
    short ``abandoned_stream_settle``; otherwise the inactivity budget bounds it."""
    turn.settle_started = True
    seconds = (
        turn.policy.abandoned_stream_settle
        if turn.status is TurnStatus.TIMEOUT
        else turn.policy.inactivity_timeout
    )
    arm_deadline(turn, DeadlineKind.SETTLE, seconds)


def settle_delivery(turn: TurnState, event: DeliveryRecorded) -> None:
    record_delivery(turn, event)
    if not turn.deliveries.in_flight:
        clear_deadline(turn, DeadlineKind.SETTLE)


def abandon_in_flight(turn: TurnState, _event: Any = None) -> None:
    turn.armed.pop(DeadlineKind.SETTLE, None)


def kill_while_settling(turn: TurnState, event: StopRequested) -> None:
    """A stop while waiting for deliveries: finish at once (the kill path skips the settle
    window). Which ending stands is declared: a stalled stream's timeout becomes
    ``stopped_by_user`` (docs/behaviour.md §6.1), any other decided outcome stands."""
    clear_deadline(turn, DeadlineKind.SETTLE)
    queue_stop_message(turn, event)


def ignore_follow_up_while_settling(turn: TurnState, _event: Any = None) -> None:
    turn.produced.follow_ups_cleared += 1


# --------------------------------------------------------------------------- the result
def build_result(
    turn: TurnState, *, status: TurnStatus | None = None, reason: str | None = None
) -> GenerationTurnResult:
    """The result of the turn as it stands (``status``/``reason`` override the decided ones,
    for a turn interrupted from outside)."""
    if status is None:
        status = turn.status
        reason = turn.reason
    assert status is not None
    final_text, undelivered_text = _result_texts(turn, status)
    details = "\n".join(
        f"{entry.call.name}: "
        + ("ok" if entry.response.success else f"failed ({entry.response.reason})")
        for entry in turn.history or ()
    )
    return GenerationTurnResult(
        status=status,
        reason=reason,
        final_text=final_text,
        undelivered_text=undelivered_text,
        details_text=details,
        history=tuple(turn.history or ()),
        stream_results=tuple(turn.produced.stream_results or ()),
        usage=UsageLedger(tuple(turn.produced.usage or ())),
        iterations=turn.iterations,
        tool_dispatches=turn.dispatches,
        finished_calls=finished_calls(turn),
        tool_response_delivered=turn.tool_response_delivered,
        thought_log=turn.produced.thought_log,
        thought_log_owner=turn.request.thought_log_owner,
        delivered=tuple(sorted(turn.deliveries.delivered or (), key=lambda d: d.seq)),
        notices=tuple(turn.produced.notices or ()),
        held_notice=turn.produced.held_notice,
        stop_message=turn.stop_message,
        error_message=turn.error_message,
        provider_error_kind=turn.provider_error_kind,
        retryable=turn.provider_error_retryable,
        retry_after=turn.provider_retry_after,
        disabled_enrichment_kinds=turn.disabled_enrichment_kinds,
        reviews=tuple(turn.draft.records) if turn.draft is not None else (),
        # the ceiling the turn ended at: a host failure or a stop after it ends it otherwise
        budget_exceeded=turn.budget_exceeded if reason in BUDGET_REASONS else None,
        cost=_cost(turn),
        approval=_approval(turn) if status is TurnStatus.AWAITING_APPROVAL else None,
        taken_messages=tuple(turn.taken_messages or ()),
        unanswered_messages=tuple(turn.held_messages or ()),
        turn_id=turn.request.turn_id,
        trace=tuple(turn.trace),
    )


def _approval(turn: TurnState) -> ApprovalRequest:
    """What a turn paused for approval hands its host: the calls it waits on and its
    snapshot, taken with its batch (docs/behaviour.md §3.13)."""
    snapshot = TurnSnapshot(capture_loop(turn, paused=True))
    return ApprovalRequest(pending_approvals(snapshot), snapshot_to_json(snapshot))


def _cost(turn: TurnState) -> float | None:
    """What the turn's ledger cost at its model's price (``None``: no price given)."""
    price = price_of(turn.policy, turn.attempt_budget)
    if price is None:
        return None
    return spent_by(turn.produced.usage or (), price).cost


def finished_calls(turn: TurnState) -> tuple[str, ...]:
    """The calls of a batch the turn ended in (a stop, a failing channel) that had run and
    finished: their outcomes are in the ledger, never shown to the model (§3.10 rule 5)."""
    tool_round = turn.tool_round
    if tool_round.recorded:
        return ()
    return tuple(
        str(c.call.name)
        for c in tool_round.calls
        if c.outcome is not None and c.outcome.dispatched and c.dispatch is not None
    )


def count_late_deliveries(
    turn: TurnState, result: GenerationTurnResult, seqs: Iterable[int]
) -> GenerationTurnResult:
    """``result`` with the deliveries ``seqs`` the channel confirmed after the turn had ended
    but before it returned (docs/behaviour.md §6.1 rule 6): they were delivered like any
    other, so they are recorded, and the result's deliveries, final text and undelivered text
    count them. The ending itself stands."""
    for seq in seqs:
        if seq in turn.deliveries.in_flight:
            record_delivery(turn, DeliveryRecorded(seq))
    final_text, undelivered_text = _result_texts(turn, result.status)
    return attrs.evolve(
        result,
        delivered=tuple(sorted(turn.deliveries.delivered or (), key=lambda d: d.seq)),
        final_text=final_text,
        undelivered_text=undelivered_text,
    )


def _result_texts(turn: TurnState, status: TurnStatus) -> tuple[str, str]:
    """The final text (with the scene metadata block, if any) and the undelivered text."""
    final_text, undelivered_text = _final_and_undelivered_text(turn, status)
    if turn.produced.scene_metadata:
        final_text = f"{final_text}\n\n[Scene Metadata]\n" + "\n".join(turn.produced.scene_metadata)
    return final_text, undelivered_text


def _final_and_undelivered_text(turn: TurnState, status: TurnStatus) -> tuple[str, str]:
    """The final text and the text that was buffered but never reached the user.

    A completed turn's final text is its last pass's text, flushed before the end. On every
    other exit it is only what the channel confirmed: the confirmed text of the latest pass
    that had any. What the last pass streamed beyond what
    was confirmed is the undelivered text.
    """
    draft = turn.draft
    if draft is not None and turn.policy.drafting:
        return _drafted_texts(turn, status)
    by_pass: dict[int, list[str]] = {}
    for item in sorted(turn.deliveries.delivered or (), key=lambda d: d.seq):
        if item.text is not None:
            by_pass.setdefault(item.iteration, []).append(item.text)
    confirmed_now = "".join(by_pass.get(turn.iterations, ()))
    streamed = "".join(turn.pass_text)
    # a suppressed pass was never handed over: nothing of it is known to have been seen
    seen = streamed.startswith(confirmed_now)
    undelivered = streamed[len(confirmed_now) :] if seen else streamed
    if status is TurnStatus.COMPLETED:
        return turn.produced.last_text, undelivered
    final = ""
    for iteration in sorted(by_pass, reverse=True):
        text = "".join(by_pass[iteration])
        if text.strip():
            final = text
            break
    return final, undelivered


def _drafted_texts(turn: TurnState, status: TurnStatus) -> tuple[str, str]:
    """With drafting, text reaches the user only as a delivered draft. The final text of a
    completed turn is the draft; on every other exit it is what the channel confirmed. The
    undelivered text is what was held or buffered and never confirmed: a draft discarded
    by a stop, a delivery still in flight."""
    draft = turn.draft
    assert draft is not None
    confirmed = "".join(
        item.text
        for item in sorted(turn.deliveries.delivered or (), key=lambda d: d.seq)
        if item.text is not None
    )
    unsent = [draft.held_text(), draft.discarded]
    unsent.extend(item.text for _, item in sorted(turn.deliveries.in_flight.items()) if item.text)
    unsent.append("".join(turn.pass_text[turn.buffer_start :]))
    undelivered = "".join(unsent)
    if status is TurnStatus.COMPLETED:
        return turn.produced.last_text, undelivered
    return confirmed, undelivered
