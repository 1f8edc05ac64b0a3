"""`VirtualClock`: test time that jumps instead of passing, but never over a real wait.

Timers run in virtual time. Whenever every task on the loop is waiting (nothing is ready
to run), the clock jumps to the next timer and fires it — so a 300-second tool deadline is
tested in microseconds and no test sleeps.

Code under test may still wait on real time: a tool that sleeps 50 ms, an HTTP call under
its client's timeout (httpx arms one as a real loop timer). Jumping then would fire a
virtual deadline long before the real wait could finish ("timed out after 300 s" for a
50 ms sleep). So the clock holds still while the event loop has a real timer pending, and
jumps once those timers have fired. I/O with no timer at all is not seen: use the real
`LoopClock` for that. A real-time watchdog around a virtual turn would hold the clock for
its whole length, so the kit's own watchdogs are made with `real_time_limit` or
`watchdog_timer`, which the clock ignores; a hold longer than ``real_hold_warning`` real
seconds is logged (logger ``toolloop_fsm.testing``) naming the timers that hold it.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import weakref
from collections.abc import AsyncIterator
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from attrs import define
from attrs import field

__all__ = ["VirtualClock", "VirtualTimer", "real_time_limit", "watchdog_timer"]

_log = logging.getLogger("toolloop_fsm.testing")

#: Longest real wait between two looks at the real timers holding virtual time still.
_REAL_HOLD_SLICE = 0.01

#: Real loop timers that guard a test rather than belong to the code under test.
_WATCHDOGS: weakref.WeakSet[asyncio.TimerHandle] = weakref.WeakSet()

#: Every clock's idle-jumper task. Several clocks can share a loop (a fuzzing host runs many
#: turns on one, and a turn that returned may leave timers on its clock); a jumper waiting
#: for idleness must not count another jumper's turn in the ready queue as work, or two of
#: them keep each other from ever jumping.
_JUMPERS: weakref.WeakSet[asyncio.Task[None]] = weakref.WeakSet()


def watchdog_timer(
    delay: float, callback: Callable[..., object], *args: Any
) -> asyncio.TimerHandle:
    """``loop.call_later`` for a real-time watchdog: a `VirtualClock` does not hold virtual
    time still for it (it would otherwise wait out the whole watchdog before jumping)."""
    handle = asyncio.get_running_loop().call_later(delay, callback, *args)
    _WATCHDOGS.add(handle)
    return handle


@asynccontextmanager
async def real_time_limit(seconds: float | None) -> AsyncIterator[None]:
    """Like ``asyncio.timeout(seconds)`` in real time, as a watchdog a `VirtualClock`
    ignores: raises `TimeoutError` if the block runs longer than ``seconds`` real seconds
    (``None``: no limit)."""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(None) as limit:
        if seconds is None:
            yield
            return
        handle = watchdog_timer(seconds, lambda: limit.reschedule(loop.time()))
        try:
            yield
        finally:
            handle.cancel()


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
    """A `Clock` whose time only moves when the loop is idle and no real timer is pending
    (or `advance` is called). ``real_hold_warning``: real seconds of holding still for real
    timers after which the clock logs a warning naming them."""

    start: float = 0.0
    idle_rounds: int = 3
    real_hold_warning: float = 5.0
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
        _JUMPERS.add(self._jumper)

    async def _jump_when_idle(self) -> None:
        loop = asyncio.get_running_loop()
        idle = 0
        held_since: float | None = None
        warned = False
        while self._live_timers():
            await asyncio.sleep(0)
            if _work_ready(loop):
                idle = 0
                continue
            idle += 1
            if idle < self.idle_rounds:
                continue
            idle = 0
            holding = _real_timers(loop)
            if holding:
                # someone waits on real time: let it pass (without spinning) before jumping
                wake_at = min(handle.when() for handle in holding)
                if held_since is None:
                    held_since, warned = loop.time(), False
                if not warned and wake_at - held_since >= self.real_hold_warning:
                    warned = True
                    _warn_held_still(wake_at - held_since, holding)
                # in short slices: the timer may be cancelled early (the reply came in)
                await _sleep_until(loop, min(wake_at, loop.time() + _REAL_HOLD_SLICE))
                continue
            held_since = None
            if not self._live_timers():
                return
            timer = heapq.heappop(self._timers)
            self._now = max(self._now, timer.when)
            timer.callback(*timer.args)

    def _live_timers(self) -> bool:
        """Whether a timer is still to fire (the cancelled ones at the front are dropped)."""
        while self._timers and self._timers[0].cancelled:
            heapq.heappop(self._timers)
        return bool(self._timers)


def _warn_held_still(seconds: float, holding: list[asyncio.TimerHandle]) -> None:
    """Tell the test's author that real timers have held virtual time still this long."""
    _log.warning(
        "VirtualClock holds virtual time still for %.3g real seconds or more: "
        "the loop has %d real timer(s) pending (%s); code under a "
        "VirtualClock should wait on the clock, and a watchdog should be made "
        "with real_time_limit() or watchdog_timer()",
        seconds,
        len(holding),
        _describe(holding),
    )


def _work_ready(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether a callback other than a clock's jumper is ready to run."""
    # asyncio keeps its runnable callbacks in `_ready`; a task's step is a callback bound to
    # the task (its ``__self__``)
    for handle in getattr(loop, "_ready", ()):
        owner = getattr(getattr(handle, "_callback", None), "__self__", None)
        if owner is None or owner not in _JUMPERS:
            return True
    return False


def _real_timers(loop: asyncio.AbstractEventLoop) -> list[asyncio.TimerHandle]:
    """The loop's pending real timers that belong to the code under test."""
    # asyncio keeps its timers in `_scheduled`; a loop without one is treated as having none
    scheduled: list[asyncio.TimerHandle] = getattr(loop, "_scheduled", [])
    return [h for h in scheduled if not h.cancelled() and h not in _WATCHDOGS]


async def _sleep_until(loop: asyncio.AbstractEventLoop, when: float) -> None:
    woken: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not woken.done():
            woken.set_result(None)

    handle = loop.call_at(when, wake)
    _WATCHDOGS.add(handle)
    try:
        await woken
    finally:
        handle.cancel()


def _describe(handles: list[asyncio.TimerHandle]) -> str:
    names = []
    for handle in handles[:3]:
        callback = getattr(handle, "_callback", None)
        names.append(getattr(callback, "__qualname__", repr(callback)))
    return ", ".join(names) + (", …" if len(handles) > 3 else "")
