"""The deadlines of one turn: timers on the turn's `Clock` by token, and which deadline
expired when one wakes."""

from __future__ import annotations

from typing import Any
from typing import Protocol

from toolloop_fsm.effects import ArmDeadline
from toolloop_fsm.events import DeadlineExpired
from toolloop_fsm.host import Clock
from toolloop_fsm.pass_rules import DUE_SLACK
from toolloop_fsm.pass_rules import stream_budget_due


class DeadlineTurn(Protocol):
    """What the deadlines need of the turn (`EventPump`): its clock, and feeding it what
    expired."""

    clock: Clock

    def feed(self, event: Any) -> None: ...


class Deadlines:
    """The turn's deadlines as timers on its `Clock`: arming and clearing them by token, and
    working out, when one wakes, whether it is really due (a rolling budget counts from the
    last chunk or recorded delivery; which budget of a pass's stream deadline runs out is
    `toolloop_fsm.pass_rules.stream_budget_due`) and which `DeadlineExpired` it is, fed to
    the turn. It holds nothing of the turn: the turn is handed to `arm` and each timer holds
    it while it is armed, so that a finished turn is freed without the cycle collector.

    The pump stamps ``last_chunk`` as each chunk arrives (one store per chunk on the hot
    path: nothing is rearmed) and ``last_activity`` as the channel confirms a delivery."""

    __slots__ = ("last_activity", "last_chunk", "stream_armed_at", "timers")

    def __init__(self) -> None:
        # [handle, effect] per armed deadline: rarely more than two, so a list of pairs
        self.timers: list[list[Any]] = []
        self.last_activity = 0.0
        self.last_chunk: float | None = None
        self.stream_armed_at = 0.0

    def arm(self, effect: ArmDeadline, turn: DeadlineTurn) -> None:
        clock = turn.clock
        now = clock.now()
        seconds = effect.seconds
        if effect.first_seconds is not None:
            # the pass's stream deadline: first wake at the earliest of its windows
            seconds = min(seconds, effect.first_seconds)
            if effect.total_seconds is not None:
                seconds = min(seconds, effect.total_seconds)
            self.stream_armed_at = now
            self.last_chunk = None
        if effect.rolling:
            self.last_activity = now
        handle = clock.call_later(seconds, self._fired, effect, turn)
        self.timers.append([handle, effect])

    def clear(self, token: int) -> None:
        entry = self._timer(token)
        if entry is not None:
            entry[0].cancel()
            self.timers.remove(entry)

    def cancel_all(self) -> None:
        for handle, _ in self.timers:
            handle.cancel()
        self.timers.clear()

    def _timer(self, token: int) -> list[Any] | None:
        for entry in self.timers:
            if entry[1].token == token:
                return entry
        return None

    def _fired(self, effect: ArmDeadline, turn: DeadlineTurn) -> None:
        entry = self._timer(effect.token)
        if entry is None:
            return
        kind = effect.kind
        if effect.rolling:
            clock = turn.clock
            now = clock.now()
            last_chunk = self.last_chunk
            # a rolling deadline counts from the last chunk or recorded delivery
            last = self.last_activity
            if last_chunk is not None and last_chunk > last:
                last = last_chunk
            if effect.first_seconds is not None:
                # the pass's stream deadline: the budget that runs out first (pass_rules)
                kind, due = stream_budget_due(
                    now,
                    begun=self.stream_armed_at,
                    answered_at=None if last_chunk is None else last,
                    first_seconds=effect.first_seconds,
                    inactivity_seconds=effect.seconds,
                    total_seconds=effect.total_seconds,
                )
                # before the first chunk, wake again within one inactivity window, so that
                # a first chunk arriving late is followed by the inactivity budget
                wake = due if last_chunk is not None else min(due, now + effect.seconds)
            else:
                due = wake = last + effect.seconds
            if due - now > DUE_SLACK:
                entry[0] = clock.call_later(wake - now, self._fired, effect, turn)
                return
        self.timers.remove(entry)
        turn.feed(DeadlineExpired(kind, effect.token))
