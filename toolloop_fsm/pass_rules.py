"""The rules of one provider pass that the machine and every shell share (docs/behaviour.md
§2.3, §6.1): which budget of the pass's one stream deadline runs out, and when; and when the
text a pass buffers is delivered.

The machine, the in-process pump and the Temporal worker each time a pass or deliver its
text in their own way, but they must agree on these answers (a durable turn ends as an
in-process one would), so each asks here. Sans-IO: plain functions of times and counts, no
clock of their own.
"""

from __future__ import annotations

import math

from toolloop_fsm.events import DeadlineKind

__all__ = [
    "DUE_SLACK",
    "STREAM_BUDGETS",
    "flush_due",
    "phase_budget",
    "stream_budget_due",
]

#: The budgets the pass's one ``STREAM`` deadline expires as.
STREAM_BUDGETS = frozenset(
    {DeadlineKind.FIRST_TOKEN, DeadlineKind.INACTIVITY, DeadlineKind.PASS_DURATION}
)
#: How close to its due time a budget counts as run out (timers wake a hair early or late).
DUE_SLACK = 1e-9


def phase_budget(answered: bool) -> DeadlineKind:
    """The budget the pass's stream deadline runs on besides its total: the first-token
    budget until the pass's first chunk (``answered``: one arrived), the inactivity budget
    after it."""
    return DeadlineKind.INACTIVITY if answered else DeadlineKind.FIRST_TOKEN


def stream_budget_due(
    now: float,
    *,
    begun: float,
    answered_at: float | None,
    first_seconds: float,
    inactivity_seconds: float,
    total_seconds: float | None,
) -> tuple[DeadlineKind, float]:
    """The budget of a pass's stream deadline that runs out first, seen at ``now``, and when
    it is due. ``begun``: when the pass started; ``answered_at``: when its inactivity budget
    last started counting (its last chunk or recorded delivery), ``None`` before its first
    chunk; ``total_seconds``: the pass's total budget, if it has one.

    Once the total budget is spent it is the one that ran out, however steadily the pass
    streams; before that, the first-token budget (no chunk yet) or the inactivity budget,
    unless the total one is due no later."""
    total_due = begun + total_seconds if total_seconds is not None else math.inf
    if total_due - now <= DUE_SLACK:
        return DeadlineKind.PASS_DURATION, total_due
    if answered_at is None:
        kind, due = DeadlineKind.FIRST_TOKEN, begun + first_seconds
    else:
        kind, due = DeadlineKind.INACTIVITY, answered_at + inactivity_seconds
    if total_due <= due:
        return DeadlineKind.PASS_DURATION, total_due
    return kind, due


def flush_due(buffered: int, flush_chars: int) -> bool:
    """Whether ``buffered`` characters of a pass's text are delivered now, mid-stream
    (``LoopPolicy.delivery_flush_chars``); what stays below it is delivered as the stream
    ends. So a delivery shorter than ``flush_chars`` is only ever its pass's last."""
    return buffered >= flush_chars
