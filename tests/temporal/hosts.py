"""The host side of the Temporal suite: a provider, tools and a channel that keep their state
in files, so that a worker process killed mid-turn and the one that replaces it share it (as
a real host's external services would), and the worker process the crash tests kill.

* `StagedProvider` plays a script chosen by how many tool rounds the request carries (no
  per-process counter: a fresh process continues the same turn), continues after a prefill
  (a retried pass skips the text it already delivered), writes every request it gets, and
  stops at a `Gate` until the test creates the gate's file (writing that it waits there).
* `SamplingProvider` writes different words on every try of a pass (as a model sampling at a
  temperature does): the try is counted in the requests file, so a fresh process writes a
  new variant; after a prefill it writes its variant as the continuation.
* `FileChannel` writes every delivery with its idempotency key and drops a key it already
  accepted, across processes (Discord's ``nonce`` with ``enforce_nonce`` does this);
  `UnkeyedFileChannel` takes no keys. Both kill their own worker process (SIGKILL) at the
  text delivery a ``kill-at`` file names, right after (or, ``N before``, right before) they
  write it: the kill instant is the channel's, never a heartbeat's.
* ``record`` writes each execution; ``charge``, ``pay`` and ``lookup`` (idempotent) write
  that they started, then wait at a gate; ``pay``'s reconcile hook writes each time it is
  asked and answers that the payment went through.

Run as ``python -m tests.temporal.hosts ADDRESS TASK_QUEUE DIRECTORY [FLUSH]`` it is a worker
process with these registries.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import attrs
from attrs import frozen

from toolloop_fsm import Attempt, Tool, ToolContext, ToolResult
from toolloop_fsm.events import Chunk, FunctionCall, TextDelta, UsageReport
from toolloop_fsm.provider import ProviderRequest
from toolloop_fsm.result import Notice

#: How often a waiting gate looks for its file (in the worker process, never in a test).
GATE_POLL = 0.02


@frozen
class Gate:
    """Stop the stream here until ``directory / name`` exists; write ``name.waiting`` first."""

    name: str


PassScript = Sequence[Chunk | Gate]

#: The crash test's turn: a tool round, then a pass that stops at a gate after two
#: deliveries (with a flush size of 8).
CRASH_SCRIPT: tuple[PassScript, ...] = (
    (TextDelta("Noting it. "), FunctionCall("record", {"note": "n1"}, "c1"), UsageReport(10, 6)),
    (TextDelta("The note "), TextDelta("is saved"), Gate("go"), TextDelta(" and "),
     TextDelta("filed."), UsageReport(30, 8)),
)  # fmt: skip
#: A turn whose tool waits at a gate (the worker is killed while it runs).
CHARGE_SCRIPT: tuple[PassScript, ...] = (
    (TextDelta("Charging. "), FunctionCall("charge", {"cents": 500}, "c1")),
    (TextDelta("The charge did not go through."),),
)
#: A turn whose tool, with a reconcile hook, waits at a gate.
PAY_SCRIPT: tuple[PassScript, ...] = (
    (TextDelta("Paying. "), FunctionCall("pay", {"cents": 700}, "p1")),
    (TextDelta("The payment went through."),),
)
#: A turn whose idempotent tool waits at a gate.
LOOKUP_SCRIPT: tuple[PassScript, ...] = (
    (FunctionCall("lookup", {"city": "Oslo"}, "c1"),),
    (TextDelta("Oslo is at 59.9° N."),),
)
#: A turn whose first pass stops at a gate (stopped while no worker is alive).
STOP_SCRIPT: tuple[PassScript, ...] = ((TextDelta("Thinking about it "), Gate("never")),)
#: The sampled turns: per pass, the variant each try writes (try n writes variant n, the last
#: one from then on); with a flush size of 8 every text chunk is a delivery of its own.
SAMPLED_TEXT: tuple[PassScript, ...] = (
    (TextDelta("The lighthouse "), TextDelta("keeper, a man "), TextDelta("named Jameson, "),
     TextDelta("kept the lamp lit."), UsageReport(10, 12)),
    (TextDelta("In the bustling "), TextDelta("port city of Sydney, "),
     TextDelta("a ship came in."), UsageReport(10, 11)),
    (TextDelta("Once upon "), TextDelta("a stormy night."), UsageReport(10, 5)),
)  # fmt: skip
#: A pass whose last delivery is shorter than the flush size (it is sent as the stream ends).
SAMPLED_ENDING: tuple[PassScript, ...] = (
    (TextDelta("The lighthouse "), TextDelta("keeper."), UsageReport(10, 4)),
    (TextDelta("In the bustling "), TextDelta("port city."), UsageReport(10, 5)),
)
SAMPLED_SCRIPTS: dict[str, tuple[tuple[PassScript, ...], ...]] = {
    "sampled": (SAMPLED_TEXT,),
    "sampled-ending": (SAMPLED_ENDING,),
    "sampled-tool": (
        ((TextDelta("Noting it. "), FunctionCall("record", {"note": "n1"}, "c1"),
          UsageReport(10, 6)),),
        SAMPLED_TEXT,
    ),
}  # fmt: skip
SCRIPTS = {
    "crash": CRASH_SCRIPT,
    "charge": CHARGE_SCRIPT,
    "pay": PAY_SCRIPT,
    "lookup": LOOKUP_SCRIPT,
    "stop": STOP_SCRIPT,
}


async def wait_for_file(path: Path) -> None:
    while not path.exists():
        await asyncio.sleep(GATE_POLL)


def _append(path: Path, record: dict[str, Any]) -> None:
    with path.open("a", encoding="utf-8") as file:
        file.write(json.dumps(record) + "\n")


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


class StagedProvider:
    name = "staged"
    tool_calling = "native"
    continuation_style = False

    def __init__(self, directory: Path, script: Sequence[PassScript]) -> None:
        self.directory = directory
        self.script = script

    def stream(self, request: ProviderRequest) -> AsyncIterator[Any]:
        index = len(request.history)
        _append(self.directory / "requests.jsonl",
                {"pass": index, "prefill": request.prefill})  # fmt: skip
        items = self.script[index] if index < len(self.script) else ()
        return self._play(items, request.prefill or "")

    async def _play(self, items: PassScript, prefill: str) -> AsyncIterator[Any]:
        skip = len(prefill)  # a retried pass continues after the text it delivered
        for item in items:
            if isinstance(item, Gate):
                (self.directory / f"{item.name}.waiting").touch()
                await wait_for_file(self.directory / item.name)
                continue
            if isinstance(item, TextDelta) and skip:
                cut = min(skip, len(item.text))
                skip -= cut
                if cut == len(item.text):
                    continue
                item = TextDelta(item.text[cut:])
            yield item


class SamplingProvider:
    """Different words on every try of a pass: ``variants[pass][try]`` (the last variant for
    any later try), the try counted from the requests file (shared by worker processes)."""

    name = "sampling"
    tool_calling = "native"
    continuation_style = False

    def __init__(self, directory: Path, variants: Sequence[Sequence[PassScript]]) -> None:
        self.directory = directory
        self.variants = variants

    def stream(self, request: ProviderRequest) -> AsyncIterator[Any]:
        index = len(request.history)
        requests = self.directory / "requests.jsonl"
        tried = sum(1 for r in read_records(requests) if r["pass"] == index)
        _append(requests, {"pass": index, "prefill": request.prefill})
        variants = self.variants[index] if index < len(self.variants) else ((),)
        return self._play(variants[min(tried, len(variants) - 1)])

    async def _play(self, items: PassScript) -> AsyncIterator[Any]:
        for item in items:
            if not isinstance(item, Gate):
                yield item


def kill_instant(directory: Path, sent: int) -> str | None:
    """``"after"`` or ``"before"`` when this worker is to die at its text delivery number
    ``sent`` (1-based, counted in the log across processes), once: the file is removed."""
    order = directory / "kill-at"
    if not order.exists():
        return None
    at, _, when = order.read_text(encoding="utf-8").partition(" ")
    if int(at) != sent:
        return None
    order.unlink()
    return when.strip() or "after"


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class FileChannel:
    """Deliveries, notices and stop messages written to files in ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.log = directory / "deliveries.jsonl"

    def _accepted(self) -> set[str]:
        return {r["key"] for r in read_records(self.log) if r["accepted"] and r["key"]}

    async def send_text(self, text: str, *, idempotency_key: str | None = None) -> None:
        self._write(idempotency_key, text=text)

    async def send_expression(self, expression: str, *, idempotency_key: str | None = None) -> None:
        self._write(idempotency_key, expression=expression)

    def _write(self, key: str | None, **delivery: str) -> None:
        instant = None
        if "text" in delivery:
            sent = 1 + sum(1 for r in read_records(self.log) if "text" in r)
            instant = kill_instant(self.directory, sent)
        if instant == "before":
            die()
        accepted = key is None or key not in self._accepted()
        _append(self.log, {"key": key, "accepted": accepted, **delivery})
        if instant == "after":
            die()

    async def send_notice(self, notice: Notice) -> None:
        _append(self.directory / "notices.jsonl", {"key": notice.key})

    async def queue_front(self, stop_message: str) -> None:
        _append(self.directory / "queued.jsonl", {"stop_message": stop_message})


class UnkeyedFileChannel(FileChannel):
    """A `FileChannel` that takes no idempotency keys: it shows whatever it is sent."""

    async def send_text(self, text: str) -> None:  # type: ignore[override]
        self._write(None, text=text)

    async def send_expression(self, expression: str) -> None:  # type: ignore[override]
        self._write(None, expression=expression)


def user_text(directory: Path) -> str:
    """What the user read: every accepted text delivery, in order."""
    log = directory / "deliveries.jsonl"
    return "".join(r.get("text", "") for r in read_records(log) if r["accepted"])


def host_tools(directory: Path) -> list[Tool]:
    executions = directory / "executions.jsonl"

    async def record(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        _append(executions, {"tool": "record", "note": arguments.get("note")})
        return ToolResult(data={"saved": arguments.get("note")})

    async def charge(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        _append(executions, {"tool": "charge", "cents": arguments.get("cents")})
        await wait_for_file(directory / "release")
        return ToolResult(data={"charged": arguments.get("cents")})

    async def pay(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        _append(executions, {"tool": "pay", "cents": arguments.get("cents")})
        await wait_for_file(directory / "release")
        return ToolResult(data={"paid": arguments.get("cents")})

    async def look_payment_up(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        _append(directory / "reconciles.jsonl", {"tool": "pay", "dispatch": ctx.dispatch})
        return ToolResult(data={"paid": arguments.get("cents"), "found_by": "lookup"})

    async def lookup(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        _append(executions, {"tool": "lookup", "city": arguments.get("city")})
        await wait_for_file(directory / "release")
        return ToolResult(data={"latitude": 59.9})

    notes = {"type": "object", "properties": {"note": {"type": "string"}}}
    cents = {"type": "object", "properties": {"cents": {"type": "integer"}}}
    return [
        Tool("record", "Records a note.", notes, record),
        Tool("charge", "Charges the user's card.", cents, charge),
        Tool("pay", "Pays a bill.", cents, pay, reconcile=look_payment_up),
        Tool("lookup", "Looks a city up.", {"type": "object"}, lookup, idempotent=True),
    ]


def host_providers(directory: Path) -> dict[str, Attempt]:
    def staged(script: Sequence[PassScript]) -> Attempt:
        return Attempt(lambda key: StagedProvider(directory, script))

    def sampling(variants: Sequence[Sequence[PassScript]]) -> Attempt:
        return Attempt(lambda key: SamplingProvider(directory, variants))

    staged_ones = {name: attrs.evolve(staged(s), label=name) for name, s in SCRIPTS.items()}
    sampled = {name: attrs.evolve(sampling(v), label=name) for name, v in SAMPLED_SCRIPTS.items()}
    return {**staged_ones, **sampled}


async def _serve(address: str, task_queue: str, directory: Path) -> None:
    from temporalio.client import Client

    from toolloop_fsm.temporal import DATA_CONVERTER, TurnWorker

    client = await Client.connect(address, data_converter=DATA_CONVERTER)
    worker = TurnWorker(
        client, task_queue, providers=host_providers(directory),
        tools=host_tools(directory),
        channels={"files": FileChannel(directory), "unkeyed": UnkeyedFileChannel(directory)},
        # a workflow task left on a killed worker's sticky queue moves on after this
        sticky_queue_schedule_to_start_timeout=timedelta(seconds=1),
    )  # fmt: skip
    async with worker:
        (directory / f"worker-{task_queue}.ready").touch()
        await asyncio.Event().wait()  # until the test kills the process


if __name__ == "__main__":
    asyncio.run(_serve(sys.argv[1], sys.argv[2], Path(sys.argv[3])))
