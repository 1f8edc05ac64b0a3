"""CPU and memory cost of `run_tool_loop` against a hand-written asyncio loop (the floor).

Turns:
  T1 — 400 text chunks of ~4 characters, one tool call, then a 100-chunk final answer.
  T5 — five tool rounds (80 chunks and a call each), then the final answer.

Both contenders stream the same pre-built chunk objects from an in-memory provider,
deliver text to the same channel, run the same tool, and send the history back; the
hand-written loop has no deadlines or signals (it is the floor, not a rival engine).
Figures are CPU microseconds per turn (process time, best of several rounds) and memory per
concurrent turn (tracemalloc, 1,000 turns alive at once under `asyncio.gather`). Both are
measured in this run; only the ratios are meaningful on a shared machine.

    python benchmarks/bench_tool_loop.py [--turns N] [--rounds R]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from toolloop_fsm import (
    FunctionCall,
    LoopPolicy,
    ProviderRequest,
    TextDelta,
    Tool,
    ToolContext,
    ToolRegistry,
    ToolResult,
    TurnRequest,
    UsageReport,
    run_tool_loop,
)
from toolloop_fsm.host import LoopClock
from toolloop_fsm.result import Notice

Chunk = Any
FLUSH_CHARS = LoopPolicy().delivery_flush_chars


def text_chunks(count: int) -> list[TextDelta]:
    return [TextDelta(f"w{i % 10:02d} ") for i in range(count)]


def t1_script() -> list[list[Chunk]]:
    return [
        [*text_chunks(400), FunctionCall("lookup", {"q": "x"}, "c1"), UsageReport(10, 100)],
        [*text_chunks(100), UsageReport(20, 25)],
    ]


def t5_script() -> list[list[Chunk]]:
    rounds: list[list[Chunk]] = [
        [*text_chunks(80), FunctionCall("lookup", {"q": f"x{i}"}, f"c{i}"), UsageReport(10, 20)]
        for i in range(5)
    ]
    return [*rounds, [*text_chunks(100), UsageReport(20, 25)]]


class MemoryProvider:
    """Streams pre-built passes; optionally waits on a gate (to hold turns alive)."""

    name = "memory"

    def __init__(self, passes: Sequence[Sequence[Chunk]], gate: asyncio.Event | None = None):
        self.passes = passes
        self.gate = gate
        self.calls = 0

    def stream(self, request: ProviderRequest) -> AsyncIterator[Chunk]:
        index = self.calls
        self.calls += 1
        return self._play(self.passes[index] if index < len(self.passes) else ())

    async def _play(self, chunks: Sequence[Chunk]) -> AsyncIterator[Chunk]:
        if self.gate is not None:
            await self.gate.wait()
        for chunk in chunks:
            yield chunk


class CountingChannel:
    def __init__(self) -> None:
        self.sent = 0

    async def send_text(self, text: str) -> None:
        self.sent += len(text)

    async def send_expression(self, expression: str) -> None:
        self.sent += 1

    async def send_notice(self, notice: Notice) -> None:
        pass

    async def queue_front(self, stop_message: str) -> None:
        pass


async def lookup(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
    return ToolResult(data={"answer": 42, "q": arguments.get("q")}, message="found")


TOOLS = ToolRegistry([Tool("lookup", "look something up", {"type": "object"}, lookup)])
REQUEST = TurnRequest([{"role": "user", "content": "hello"}])


async def handwritten_turn(provider: MemoryProvider, channel: CountingChannel) -> str:
    """What a careful hand-written loop does: stream, buffer and deliver text, run the
    first tool call under a timeout, append history, repeat."""
    history: list[dict[str, Any]] = []
    context = list(REQUEST.context)
    for _iteration in range(100):
        parts: list[str] = []
        buffer: list[str] = []
        buffered = 0
        call: FunctionCall | None = None
        usage: tuple[int, int] | None = None
        request = ProviderRequest(context, tools=(), history=tuple(history))  # type: ignore[arg-type]
        async for chunk in provider.stream(request):
            kind = type(chunk)
            if kind is TextDelta:
                parts.append(chunk.text)
                buffer.append(chunk.text)
                buffered += len(chunk.text)
                if buffered >= FLUSH_CHARS:
                    await channel.send_text("".join(buffer))
                    buffer.clear()
                    buffered = 0
            elif kind is FunctionCall:
                if call is None:
                    call = chunk
            elif kind is UsageReport:
                usage = (chunk.input_tokens, chunk.output_tokens)
        if buffer:
            await channel.send_text("".join(buffer))
        text = "".join(parts)
        if call is None:
            return text
        tool = TOOLS.get(call.name)
        assert tool is not None
        ctx = ToolContext(call.name, _iteration, _iteration, LoopClock())
        result = await asyncio.wait_for(tool.handler(dict(call.arguments), ctx), 300)
        history.append(
            {"call": call, "result": result, "pre_tool_text": text or None, "usage": usage}
        )
    return ""


async def engine_turn(provider: MemoryProvider, channel: CountingChannel) -> str:
    result = await run_tool_loop(provider, TOOLS, channel, REQUEST)  # type: ignore[arg-type]
    return result.final_text


Runner = Callable[[MemoryProvider, CountingChannel], Awaitable[str]]


async def cpu_per_turn(runner: Runner, script: list[list[Chunk]], turns: int) -> float:
    start = time.process_time()
    for _ in range(turns):
        await runner(MemoryProvider(script), CountingChannel())
    return (time.process_time() - start) / turns * 1e6


async def memory_per_turn(runner: Runner, script: list[list[Chunk]], turns: int) -> float:
    gate = asyncio.Event()
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    tasks = [
        asyncio.ensure_future(runner(MemoryProvider(script, gate), CountingChannel()))
        for _ in range(turns)
    ]
    for _ in range(5):  # let every turn reach its first provider pass and park on the gate
        await asyncio.sleep(0)
    alive = tracemalloc.get_traced_memory()[0] - base
    gate.set()
    await asyncio.gather(*tasks)
    tracemalloc.stop()
    return alive / turns


async def main(turns: int, rounds: int) -> None:
    print(f"CPU per turn, {rounds} interleaved rounds of {turns} turns each (process time);")
    print("the ratio is the median of the per-round ratios (each round measures both):")
    for label, script in (("T1", t1_script()), ("T5", t5_script())):
        await cpu_per_turn(handwritten_turn, script, turns // 5)  # warm both paths up
        await cpu_per_turn(engine_turn, script, turns // 5)
        hands: list[float] = []
        engines: list[float] = []
        for _ in range(rounds):
            hands.append(await cpu_per_turn(handwritten_turn, script, turns))
            engines.append(await cpu_per_turn(engine_turn, script, turns))
        ratios = sorted(e / h for e, h in zip(engines, hands, strict=True))
        print(
            f"  {label}: hand-written {statistics.median(hands):8.1f} µs"
            f"   run_tool_loop {statistics.median(engines):8.1f} µs"
            f"   ratio {statistics.median(ratios):5.2f}x (rounds {ratios[0]:.2f}–{ratios[-1]:.2f})"
        )
    hand_mem = await memory_per_turn(handwritten_turn, t1_script(), 1000)
    engine_mem = await memory_per_turn(engine_turn, t1_script(), 1000)
    print("Memory per concurrent turn (1,000 T1 turns alive under asyncio.gather):")
    print(
        f"  hand-written {hand_mem / 1024:6.1f} KiB   run_tool_loop {engine_mem / 1024:6.1f} KiB"
        f"   ratio {engine_mem / hand_mem:5.2f}x"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    asyncio.run(main(args.turns, args.rounds))
