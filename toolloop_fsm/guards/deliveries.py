"""Delivery bookkeeping: whether the turn must wait for deliveries still in flight."""

from __future__ import annotations

from toolloop_fsm.events import DeliveryFailed
from toolloop_fsm.events import DeliveryRecorded
from toolloop_fsm.result import TurnStatus
from toolloop_fsm.turn import TurnState


def must_settle_deliveries(turn: TurnState) -> bool:
    """Deliveries are in flight and the turn is not being killed and its channel did not
    fail: wait for them (bounded)."""
    return (
        bool(turn.deliveries.in_flight)
        and not turn.settle_started
        and turn.status is not TurnStatus.STOPPED_BY_USER
        and turn.reason not in ("host_error", "host_timeout")
    )


def all_deliveries_recorded(turn: TurnState) -> bool:
    """The delivery being recorded now is the last one in flight."""
    event = turn.current_event
    if isinstance(event, DeliveryRecorded):
        in_flight = turn.deliveries.in_flight
        return not in_flight or (len(in_flight) == 1 and event.seq in in_flight)
    return not turn.deliveries.in_flight


def delivery_timed_out(turn: TurnState) -> bool:
    """The delivery failing now did not return in time (rather than raising)."""
    event = turn.current_event
    return isinstance(event, DeliveryFailed) and event.timed_out
