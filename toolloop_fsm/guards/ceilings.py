"""Ceilings: how many passes, failures and retries a turn may take."""

from __future__ import annotations

from toolloop_fsm.turn import TurnState


def iteration_ceiling_reached(turn: TurnState) -> bool:
    """Another pass would exceed ``max_function_call_iterations``."""
    return turn.iterations >= turn.policy.max_function_call_iterations


def consecutive_error_ceiling_reached(turn: TurnState) -> bool:
    """``max_consecutive_tool_errors`` tool failures in a row (docs/behaviour.md §4.3)."""
    return turn.consecutive_tool_errors >= turn.policy.max_consecutive_tool_errors


def continuation_retries_exhausted(turn: TurnState) -> bool:
    """A continuation-style provider failed after visible text too often in a row
    (docs/behaviour.md §4.5)."""
    return (
        turn.continuation_style
        and turn.continuation_failures >= turn.policy.continuation_tool_failure_threshold
    )
