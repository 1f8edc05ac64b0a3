"""Messages held while the turn runs (docs/behaviour.md §8.5): a steered or queued message is
held as it arrives, whatever the turn is doing; a steered one joins the context as the next
pass opens (`stream_once.open_pass` takes it); a queued one (and any steered one still held)
is answered in one more pass when the turn would end ``completed``. Taking one moves the
tool rounds recorded so far into the context first, so that the model reads the message
after them."""

from __future__ import annotations

from typing import Any

from toolloop_fsm.conversation import history_messages
from toolloop_fsm.events import MessageHeld
from toolloop_fsm.messages import HeldMessage
from toolloop_fsm.messages import TakenMessage
from toolloop_fsm.turn import TurnState


def hold_message(turn: TurnState, event: MessageHeld) -> None:
    """A steered or queued message arrived: the turn holds it until it takes it."""
    if turn.held_messages is None:
        turn.held_messages = []
    turn.held_messages.append(event.message)


def take_steered_messages(turn: TurnState, _event: Any = None) -> None:
    """The next pass opens: the steered messages held join its context (§8.5 rule 2)."""
    if not turn.held_messages:
        return
    steered = [m for m in turn.held_messages if m.mode == "steer"]
    if steered:
        turn.held_messages = [m for m in turn.held_messages if m.mode != "steer"] or None
        _take(turn, steered)


def answer_held_messages(turn: TurnState, _event: Any = None) -> None:
    """The turn would end ``completed`` with messages held: it takes them all and goes on
    with one more pass to answer them (§8.5 rule 3); the ending decided is undone."""
    held, turn.held_messages = turn.held_messages or [], None
    _take(turn, held)
    turn.status = None
    turn.reason = None


def _take(turn: TurnState, messages: list[HeldMessage]) -> None:
    history = turn.history or []
    turn.context.extend(history_messages(history[turn.history_in_context :]))
    turn.history_in_context = len(history)
    if turn.taken_messages is None:
        turn.taken_messages = []
    for message in messages:
        turn.context.append(message.as_context())
        turn.taken_messages.append(TakenMessage(message.mode, message.text, turn.iterations))
