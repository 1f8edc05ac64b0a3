"""Stable points (durable turns): the snapshot a machine asked for snapshots offers as it
enters ``starting_pass``, and what a resumed tool loop does first."""

from __future__ import annotations

from typing import Any

from toolloop_fsm.effects import Deliver
from toolloop_fsm.effects import OfferSnapshot
from toolloop_fsm.snapshot_capture import capture_loop
from toolloop_fsm.turn import TurnState


def offer_snapshot(turn: TurnState, _event: Any = None) -> None:
    """Before each pass everything the turn needs is plain data: offer it (only when the
    host asked for snapshots: building one costs a copy of the turn's state)."""
    if turn.snapshots:
        turn.effects.append(OfferSnapshot(capture_loop(turn)))


def resend_in_flight(turn: TurnState, _event: Any = None) -> None:
    """A resumed turn first sends again what was in flight when its snapshot was taken,
    under the same sequence numbers: a channel that takes idempotency keys drops what it
    already showed, and a confirmation is recorded like any other."""
    for seq, item in sorted(turn.deliveries.in_flight.items()):
        turn.effects.append(Deliver(seq, text=item.text, expression=item.expression))
