"""The one host-call budget the notices of a turn share, both tiers' alike (docs/behaviour.md
§7.3, rule 2): what is left of it, whether a notice overran it, and what became of a
notice (`NoticeBudget`, `NoticeOutcome`). Pure — the seconds a notice took are handed in —
so the asyncio pumps (on their clock) and the Temporal workflow (on ``workflow.time()``)
keep the rule in one place."""

from __future__ import annotations

from enum import StrEnum

from attrs import define

#: How a notice given up on is named in ``abandoned_calls``.
SEND_NOTICE = "channel.send_notice"


@define
class NoticeBudget:
    """What is left of the turn's notice budget: each notice is bounded by ``remaining``, a
    notice that overran it is given up on (named in ``abandoned_calls``, the ending
    unchanged), and once one has, later notices of the turn are not sent (a channel whose
    notices hang would hang every one of them). So the notices delay a turn by at most one
    ``host_call_timeout`` (and, for one that ignores its cancellation, ``cancel_grace``).

    Not frozen: the two tiers of a turn draw on the same budget, one notice after another.
    """

    remaining: float
    overran: bool = False

    @property
    def spent(self) -> bool:
        """Whether the next notice is not sent."""
        return self.overran or self.remaining <= 0

    def spend(self, seconds: float) -> None:
        """A notice took ``seconds`` of what was left."""
        self.remaining = max(0.0, self.remaining - seconds)

    def overrun(self) -> None:
        """A notice did not return within what was left: the turn sends no more."""
        self.overran = True


class NoticeOutcome(StrEnum):
    """What became of a notice that did not raise."""

    SHOWN = "shown"
    GIVEN_UP = "given_up"  # it overran the budget now: named in the result
    NOT_SENT = "not_sent"  # the budget was already spent
