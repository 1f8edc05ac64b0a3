"""The test kit's `VirtualClock` jumps over virtual waits but never over real ones.

A tool that awaits real time (a short `asyncio.sleep`, an HTTP call under its timeout) must
see its real wait complete before virtual time moves past its deadline; the kit's own
real-time watchdogs must not hold virtual time still.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from toolloop_fsm import LoopPolicy
from toolloop_fsm import Tool
from toolloop_fsm import ToolRegistry
from toolloop_fsm import ToolResult
from toolloop_fsm import TurnRequest
from toolloop_fsm import run_tool_loop
from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import TextDelta
from toolloop_fsm.result import TurnStatus
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import ScriptedProvider
from toolloop_fsm.testing import VirtualClock
from toolloop_fsm.testing import real_time_limit
from toolloop_fsm.testing.hostile import returns_within


async def test_a_tool_awaiting_a_short_real_sleep_is_not_timed_out_by_virtual_time() -> None:
    clock = VirtualClock()

    async def lookup(arguments: dict[str, object], context: object) -> ToolResult:
        await asyncio.sleep(0.05)  # real I/O stand-in: 50 ms of real time
        return ToolResult(message="found it")

    provider = ScriptedProvider(
        [[FunctionCall("lookup", {})], [TextDelta("Here it is.")]], clock=clock
    )
    tools = ToolRegistry([Tool("lookup", "look it up", {"type": "object"}, lookup)])
    channel = RecordingChannel(clock=clock)
    result = await run_tool_loop(
        provider,
        tools,
        channel,
        TurnRequest([{"role": "user", "content": "hi"}]),
        policy=LoopPolicy(),
        clock=clock,
    )
    assert result.status is TurnStatus.COMPLETED, result.error_message
    assert result.history[0].response.success, result.history[0].response
    assert result.final_text == "Here it is."


async def test_virtual_time_waits_for_a_pending_real_timer_before_jumping() -> None:
    clock = VirtualClock()
    order: list[str] = []

    async def real_wait() -> None:
        await asyncio.sleep(0.02)
        order.append("real")

    async def virtual_wait() -> None:
        await clock.sleep(1_000)
        order.append("virtual")

    await asyncio.gather(real_wait(), virtual_wait())
    assert order == ["real", "virtual"]
    assert clock.now() == 1_000


async def test_the_kits_real_time_watchdogs_do_not_hold_virtual_time() -> None:
    clock = VirtualClock()
    # a watchdog that held virtual time still would fire before the clock jumped: the sleep
    # would end in TimeoutError, not at the virtual hour
    async with real_time_limit(30.0):
        await clock.sleep(3_600)
    await returns_within(clock.sleep(3_600), 30.0)
    assert clock.now() == 7_200


async def test_real_time_limit_raises_timeout_when_real_time_runs_out() -> None:
    with pytest.raises(TimeoutError):
        async with real_time_limit(0.01):
            await asyncio.Event().wait()


async def test_a_clock_held_by_real_timers_says_which_and_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = VirtualClock(real_hold_warning=0.01)
    caplog.set_level(logging.WARNING, logger="toolloop_fsm.testing")

    async def long_real_wait() -> None:
        await asyncio.sleep(0.05)

    await asyncio.gather(long_real_wait(), clock.sleep(5))
    assert clock.now() == 5
    held = [r.getMessage() for r in caplog.records if "VirtualClock" in r.getMessage()]
    assert held, "no warning that virtual time was held by real timers"
    assert "real timer" in held[0]


async def test_a_real_timer_cancelled_early_releases_virtual_time_at_once() -> None:
    clock = VirtualClock()
    loop = asyncio.get_running_loop()

    async def http_call_under_a_long_timeout() -> None:
        # the client's hour-long timeout: a clock that waited for it although it was cancelled
        # would hold the test past pytest's faulthandler_timeout, which fails it
        timeout = loop.call_later(3_600.0, lambda: None)
        reply: asyncio.Future[None] = loop.create_future()
        # the reply arrives as I/O 10 ms later (from outside the loop, not on a loop timer)
        threading.Timer(0.01, loop.call_soon_threadsafe, (reply.set_result, None)).start()
        await reply
        timeout.cancel()

    await asyncio.gather(http_call_under_a_long_timeout(), clock.sleep(60))
    assert clock.now() == 60


async def test_two_clocks_on_one_loop_both_jump() -> None:
    # a turn that returned may leave timers on its clock (a straggler's, a trickle's); the
    # next turn on the same loop gets a clock of its own, and neither may take the other's
    # waiting for work
    left_behind, current = VirtualClock(), VirtualClock()
    fired: list[float] = []
    done = asyncio.Event()

    def fire() -> None:
        fired.append(left_behind.now())
        done.set()

    left_behind.call_later(10, fire)
    await current.sleep(5)
    assert current.now() == 5
    await done.wait()
    assert fired == [10]


async def test_a_script_runs_on_a_loop_where_an_earlier_clock_still_has_timers() -> None:
    # the shape of a fuzzing host: many turns on one event loop, the earlier ones leaving
    # timers on their own clocks
    from toolloop_fsm.testing import Pause
    from toolloop_fsm.testing import TurnScript
    from toolloop_fsm.testing import run_script

    left_behind = VirtualClock()
    ticks: list[float] = []
    drained = asyncio.Event()

    def tick() -> None:  # a trickle that outlived its turn, re-arming itself a while
        ticks.append(left_behind.now())
        if len(ticks) < 2_000:
            left_behind.call_later(1.0, tick)
        else:
            drained.set()

    left_behind.call_later(1.0, tick)
    # the pause makes the turn wait on its own clock
    script = TurnScript(passes=((Pause(1.0), TextDelta("Hi")),))
    run = await run_script(script, LoopPolicy(), real_timeout=None)
    assert run.result.status is TurnStatus.COMPLETED, run.result.error_message
    assert run.result.final_text == "Hi"
    await drained.wait()
    assert left_behind.now() == 2_000
