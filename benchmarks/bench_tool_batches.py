"""CPU cost of a tool batch in `run_tool_loop`: per call, against single-call rounds and
against a hand-written `asyncio.TaskGroup` batch (the floor).

Turns (every one streams the same 80 text chunks of ~4 characters in all):
  BASE    — one pass of 80 chunks, no tool call.
  BATCH5  — a pass of 40 chunks and 5 calls of a fast tool (one batch), then a 40-chunk answer.
  BATCH1  — the same with 1 call: ``(BATCH5 - BATCH1) / 4`` is what one more call of a batch costs.
  ROUNDS5 — five passes of 8 chunks and one call each (single-call rounds), then the answer.

The figures, each printed with its target and PASS / MISS:
  (a) the engine's cost per call in a batch, ``(BATCH5 - BASE) / 5``, against its cost per
      single-call round, ``(ROUNDS5 - BASE) / 5`` — target: at most 1.0× (the hand-written
      loop's own figure is printed beside it);
  (b) the engine's BATCH5 turn against the same-work hand-written loop running BATCH5 —
      target: at most 2.0×.

The hand-written loop is `bench_tool_loop`'s same-work floor (first-token and rolling
inactivity deadlines on every pass, the host's stop / follow-up flags checked between chunks,
text buffered and delivered in ``delivery_flush_chars`` batches, the history appended)
taught to batch: it keeps every call of a pass and runs them in an `asyncio.TaskGroup`, each
under ``async with asyncio.timeout(tool_timeout)`` and the ``max_parallel_tools`` bound, a
failing or late call answered with a failure instead of cancelling its siblings, every call
answered in emitted order. It runs under one module-level policy.

Both contenders stream the same pre-built chunk objects from an in-memory provider, deliver
text to the same channel and run the same tool. Figures are CPU microseconds (process time).
Each round measures every contender and turn back to back; a figure is the median over the
rounds, and a ratio the median of the per-round ratios (so a burst of load from other
processes hits both sides of a ratio alike), except the per-call lines' engine / hand-written
ratios, which are of the medians (a difference of two turns can be near zero in one round).
Only the ratios mean much on a shared machine. Before measuring, the benchmark checks that
both contenders make the same passes and calls and end with the same text.

    python benchmarks/bench_tool_batches.py [--turns N] [--rounds R]
    python benchmarks/bench_tool_batches.py --run-only engine|floor [--turns N]
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

from bench_tool_loop import REQUEST
from bench_tool_loop import TOOLS
from bench_tool_loop import Chunk
from bench_tool_loop import CountingChannel
from bench_tool_loop import MemoryProvider
from bench_tool_loop import Runner
from bench_tool_loop import StreamedPass
from bench_tool_loop import awaitable
from bench_tool_loop import command_line
from bench_tool_loop import cpu_per_turn
from bench_tool_loop import engine_turn
from bench_tool_loop import handwritten_same_work_turn
from bench_tool_loop import text_chunks

from toolloop_fsm import FunctionCall
from toolloop_fsm import LoopPolicy
from toolloop_fsm import ToolContext
from toolloop_fsm import ToolResult
from toolloop_fsm import UsageReport
from toolloop_fsm import run_tool_loop
from toolloop_fsm.host import LoopClock

BATCH = 5
#: The floor's one policy (the engine runs under the default policy, which this equals).
POLICY = LoopPolicy()
#: Target of figure (a): per call in a batch over per single-call round.
PER_CALL_TARGET = 1.0
#: Target of figure (b): the engine's batch turn over the hand-written batch turn.
FLOOR_TARGET = 2.0


def _call(index: int) -> FunctionCall:
    return FunctionCall("lookup", {"q": f"x{index}"}, f"c{index}")


def base_script() -> list[list[Chunk]]:
    return [[*text_chunks(80), UsageReport(20, 25)]]


def batch_script(calls: int) -> list[list[Chunk]]:
    return [
        [*text_chunks(40), *(_call(i) for i in range(calls)), UsageReport(10, 20)],
        [*text_chunks(40), UsageReport(20, 25)],
    ]


def rounds_script(rounds: int) -> list[list[Chunk]]:
    passes: list[list[Chunk]] = [
        [*text_chunks(40 // rounds), _call(i), UsageReport(10, 20)] for i in range(rounds)
    ]
    return [*passes, [*text_chunks(40), UsageReport(20, 25)]]


SCRIPTS: dict[str, list[list[Chunk]]] = {
    "BASE": base_script(),
    "BATCH1": batch_script(1),
    "BATCH5": batch_script(BATCH),
    "ROUNDS5": rounds_script(BATCH),
}


async def _run_call(
    call: FunctionCall,
    ctx: ToolContext,
    limit: asyncio.Semaphore,
    answers: list[ToolResult],
    position: int,
) -> None:
    """One call of the hand-written batch: bounded, under its deadline, and answered with a
    failure rather than raised (a raise in a TaskGroup would cancel its siblings)."""
    tool = TOOLS.get(call.name)
    if tool is None:
        answers[position] = ToolResult(success=False, message=f"unknown tool {call.name}")
        return
    seconds = tool.timeout if tool.timeout is not None else POLICY.tool_timeout
    async with limit:
        try:
            async with asyncio.timeout(seconds):
                answers[position] = await awaitable(tool.handler(dict(call.arguments), ctx))
        except TimeoutError:
            answers[position] = ToolResult(success=False, message="timed out")
        except Exception as error:
            answers[position] = ToolResult(success=False, message=str(error))


#: What a call of the hand-written batch is answered with until it has run.
NOT_RUN = ToolResult(success=False, message="not run")


async def answer_batch(
    policy: LoopPolicy, streamed: StreamedPass, history: list[dict[str, Any]]
) -> bool:
    """Run every call of the pass at once in an `asyncio.TaskGroup`, under the
    ``max_parallel_tools`` bound, and answer them in emitted order."""
    calls = streamed.calls
    if not calls:
        return False
    # every call dispatched so far has its history entry: the batch's dispatches follow them
    dispatched = len(history)
    clock = LoopClock()
    limit = asyncio.Semaphore(policy.max_parallel_tools)
    answers = [NOT_RUN] * len(calls)
    async with asyncio.TaskGroup() as group:
        for position, call in enumerate(calls):
            ctx = ToolContext(call.name, dispatched + position + 1, streamed.iteration, clock)
            group.create_task(_run_call(call, ctx, limit, answers, position))
    for position, (call, answer) in enumerate(zip(calls, answers, strict=True)):
        history.append(
            {
                "call": call,
                "result": answer,
                "pre_tool_text": (streamed.text or None) if position == 0 else None,
                "position": position,
                "usage": streamed.usage,
            }
        )
    return True


def handwritten_batch_turn(provider: MemoryProvider, channel: CountingChannel) -> Awaitable[str]:
    """`bench_tool_loop.handwritten_same_work_turn` running every call of a pass at once."""
    return handwritten_same_work_turn(provider, channel, policy=POLICY, answer=answer_batch)


CONTENDERS: dict[str, Runner] = {"engine": engine_turn, "floor": handwritten_batch_turn}


def verdict(ratio: float, target: float) -> str:
    if ratio <= target:
        return f"PASS (target ≤ {target:.1f}x)"
    return f"MISS (target ≤ {target:.1f}x, {ratio / target - 1:.0%} over)"


def spread(ratios: list[float]) -> str:
    ordered = sorted(ratios)
    return f"{statistics.median(ordered):4.2f}x (rounds {ordered[0]:.2f}–{ordered[-1]:.2f})"


PER_BATCH_CALL = "per call in a batch of 5, (BATCH5-BASE)/5"
PER_SINGLE_ROUND = "per single-call round, (ROUNDS5-BASE)/5"
#: Per-call figures from one round's turn costs (differences between turns).
PIECES: dict[str, Callable[[Mapping[str, float]], float]] = {
    PER_BATCH_CALL: lambda cost: (cost["BATCH5"] - cost["BASE"]) / BATCH,
    PER_SINGLE_ROUND: lambda cost: (cost["ROUNDS5"] - cost["BASE"]) / BATCH,
    "one more call in a batch, (BATCH5-BATCH1)/4": (
        lambda cost: (cost["BATCH5"] - cost["BATCH1"]) / (BATCH - 1)
    ),
}


#: How many calls and passes each turn makes.
SHAPES = {"BASE": (0, 1), "BATCH1": (1, 2), "BATCH5": (BATCH, 2), "ROUNDS5": (BATCH, BATCH + 1)}


async def check_same_work() -> None:
    """Both contenders stream the same passes and give the same final text on every turn,
    and the engine runs every call of a batch."""
    for name, script in SCRIPTS.items():
        calls, passes = SHAPES[name]
        engine_provider = MemoryProvider(script)
        result = await run_tool_loop(engine_provider, TOOLS, CountingChannel(), REQUEST)
        assert result.tool_dispatches == calls, (name, result.tool_dispatches)
        assert engine_provider.calls == passes, (name, engine_provider.calls)
        floor_provider = MemoryProvider(script)
        floor_text = await handwritten_batch_turn(floor_provider, CountingChannel())
        assert floor_provider.calls == passes, (name, floor_provider.calls)
        assert floor_text == result.final_text, (name, floor_text, result.final_text)


async def main(turns: int, rounds: int) -> None:
    await check_same_work()
    print(f"CPU per turn (process time), {rounds} interleaved rounds of {turns} turns;")
    print("figures are medians over the rounds, ratio = median of the per-round ratios.")
    for runner in CONTENDERS.values():  # warm every path up
        for script in SCRIPTS.values():
            await cpu_per_turn(runner, script, max(1, turns // 5))
    # costs[who][r][name]: the CPU per turn of ``name`` by ``who`` in round ``r``
    costs: dict[str, list[dict[str, float]]] = {who: [] for who in CONTENDERS}
    for _ in range(rounds):
        for who in CONTENDERS:
            costs[who].append({})
        for name, script in SCRIPTS.items():
            for who, runner in CONTENDERS.items():
                costs[who][-1][name] = await cpu_per_turn(runner, script, turns)

    def ratios(top: list[float], bottom: list[float]) -> list[float]:
        return [t / b for t, b in zip(top, bottom, strict=True)]

    print("Whole turns:")
    for name in SCRIPTS:
        engine = [cost[name] for cost in costs["engine"]]
        floor = [cost[name] for cost in costs["floor"]]
        print(
            f"  {name:>7}: hand-written {statistics.median(floor):7.1f} µs"
            f"   run_tool_loop {statistics.median(engine):7.1f} µs"
            f"   ratio {spread(ratios(engine, floor))}"
        )
    print("Per call (µs, differences between turns of the same round):")
    figures: dict[str, dict[str, list[float]]] = {}
    for title, piece in PIECES.items():
        figures[title] = {who: [piece(cost) for cost in costs[who]] for who in CONTENDERS}
        by_hand = statistics.median(figures[title]["floor"])
        by_engine = statistics.median(figures[title]["engine"])
        # a difference of two noisy turns can come out near zero in one round: the ratio is
        # of the medians, as bench_tool_loop's per-piece figures are
        print(
            f"  {title:>44}: hand-written {by_hand:6.1f} µs   run_tool_loop {by_engine:6.1f} µs"
            f"   ratio {by_engine / by_hand:4.2f}x"
        )
    print("Targets:")
    ratios_a = ratios(figures[PER_BATCH_CALL]["engine"], figures[PER_SINGLE_ROUND]["engine"])
    ratio_a = statistics.median(ratios_a)
    print(
        f"  (a) run_tool_loop per call in a batch / per single-call round: {spread(ratios_a)}"
        f"   {verdict(ratio_a, PER_CALL_TARGET)}"
    )
    floor_a = ratios(figures[PER_BATCH_CALL]["floor"], figures[PER_SINGLE_ROUND]["floor"])
    print(f"      (the hand-written loop's own figure: {spread(floor_a)})")
    ratios_b = ratios(
        [cost["BATCH5"] for cost in costs["engine"]], [cost["BATCH5"] for cost in costs["floor"]]
    )
    ratio_b = statistics.median(ratios_b)
    print(
        f"  (b) run_tool_loop BATCH5 turn / hand-written TaskGroup batch: {spread(ratios_b)}"
        f"   {verdict(ratio_b, FLOOR_TARGET)}"
    )


if __name__ == "__main__":
    command_line(
        __doc__,
        main,
        CONTENDERS,
        SCRIPTS["BATCH5"],
        "just run --turns BATCH5 turns of one contender (for cProfile or callgrind)",
    )
