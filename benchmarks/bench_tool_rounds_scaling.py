"""Whether a tool round costs the same late in a long turn as early in it.

A turn of R tool rounds (each pass: 40 text chunks and a call; then a 40-chunk final answer)
against a registry of eight tools with JSON-schema parameters, run by `run_tool_loop`
(``max_function_call_iterations`` 200), with a usage report in each pass and without one
(llama.cpp's server sends none: the engine then estimates the pass's usage from its request).

The cost of a tool round at R rounds is ``(turn(R) - turn(0)) / R``: the CPU a turn of R
rounds spends beyond the bare final pass, per round. A round whose cost grows with the
history shows as ``cost@99 / cost@10`` above 1; the stricter figure, the cost of rounds 11 to
99 against that of rounds 1 to 10, ``((turn(99) - turn(10)) / 89) / ((turn(10) - turn(0)) / 10)``,
is printed too.

The baseline is the same-work hand-written loop of `bench_tool_loop.py` (deadlines, the host's
signals), doing what the engine does with a pass that brought no usage report the plain way: a
running count of the characters it sends (each history entry measured once, as it is
appended; the tool schemas once per turn), read when the pass ends.

Figures are CPU microseconds (process time), medians over interleaved rounds (each round
measures every contender and size back to back); only the ratios mean much on a shared
machine.

    python benchmarks/bench_tool_rounds_scaling.py [--turns N] [--rounds R]
    python benchmarks/bench_tool_rounds_scaling.py --run-only engine --size 99 [--no-usage]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Awaitable
from collections.abc import Callable
from typing import Any

from bench_tool_loop import REQUEST
from bench_tool_loop import Chunk
from bench_tool_loop import CountingChannel
from bench_tool_loop import MemoryProvider
from bench_tool_loop import StreamedPass
from bench_tool_loop import awaitable
from bench_tool_loop import handwritten_same_work_turn
from bench_tool_loop import text_chunks

from toolloop_fsm import FunctionCall
from toolloop_fsm import LoopPolicy
from toolloop_fsm import Tool
from toolloop_fsm import ToolContext
from toolloop_fsm import ToolRegistry
from toolloop_fsm import ToolResult
from toolloop_fsm import UsageReport
from toolloop_fsm import run_tool_loop
from toolloop_fsm.host import LoopClock
from toolloop_fsm.result import token_weight
from toolloop_fsm.result import tokens_of_weight

SIZES = (0, 10, 99)
POLICY = LoopPolicy(max_function_call_iterations=200)


async def lookup(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
    return ToolResult(
        data={"answer": 42, "q": arguments.get("q"), "source": "the benchmark's table"},
        message="found",
    )


def _schema(index: int) -> dict[str, Any]:
    """A tool's parameters as a host writes them: a few typed, described properties."""
    return {
        "type": "object",
        "properties": {
            "q": {"type": "string", "description": f"what tool {index} looks up"},
            "limit": {"type": "integer", "minimum": 1, "maximum": 50, "description": "at most"},
            "since": {"type": "string", "format": "date", "description": "not before this day"},
            "tags": {"type": "array", "items": {"type": "string"}, "description": "any of"},
        },
        "required": ["q"],
    }


TOOLS = ToolRegistry(
    [Tool("lookup", "look something up", _schema(0), lookup)]
    + [Tool(f"tool_{i}", f"the benchmark's tool {i}", _schema(i), lookup) for i in range(1, 8)]
)


def script(rounds: int, usage: bool) -> list[list[Chunk]]:
    """``rounds`` passes of 40 chunks and a call, then a 40-chunk answer; each pass ends with
    a usage report when ``usage``."""

    def report(a: int, b: int) -> list[Chunk]:
        return [UsageReport(a, b)] if usage else []

    passes: list[list[Chunk]] = [
        [*text_chunks(40), FunctionCall("lookup", {"q": f"x{i}"}, f"c{i}"), *report(10 + i, 20)]
        for i in range(rounds)
    ]
    return [*passes, [*text_chunks(40), *report(20, 25)]]


def _weight(value: Any) -> int:
    return token_weight(json.dumps(value, ensure_ascii=False, default=str))


async def floor_turn(provider: MemoryProvider, channel: CountingChannel) -> list[tuple[int, int]]:
    """`bench_tool_loop.handwritten_same_work_turn` with this benchmark's tools and policy,
    plus the usage of a pass without a report estimated from a running count of what the
    loop sends (each history entry measured as it is appended, the schemas once)."""
    specs = TOOLS.specs(TOOLS.names)
    sent = sum(token_weight(str(m.get("content", ""))) for m in REQUEST.context) + sum(
        token_weight(s.name) + token_weight(s.description) + _weight(s.parameters) for s in specs
    )
    ledger: list[tuple[int, int]] = []

    async def answer(
        policy: LoopPolicy, streamed: StreamedPass, history: list[dict[str, Any]]
    ) -> bool:
        nonlocal sent
        text, usage = streamed.text, streamed.usage
        call = streamed.calls[0] if streamed.calls else None
        if usage is None:
            written = token_weight(text)
            if call:
                written += token_weight(call.name) + _weight(call.arguments)
            usage = (tokens_of_weight(sent), tokens_of_weight(written))
        ledger.append(usage)
        if call is None:
            return False
        tool = TOOLS.get(call.name)
        assert tool is not None
        ctx = ToolContext(call.name, streamed.iteration, streamed.iteration, LoopClock())
        result = await asyncio.wait_for(
            awaitable(tool.handler(dict(call.arguments), ctx)), policy.tool_timeout
        )
        history.append({"call": call, "result": result, "pre_tool_text": text or None})
        sent += token_weight(text) + token_weight(call.name) + _weight(call.arguments)
        sent += _weight([result.data, result.message, None])
        return True

    await handwritten_same_work_turn(provider, channel, policy=POLICY, tools=specs, answer=answer)
    return ledger


async def engine_turn(provider: MemoryProvider, channel: CountingChannel) -> object:
    return await run_tool_loop(provider, TOOLS, channel, REQUEST, policy=POLICY)


Runner = Callable[[MemoryProvider, CountingChannel], Awaitable[object]]
CONTENDERS: dict[str, Runner] = {"hand-written loop": floor_turn, "run_tool_loop": engine_turn}


def turns_at(size: int, turns: int) -> int:
    """How many turns of ``size`` rounds a figure runs: ``turns`` at 99 rounds, more of the
    shorter turns (about the same CPU per figure, so their differences are not lost in noise)."""
    return max(1, turns * 100 // (size + 1))


async def cpu_per_turn(runner: Runner, passes: list[list[Chunk]], turns: int) -> float:
    start = time.process_time()
    for _ in range(turns):
        await runner(MemoryProvider(passes), CountingChannel())
    return (time.process_time() - start) / turns * 1e6


async def main(turns: int, rounds: int) -> None:
    print(f"CPU (process time), {rounds} interleaved rounds; {turns} turns of 99 rounds a figure;")
    print("per-round cost at R = (turn(R) - turn(0)) / R; medians over the rounds.")
    scripts = {(usage, size): script(size, usage) for usage in (True, False) for size in SIZES}
    for runner in CONTENDERS.values():  # warm up
        for passes in scripts.values():
            await cpu_per_turn(runner, passes, 1)
    # (contender, usage) -> figure name -> one value per round
    measured: dict[tuple[str, bool], dict[str, list[float]]] = {
        (name, usage): {"@10": [], "@99": [], "ratio": [], "late": []}
        for name in CONTENDERS
        for usage in (True, False)
    }
    for _ in range(rounds):
        for usage in (True, False):
            for name, runner in CONTENDERS.items():
                cost = {
                    size: await cpu_per_turn(runner, scripts[usage, size], turns_at(size, turns))
                    for size in SIZES
                }
                at10 = (cost[10] - cost[0]) / 10
                at99 = (cost[99] - cost[0]) / 99
                late = (cost[99] - cost[10]) / 89
                figures = measured[name, usage]
                figures["@10"].append(at10)
                figures["@99"].append(at99)
                figures["ratio"].append(at99 / at10)
                figures["late"].append(late / at10)
    for usage in (True, False):
        print("with a usage report in each pass:" if usage else "without usage reports:")
        for name in CONTENDERS:
            figures = measured[name, usage]
            ratios = sorted(figures["ratio"])
            print(
                f"  {name:>17}: a tool round {statistics.median(figures['@10']):6.1f} µs at 10"
                f" rounds, {statistics.median(figures['@99']):6.1f} µs at 99"
                f"   cost@99 / cost@10 {statistics.median(ratios):4.2f}x"
                f" (rounds {ratios[0]:.2f}–{ratios[-1]:.2f})"
                f"   rounds 11–99 / rounds 1–10 {statistics.median(figures['late']):4.2f}x"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=5, help="turns of 99 rounds per figure")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--run-only",
        choices=("engine", "hand-written"),
        help="just run --turns turns of --size rounds of one contender, after one warm-up turn "
        "of one round (for instruction counts under valgrind --tool=callgrind: a round at R "
        "costs (count(--size R) - count(--size 0)) / (R * turns))",
    )
    parser.add_argument("--size", type=int, default=99, help="tool rounds of a --run-only turn")
    parser.add_argument("--no-usage", action="store_true", help="--run-only passes without usage")
    args = parser.parse_args()
    if args.run_only:
        runner = CONTENDERS["run_tool_loop" if args.run_only == "engine" else "hand-written loop"]

        async def run_only() -> None:
            usage = not args.no_usage
            await runner(MemoryProvider(script(1, usage)), CountingChannel())
            passes = script(args.size, usage)
            for _ in range(args.turns):
                await runner(MemoryProvider(passes), CountingChannel())

        asyncio.run(run_only())
    else:
        asyncio.run(main(args.turns, args.rounds))
