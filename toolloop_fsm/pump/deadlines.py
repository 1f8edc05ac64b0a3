"""The deadlines of one turn: timers on the turn's `Clock`, and which deadline expired."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from toolloop_fsm.effects import (
    ArmDeadline,
)
from toolloop_fsm.events import (
    DeadlineExpired,
    DeadlineKind,
)
from toolloop_fsm.host import (
    Clock,
)


class StreamDeadlines:
    """The turn's deadlines as timers on its `Clock`: arming them, and working out, when one
    wakes, whether it is really due (a rolling budget counts from the last chunk or recorded
    delivery, a pass's stream deadline from its first-token and total budgets) and which
    `DeadlineExpired` it is."""

    if TYPE_CHECKING:
        # the state it works on belongs to the pump that mixes it in (`EventPump`)
        clock: Clock
        _timers: list[list[Any]]
        _last_activity: float
        _last_chunk: float | None
        _stream_armed_at: float
        _tool_grace: Any
        _review_grace: Any

        def _feed(self, event: Any) -> None: ...

    else:
        __slots__ = ()

    def _arm(self, effect: ArmDeadline) -> None:
        now = self.clock.now()
        seconds = effect.seconds
        if effect.first_seconds is not None:
            # the pass's stream deadline: first wake at the earliest of its windows
            seconds = min(seconds, effect.first_seconds)
            if effect.total_seconds is not None:
                seconds = min(seconds, effect.total_seconds)
            self._stream_armed_at = now
            self._last_chunk = None
        if effect.rolling:
            self._last_activity = now
        handle = self.clock.call_later(seconds, self._deadline_fired, effect)
        self._timers.append([handle, effect])

    def _timer(self, token: int) -> list[Any] | None:
        for entry in self._timers:
            if entry[1].token == token:
                return entry
        return None

    def _deadline_fired(self, effect: ArmDeadline) -> None:
        entry = self._timer(effect.token)
        if entry is None:
            return
        kind = effect.kind
        if effect.rolling:
            now = self.clock.now()
            total = effect.total_seconds
            pass_due = self._stream_armed_at + total if total is not None else math.inf
            if effect.first_seconds is not None and pass_due - now <= 1e-9:
                # the pass's total budget is spent, however steadily it streams
                kind = DeadlineKind.PASS_DURATION
            else:
                if effect.first_seconds is not None and self._last_chunk is None:
                    kind = DeadlineKind.FIRST_TOKEN  # no chunk yet in this pass
                    due = self._stream_armed_at + effect.first_seconds
                    # wake again within one inactivity window, so that a first chunk
                    # arriving late is followed by the inactivity budget, not the first due
                    wake = min(due, now + effect.seconds)
                else:
                    if effect.first_seconds is not None:
                        kind = DeadlineKind.INACTIVITY
                    # a rolling deadline counts from the last chunk or recorded delivery
                    # (chunks stamp _last_chunk only: one store per chunk on the hot path)
                    last = self._last_activity
                    if self._last_chunk is not None and self._last_chunk > last:
                        last = self._last_chunk
                    due = wake = last + effect.seconds
                if due - now > 1e-9:
                    wake = min(wake, pass_due)
                    entry[0] = self.clock.call_later(wake - now, self._deadline_fired, effect)
                    return
        self._timers.remove(entry)
        self._feed(DeadlineExpired(kind, effect.token))

    def _cancel_timers(self) -> None:
        for handle, _ in self._timers:
            handle.cancel()
        self._timers.clear()
        for grace in (self._tool_grace, self._review_grace):
            if grace is not None:
                grace.cancel()
        self._tool_grace = self._review_grace = None
