"""CPU and memory cost of `run_tool_loop` against a hand-written asyncio loop (the floor).

Turns:
  T1 — 400 text chunks of ~4 characters, one tool call, then a 100-chunk final answer.
  T5 — five tool rounds (80 chunks and a call each), then the final answer.

Both contenders stream the same pre-built chunk objects from an in-memory provider,
deliver text to the same channel, run the same tool, and send the history back; the
hand-written loop has no deadlines or signals (it is the floor, not a rival engine).
Figures are CPU microseconds per turn (process time, best of several rounds) and memory per
concurrent turn (tracemalloc, 1,000 turns alive at once under `asyncio.gather`). Both are
measured in this run; only the ratios are meaningful on a shared machine. Last, the cost of
watching a turn live: `stream_tool_loop` with every event consumed, against `run_tool_loop`.

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
    TurnSignals,
    UsageReport,
    run_tool_loop,
)
from toolloop_fsm.host import LoopClock
from toolloop_fsm.result import Notice
from toolloop_fsm.stream import TurnEnded, stream_tool_loop

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
SIGNALS = TurnSignals()
REQUEST = TurnRequest([{"role": "user", "content": "hello"}])


def _awaitable(result: Awaitable[ToolResult] | ToolResult) -> Awaitable[ToolResult]:
    """The benchmark's one tool is async; this narrows the handler type for the checker."""
    assert not isinstance(result, ToolResult)
    return result


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
        result = await asyncio.wait_for(_awaitable(tool.handler(dict(call.arguments), ctx)), 300)
        history.append(
            {"call": call, "result": result, "pre_tool_text": text or None, "usage": usage}
        )
    return ""


class StreamWatchdog:
    """The careful hand-written way to bound a stream: one timer per pass that, when it
    wakes, checks the time of the last chunk (first-token budget until the first chunk,
    then the rolling inactivity budget) instead of re-arming a timer for every chunk."""

    def __init__(self, task: asyncio.Task[Any], first: float, inactivity: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.task = task
        self.first = first
        self.inactivity = inactivity
        self.started = self.loop.time()
        self.last_chunk: float | None = None
        self.expired = False
        self.handle = self.loop.call_later(min(first, inactivity), self.wake)

    def wake(self) -> None:
        now = self.loop.time()
        if self.last_chunk is None:
            due = self.started + self.first
        else:
            due = self.last_chunk + self.inactivity
        if due > now:
            self.handle = self.loop.call_later(due - now, self.wake)
            return
        self.expired = True
        self.task.cancel()

    def close(self) -> None:
        self.handle.cancel()


async def handwritten_same_work_turn(provider: MemoryProvider, channel: CountingChannel) -> str:
    """The hand-written loop doing the same work as the engine: the minimal loop above plus
    the first-token and rolling inactivity deadlines on every pass, the tool deadline, and
    the host's stop / follow-up flags checked between chunks."""
    policy = LoopPolicy()
    signals = SIGNALS
    seen = signals.follow_ups
    history: list[dict[str, Any]] = []
    context = list(REQUEST.context)
    task = asyncio.current_task()
    assert task is not None
    for _iteration in range(policy.max_function_call_iterations):
        parts: list[str] = []
        buffer: list[str] = []
        buffered = 0
        call: FunctionCall | None = None
        usage: tuple[int, int] | None = None
        request = ProviderRequest(context, tools=(), history=tuple(history))  # type: ignore[arg-type]
        watchdog = StreamWatchdog(
            task, policy.effective_first_token_timeout, policy.inactivity_timeout
        )
        now = watchdog.loop.time
        # the per-chunk body repeats the minimal loop's on purpose: a hand-written loop inlines
        # it, and a shared helper would add a call per chunk to the floor
        try:
            async for chunk in provider.stream(request):
                watchdog.last_chunk = now()
                if signals.stop_requested or signals.follow_ups != seen:
                    return "".join(parts)
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
        except asyncio.CancelledError:
            if not watchdog.expired:
                raise
            task.uncancel()
            return "".join(parts)
        finally:
            watchdog.close()
        if buffer:
            await channel.send_text("".join(buffer))
        text = "".join(parts)
        if call is None:
            return text
        tool = TOOLS.get(call.name)
        assert tool is not None
        ctx = ToolContext(call.name, _iteration, _iteration, LoopClock())
        result = await asyncio.wait_for(
            _awaitable(tool.handler(dict(call.arguments), ctx)), policy.tool_timeout
        )
        history.append(
            {"call": call, "result": result, "pre_tool_text": text or None, "usage": usage}
        )
    return ""


async def engine_turn(provider: MemoryProvider, channel: CountingChannel) -> str:
    result = await run_tool_loop(provider, TOOLS, channel, REQUEST)
    return result.final_text


async def streamed_turn(provider: MemoryProvider, channel: CountingChannel) -> str:
    """The same turn watched live: every chunk and phase event consumed as it comes."""
    text = ""
    async with stream_tool_loop(provider, TOOLS, channel, REQUEST) as events:
        async for event in events:
            if type(event) is TurnEnded:
                text = event.result.final_text
    return text


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


async def compare(label: str, floor: Runner, script: list[list[Chunk]], turns: int,
                  rounds: int) -> None:  # fmt: skip
    await cpu_per_turn(floor, script, turns // 5)  # warm both paths up
    await cpu_per_turn(engine_turn, script, turns // 5)
    floors: list[float] = []
    engines: list[float] = []
    for _ in range(rounds):
        floors.append(await cpu_per_turn(floor, script, turns))
        engines.append(await cpu_per_turn(engine_turn, script, turns))
    ratios = sorted(e / f for e, f in zip(engines, floors, strict=True))
    print(
        f"  {label}: floor {statistics.median(floors):7.1f} µs"
        f"   run_tool_loop {statistics.median(engines):7.1f} µs"
        f"   ratio {statistics.median(ratios):4.2f}x (rounds {ratios[0]:.2f}–{ratios[-1]:.2f})"
    )


async def main(turns: int, rounds: int) -> None:
    print(f"CPU per turn (process time), {rounds} interleaved rounds of {turns} turns;")
    print("ratio = median of the per-round ratios (each round measures both).")
    floors = (
        ("same-work hand-written loop (deadlines, signals)", handwritten_same_work_turn),
        ("minimal hand-written loop (no deadlines, no signals)", handwritten_turn),
    )
    for title, floor in floors:
        print(f"against the {title}:")
        for label, script in (("T1", t1_script()), ("T5", t5_script())):
            await compare(label, floor, script, turns, rounds)
    print("Watching a turn live (stream_tool_loop, every event consumed) against run_tool_loop:")
    for label, script in (("T1", t1_script()), ("T5", t5_script())):
        await cpu_per_turn(streamed_turn, script, turns // 5)
        plain: list[float] = []
        live: list[float] = []
        for _ in range(rounds):
            plain.append(await cpu_per_turn(engine_turn, script, turns))
            live.append(await cpu_per_turn(streamed_turn, script, turns))
        ratios = sorted(s / p for s, p in zip(live, plain, strict=True))
        print(
            f"  {label}: run_tool_loop {statistics.median(plain):7.1f} µs"
            f"   stream_tool_loop {statistics.median(live):7.1f} µs"
            f"   ratio {statistics.median(ratios):4.2f}x (rounds {ratios[0]:.2f}–{ratios[-1]:.2f})"
        )
    print("Memory per concurrent turn (1,000 T1 turns alive under asyncio.gather):")
    engine_mem = await memory_per_turn(engine_turn, t1_script(), 1000)
    for title, floor in floors:
        floor_mem = await memory_per_turn(floor, t1_script(), 1000)
        print(
            f"  {title.split(' (')[0]}: {floor_mem / 1024:5.1f} KiB"
            f"   run_tool_loop {engine_mem / 1024:5.1f} KiB   ratio {engine_mem / floor_mem:4.2f}x"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument(
        "--run-only",
        choices=("minimal", "same-work", "engine", "stream"),
        help="just run --turns T1 turns of one contender (for instruction counts under "
        "valgrind --tool=callgrind: subtract a --turns 0 run)",
    )
    args = parser.parse_args()
    if args.run_only:
        runner = {
            "minimal": handwritten_turn,
            "same-work": handwritten_same_work_turn,
            "engine": engine_turn,
            "stream": streamed_turn,
        }[args.run_only]

        async def run_only() -> None:
            script = t1_script()
            for _ in range(args.turns):
                await runner(MemoryProvider(script), CountingChannel())

        asyncio.run(run_only())
    else:
        asyncio.run(main(args.turns, args.rounds))
