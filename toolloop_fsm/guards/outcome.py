"""Which terminal state the decided outcome names."""

from __future__ import annotations

from toolloop_fsm.result import TurnStatus
from toolloop_fsm.turn import TurnState


def outcome_is_completed(turn: TurnState) -> bool:
    return turn.status is TurnStatus.COMPLETED


def outcome_is_stopped_by_user(turn: TurnState) -> bool:
    return turn.status is TurnStatus.STOPPED_BY_USER


def outcome_is_follow_up_interrupt(turn: TurnState) -> bool:
    return turn.status is TurnStatus.FOLLOW_UP_INTERRUPT


def outcome_is_timeout(turn: TurnState) -> bool:
    return turn.status is TurnStatus.TIMEOUT


def outcome_is_error(turn: TurnState) -> bool:
    return turn.status is TurnStatus.ERROR


def outcome_is_empty_response(turn: TurnState) -> bool:
    return turn.status is TurnStatus.EMPTY_RESPONSE
