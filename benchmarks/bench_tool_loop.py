"""CPU and memory cost of `run_tool_loop` against a hand-written asyncio loop (the floor).

Turns:
  T1  — 400 text chunks of ~4 characters, one tool call, then a 100-chunk final answer.
  T5  — five tool rounds (80 chunks and a call each), then the final answer.
  T10 — ten tool rounds (40 chunks and a call each), then a 40-chunk final answer.

Both contenders stream the same pre-built chunk objects from an in-memory provider,
deliver text to the same channel, run the same tool, and send the history back; the
hand-written loops are the floor, not a rival engine (the same-work one keeps the deadlines
and checks the host's signals, the minimal one does neither).

Figures are CPU microseconds per turn (process time). Each round measures the floor and the
engine back to back; a figure is the median over the rounds, and a ratio the median of the
per-round ratios (so a burst of load from other processes hits both sides of a ratio alike).
Only the ratios are meaningful on a shared machine. Also printed:

* the same T1 turn over a channel that suspends on every send (real channels do);
* per-piece costs, from differences between turns that differ in one piece only: per chunk
  (no delivery), per 200-character delivery, per tool round, and the fixed cost of a turn;
* the cost of watching a turn live: `stream_tool_loop` with every event consumed;
* memory per concurrent turn (tracemalloc, 1,000 turns alive at once under `asyncio.gather`),
  parked before the first chunk and parked mid-stream (after 200 of T1's 400 chunks).

    python benchmarks/bench_tool_loop.py [--turns N] [--rounds R]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time
import tracemalloc
from collections.abc import AsyncIterator
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Coroutine
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import attrs

from toolloop_fsm import FunctionCall
from toolloop_fsm import LoopPolicy
from toolloop_fsm import ProviderRequest
from toolloop_fsm import TextDelta
from toolloop_fsm import Tool
from toolloop_fsm import ToolContext
from toolloop_fsm import ToolRegistry
from toolloop_fsm import ToolResult
from toolloop_fsm import TurnRequest
from toolloop_fsm import TurnSignals
from toolloop_fsm import UsageReport
from toolloop_fsm import run_tool_loop
from toolloop_fsm.host import LoopClock
from toolloop_fsm.provider import ToolSpec
from toolloop_fsm.result import Notice
from toolloop_fsm.stream import TurnEnded
from toolloop_fsm.stream import stream_tool_loop

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


def t10_script() -> list[list[Chunk]]:
    rounds: list[list[Chunk]] = [
        [*text_chunks(40), FunctionCall("lookup", {"q": f"x{i}"}, f"c{i}"), UsageReport(10, 20)]
        for i in range(10)
    ]
    return [*rounds, [*text_chunks(40), UsageReport(20, 25)]]


#: Turns that differ from ``PIECE_BASE`` in one piece only (see `pieces`).
PIECE_CHUNKS = 400
PIECE_ROUNDS = 10
NO_FLUSH = 10**9


def piece_base_script() -> list[list[Chunk]]:
    """The smallest turn: one chunk of text, no tool; its cost is the fixed cost of a turn."""
    return [[*text_chunks(1), UsageReport(1, 1)]]


def piece_chunks_script() -> list[list[Chunk]]:
    """The smallest turn plus ``PIECE_CHUNKS`` chunks (1,604 characters in all)."""
    return [[*text_chunks(1 + PIECE_CHUNKS), UsageReport(1, 1)]]


def piece_rounds_script() -> list[list[Chunk]]:
    """The smallest turn plus ``PIECE_ROUNDS`` tool rounds of one chunk and a call each."""
    rounds: list[list[Chunk]] = [
        [*text_chunks(1), FunctionCall("lookup", {"q": f"x{i}"}, f"c{i}"), UsageReport(1, 1)]
        for i in range(PIECE_ROUNDS)
    ]
    return [*rounds, *piece_base_script()]


class Parking:
    """Holds turns alive at one point of their first pass: ``after`` chunks in, each turn
    counts itself parked and waits for the gate."""

    def __init__(self, after: int) -> None:
        self.after = after
        self.gate = asyncio.Event()
        self.parked = 0


class MemoryProvider:
    """Streams pre-built passes; optionally parks the first pass (to hold turns alive)."""

    name = "memory"

    def __init__(self, passes: Sequence[Sequence[Chunk]], parking: Parking | None = None):
        self.passes = passes
        self.parking = parking
        self.calls = 0

    def stream(self, request: ProviderRequest) -> AsyncIterator[Chunk]:
        index = self.calls
        self.calls += 1
        chunks = self.passes[index] if index < len(self.passes) else ()
        if self.parking is not None and index == 0:
            return self._play_parked(chunks, self.parking)
        return self._play(chunks)

    async def _play(self, chunks: Sequence[Chunk]) -> AsyncIterator[Chunk]:
        for chunk in chunks:
            yield chunk

    async def _play_parked(self, chunks: Sequence[Chunk], parking: Parking) -> AsyncIterator[Chunk]:
        for chunk in chunks[: parking.after]:
            yield chunk
        parking.parked += 1
        await parking.gate.wait()
        for chunk in chunks[parking.after :]:
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


class SuspendingChannel(CountingChannel):
    """A channel whose sends give the event loop a turn, as a real network channel's do."""

    async def send_text(self, text: str) -> None:
        await asyncio.sleep(0)
        self.sent += len(text)

    async def send_expression(self, expression: str) -> None:
        await asyncio.sleep(0)
        self.sent += 1


async def lookup(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
    return ToolResult(data={"answer": 42, "q": arguments.get("q")}, message="found")


TOOLS = ToolRegistry([Tool("lookup", "look something up", {"type": "object"}, lookup)])
SIGNALS = TurnSignals()
REQUEST = TurnRequest([{"role": "user", "content": "hello"}])


def awaitable(result: Awaitable[ToolResult] | ToolResult) -> Awaitable[ToolResult]:
    """The benchmark's one tool is async; this narrows the handler type for the checker."""
    assert not isinstance(result, ToolResult)
    return result


async def handwritten_turn(
    provider: MemoryProvider, channel: CountingChannel, flush_chars: int = FLUSH_CHARS
) -> str:
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
                if buffered >= flush_chars:
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
        result = await asyncio.wait_for(awaitable(tool.handler(dict(call.arguments), ctx)), 300)
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


@attrs.frozen
class StreamedPass:
    """A pass the same-work floor has streamed to its end: which pass of the turn, its text,
    its calls in emitted order and its usage."""

    iteration: int
    text: str
    calls: list[FunctionCall]
    usage: tuple[int, int] | None


#: What the same-work floor does once a pass has streamed (under its policy, with the turn's
#: history): run the calls and append them to the history (true), or end the turn with the
#: pass's text (false).
PassAnswer = Callable[[LoopPolicy, StreamedPass, list[dict[str, Any]]], Awaitable[bool]]


async def answer_first_call(
    policy: LoopPolicy, streamed: StreamedPass, history: list[dict[str, Any]]
) -> bool:
    """Run the pass's first call under the tool deadline, as a single-call loop does."""
    if not streamed.calls:
        return False
    call = streamed.calls[0]
    tool = TOOLS.get(call.name)
    assert tool is not None
    ctx = ToolContext(call.name, streamed.iteration, streamed.iteration, LoopClock())
    result = await asyncio.wait_for(
        awaitable(tool.handler(dict(call.arguments), ctx)), policy.tool_timeout
    )
    history.append(
        {
            "call": call,
            "result": result,
            "pre_tool_text": streamed.text or None,
            "usage": streamed.usage,
        }
    )
    return True


async def handwritten_same_work_turn(
    provider: MemoryProvider,
    channel: CountingChannel,
    flush_chars: int = FLUSH_CHARS,
    *,
    policy: LoopPolicy | None = None,
    tools: Sequence[ToolSpec] = (),
    answer: PassAnswer = answer_first_call,
) -> str:
    """The hand-written loop doing the same work as the engine: the minimal loop above plus
    the first-token and rolling inactivity deadlines on every pass, the tool deadline, and
    the host's stop / follow-up flags checked between chunks. ``answer`` runs a pass's calls
    (by default its first call); `bench_tool_batches` and `bench_tool_rounds_scaling` give
    their own, with their policy (``delivery_flush_chars`` then comes from it) and tools."""
    if policy is None:
        policy = LoopPolicy(delivery_flush_chars=flush_chars)
    signals = SIGNALS
    seen = signals.follow_ups
    history: list[dict[str, Any]] = []
    context = list(REQUEST.context)
    task = asyncio.current_task()
    assert task is not None
    for iteration in range(policy.max_function_call_iterations):
        parts: list[str] = []
        buffer: list[str] = []
        buffered = 0
        calls: list[FunctionCall] = []
        usage: tuple[int, int] | None = None
        request = ProviderRequest(context, tools=tools, history=tuple(history))  # type: ignore[arg-type]
        watchdog = StreamWatchdog(
            task, policy.effective_first_token_timeout, policy.inactivity_timeout
        )
        now = watchdog.loop.time
        # the per-chunk body repeats the minimal loop's on purpose, and the pass is not a
        # function of its own: a hand-written loop inlines them, and a shared helper would
        # add a call per chunk (and a coroutine frame per parked turn) to the floor
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
                    if buffered >= policy.delivery_flush_chars:
                        await channel.send_text("".join(buffer))
                        buffer.clear()
                        buffered = 0
                elif kind is FunctionCall:
                    calls.append(chunk)
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
        if not await answer(policy, StreamedPass(iteration, text, calls, usage), history):
            return text
    return ""


async def engine_turn(
    provider: MemoryProvider, channel: CountingChannel, flush_chars: int = FLUSH_CHARS
) -> str:
    policy = None if flush_chars == FLUSH_CHARS else LoopPolicy(delivery_flush_chars=flush_chars)
    result = await run_tool_loop(provider, TOOLS, channel, REQUEST, policy=policy)
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
#: A contender that takes the flush size (every contender here does, defaulting to the policy's).
FlushRunner = Callable[[MemoryProvider, CountingChannel, int], Awaitable[str]]


def flushing_at(runner: FlushRunner, flush_chars: int) -> Runner:
    """The contender delivering text in batches of ``flush_chars`` characters."""

    async def run(provider: MemoryProvider, channel: CountingChannel) -> str:
        return await runner(provider, channel, flush_chars)

    return run


async def cpu_per_turn(
    runner: Runner,
    script: list[list[Chunk]],
    turns: int,
    channel_type: type[CountingChannel] = CountingChannel,
) -> float:
    start = time.process_time()
    for _ in range(turns):
        await runner(MemoryProvider(script), channel_type())
    return (time.process_time() - start) / turns * 1e6


async def memory_per_turn(
    runner: Runner, script: list[list[Chunk]], turns: int, park_after: int = 0
) -> float:
    """Bytes allocated per turn while ``turns`` turns are parked ``park_after`` chunks into
    their first pass."""
    parking = Parking(park_after)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    tasks = [
        asyncio.ensure_future(runner(MemoryProvider(script, parking), CountingChannel()))
        for _ in range(turns)
    ]
    while parking.parked < turns:  # every turn reaches the parking point and waits there
        await asyncio.sleep(0)
    alive = tracemalloc.get_traced_memory()[0] - base
    parking.gate.set()
    await asyncio.gather(*tasks)
    tracemalloc.stop()
    return alive / turns


def spread(ratios: list[float]) -> str:
    ordered = sorted(ratios)
    return f"ratio {statistics.median(ordered):4.2f}x (rounds {ordered[0]:.2f}–{ordered[-1]:.2f})"


async def compare(
    label: str,
    floor: Runner,
    script: list[list[Chunk]],
    turns: int,
    rounds: int,
    channel_type: type[CountingChannel] = CountingChannel,
) -> tuple[float, float]:
    """Print and return the median CPU per turn of the floor and of the engine."""
    await cpu_per_turn(floor, script, turns // 5, channel_type)  # warm both paths up
    await cpu_per_turn(engine_turn, script, turns // 5, channel_type)
    floors: list[float] = []
    engines: list[float] = []
    for _ in range(rounds):
        floors.append(await cpu_per_turn(floor, script, turns, channel_type))
        engines.append(await cpu_per_turn(engine_turn, script, turns, channel_type))
    ratios = [e / f for e, f in zip(engines, floors, strict=True)]
    floor_median, engine_median = statistics.median(floors), statistics.median(engines)
    print(
        f"  {label}: floor {floor_median:7.1f} µs   run_tool_loop {engine_median:7.1f} µs"
        f"   {spread(ratios)}"
    )
    return floor_median, engine_median


async def pieces(floor: FlushRunner, turns: int, rounds: int) -> None:
    """Per-piece CPU cost, floor and engine, each a median over rounds of a difference
    between two turns measured in the same round."""
    # 401 chunks of 4 characters: 8 deliveries of 200 characters mid-pass, where the
    # no-flush turn delivers nothing until the pass ends (both deliver the rest then)
    deliveries = (1 + PIECE_CHUNKS) * 4 // FLUSH_CHARS
    contenders: dict[str, tuple[Runner, Runner]] = {
        "floor": (flushing_at(floor, FLUSH_CHARS), flushing_at(floor, NO_FLUSH)),
        "engine": (flushing_at(engine_turn, FLUSH_CHARS), flushing_at(engine_turn, NO_FLUSH)),
    }
    measured: dict[str, dict[str, list[float]]] = {
        name: {"fixed": [], "chunk": [], "delivery": [], "round": []} for name in contenders
    }
    for runner, no_flush in contenders.values():  # warm up
        await cpu_per_turn(no_flush, piece_chunks_script(), turns // 5)
        await cpu_per_turn(runner, piece_rounds_script(), turns // 5)
    for _ in range(rounds):
        for name, (runner, no_flush) in contenders.items():
            base = await cpu_per_turn(runner, piece_base_script(), turns)
            chunks = await cpu_per_turn(no_flush, piece_chunks_script(), turns)
            delivered = await cpu_per_turn(runner, piece_chunks_script(), turns)
            with_rounds = await cpu_per_turn(runner, piece_rounds_script(), turns)
            figures = measured[name]
            figures["fixed"].append(base)
            figures["chunk"].append((chunks - base) / PIECE_CHUNKS)
            figures["delivery"].append((delivered - chunks) / deliveries)
            figures["round"].append((with_rounds - base) / PIECE_ROUNDS)
    rows = (
        ("per chunk, no delivery", "chunk", 1e3, "ns"),
        (f"per {FLUSH_CHARS}-character delivery", "delivery", 1.0, "µs"),
        ("per tool round", "round", 1.0, "µs"),
        ("fixed cost per turn", "fixed", 1.0, "µs"),
    )
    for title, key, scale, unit in rows:
        floor_value = statistics.median(measured["floor"][key]) * scale
        engine_value = statistics.median(measured["engine"][key]) * scale
        # a hand-written send to a channel that does not wait costs about what joining the
        # text at the end of the pass does: the floor's difference can be nil or below it
        ratio = (
            f"ratio {engine_value / floor_value:4.2f}x"
            if floor_value > 0.05 * engine_value
            else "floor within noise of zero"
        )
        print(
            f"  {title:>27}: floor {floor_value:7.2f} {unit}   run_tool_loop "
            f"{engine_value:7.2f} {unit}   {ratio}"
        )


async def main(turns: int, rounds: int) -> None:
    print(f"CPU per turn (process time), {rounds} interleaved rounds of {turns} turns;")
    print("figures are medians over the rounds, ratio = median of the per-round ratios.")
    floors = (
        ("same-work hand-written loop (deadlines, signals)", handwritten_same_work_turn),
        ("minimal hand-written loop (no deadlines, no signals)", handwritten_turn),
    )
    for title, floor in floors:
        print(f"against the {title}:")
        for label, script in (("T1", t1_script()), ("T5", t5_script()), ("T10", t10_script())):
            await compare(label, floor, script, turns, rounds)
    print("T1 over a channel that suspends on every send (asyncio.sleep(0) a send):")
    quiet = await compare(
        "T1, quiet channel     ", handwritten_same_work_turn, t1_script(), turns, rounds
    )
    suspending = await compare(
        "T1, suspending channel",
        handwritten_same_work_turn,
        t1_script(),
        turns,
        rounds,
        SuspendingChannel,
    )
    print(
        f"  suspending sends add {suspending[0] - quiet[0]:+.1f} µs a turn to the floor, "
        f"{suspending[1] - quiet[1]:+.1f} µs to run_tool_loop"
    )
    print("Per piece, against the same-work hand-written loop (differences between turns):")
    await pieces(handwritten_same_work_turn, turns, rounds)
    print("Watching a turn live (stream_tool_loop, every event consumed) against run_tool_loop:")
    for label, script in (("T1", t1_script()), ("T5", t5_script())):
        await cpu_per_turn(streamed_turn, script, turns // 5)
        plain: list[float] = []
        live: list[float] = []
        for _ in range(rounds):
            plain.append(await cpu_per_turn(engine_turn, script, turns))
            live.append(await cpu_per_turn(streamed_turn, script, turns))
        ratios = [s / p for s, p in zip(live, plain, strict=True)]
        print(
            f"  {label}: run_tool_loop {statistics.median(plain):7.1f} µs"
            f"   stream_tool_loop {statistics.median(live):7.1f} µs   {spread(ratios)}"
        )
    for where, park_after in (("before the first chunk", 0), ("mid-stream, 200 chunks in", 200)):
        print(f"Memory per concurrent turn (1,000 T1 turns parked {where}):")
        engine_mem = await memory_per_turn(engine_turn, t1_script(), 1000, park_after)
        for title, floor in floors:
            floor_mem = await memory_per_turn(floor, t1_script(), 1000, park_after)
            print(
                f"  {title.split(' (')[0]}: {floor_mem / 1024:5.1f} KiB"
                f"   run_tool_loop {engine_mem / 1024:5.1f} KiB"
                f"   ratio {engine_mem / floor_mem:4.2f}x"
            )


def command_line(
    doc: str,
    main: Callable[[int, int], Coroutine[Any, Any, None]],
    contenders: Mapping[str, Runner],
    script: list[list[Chunk]],
    run_only_help: str,
) -> None:
    """A benchmark's command line: ``main(--turns, --rounds)``, or with ``--run-only NAME``
    just ``--turns`` turns of ``script`` by that contender (for a profiler)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--run-only", choices=tuple(contenders), help=run_only_help)
    args = parser.parse_args()
    if args.run_only:
        runner = contenders[args.run_only]

        async def run_only() -> None:
            for _ in range(args.turns):
                await runner(MemoryProvider(script), CountingChannel())

        asyncio.run(run_only())
    else:
        asyncio.run(main(args.turns, args.rounds))


if __name__ == "__main__":
    command_line(
        __doc__,
        main,
        {
            "minimal": handwritten_turn,
            "same-work": handwritten_same_work_turn,
            "engine": engine_turn,
            "stream": streamed_turn,
        },
        t1_script(),
        "just run --turns T1 turns of one contender (for instruction counts under "
        "valgrind --tool=callgrind: subtract a --turns 0 run)",
    )
