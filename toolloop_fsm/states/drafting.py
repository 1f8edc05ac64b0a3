"""Drafting and the tool checkpoint (docs/behaviour.md §14): holding prose under the held-prose
ceiling, completing a response (review, one revision, delivering the held presentation),
and reviewing a proposed tool call before it runs. Which way each verdict leads, and the
ending it decides, is declared in `toolloop_fsm.machine`."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs

from toolloop_fsm.effects import CancelReview
from toolloop_fsm.effects import RequestReview
from toolloop_fsm.events import DeadlineKind
from toolloop_fsm.events import DeliveryFailed
from toolloop_fsm.events import StopRequested
from toolloop_fsm.guards.ceilings import continuation_retries_exhausted
from toolloop_fsm.guards.drafting import call_identity
from toolloop_fsm.guards.exit_policy import pass_has_text
from toolloop_fsm.guards.exit_policy import tool_asked_to_end_turn
from toolloop_fsm.ledger import ToolOutcome
from toolloop_fsm.result import Notice
from toolloop_fsm.result import UsageEntry
from toolloop_fsm.review import CandidateStatus
from toolloop_fsm.review import Finding
from toolloop_fsm.review import Pass
from toolloop_fsm.review import ProposedCall
from toolloop_fsm.review import ReviewedTool
from toolloop_fsm.review import ReviewKind
from toolloop_fsm.review import ReviewPacket
from toolloop_fsm.review import ReviewRecord
from toolloop_fsm.review import Revise
from toolloop_fsm.review import RevisionInfo
from toolloop_fsm.review import Unavailable
from toolloop_fsm.states.build_result import fail_delivery_while_settling
from toolloop_fsm.states.delivery import arm_deadline
from toolloop_fsm.states.delivery import clear_deadline
from toolloop_fsm.states.delivery import deliver_expression
from toolloop_fsm.states.delivery import deliver_text
from toolloop_fsm.states.delivery import post_notice
from toolloop_fsm.states.stream_once import close_pass
from toolloop_fsm.states.stream_once import queue_stop_message
from toolloop_fsm.states.tool_dispatch import admit_call
from toolloop_fsm.states.tool_dispatch import at_gate
from toolloop_fsm.turn import DraftState
from toolloop_fsm.turn import TurnState


def _draft(turn: TurnState) -> DraftState:
    draft = turn.draft
    assert draft is not None, "drafting actions run only on a turn with a draft"
    return draft


# --------------------------------------------------------------------------- completing
def close_cut_pass(turn: TurnState, _event: Any = None) -> None:
    """The pass stopped at the ceiling: it is closed as cut (usage estimated when none was
    reported); a call it may have begun is ignored (the reply is over)."""
    calls = turn.tool_round.calls
    if calls:
        turn.current_pass.ignored_calls = [str(c.call.name) for c in calls]
        calls.clear()
    close_pass(turn, "cut_at_length_limit")
    _draft(turn).trigger = "length_limit"


def close_pass_for_review(turn: TurnState, _event: Any = None) -> None:
    completed = pass_has_text(turn)
    close_pass(turn, "completed" if completed else "empty_response")
    _draft(turn).trigger = "completed_pass" if completed else "empty_pass"


def note_tool_round_trigger(turn: TurnState, _event: Any = None) -> None:
    """A tool round would have ended the turn: say which rule, for the reviewer."""
    draft = _draft(turn)
    if tool_asked_to_end_turn(turn):
        draft.trigger = "end_turn"
    elif continuation_retries_exhausted(turn):
        post_notice(turn, Notice("retry_exhausted", {"failures": turn.continuation_failures}))
        draft.trigger = "continuation_retries_exhausted"
    else:
        draft.trigger = "pre_tool_text"


def request_draft_review(turn: TurnState, _event: Any = None) -> None:
    """Ask the reviewer about the held candidate, bounded by the review timeout."""
    draft = _draft(turn)
    draft.reviews += 1
    _request_review(turn, draft, _packet(turn, draft, ReviewKind.RESPONSE, draft.trigger))


def deliver_held_draft(turn: TurnState, _event: Any = None) -> None:
    """Deliver the held presentation in order; it is the turn's final text. A candidate cut
    at the ceiling is followed by the ``flush_limit`` notice — unless the host's own send
    limit cut it (silent, as when streaming)."""
    draft = _draft(turn)
    _take_verdict(turn, draft)
    segments, draft.segments = draft.segments, []
    draft.committed_segments = 0
    draft.expression_held = False
    text: list[str] = []
    for segment in segments:
        if segment.text is not None:
            text.append(segment.text)
            deliver_text(turn, segment.text)
        elif segment.expression is not None:
            deliver_expression(turn, segment.expression)
            turn.tool_response_delivered = True
    turn.produced.last_text = "".join(text)
    if draft.cut and not draft.cut_by_send_limit:
        post_notice(
            turn,
            Notice("flush_limit", {"bytes": draft.held_bytes, "segments": draft.held_segments}),
        )


def begin_revision(turn: TurnState, _event: Any = None) -> None:
    """The first `Revise`: clear the held presentation and the model's own words (its
    narration in the history, the prefill), keep every actual tool outcome, and ask the model
    — one user instruction carrying the draft and the findings — for a complete
    replacement. The passes that follow are a new replay scope: a successful call the model
    repeats is reused from the ledger, never run again."""
    draft = _draft(turn)
    verdict = _take_verdict(turn, draft)
    findings = verdict.findings if isinstance(verdict, Revise) else ()
    candidate = draft.held_text()
    draft.revisions += 1
    draft.last_findings = findings
    draft.segments = []
    draft.committed_segments = 0
    draft.cut = False
    draft.trigger = None
    if draft.expression_held:
        # the dropped draft's expression was never shown: the replacement may show one, and
        # an empty pass cannot settle on it
        draft.expression_held = False
        turn.expression_delivered = False
    if turn.history:
        turn.history = [attrs.evolve(entry, pre_tool_text=None) for entry in turn.history]
    turn.prefill = None
    turn.pre_tool_text = None
    turn.produced.last_text = ""
    turn.occurrences = None
    turn.context.append({"role": "user", "content": revision_instruction(candidate, findings)})


def revision_instruction(draft: str, findings: tuple[Finding, ...]) -> str:
    """The one user instruction a revision adds to the conversation."""
    listed = "\n".join(
        f"- [{finding.category.value}] {finding.problem} → {finding.direction}"
        for finding in findings
    )
    return (
        "Your draft reply was reviewed before anyone saw it, and it needs a revision.\n\n"
        f"Draft:\n<<<\n{draft}\n>>>\n\nFindings:\n{listed}\n\n"
        "Write a complete replacement reply that addresses every finding. The results of the "
        "tools you already called are above: do not call a tool again that already succeeded."
    )


# --------------------------------------------------------------------------- review ends otherwise
def take_review_timeout(turn: TurnState, _event: Any = None) -> None:
    """The reviewer did not answer within the review timeout: it is unavailable for the rest
    of the turn; the held presentation is delivered as it is."""
    draft = _draft(turn)
    turn.armed.pop(DeadlineKind.REVIEW, None)
    turn.effects.append(CancelReview(draft.review_seq))
    draft.reviewer_unavailable = True
    _record(draft, turn, "unavailable", reason="timeout")
    deliver_held_draft(turn)


def stop_during_review(turn: TurnState, event: StopRequested) -> None:
    """A stop while the reviewer is asked: the review is cancelled and nothing held is ever
    sent; the stop message is queued as on any stop."""
    _cancel_review(turn)
    queue_stop_message(turn, event)


def interrupt_review(turn: TurnState, _event: Any = None) -> None:
    """A follow-up while a drafted reply is reviewed: the turn yields; nothing held is sent."""
    _cancel_review(turn)


def fail_delivery_during_review(turn: TurnState, event: DeliveryFailed) -> None:
    """The host's channel failed while the reviewer is asked: the review is cancelled."""
    _cancel_review(turn)
    fail_delivery_while_settling(turn, event)


def _cancel_review(turn: TurnState) -> None:
    draft = _draft(turn)
    clear_deadline(turn, DeadlineKind.REVIEW)
    turn.effects.append(CancelReview(draft.review_seq))


# --------------------------------------------------------------------------- the checkpoint
def request_call_review(turn: TurnState, _event: Any = None) -> None:
    """Show the proposed call to the reviewer before it runs (the pass is closed first: its
    narration is held, or delivered when not drafting)."""
    draft = _draft(turn)
    call = turn.tool_round.pending_call
    assert call is not None
    name = str(call.name)
    correction = name in draft.rejected_names
    draft.tool_reviews += 1
    if correction:
        draft.corrections += 1
    draft.reviewing_correction = correction
    draft.reviewing_identity = call_identity(name, call.arguments)
    proposed = ProposedCall(name, _redacted(turn, name, call.arguments), correction=correction)
    packet = _packet(turn, draft, ReviewKind.TOOL_CALL, "tool_call", proposed=proposed)
    _request_review(turn, draft, packet)


def run_approved_call(turn: TurnState, _event: Any = None) -> None:
    """The reviewer approved the call: it runs (an approved correction closes its name's
    correction chain)."""
    draft = _draft(turn)
    _take_verdict(turn, draft)
    call = turn.tool_round.pending_call
    assert call is not None
    if draft.reviewing_correction:
        draft.rejected_names.discard(str(call.name))
    admit_call(turn)


def run_unreviewed_call(turn: TurnState, _event: Any = None) -> None:
    """No verdict (unavailable, timed out): the reviewer is not asked again in this turn and
    the call runs ordinarily."""
    draft = _draft(turn)
    _take_no_verdict(turn, draft)
    admit_call(turn)


def reject_call(turn: TurnState, _event: Any = None) -> None:
    """`Revise` on a proposed call rejects it: the model is shown a failed call with status
    ``review_rejected``, the findings and ``action_executed: false``."""
    draft = _draft(turn)
    verdict = _take_verdict(turn, draft)
    findings = verdict.findings if isinstance(verdict, Revise) else ()
    summary = "; ".join(f"{f.category.value}: {f.problem} → {f.direction}" for f in findings)
    _reject(turn, draft, f"The reviewer rejected this call before it ran: {summary}", findings)


def refuse_unapproved_correction(turn: TurnState, _event: Any = None) -> None:
    """A correction under review got no verdict: it stays rejected (only an approval lets a
    correction run), and the reviewer is not asked again in this turn."""
    draft = _draft(turn)
    _take_no_verdict(turn, draft)
    _reject(turn, draft, _NO_APPROVAL, ())


def repeat_rejection(turn: TurnState, _event: Any = None) -> None:
    """The identical call was rejected before: the same rejection, without a review."""
    draft = _draft(turn)
    call = turn.tool_round.pending_call
    assert call is not None
    at_gate(turn).outcome = draft.rejected_calls[call_identity(str(call.name), call.arguments)]


def refuse_correction(turn: TurnState, _event: Any = None) -> None:
    """A correction with no correction left, or no reviewer to approve it: rejected."""
    draft = _draft(turn)
    call = turn.tool_round.pending_call
    assert call is not None
    draft.reviewing_identity = call_identity(str(call.name), call.arguments)
    _reject(turn, draft, _NO_APPROVAL, ())


_NO_APPROVAL = (
    "The reviewer rejected an earlier call of this tool, and this corrected call could not be "
    "approved in this turn; it did not run."
)


def _reject(turn: TurnState, draft: DraftState, reason: str, findings: tuple[Finding, ...]) -> None:
    call = turn.tool_round.pending_call
    assert call is not None
    name = str(call.name)
    outcome = ToolOutcome(
        success=False,
        data={
            "findings": [
                {"category": f.category.value, "problem": f.problem, "direction": f.direction}
                for f in findings
            ],
            "action_executed": False,
        },
        reason=reason,
        dispatched=False,
        rejected=True,
    )
    identity = draft.reviewing_identity or call_identity(name, call.arguments)
    draft.rejected_calls[identity] = outcome
    draft.rejected_names.add(name)
    draft.reviewing_correction = False
    at_gate(turn).outcome = outcome


# --------------------------------------------------------------------------- shared
def _request_review(turn: TurnState, draft: DraftState, packet: ReviewPacket) -> None:
    draft.review_seq += 1
    turn.effects.append(RequestReview(draft.review_seq, packet))
    arm_deadline(turn, DeadlineKind.REVIEW, turn.policy.review_timeout)


def _take_verdict(turn: TurnState, draft: DraftState) -> Any:
    """The verdict of the event being taken (``None`` when none came: a delivery without a
    review), recorded with its usage; the review deadline is cleared. An `Unavailable`
    verdict makes the reviewer unavailable for the rest of the turn."""
    verdict = getattr(turn.current_event, "verdict", None)
    if verdict is None:
        return None
    clear_deadline(turn, DeadlineKind.REVIEW)
    if isinstance(verdict, Pass):
        _record(draft, turn, "pass")
    elif isinstance(verdict, Revise):
        _record(draft, turn, "revise", findings=verdict.findings)
    else:
        draft.reviewer_unavailable = True
        reason = verdict.reason if isinstance(verdict, Unavailable) else "not a verdict"
        _record(draft, turn, "unavailable", reason=reason)
    usage = getattr(verdict, "usage", None)
    if usage is not None:
        if turn.produced.usage is None:
            turn.produced.usage = []
        role = "decision" if turn.state == "reviewing_call" else "reviewer"
        turn.produced.usage.append(
            UsageEntry(
                turn.iterations, usage.input_tokens, usage.output_tokens, usage.estimated, role
            )
        )
    return verdict


def _take_no_verdict(turn: TurnState, draft: DraftState) -> None:
    """An `Unavailable` verdict, or the review deadline: the reviewer is done for the turn."""
    if getattr(turn.current_event, "verdict", None) is not None:
        _take_verdict(turn, draft)
    else:
        turn.armed.pop(DeadlineKind.REVIEW, None)
        turn.effects.append(CancelReview(draft.review_seq))
        _record(draft, turn, "unavailable", reason="timeout")
    draft.reviewer_unavailable = True


def _record(
    draft: DraftState,
    turn: TurnState,
    verdict: str,
    *,
    findings: tuple[Finding, ...] = (),
    reason: str | None = None,
) -> None:
    checkpoint = turn.state == "reviewing_call"
    call = turn.tool_round.pending_call if checkpoint else None
    draft.records.append(
        ReviewRecord(
            kind=ReviewKind.TOOL_CALL if checkpoint else ReviewKind.RESPONSE,
            trigger="tool_call" if checkpoint else (draft.trigger or "completed_pass"),
            verdict=verdict,
            findings=findings,
            reason=reason,
            call=str(call.name) if call is not None else None,
        )
    )


def _packet(
    turn: TurnState,
    draft: DraftState,
    kind: ReviewKind,
    trigger: str | None,
    *,
    proposed: ProposedCall | None = None,
) -> ReviewPacket:
    policy = turn.policy
    tools = tuple(
        ReviewedTool(
            name=entry.call.name,
            arguments=_redacted(turn, entry.call.name, entry.call.arguments),
            success=entry.response.success,
            data=entry.response.data,
            message=entry.response.message,
            status=entry.response.status,
            reason=entry.response.reason,
        )
        for entry in turn.history or ()
    )
    return ReviewPacket(
        kind=kind,
        candidate=draft.held_text() if policy.drafting else (turn.pre_tool_text or ""),
        status=(
            CandidateStatus.PENDING_CUT_AT_LENGTH_LIMIT if draft.cut else CandidateStatus.PENDING
        ),
        trigger=trigger or "completed_pass",
        history=tuple(turn.request.context[-2:]),
        tools=tools,
        revision=RevisionInfo(
            reviews_done=draft.reviews - (1 if kind is ReviewKind.RESPONSE else 0),
            max_reviews=policy.max_reviews,
            revisions_done=draft.revisions,
            max_revisions=policy.max_revisions,
            previous_findings=draft.last_findings,
        ),
        proposed_call=proposed,
    )


def _redacted(turn: TurnState, name: str, arguments: Any) -> Mapping[str, Any]:
    """A call's arguments as a reviewer may see them: through the tool's ``redact`` hook."""
    if not isinstance(arguments, Mapping):
        return {}
    tool = turn.registry.get(name)
    if tool is not None and tool.redact is not None:
        try:
            return dict(tool.redact(arguments))
        except Exception as err:  # a hook that fails shows nothing rather than everything
            return {"redaction_failed": json.dumps(type(err).__name__)}
    return dict(arguments)
