"""What the decided ending is: the terminal state it names (for either machine), and whether it
is a stalled stream's timeout; and the transitions by which either machine, its ending
decided, goes to that terminal state."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import Protocol

from toolloop_fsm.declaration import Transition
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


def outcome_is_awaiting_approval(turn: HasOutcome) -> bool:
    return turn.status is TurnStatus.AWAITING_APPROVAL


#: The guard that tells each terminal state is the one the decided ending names.
_NAMED_BY_ENDING: dict[str, Callable[[HasOutcome], bool]] = {
    "completed": outcome_is_completed,
    "stopped_by_user": outcome_is_stopped_by_user,
    "follow_up_interrupt": outcome_is_follow_up_interrupt,
    "timeout": outcome_is_timeout,
    "error": outcome_is_error,
    "empty_response": outcome_is_empty_response,
    "awaiting_approval": outcome_is_awaiting_approval,
}


def to_decided_terminal(source: str, terminals: Sequence[str]) -> list[Transition]:
    """The ``advance`` transitions by which the decision point ``source`` goes to the terminal
    state the decided ending names, one per state of ``terminals`` in that order; the last is
    unconditional (a decision point must always be left)."""
    *guarded, last = terminals
    return [
        *(Transition("advance", source, dest, when=_NAMED_BY_ENDING[dest]) for dest in guarded),
        Transition("advance", source, last),
    ]
