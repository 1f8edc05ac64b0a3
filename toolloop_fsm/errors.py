"""Errors the library raises on its own behalf (never on a provider's)."""

from __future__ import annotations


class InvalidEvent(Exception):
    """An event the machine's current state cannot take — a programming error in the shell
    that feeds the machine (h11's rule: name the state and the event)."""

    def __init__(self, machine: str, state: str, event: object, detail: str | None = None) -> None:
        self.machine = machine
        self.state = state
        self.event = event
        name = type(event).__name__
        message = f"{machine} cannot take {name} in state {state!r}"
        if detail:
            message += f": {detail}"
        super().__init__(message)
