"""Whole simulated turns per second for `toolloop-fsm fuzz`, generation included.

The goal (issue #14) is ≥ 2,000 whole turns a second: every turn a fuzzing host runs is
drawn first, so drawing counts. Each round times, one after the other (so that a burst of
load from other processes hits them alike):

* ``fuzz inner``           — `fuzz(LoopPolicy(), examples=N, seed=S)`, exactly what
                             ``toolloop-fsm fuzz --examples N`` runs: Hypothesis draws
                             batches of compact seeds, each expanded into a script, run on a
                             `VirtualClock` and checked against every invariant;
* ``fuzz inner --drafting`` — the same with drafting and the tool checkpoint on;
* ``fuzz outer``           — ``--tier outer`` (one chain per Hypothesis example, drawn with
                             `generation_chains()`), with ``--outer``;
* ``rich strategies``      — the way the fuzzer drew before compact seeds, for comparison:
                             one `turn_scripts()` turn per Hypothesis example, run and
                             checked under the default policy (``--rich-turns`` of them).

Rates are medians over ``--repeat`` rounds, with the spread (slowest–fastest round). Then
one split of a turn of the compact path, measured on its own: Hypothesis drawing the seeds,
expanding them, running the turns (one event loop) and checking the invariants.

    python benchmarks/bench_property_throughput.py [--turns 5000] [--seed 0] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import statistics
import time
from collections.abc import Callable

from hypothesis import HealthCheck
from hypothesis import Phase
from hypothesis import given
from hypothesis import seed
from hypothesis import settings

from toolloop_fsm.fuzz import BATCH_TURNS
from toolloop_fsm.fuzz import fuzz
from toolloop_fsm.policy import LoopPolicy
from toolloop_fsm.policy import TurnPolicy
from toolloop_fsm.testing import TurnScript
from toolloop_fsm.testing import run_script
from toolloop_fsm.testing import turn_scripts
from toolloop_fsm.testing.seeds import seed_batches
from toolloop_fsm.testing.seeds import turn_from_seed

TARGET = 2000.0


def fuzz_rate(tier: str, turns: int, seed_value: int, *, drafting: bool = False) -> float:
    """Whole turns a second of one `fuzz` run, as the CLI runs it."""
    policy = LoopPolicy() if tier == "inner" else TurnPolicy()
    report = fuzz(policy, tier=tier, examples=turns, seed=seed_value, drafting=drafting)
    if report.failure is not None:
        raise SystemExit(f"the fuzz run failed: {report.failure.message}")
    return report.rate


def rich_rate(turns: int, seed_value: int) -> float:
    """Whole turns a second drawing one `turn_scripts()` turn per Hypothesis example."""
    policy = LoopPolicy()
    loop = asyncio.new_event_loop()

    @seed(seed_value)
    @settings(
        max_examples=turns,
        database=None,
        deadline=None,
        derandomize=False,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(turn_scripts())
    def run(script: TurnScript) -> None:
        loop.run_until_complete(run_script(script, policy)).check()

    started = time.perf_counter()
    try:
        run()
    finally:
        loop.close()
    return turns / (time.perf_counter() - started)


def split(turns: int, seed_value: int) -> dict[str, float]:
    """Microseconds a turn of the compact path spends in each part."""
    seeds: list[bytes] = []

    @seed(seed_value)
    @settings(
        max_examples=max(1, turns * 2 // BATCH_TURNS),
        database=None,
        deadline=None,
        derandomize=False,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(seed_batches(BATCH_TURNS))
    def collect(batch: tuple[bytes, ...]) -> None:
        seeds.extend(batch)

    parts: dict[str, float] = {}
    started = time.perf_counter()
    collect()
    parts["Hypothesis drawing the seeds"] = time.perf_counter() - started
    started = time.perf_counter()
    scripts = [turn_from_seed(s) for s in seeds]
    parts["expanding them"] = time.perf_counter() - started
    policy = LoopPolicy()
    parts["running"] = parts["checking"] = 0.0

    async def run_all() -> None:
        clock = time.perf_counter
        for script in scripts:
            started = clock()
            run = await run_script(script, policy)
            checked = clock()
            run.check()
            parts["running"] += checked - started
            parts["checking"] += clock() - checked

    loop = asyncio.new_event_loop()
    try:
        gc.collect()
        loop.run_until_complete(run_all())
    finally:
        loop.close()
    return {part: seconds / len(seeds) * 1e6 for part, seconds in parts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=5000)
    parser.add_argument("--rich-turns", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--outer", action="store_true", help="also time --tier outer")
    args = parser.parse_args()
    # the fuzzed tools raise on purpose; their warnings are not news here (as in the CLI)
    logging.getLogger("toolloop_fsm.tools").addHandler(logging.NullHandler())
    logging.getLogger("toolloop_fsm.tools").propagate = False

    bodies: dict[str, Callable[[], float]] = {
        "fuzz inner": lambda: fuzz_rate("inner", args.turns, args.seed),
        "fuzz inner --drafting": lambda: fuzz_rate("inner", args.turns, args.seed, drafting=True),
    }
    if args.outer:
        bodies["fuzz outer"] = lambda: fuzz_rate("outer", args.turns // 5, args.seed)
    bodies["rich strategies"] = lambda: rich_rate(args.rich_turns, args.seed)
    rates: dict[str, list[float]] = {label: [] for label in bodies}
    ratios: list[float] = []
    for _ in range(args.repeat):
        for label, body in bodies.items():
            gc.collect()
            rates[label].append(body())
        ratios.append(rates["fuzz inner"][-1] / rates["rich strategies"][-1])

    print(
        f"whole simulated turns a second, generation included ({args.repeat} rounds; "
        f"{args.turns} turns a fuzz run, {args.rich_turns} rich ones, seed {args.seed}):"
    )
    for label, values in rates.items():
        median = statistics.median(values)
        verdict = (
            "meets the 2,000/s target"
            if median >= TARGET
            else f"below the 2,000/s target ({median / TARGET:.2f}x of it)"
        )
        print(
            f"{label:>22}: {median:7.0f} /s (rounds {min(values):.0f}–{max(values):.0f})"
            f" — {verdict}"
        )
    print(
        f"fuzz inner / rich strategies, same round: {statistics.median(ratios):.1f}x "
        f"(rounds {min(ratios):.1f}–{max(ratios):.1f})"
    )
    parts = split(min(args.turns, 3000), args.seed)
    total = sum(parts.values())
    print(f"a compact turn, split (µs; {total:.0f} µs in all, {1e6 / total:.0f} turns/s):")
    for part, micros in parts.items():
        print(f"{part:>30}: {micros:6.0f} µs ({micros / total:.0%})")


if __name__ == "__main__":
    main()
