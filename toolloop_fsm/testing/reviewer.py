"""`ScriptedReviewer`: a reviewer that answers from a script, for tests and property tests of
drafting and the tool checkpoint."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import TypeAlias

from attrs import frozen

from toolloop_fsm.host import Clock
from toolloop_fsm.review import Pass
from toolloop_fsm.review import ReviewPacket
from toolloop_fsm.review import Verdict


@frozen
class Hang:
    """Never answer (the review deadline decides)."""


@frozen
class Slow:
    """Answer ``verdict`` after ``seconds`` on the clock."""

    seconds: float
    verdict: Verdict


@frozen
class Raise:
    """Raise ``error`` instead of answering."""

    error: BaseException


ReviewerAct: TypeAlias = Verdict | Hang | Slow | Raise


class ScriptedReviewer:
    """Answers each review with the next act of ``acts`` (`Pass` once they run out), and
    records every `ReviewPacket` it was shown in ``packets``."""

    def __init__(self, acts: Iterable[ReviewerAct] = (), *, clock: Clock | None = None) -> None:
        self.acts: list[ReviewerAct] = list(acts)
        self.clock = clock
        self.packets: list[ReviewPacket] = []

    async def review(self, packet: ReviewPacket) -> Verdict:
        index = len(self.packets)
        self.packets.append(packet)
        act = self.acts[index] if index < len(self.acts) else Pass()
        if isinstance(act, Hang):
            await asyncio.get_running_loop().create_future()  # until cancelled
        if isinstance(act, Raise):
            raise act.error
        if isinstance(act, Slow):
            if self.clock is None:
                await asyncio.sleep(act.seconds)
            else:
                await self.clock.sleep(act.seconds)
            return act.verdict
        assert not isinstance(act, Hang)
        return act


__all__ = ["Hang", "Raise", "ReviewerAct", "ScriptedReviewer", "Slow"]
