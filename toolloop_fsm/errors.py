"""Errors the library raises on its own behalf (never on a provider's)."""

from __future__ import annotations


class InvalidEvent(Exception):
    """An event the machine's current state cannot take — a programming error in the shell
    that feeds the machine (h11's rule: name the state and the event). A call that is a
    trigger rather than an event (``start``, ``resume``, a decision point's ``advance``)
    passes ``trigger``, and is named by it."""

    def __init__(
        self,
        machine: str,
        state: str,
        event: object,
        detail: str | None = None,
        *,
        trigger: str | None = None,
    ) -> None:
        self.machine = machine
        self.state = state
        # what was refused: the event, or (for a trigger, which carries none) its name
        self.event = trigger if event is None and trigger is not None else event
        self.trigger = trigger
        taken = f"the {trigger} trigger" if trigger is not None else type(event).__name__
        message = f"{machine} cannot take {taken} in state {state!r}"
        if detail:
            message += f": {detail}"
        super().__init__(message)
