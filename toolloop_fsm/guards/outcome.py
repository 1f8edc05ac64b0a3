"""What the decided ending is: the terminal state it names (for either machine), and whether it
is a stalled stream's timeout."""

from __future__ import annotations

from typing import Protocol

from toolloop_fsm.result import TurnStatus


class HasOutcome(Protocol):
    status: TurnStatus | None
    reason: str | None


_STALLED_STREAM_REASONS = frozenset({"first_token_timeout", "inactivity_timeout"})


def outcome_is_completed(turn: HasOutcome) -> bool:
    return turn.status is TurnStatus.COMPLETED


def outcome_is_stopped_by_user(turn: HasOutcome) -> bool:
    return turn.status is TurnStatus.STOPPED_BY_USER


def outcome_is_follow_up_interrupt(turn: HasOutcome) -> bool:
    return turn.status is TurnStatus.FOLLOW_UP_INTERRUPT


def outcome_is_timeout(turn: HasOutcome) -> bool:
    return turn.status is TurnStatus.TIMEOUT


def outcome_is_stalled_stream(turn: HasOutcome) -> bool:
    """The decided ending is a stream that stalled: a first-token or inactivity timeout (a
    pass that streamed for its whole duration did not stall)."""
    return turn.status is TurnStatus.TIMEOUT and turn.reason in _STALLED_STREAM_REASONS


def outcome_is_error(turn: HasOutcome) -> bool:
    return turn.status is TurnStatus.ERROR


def outcome_is_empty_response(turn: HasOutcome) -> bool:
    return turn.status is TurnStatus.EMPTY_RESPONSE
