"""`VirtualClock`: test time that jumps instead of passing.

Timers run in virtual time. Whenever every task on the loop is waiting (nothing is ready
to run), the clock jumps to the next timer and fires it — so a 300-second tool deadline is
tested in microseconds and no test sleeps. Like trio's autojump clock, it assumes the code
under test waits only on its own timers and in-memory work; use the real `LoopClock` with
real sockets.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from typing import Any

from attrs import define, field


@define(eq=False)
class VirtualTimer:
    when: float
    seq: int
    callback: Callable[..., None]
    args: tuple[Any, ...] = ()
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True

    def __lt__(self, other: VirtualTimer) -> bool:
        return (self.when, self.seq) < (other.when, other.seq)


@define
class VirtualClock:
    """A `Clock` whose time only moves when the loop is idle (or `advance` is called)."""

    start: float = 0.0
    idle_rounds: int = 3
    _now: float = field(init=False)
    _timers: list[VirtualTimer] = field(init=False, factory=list)
    _seq: itertools.count[int] = field(init=False, factory=itertools.count)
    _jumper: asyncio.Task[None] | None = field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        self._now = self.start

    def now(self) -> float:
        return self._now

    def call_later(self, delay: float, callback: Callable[..., None], *args: Any) -> VirtualTimer:
        timer = VirtualTimer(self._now + max(0.0, delay), next(self._seq), callback, args)
        heapq.heappush(self._timers, timer)
        self._ensure_jumper()
        return timer

    async def sleep(self, seconds: float) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def wake() -> None:
            if not future.done():
                future.set_result(None)

        timer = self.call_later(seconds, wake)
        try:
            await future
        finally:
            timer.cancel()

    def advance(self, seconds: float) -> None:
        """Move time forward by hand, firing every timer that falls due."""
        target = self._now + seconds
        while self._timers and self._timers[0].when <= target:
            timer = heapq.heappop(self._timers)
            if timer.cancelled:
                continue
            self._now = max(self._now, timer.when)
            timer.callback(*timer.args)
        self._now = target

    @property
    def pending_timers(self) -> int:
        return sum(1 for t in self._timers if not t.cancelled)

    def _ensure_jumper(self) -> None:
        if self._jumper is not None and not self._jumper.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._jumper = loop.create_task(self._jump_when_idle())

    async def _jump_when_idle(self) -> None:
        loop = asyncio.get_running_loop()
        idle = 0
        while True:
            while self._timers and self._timers[0].cancelled:
                heapq.heappop(self._timers)
            if not self._timers:
                return
            await asyncio.sleep(0)
            # asyncio keeps its runnable callbacks in `_ready`; empty means every task waits
            if getattr(loop, "_ready", ()):
                idle = 0
                continue
            idle += 1
            if idle < self.idle_rounds:
                continue
            idle = 0
            while self._timers and self._timers[0].cancelled:
                heapq.heappop(self._timers)
            if not self._timers:
                return
            timer = heapq.heappop(self._timers)
            self._now = max(self._now, timer.when)
            timer.callback(*timer.args)
