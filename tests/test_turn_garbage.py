"""A finished turn leaves no reference cycles behind: everything it built is freed the moment
the host drops the result, by reference counting alone.

A cycle (a pump part holding the pump that holds it) keeps a whole turn — its machine, run
state, trace and history — alive until the cycle collector next runs, and makes that collector
run more often: a host running many turns pays for it in memory and in CPU on every turn.
"""

from __future__ import annotations

import collections
import gc
from collections.abc import AsyncIterator
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import pytest

from tests.inner_kit import USER
from tests.inner_kit import Executions
from tests.inner_kit import make_tool
from tests.inner_kit import scripted_turn
from toolloop_fsm import Attempt
from toolloop_fsm import FunctionCall
from toolloop_fsm import ProviderError
from toolloop_fsm import ProviderRequest
from toolloop_fsm import TextDelta
from toolloop_fsm import TurnRequest
from toolloop_fsm import TurnStatus
from toolloop_fsm import run_generation_turn
from toolloop_fsm import run_tool_loop
from toolloop_fsm.events import Chunk
from toolloop_fsm.stream import TurnEnded
from toolloop_fsm.stream import stream_tool_loop
from toolloop_fsm.testing import RecordingChannel
from toolloop_fsm.testing import ScriptedProvider
from toolloop_fsm.testing import ScriptItem
from toolloop_fsm.testing import VirtualClock

#: A pass that streams text and asks for a tool, then the answer: deliveries, a stream
#: deadline per pass, a tool round.
PASSES: list[list[ScriptItem]] = [
    [TextDelta("Let me look that up. " * 10), FunctionCall("lookup", {"q": "Paris"})],
    [TextDelta("It is sunny in Paris. " * 10)],
]


class OverloadedProvider:
    """A provider whose every stream fails at once with a new 503, as a real one's does. (The
    kit's `Fail` raises the one exception it holds, whose traceback then holds the script
    that holds it: a cycle of the test's own making.)"""

    name = "overloaded"

    def stream(self, request: ProviderRequest) -> AsyncIterator[Chunk]:
        return self._fail()

    async def _fail(self) -> AsyncIterator[Chunk]:
        raise ProviderError("503 overloaded", kind="server", retryable=True, status_code=503)
        yield  # an async generator: it fails when first read


def engine_garbage(garbage: list[Any]) -> collections.Counter[str]:
    """The engine's objects among what the collector found unreachable, by class."""
    return collections.Counter(
        type(item).__qualname__
        for item in garbage
        if getattr(type(item), "__module__", "").startswith("toolloop_fsm")
    )


@pytest.fixture
def collector_off() -> Iterator[list[Any]]:
    """The cycle collector held off while a turn runs; what it then finds unreachable is kept
    (not freed) in the returned list, for the test to read."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield gc.garbage
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


async def cycles_left_by(run: Callable[[], Awaitable[TurnStatus]], garbage: list[Any]) -> None:
    status = await run()
    assert status is TurnStatus.COMPLETED
    gc.collect()
    assert engine_garbage(garbage) == collections.Counter()


async def test_a_tool_loop_turn_leaves_no_reference_cycles(collector_off: list[Any]) -> None:
    async def run() -> TurnStatus:
        turn = scripted_turn(PASSES)
        tools = [make_tool("lookup", Executions(), turn.clock)]
        result = await run_tool_loop(
            turn.provider, tools, turn.channel, TurnRequest(USER), clock=turn.clock
        )
        return result.status

    await cycles_left_by(run, collector_off)


async def test_a_generation_turn_with_a_fallback_leaves_no_reference_cycles(
    collector_off: list[Any],
) -> None:
    async def run() -> TurnStatus:
        clock = VirtualClock()
        broken = OverloadedProvider()
        backup = ScriptedProvider(PASSES, clock=clock)
        tools = [make_tool("lookup", Executions(), clock)]
        result = await run_generation_turn(
            [Attempt(broken, label="primary"), Attempt(backup, label="backup")],
            tools,
            RecordingChannel(clock=clock),
            TurnRequest(USER),
            clock=clock,
        )
        return result.status

    await cycles_left_by(run, collector_off)


async def test_a_watched_turn_leaves_no_reference_cycles(collector_off: list[Any]) -> None:
    async def run() -> TurnStatus:
        turn = scripted_turn(PASSES)
        tools = [make_tool("lookup", Executions(), turn.clock)]
        status = TurnStatus.ERROR
        async with stream_tool_loop(
            turn.provider, tools, turn.channel, TurnRequest(USER), clock=turn.clock
        ) as events:
            async for event in events:
                if isinstance(event, TurnEnded):
                    status = event.result.status
        return status

    await cycles_left_by(run, collector_off)
