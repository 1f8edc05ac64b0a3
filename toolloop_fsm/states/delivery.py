"""Deliveries, notices and deadlines: the effects every stage emits the same way."""

from __future__ import annotations

from toolloop_fsm.effects import ArmDeadline, ClearDeadline, Deliver, PostNotice
from toolloop_fsm.events import DeadlineKind, DeliveryRecorded
from toolloop_fsm.result import Delivered, Notice
from toolloop_fsm.turn import TurnState


def deliver_text(turn: TurnState, text: str) -> None:
    seq = turn.next_seq
    turn.next_seq = seq + 1
    turn.in_flight[seq] = Delivered(seq, text=text, iteration=turn.iterations)
    if text.strip():
        turn.visible_text_delivered = True
    turn.effects.append(Deliver(seq, text=text))


def deliver_expression(turn: TurnState, expression: str) -> None:
    seq = turn.next_seq
    turn.next_seq = seq + 1
    turn.in_flight[seq] = Delivered(seq, expression=expression, iteration=turn.iterations)
    turn.expression_delivered = True
    turn.effects.append(Deliver(seq, expression=expression))


def flush_buffer(turn: TurnState) -> None:
    """Hand the buffered visible text to the channel (unless text is suppressed)."""
    parts = turn.pass_text
    start = turn.buffer_start
    if start >= len(parts):
        return
    text = "".join(parts[start:])
    turn.buffer_start = len(parts)
    turn.buffer_len = 0
    if not turn.suppress_text:
        deliver_text(turn, text)


def discard_buffer(turn: TurnState) -> None:
    turn.buffer_start = len(turn.pass_text)
    turn.buffer_len = 0


def record_delivery(turn: TurnState, event: DeliveryRecorded) -> None:
    delivered = turn.in_flight.pop(event.seq, None)
    if delivered is not None:
        if turn.delivered is None:
            turn.delivered = []
        turn.delivered.append(delivered)


def post_notice(turn: TurnState, notice: Notice) -> None:
    if turn.notices is None:
        turn.notices = []
    turn.notices.append(notice)
    turn.effects.append(PostNotice(notice))


def arm_deadline(
    turn: TurnState,
    kind: DeadlineKind,
    seconds: float,
    *,
    rolling: bool = False,
    first_seconds: float | None = None,
    total_seconds: float | None = None,
) -> None:
    turn.next_token += 1
    token = turn.next_token
    turn.armed[kind] = token
    turn.effects.append(ArmDeadline(kind, token, seconds, rolling, first_seconds, total_seconds))


def clear_deadline(turn: TurnState, kind: DeadlineKind) -> None:
    token = turn.armed.pop(kind, None)
    if token is not None:
        turn.effects.append(ClearDeadline(kind, token))
