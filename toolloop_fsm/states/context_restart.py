"""Enhanced context restart: append the enrichment, disable its kinds, reset the
error counters, and start a new pass — without a tool-history entry for the call that asked
for it (the other calls of its batch are recorded as any batch's are)."""

from __future__ import annotations

from typing import Any

from toolloop_fsm.states.tool_dispatch import record_calls
from toolloop_fsm.turn import TurnState


def apply_context_restart(turn: TurnState, _event: Any = None) -> None:
    calls = turn.tool_round.calls
    restarts = [c for c in calls if c.outcome is not None and c.outcome.restart_item is not None]
    assert restarts
    # the other calls ran too: their outcomes are kept and the model sees them
    record_calls(turn, [c for c in calls if c not in restarts])
    for batch_call in restarts:
        outcome = batch_call.outcome
        assert outcome is not None and outcome.restart_item is not None
        turn.context.append(outcome.restart_item)
        turn.disabled_enrichment_kinds = turn.disabled_enrichment_kinds | set(outcome.restart_kinds)
    turn.consecutive_tool_errors = 0
    turn.continuation_failures = 0
    turn.suppress_text = False  # a successful tool, like any other, lifts the suppression
    turn.last_tools = tuple(str(c.call.name) for c in calls)
    turn.last_tool = turn.last_tools[-1]
    # the restarted passes replay like a new attempt: their n-th identical call matches the
    # n-th one recorded so far
    turn.occurrences = None
