"""CPU cost of `fork()` against `copy.deepcopy` of the same mid-turn machine.

Machines (sans-IO, driven by hand to a point in the middle of a turn):
  loop      — a `ToolLoopMachine` five tool rounds in (80 text chunks and a call each, every
              delivery confirmed), 200 chunks into its sixth pass.
  drafting  — the same turn with drafting and the tool checkpoint on (every call approved).
  chain     — a `GenerationTurnMachine` over three models of two keys, its third attempt
              running after two failed ones.

A fork copies the run state and shares the configuration and the compiled tables; a deep
copy copies everything. Each round forks a machine ``--copies`` times, then deep-copies it
as many times, back to back; a figure is the median over the rounds, and the ratio the median
of the per-round ratios (so a burst of load from other processes hits both sides alike). Only
the ratio means much on a shared machine. Target: fork ≤ 0.2 × deepcopy.

    python benchmarks/bench_fork.py [--copies N] [--rounds R]
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

from toolloop_fsm.attempts import AttemptPlan
from toolloop_fsm.effects import Deliver
from toolloop_fsm.effects import RequestReview
from toolloop_fsm.effects import RunTool
from toolloop_fsm.events import AttemptFinished
from toolloop_fsm.events import DeliveryRecorded
from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import ReviewReturned
from toolloop_fsm.events import StreamEnded
from toolloop_fsm.events import TextDelta
from toolloop_fsm.events import ToolFinished
from toolloop_fsm.events import ToolOutcomeKind
from toolloop_fsm.events import UsageReport
from toolloop_fsm.generation import GenerationTurnMachine
from toolloop_fsm.host import Tool
from toolloop_fsm.host import ToolContext
from toolloop_fsm.host import ToolRegistry
from toolloop_fsm.host import ToolResult
from toolloop_fsm.host import TurnRequest
from toolloop_fsm.machine import ToolLoopMachine
from toolloop_fsm.policy import LoopPolicy
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.result import TurnStatus
from toolloop_fsm.review import Pass

ROUNDS_BEFORE = 5
CHUNKS_PER_PASS = 80
CHUNKS_INTO_THE_PASS = 200


async def lookup(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
    return ToolResult(data={"answer": 42}, message="found")


TOOLS = ToolRegistry([Tool("lookup", "look something up", {"type": "object"}, lookup)])
REQUEST = TurnRequest([{"role": "user", "content": "hello"}])


def _answer(machine: ToolLoopMachine, effects: list[Any]) -> None:
    """Answer what the effects ask: confirm deliveries, finish tools, approve reviews."""
    queue = list(effects)
    while queue:
        effect = queue.pop(0)
        if isinstance(effect, Deliver) and effect.seq is not None:
            queue += machine.feed(DeliveryRecorded(effect.seq))
        elif isinstance(effect, RunTool):
            outcome = ToolFinished(effect.dispatch, ToolOutcomeKind.SUCCEEDED, data={"a": 42})
            queue += machine.feed(outcome)
        elif isinstance(effect, RequestReview):
            queue += machine.feed(ReviewReturned(effect.review, Pass()))


def loop_machine(policy: LoopPolicy) -> ToolLoopMachine:
    machine = ToolLoopMachine(policy, tools=TOOLS)
    _answer(machine, machine.start(REQUEST))
    for round_ in range(ROUNDS_BEFORE):
        for i in range(CHUNKS_PER_PASS):
            _answer(machine, machine.feed(TextDelta(f"w{i % 10:02d} ")))
        _answer(machine, machine.feed(FunctionCall("lookup", {"q": f"x{round_}"}, f"c{round_}")))
        _answer(machine, machine.feed(UsageReport(10, 20)))
        _answer(machine, machine.feed(StreamEnded()))
    for i in range(CHUNKS_INTO_THE_PASS):
        _answer(machine, machine.feed(TextDelta(f"w{i % 10:02d} ")))
    assert machine.state == "streaming", machine.state
    return machine


def chain_machine() -> GenerationTurnMachine:
    plans = [AttemptPlan(f"m{i}", keys=2) for i in range(3)]
    machine = GenerationTurnMachine(plans=plans)
    machine.start(REQUEST)
    failed = GenerationTurnResult(
        status=TurnStatus.ERROR, reason="provider_error", provider_error_kind="server"
    )
    for attempt in (1, 2):
        machine.feed(AttemptFinished(attempt, failed, {}, float(attempt)))
    assert machine.state == "attempting", machine.state
    return machine


def _cpu_us(make: Callable[[], object], copies: int) -> float:
    start = time.process_time()
    for _ in range(copies):
        make()
    return (time.process_time() - start) / copies * 1e6


def main(copies: int, rounds: int) -> None:
    machines: dict[str, ToolLoopMachine | GenerationTurnMachine] = {
        "loop": loop_machine(LoopPolicy()),
        "drafting": loop_machine(LoopPolicy(drafting=True, review_tool_calls=True)),
        "chain": chain_machine(),
    }
    print(f"CPU (process time), {rounds} interleaved rounds of {copies} copies each;")
    print("microseconds per copy, medians over the rounds; ratio = fork / deepcopy")
    print(f"{'machine':<10} {'fork µs':>9} {'deepcopy µs':>12} {'ratio':>7}")
    for name, machine in machines.items():
        forks: list[float] = []
        deep: list[float] = []
        ratios: list[float] = []
        for _ in range(rounds):
            f = _cpu_us(machine.fork, copies)
            d = _cpu_us(functools.partial(copy.deepcopy, machine), copies)
            forks.append(f)
            deep.append(d)
            ratios.append(f / d)
        print(
            f"{name:<10} {statistics.median(forks):>9.1f} {statistics.median(deep):>12.1f} "
            f"{statistics.median(ratios):>7.3f}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    main(args.copies, args.rounds)
