"""Enhanced context restart: append the enrichment, disable its kinds, reset the
error counters, and start a new pass — without a tool-history entry."""

from __future__ import annotations

from typing import Any

from toolloop_fsm.ledger import LedgerEntry
from toolloop_fsm.turn import TurnState


def apply_context_restart(turn: TurnState, _event: Any = None) -> None:
    outcome = turn.tool_round.outcome
    assert outcome is not None and outcome.restart_item is not None
    turn.context.append(outcome.restart_item)
    turn.disabled_enrichment_kinds = turn.disabled_enrichment_kinds | set(outcome.restart_kinds)
    turn.consecutive_tool_errors = 0
    turn.continuation_failures = 0
    turn.suppress_text = False  # a successful tool, like any other, lifts the suppression
    if outcome.dispatched and turn.tool_round.current_call_key is not None:
        turn.ledger[turn.tool_round.current_call_key] = LedgerEntry(
            turn.tool_round.current_call_key, outcome
        )
    call = turn.tool_round.pending_call
    if call is not None:
        turn.last_tool = str(call.name)
    # the restarted passes replay like a new attempt: their n-th identical call matches the
    # n-th one recorded so far
    turn.occurrences = None
