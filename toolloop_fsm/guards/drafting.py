"""Drafting and tool-checkpoint decisions (docs/behaviour.md §14): when held prose is completed,
whether a reviewer may still be asked, what a verdict says, and which tool calls the
checkpoint reviews, rejects again or cannot approve."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from toolloop_fsm.guards.ceilings import continuation_retries_exhausted
from toolloop_fsm.guards.exit_policy import should_end_after_pre_tool_text
from toolloop_fsm.guards.exit_policy import tool_asked_to_end_turn
from toolloop_fsm.review import Pass
from toolloop_fsm.review import Revise
from toolloop_fsm.turn import DraftState
from toolloop_fsm.turn import TurnState


def call_identity(name: str, arguments: Any) -> str:
    """The checkpoint's identity of a call: SHA-256 of ``[name, arguments]`` as JSON with the
    keys of every object sorted (so the same call written with its keys in another order is
    the same call)."""
    try:
        canonical = json.dumps(
            [name, arguments], sort_keys=True, separators=(",", ":"), ensure_ascii=False
        )
    except (TypeError, ValueError):
        canonical = repr([name, arguments])
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _drafting(turn: TurnState) -> DraftState | None:
    draft = turn.draft
    return draft if draft is not None and turn.policy.drafting else None


# --------------------------------------------------------------------------- completing
def draft_cut_at_length_limit(turn: TurnState) -> bool:
    """The held prose reached the ceiling (bytes or segments): the candidate is cut."""
    draft = _drafting(turn)
    return draft is not None and draft.cut


def completes_held_draft(turn: TurnState) -> bool:
    """A pass without a call ends while presentation is held: the response is completed
    (on a completed pass, or an empty pass after pending narration)."""
    draft = _drafting(turn)
    return draft is not None and bool(draft.segments)


def tool_round_completes_held_draft(turn: TurnState) -> bool:
    """A tool round would end the turn (the tool asked to, a silent tool after narration,
    a continuation provider's retries are spent) while presentation is held: the response
    is completed instead of ending with it undelivered."""
    draft = _drafting(turn)
    if draft is None or not draft.segments:
        return False
    return (
        tool_asked_to_end_turn(turn)
        or continuation_retries_exhausted(turn)
        or should_end_after_pre_tool_text(turn)
    )


def no_pending_prose(turn: TurnState) -> bool:
    """Nothing but expressions is held: there is no prose to review (a tool-only turn does
    not invent prose)."""
    draft = turn.draft
    return draft is None or not draft.held_text().strip()


def reviewer_unavailable(turn: TurnState) -> bool:
    """The reviewer could not give a verdict earlier in the turn (unavailable, timed out,
    raised): it is not asked again."""
    draft = turn.draft
    return draft is not None and draft.reviewer_unavailable


def reviews_exhausted(turn: TurnState) -> bool:
    draft = turn.draft
    return draft is not None and draft.reviews >= turn.policy.max_reviews


# --------------------------------------------------------------------------- verdicts
def verdict_passes(turn: TurnState) -> bool:
    return isinstance(getattr(turn.current_event, "verdict", None), Pass)


def verdict_revises(turn: TurnState) -> bool:
    return isinstance(getattr(turn.current_event, "verdict", None), Revise)


def verdict_unavailable(turn: TurnState) -> bool:
    """Anything but `Pass` and `Revise` is no verdict at all."""
    return not (verdict_passes(turn) or verdict_revises(turn))


def revision_left(turn: TurnState) -> bool:
    """A `Revise` while the turn may still revise (at most ``max_revisions``)."""
    draft = turn.draft
    return (
        draft is not None and verdict_revises(turn) and draft.revisions < turn.policy.max_revisions
    )


# --------------------------------------------------------------------------- the checkpoint
def _call_under_checkpoint(turn: TurnState) -> tuple[DraftState, str] | None:
    draft = turn.draft
    call = turn.tool_round.pending_call
    if draft is None or call is None or not turn.policy.review_tool_calls:
        return None
    return draft, str(call.name)


def call_rejected_before(turn: TurnState) -> bool:
    """The identical call was rejected earlier in the turn: the same rejection, no review."""
    under = _call_under_checkpoint(turn)
    if under is None:
        return False
    draft, name = under
    call = turn.tool_round.pending_call
    assert call is not None
    return call_identity(name, call.arguments) in draft.rejected_calls


def checkpoint_available(turn: TurnState) -> bool:
    draft = turn.draft
    return (
        draft is not None
        and not draft.reviewer_unavailable
        and draft.tool_reviews < turn.policy.max_tool_reviews
    )


def correction_cannot_be_approved(turn: TurnState) -> bool:
    """A new call of a rejected name is a correction: it runs only when the reviewer
    approves it, so with no correction left, or no reviewer to ask, it stays rejected."""
    under = _call_under_checkpoint(turn)
    if under is None:
        return False
    draft, name = under
    if name not in draft.rejected_names:
        return False
    return draft.corrections >= turn.policy.max_tool_corrections or not checkpoint_available(turn)


def call_needs_checkpoint(turn: TurnState) -> bool:
    """A new call, while the checkpoint has reviews left and a reviewer to ask."""
    return _call_under_checkpoint(turn) is not None and checkpoint_available(turn)


def reviewing_correction(turn: TurnState) -> bool:
    """The call under review is a correction (an unavailable reviewer cannot approve it)."""
    draft = turn.draft
    return draft is not None and draft.reviewing_correction
