"""Messages that arrive while a turn runs (docs/behaviour.md §8.5), as values: one the host
hands to a running turn to steer it or to be answered before it ends (`HeldMessage`), the
refusal when a turn already holds as many as it may (`HeldMessagesFull`), and where a turn
took one into its context (`TakenMessage`)."""

from __future__ import annotations

from typing import Any
from typing import Literal

from attrs import field
from attrs import frozen

#: How a message that arrives while a turn runs is taken: ``steer`` joins the context at the
#: next pass boundary and the turn goes on; ``queue`` is answered once the turn would end, in
#: one more pass. (``interrupt``, the third mode, is `TurnSignals.interrupt`: it holds nothing.)
HeldMode = Literal["steer", "queue"]
HELD_MODES: tuple[HeldMode, ...] = ("steer", "queue")

#: How many messages one turn holds by default (`TurnSignals.max_held_messages`).
DEFAULT_MAX_HELD_MESSAGES = 8


def _text(_instance: Any, _attribute: Any, value: str) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"a held message is a non-empty text, got {value!r}")


def _mode(_instance: Any, _attribute: Any, value: str) -> None:
    if value not in HELD_MODES:
        raise ValueError(f"a held message's mode is 'steer' or 'queue', got {value!r}")


@frozen
class HeldMessage:
    """A user message held by a running turn, in its ``mode`` (`HeldMode`). Each is its own
    message: two with the same text are two messages (a turn tells them apart by identity,
    and they compare equal as values)."""

    mode: HeldMode = field(validator=_mode)
    text: str = field(validator=_text)

    def as_context(self) -> dict[str, Any]:
        """The message as the context's user message."""
        return {"role": "user", "content": self.text}


@frozen
class TakenMessage:
    """A held message the turn took into its context: after pass ``iteration`` (its next
    request was the first to carry it), in its ``mode``."""

    mode: HeldMode
    text: str
    iteration: int


class HeldMessagesFull(RuntimeError):
    """The turn already holds as many messages as `TurnSignals.max_held_messages` allows:
    this one is refused (``message``), and nothing is held. Send it as the next turn's, or
    interrupt the turn."""

    def __init__(self, message: HeldMessage, limit: int) -> None:
        super().__init__(
            f"the turn already holds {limit} messages (max_held_messages={limit}): the "
            f"{message.mode} message {message.text[:40]!r} was not held"
        )
        self.message = message
        self.limit = limit


__all__ = [
    "DEFAULT_MAX_HELD_MESSAGES",
    "HELD_MODES",
    "HeldMessage",
    "HeldMessagesFull",
    "HeldMode",
    "TakenMessage",
]
