"""Which terminal state the decided outcome names (for either machine)."""

from __future__ import annotations

from typing import Protocol

from toolloop_fsm.result import TurnStatus


class HasOutcome(Protocol):
    status: TurnStatus | None


def outcome_is_completed(turn: HasOutcome) -> bool:
    return turn.status is TurnStatus.COMPLETED


def outcome_is_stopped_by_user(turn: HasOutcome) -> bool:
    return turn.status is TurnStatus.STOPPED_BY_USER


def outcome_is_follow_up_interrupt(turn: HasOutcome) -> bool:
    return turn.status is TurnStatus.FOLLOW_UP_INTERRUPT


def outcome_is_timeout(turn: HasOutcome) -> bool:
    return turn.status is TurnStatus.TIMEOUT


def outcome_is_error(turn: HasOutcome) -> bool:
    return turn.status is TurnStatus.ERROR


def outcome_is_empty_response(turn: HasOutcome) -> bool:
    return turn.status is TurnStatus.EMPTY_RESPONSE


def outcome_is_skipped(turn: HasOutcome) -> bool:
    return turn.status is TurnStatus.SKIPPED
