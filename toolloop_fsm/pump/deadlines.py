"""The deadlines of one turn: timers on the turn's `Clock`, and which deadline expired."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from toolloop_fsm.effects import (
    ArmDeadline,
)
from toolloop_fsm.events import (
    DeadlineExpired,
)
from toolloop_fsm.host import (
    Clock,
)
from toolloop_fsm.pass_rules import DUE_SLACK, stream_budget_due


class StreamDeadlines:
    """The turn's deadlines as timers on its `Clock`: arming them, and working out, when one
    wakes, whether it is really due (a rolling budget counts from the last chunk or recorded
    delivery; which budget of a pass's stream deadline runs out is
    `toolloop_fsm.pass_rules.stream_budget_due`) and which `DeadlineExpired` it is."""

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
            last_chunk = self._last_chunk
            # a rolling deadline counts from the last chunk or recorded delivery (chunks
            # stamp _last_chunk only: one store per chunk on the hot path)
            last = self._last_activity
            if last_chunk is not None and last_chunk > last:
                last = last_chunk
            if effect.first_seconds is not None:
                # the pass's stream deadline: the budget that runs out first (pass_rules)
                kind, due = stream_budget_due(
                    now, begun=self._stream_armed_at,
                    answered_at=None if last_chunk is None else last,
                    first_seconds=effect.first_seconds, inactivity_seconds=effect.seconds,
                    total_seconds=effect.total_seconds,
                )  # fmt: skip
                # before the first chunk, wake again within one inactivity window, so that
                # a first chunk arriving late is followed by the inactivity budget
                wake = due if last_chunk is not None else min(due, now + effect.seconds)
            else:
                due = wake = last + effect.seconds
            if due - now > DUE_SLACK:
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
