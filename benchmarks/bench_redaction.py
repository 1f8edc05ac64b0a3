"""What key redaction costs a generation turn whose result holds no piece of a key.

`run_generation_turn` redacts every result before it leaves the outer tier: a key, or any
8-character run of one, quoted anywhere in it is replaced. A result with nothing to redact
(the usual case) gets one quick look: its texts gathered once, a substring test for the keys'
blocks, the pattern only if a block is there; no conversion. This script measures:

* the same turns (T1, T10 of `bench_tool_loop.py`) run by `run_generation_turn` with a model
  holding two API keys (redaction on) and without keys (nothing to redact, so no look at
  all): CPU per turn, medians of interleaved rounds, and the ratio with/without;
* one quick look on its own (a keyed turn takes one per attempt and one of its whole result,
  which searches only the texts the attempts' looks did not), on each turn's result and on a
  long one (200 tool rounds), in µs and as a share of the turn;
* the stream mask on its own (`Secrets.stream_mask`, what a keyed turn's stream read hands
  every chunk through, and `Secrets.masked`, the iterator a watched turn reads; a turn
  without keys does neither): ns per chunk over plain iteration, for text that holds no
  piece of a key;
* for contrast, a turn whose model quotes a piece of a key: masked in its stream, so its
  result is again clean.

    python benchmarks/bench_redaction.py [--turns N] [--rounds R]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

from bench_tool_loop import REQUEST
from bench_tool_loop import TOOLS
from bench_tool_loop import Chunk
from bench_tool_loop import CountingChannel
from bench_tool_loop import MemoryProvider
from bench_tool_loop import t1_script
from bench_tool_loop import t10_script
from bench_tool_loop import text_chunks

from toolloop_fsm import Attempt
from toolloop_fsm import FunctionCall
from toolloop_fsm import GenerationTurnResult
from toolloop_fsm import TextDelta
from toolloop_fsm import UsageReport
from toolloop_fsm import run_generation_turn
from toolloop_fsm.providers._secrecy import fragment_pattern
from toolloop_fsm.pump.redaction import Secrets
from toolloop_fsm.pump.redaction import may_hold_key

KEYS = ("sk-bench-4f9Qz2LmX8vTnR7c", "sk-bench-Hy3Wd6PaKs1JeB0u")


def long_script(rounds: int) -> list[list[Chunk]]:
    """``rounds`` tool rounds of 20 chunks each, then a short answer: a long result."""
    passes: list[list[Chunk]] = [
        [*text_chunks(20), FunctionCall("lookup", {"q": f"x{i}"}, f"c{i}"), UsageReport(5, 5)]
        for i in range(rounds)
    ]
    return [*passes, [*text_chunks(20), UsageReport(5, 5)]]


async def generation_turn(script: Sequence[Sequence[Chunk]], keys: tuple[str, ...]) -> float:
    """CPU seconds of one generation turn over ``script``; with ``keys``, the model is built
    by a factory for each key, as a keyed model is."""

    def per_key(key: str | None) -> MemoryProvider:
        return MemoryProvider(script)

    attempt = Attempt(per_key, keys=keys) if keys else Attempt(MemoryProvider(script))
    started = time.process_time()
    result = await run_generation_turn([attempt], TOOLS, CountingChannel(), REQUEST)
    elapsed = time.process_time() - started
    assert result.final_text, result.error_message
    return elapsed


async def per_turn(script: Sequence[Sequence[Chunk]], keys: tuple[str, ...], turns: int) -> float:
    total = 0.0
    for _ in range(turns):
        total += await generation_turn(script, keys)
    return total / turns * 1e6


async def compare(label: str, script: list[list[Chunk]], turns: int, rounds: int) -> None:
    await per_turn(script, KEYS, turns // 5)  # warm up
    keyed: list[float] = []
    bare: list[float] = []
    for _ in range(rounds):
        bare.append(await per_turn(script, (), turns))
        keyed.append(await per_turn(script, KEYS, turns))
    ratios = sorted(k / b for k, b in zip(keyed, bare, strict=True))
    print(
        f"  {label}: no keys {statistics.median(bare):8.1f} µs   two keys "
        f"{statistics.median(keyed):8.1f} µs   ratio {statistics.median(ratios):.3f}x "
        f"(rounds {ratios[0]:.3f}–{ratios[-1]:.3f})"
    )


async def final_result(script: Sequence[Sequence[Chunk]]) -> GenerationTurnResult:
    return await run_generation_turn(
        [Attempt(MemoryProvider(script))], TOOLS, CountingChannel(), REQUEST
    )


def time_call(call: Callable[[], object], repeat: int) -> float:
    """Median µs of ``call`` over ``repeat`` runs."""
    times: list[float] = []
    for _ in range(repeat):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


async def quick_look(turns: int) -> None:
    leak = fragment_pattern(KEYS)
    assert leak is not None
    for label, script in (
        ("T1", t1_script()),
        ("T10", t10_script()),
        ("200 tool rounds", long_script(200)),
    ):
        result = await final_result(script)
        assert not may_hold_key(result, KEYS, leak)

        def look_once(result: GenerationTurnResult = result) -> bool:
            return may_hold_key(result, KEYS, leak)

        look = time_call(look_once, turns)
        turn = statistics.median([await per_turn(script, (), 1) for _ in range(turns // 10 + 5)])
        print(
            f"  {label}: the quick look {look:7.1f} µs, {look / turn:6.2%} of the turn "
            f"({turn:,.0f} µs)"
        )
    leaky = long_script(20)
    leaky[-1] = [TextDelta(f"the key was {KEYS[0][3:15]}"), UsageReport(5, 5)]
    keyed = await per_turn(leaky, KEYS, 20)
    bare = await per_turn(leaky, (), 20)
    print(
        f"  for contrast, a 20-round turn whose model quotes 12 characters of a key: masked "
        f"in its stream, {keyed - bare:+.0f} µs on a {bare:,.0f} µs turn"
    )


async def stream_mask(chunks: int, rounds: int) -> None:
    """ns per chunk the stream mask adds to reading ``chunks`` text chunks holding no piece
    of a key: chunks ending in a space (no piece begins with it: one dict lookup), and
    chunks ending in a digit the keys hold (the tail is looked up; some digits begin a
    piece, so those chunks' last character is held and goes out with the next). Both as a
    keyed turn reads (each chunk handed through `Secrets.stream_mask` by the read itself)
    and as a watched one does (`Secrets.masked`, an iterator before the observer's tap)."""
    secrets = Secrets(KEYS)
    for label, script in (
        ("ending in a space", [TextDelta(f"w{i % 10:02d} ") for i in range(chunks)]),
        ("ending in a key's character", [TextDelta(f" w{i % 10:02d}") for i in range(chunks)]),
    ):

        async def plain(script: list[TextDelta] = script) -> Any:
            for chunk in script:
                yield chunk

        async def read(how: str) -> float:
            started = time.perf_counter()
            if how == "iterator":
                async for _ in secrets.masked(plain()):
                    pass
            elif how == "read":  # as the pump's stream read hands chunks through
                mask = secrets.stream_mask()
                async for chunk in plain():
                    if mask.held:
                        mask.release_before(chunk)
                    mask.admit(chunk)
                mask.release()
            else:
                async for _ in plain():
                    pass
            return time.perf_counter() - started

        for how in ("read", "iterator"):
            added: list[float] = []
            for _ in range(rounds):
                bare = statistics.median([await read("plain") for _ in range(20)])
                masked = statistics.median([await read(how) for _ in range(20)])
                added.append((masked - bare) / len(script) * 1e9)
            print(
                f"  text chunks {label}, {how:8}: {statistics.median(added):6.0f} ns a chunk "
                f"over plain iteration (rounds {min(added):.0f}–{max(added):.0f})"
            )


async def main(turns: int, rounds: int) -> None:
    print(f"Generation turns with and without keys, {rounds} interleaved rounds of {turns}:")
    await compare("T1 ", t1_script(), turns, rounds)
    await compare("T10", t10_script(), turns, rounds)
    print("The quick look on a clean result (median of runs):")
    await quick_look(turns)
    print("The stream mask of a keyed turn:")
    await stream_mask(400, rounds)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    asyncio.run(main(args.turns, args.rounds))
