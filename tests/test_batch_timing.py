"""How long a tool batch takes, in virtual time (docs/behaviour.md §3.10 rule 2): five calls
whose tools each wait 1 s on the turn's clock take 1 s together, not 5; at most
``max_parallel_tools`` run at once; a ``sequential`` tool is a barrier (the calls before it
finish, it runs alone, then the rest). Assertions are on the virtual clock and on the order
the tools started; nothing waits on the real clock."""

from __future__ import annotations

from typing import Any

import pytest
from attrs import define
from attrs import field

from tests.inner_kit import Turn
from tests.inner_kit import run_turn
from tests.inner_kit import scripted_turn
from toolloop_fsm import FunctionCall
from toolloop_fsm import LoopPolicy
from toolloop_fsm import TextDelta
from toolloop_fsm import Tool
from toolloop_fsm import ToolContext
from toolloop_fsm import ToolResult
from toolloop_fsm import TurnStatus

CITIES = ("Paris", "London", "Rome", "Berlin", "Madrid")
#: What each tool waits, in virtual seconds.
WAIT = 1.0


@define
class Timeline:
    """When each call's tool started and finished, in virtual seconds, in start order."""

    started: list[tuple[str, float]] = field(factory=list)
    finished: list[tuple[str, float]] = field(factory=list)


def waiting_tool(name: str, timeline: Timeline, *, sequential: bool = False) -> Tool:
    """A tool that waits `WAIT` seconds on the turn's clock, recording when it ran."""

    async def handler(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        city = str(arguments["city"])
        timeline.started.append((city, ctx.clock.now()))
        await ctx.clock.sleep(WAIT)
        timeline.finished.append((city, ctx.clock.now()))
        return ToolResult(data={"city": city}, message=f"{name} for {city}")

    return Tool(name, f"the {name} tool", {"type": "object"}, handler, sequential=sequential)


def batch_turn(names: tuple[str, ...]) -> Turn:
    """A turn whose first pass is one batch: ``names[i]`` called for ``CITIES[i]``."""
    calls = [
        FunctionCall(name, {"city": city}, f"call-{city}")
        for name, city in zip(names, CITIES, strict=True)
    ]
    return scripted_turn(
        [[TextDelta("Checking every city. "), *calls], [TextDelta("All five are sunny.")]]
    )


async def run_batch(
    names: tuple[str, ...], policy: LoopPolicy | None = None
) -> tuple[Turn, Timeline]:
    timeline = Timeline()
    tools = [
        waiting_tool("get_weather", timeline),
        waiting_tool("book_table", timeline, sequential=True),
    ]
    turn = batch_turn(names)
    result = await run_turn(turn, tools, policy=policy)
    assert result.status is TurnStatus.COMPLETED
    assert result.final_text == "All five are sunny."
    # every call is answered once, in emitted order, in the one request after the batch
    (_first, after_batch) = turn.provider.requests
    assert [
        (entry.call.arguments["city"], entry.response.success, entry.position)
        for entry in after_batch.history
    ] == [(city, True, position) for position, city in enumerate(CITIES)]
    return turn, timeline


ALL_WEATHER = ("get_weather",) * 5


async def test_five_calls_waiting_one_second_each_finish_in_one_second_together() -> None:
    turn, timeline = await run_batch(ALL_WEATHER)
    assert timeline.started == [(city, 0.0) for city in CITIES]
    assert sorted(timeline.finished) == sorted((city, WAIT) for city in CITIES)
    assert turn.clock.now() == pytest.approx(1.0)


async def test_at_most_max_parallel_tools_run_at_once() -> None:
    turn, timeline = await run_batch(ALL_WEATHER, LoopPolicy(max_parallel_tools=2))
    # two at a time, in emitted order: a waiting call starts as soon as a running one ends
    assert timeline.started == [
        ("Paris", 0.0),
        ("London", 0.0),
        ("Rome", 1.0),
        ("Berlin", 1.0),
        ("Madrid", 2.0),
    ]
    assert turn.clock.now() == pytest.approx(3.0)


async def test_a_sequential_tool_mid_batch_runs_alone_between_the_calls_around_it() -> None:
    names = ("get_weather", "get_weather", "book_table", "get_weather", "get_weather")
    turn, timeline = await run_batch(names)
    assert timeline.started == [
        ("Paris", 0.0),
        ("London", 0.0),
        ("Rome", 1.0),  # the barrier: after Paris and London finished
        ("Berlin", 2.0),  # and before anything after it
        ("Madrid", 2.0),
    ]
    assert ("Rome", 2.0) in timeline.finished
    assert turn.clock.now() == pytest.approx(3.0)


async def test_max_parallel_tools_one_runs_the_calls_one_by_one() -> None:
    turn, timeline = await run_batch(ALL_WEATHER, LoopPolicy(max_parallel_tools=1))
    assert timeline.started == [(city, float(i)) for i, city in enumerate(CITIES)]
    assert timeline.finished == [(city, float(i + 1)) for i, city in enumerate(CITIES)]
    assert turn.clock.now() == pytest.approx(5.0)
