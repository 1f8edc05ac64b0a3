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
  `UnkeyedFileChannel` takes no keys.
* A ``kill-plan`` file (`KillPlan`) names the instant the worker kills itself (SIGKILL): a
  text delivery (right before or right after the channel writes it), a provider chunk, a
  tool's start or end, at once or a ``delay`` later from a timer thread while the worker
  goes on. The instant is the host's, never a heartbeat's.
* ``record`` writes each execution; ``charge``, ``pay`` and ``lookup`` (idempotent) write
  that they started, then wait at a gate; ``pay``'s reconcile hook writes each time it is
  asked and answers that the payment went through.
* The crash campaign's turn (`CampaignProvider`, ``campaign*`` chains): four passes whose
  words differ on every try, and three tools that take a moment — ``save_note`` (no hook),
  ``find_city`` (idempotent) and ``pay_bill``, whose hook looks the payment up in the
  executions file and answers what really happened.

Run as ``python -m tests.temporal.hosts ADDRESS TASK_QUEUE DIRECTORY [FLUSH]`` it is a worker
process with these registries.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import attrs
from attrs import frozen

from toolloop_fsm import Attempt
from toolloop_fsm import Tool
from toolloop_fsm import ToolContext
from toolloop_fsm import ToolResult
from toolloop_fsm.events import Chunk
from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import TextDelta
from toolloop_fsm.events import UsageReport
from toolloop_fsm.provider import Provider
from toolloop_fsm.provider import ProviderError
from toolloop_fsm.provider import ProviderRequest
from toolloop_fsm.result import Notice

#: How often a waiting gate looks for its file (in the worker process, never in a test).
GATE_POLL = 0.02
#: How long a campaign tool works (in the worker process): long enough to be cut off mid-run.
TOOL_WORK = 0.05


@frozen
class Gate:
    """Stop the stream here until ``directory / name`` exists; write ``name.waiting`` first."""

    name: str


PassScript = Sequence[Chunk | Gate]

#: The crash test's turn: a tool round, then a pass that stops at a gate after two
#: deliveries (with a flush size of 8).
CRASH_SCRIPT: tuple[PassScript, ...] = (
    (TextDelta("Noting it. "), FunctionCall("record", {"note": "n1"}, "c1"), UsageReport(10, 6)),
    (
        TextDelta("The note "),
        TextDelta("is saved"),
        Gate("go"),
        TextDelta(" and "),
        TextDelta("filed."),
        UsageReport(30, 8),
    ),
)
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
    (
        TextDelta("The lighthouse "),
        TextDelta("keeper, a man "),
        TextDelta("named Jameson, "),
        TextDelta("kept the lamp lit."),
        UsageReport(10, 12),
    ),
    (
        TextDelta("In the bustling "),
        TextDelta("port city of Sydney, "),
        TextDelta("a ship came in."),
        UsageReport(10, 11),
    ),
    (TextDelta("Once upon "), TextDelta("a stormy night."), UsageReport(10, 5)),
)
#: A pass whose last delivery is shorter than the flush size (it is sent as the stream ends).
SAMPLED_ENDING: tuple[PassScript, ...] = (
    (TextDelta("The lighthouse "), TextDelta("keeper."), UsageReport(10, 4)),
    (TextDelta("In the bustling "), TextDelta("port city."), UsageReport(10, 5)),
)
SAMPLED_SCRIPTS: dict[str, tuple[tuple[PassScript, ...], ...]] = {
    "sampled": (SAMPLED_TEXT,),
    "sampled-ending": (SAMPLED_ENDING,),
    "sampled-tool": (
        (
            (
                TextDelta("Noting it. "),
                FunctionCall("record", {"note": "n1"}, "c1"),
                UsageReport(10, 6),
            ),
        ),
        SAMPLED_TEXT,
    ),
}

#: The campaign's turn: per pass, three variants of the words (the calls the same in each);
#: with a flush size of 8 every text chunk is a delivery of its own.
CAMPAIGN_TEXT: tuple[tuple[PassScript, ...], ...] = (
    tuple(
        (
            TextDelta(a),
            TextDelta(b),
            FunctionCall("save_note", {"note": "milk"}, "n1"),
            UsageReport(10, 6),
        )
        for a, b in (
            ("Let me note ", "that down. "),
            ("I will write ", "it down now. "),
            ("Noting this ", "for you. "),
        )
    ),
    tuple(
        (
            TextDelta(a),
            TextDelta(b),
            FunctionCall("find_city", {"city": "Oslo"}, "f1"),
            UsageReport(20, 6),
        )
        for a, b in (
            ("Now the city ", "itself. "),
            ("Looking up ", "where it is. "),
            ("Finding the ", "place first. "),
        )
    ),
    tuple(
        (TextDelta(a), FunctionCall("pay_bill", {"cents": 900}, "p1"), UsageReport(30, 4))
        for a in ("Paying the bill. ", "Settling what you owe. ", "Sending the payment. ")
    ),
    tuple(
        (TextDelta(a), TextDelta(b), TextDelta(c), UsageReport(40, 9))
        for a, b, c in (
            ("All done: ", "the note is ", "saved, Oslo found."),
            ("That is it: ", "your note, the city ", "and the bill."),
            ("Finished. ", "Everything you ", "asked for is done."),
        )
    ),
)
#: The campaign's chains: one model; a model that fails mid-pass, then the fallback; a key
#: that is rate limited mid-pass, then the next key of the same model.
CAMPAIGN_CHAINS: dict[str, tuple[str, ...]] = {
    "plain": ("campaign",),
    "fallback": ("campaign-flaky", "campaign"),
    "rotation": ("campaign-keys",),
}
#: Where the failing model or key fails: (pass, after how many chunks)
CAMPAIGN_FAILS_AT = (1, 1)
LIMITED_KEY = "k-limited"

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
        _append(self.directory / "requests.jsonl", {"pass": index, "prefill": request.prefill})
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


class CampaignProvider(SamplingProvider):
    """A `SamplingProvider` that writes each chunk it yields to ``chunks.jsonl`` with its
    ``tag``, dies before the chunk a kill plan names, and, given ``failure``, raises it at
    `CAMPAIGN_FAILS_AT` (as a failing model or a rate-limited key would)."""

    def __init__(
        self,
        directory: Path,
        variants: Sequence[Sequence[PassScript]],
        tag: str,
        failure: ProviderError | None = None,
    ) -> None:
        super().__init__(directory, variants)
        self.tag = tag
        self.failure = failure
        self.pass_index = 0

    def stream(self, request: ProviderRequest) -> AsyncIterator[Any]:
        self.pass_index = len(request.history)
        return super().stream(request)

    async def _play(self, items: PassScript) -> AsyncIterator[Any]:
        chunks = self.directory / "chunks.jsonl"
        for played, item in enumerate(item for item in items if not isinstance(item, Gate)):
            if self.failure is not None and (self.pass_index, played) == CAMPAIGN_FAILS_AT:
                raise self.failure
            if die_if_planned(self.directory, at="chunk", n=1 + len(read_records(chunks))):
                await until_killed()
            _append(chunks, {"tag": self.tag, "pass": self.pass_index})
            yield item


#: The file a `KillPlan` is written to, in the worker's directory.
KILL_PLAN = "kill-plan"


@frozen
class KillPlan:
    """Where a worker kills itself: ``at`` ``"delivery"`` (the ``n``-th text delivery of the
    turn, ``when`` ``"before"`` or ``"after"`` the channel writes it), ``"chunk"`` (before the
    ``n``-th provider chunk of the turn is yielded) or ``"tool"`` (``tool``'s ``when``
    ``"start"`` or ``"end"``); ``delay`` seconds after that instant (0: then and there)."""

    at: str
    n: int = 0
    when: str = ""
    tool: str = ""
    delay: float = 0.0

    def write(self, directory: Path) -> None:
        (directory / KILL_PLAN).write_text(json.dumps(attrs.asdict(self)), encoding="utf-8")


def die_if_planned(directory: Path, **instant: Any) -> bool:
    """Kill this process if the kill plan names ``instant`` (its fields), once: the plan is
    removed first, so the worker that takes over lives. ``True`` when the death is armed for
    the plan's ``delay`` from now: the caller then waits for it (`until_killed`), so that
    what it was doing cannot let the rest of the turn end before the kill lands (other work
    of the worker goes on meanwhile)."""
    path = directory / KILL_PLAN
    if not path.exists():
        return False
    plan = json.loads(path.read_text(encoding="utf-8"))
    if any(plan[field] != value for field, value in instant.items()):
        return False
    path.unlink()
    if plan["delay"] <= 0:
        die()
    timer = threading.Timer(plan["delay"], die)
    timer.daemon = True
    timer.start()
    return True


async def until_killed() -> None:
    """Wait for the death `die_if_planned` armed: the process ends in this wait."""
    await asyncio.Event().wait()


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
        if self._write(idempotency_key, text=text):
            await until_killed()

    async def send_expression(self, expression: str, *, idempotency_key: str | None = None) -> None:
        if self._write(idempotency_key, expression=expression):
            await until_killed()

    def _write(self, key: str | None, **delivery: str) -> bool:
        """Write the delivery (once per key); ``True`` when a death is armed around it."""
        sent = 1 + sum(1 for r in read_records(self.log) if "text" in r)
        armed = False
        if "text" in delivery:
            armed = die_if_planned(self.directory, at="delivery", n=sent, when="before")
        accepted = key is None or key not in self._accepted()
        _append(self.log, {"key": key, "accepted": accepted, **delivery})
        if "text" in delivery:
            armed = die_if_planned(self.directory, at="delivery", n=sent, when="after") or armed
        return armed

    async def send_notice(self, notice: Notice) -> None:
        _append(self.directory / "notices.jsonl", {"key": notice.key})

    async def queue_front(self, stop_message: str) -> None:
        _append(self.directory / "queued.jsonl", {"stop_message": stop_message})


class UnkeyedFileChannel(FileChannel):
    """A `FileChannel` that takes no idempotency keys: it shows whatever it is sent."""

    async def send_text(self, text: str) -> None:  # type: ignore[override]
        if self._write(None, text=text):
            await until_killed()

    async def send_expression(self, expression: str) -> None:  # type: ignore[override]
        if self._write(None, expression=expression):
            await until_killed()


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

    async def save_note(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        await working("save_note", ctx)
        return ToolResult(data={"noted": arguments.get("note")})

    async def find_city(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        await working("find_city", ctx)
        return ToolResult(data={"city": arguments.get("city"), "latitude": 59.9})

    async def pay_bill(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        await working("pay_bill", ctx)
        return ToolResult(data={"paid": arguments.get("cents")})

    async def working(tool: str, ctx: ToolContext) -> None:
        """Write that ``tool`` started, take a moment, write that it finished (its effect):
        a kill plan can cut it off at either end or in between."""
        _append(executions, {"tool": tool, "dispatch": ctx.dispatch, "phase": "started"})
        die_if_planned(directory, at="tool", tool=tool, when="start")  # lands in the work
        await asyncio.sleep(TOOL_WORK)
        _append(executions, {"tool": tool, "dispatch": ctx.dispatch, "phase": "finished"})
        if die_if_planned(directory, at="tool", tool=tool, when="end"):
            await until_killed()

    async def look_the_bill_up(arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        # the turn pays one bill: its lookup is whether that payment was made
        _append(directory / "reconciles.jsonl", {"tool": "pay_bill", "dispatch": ctx.dispatch})
        finished = [r for r in read_records(executions) if r.get("phase") == "finished"]
        if any(r["tool"] == "pay_bill" for r in finished):
            return ToolResult(data={"paid": arguments.get("cents"), "found_by": "lookup"})
        return ToolResult(success=False, message="no such payment was made")

    notes = {"type": "object", "properties": {"note": {"type": "string"}}}
    cents = {"type": "object", "properties": {"cents": {"type": "integer"}}}
    return [
        Tool("record", "Records a note.", notes, record),
        Tool("charge", "Charges the user's card.", cents, charge),
        Tool("pay", "Pays a bill.", cents, pay, reconcile=look_payment_up),
        Tool("lookup", "Looks a city up.", {"type": "object"}, lookup, idempotent=True),
        Tool("save_note", "Saves a note.", notes, save_note),
        Tool("find_city", "Finds a city.", {"type": "object"}, find_city, idempotent=True),
        Tool("pay_bill", "Pays a bill.", cents, pay_bill, reconcile=look_the_bill_up),
    ]


def host_providers(directory: Path) -> dict[str, Attempt]:
    def staged(script: Sequence[PassScript]) -> Attempt:
        return Attempt(lambda key: StagedProvider(directory, script))

    def sampling(variants: Sequence[Sequence[PassScript]]) -> Attempt:
        return Attempt(lambda key: SamplingProvider(directory, variants))

    def campaign(key: str | None, tag: str, failure: ProviderError | None) -> Provider:
        return CampaignProvider(directory, CAMPAIGN_TEXT, tag, failure)

    staged_ones = {name: attrs.evolve(staged(s), label=name) for name, s in SCRIPTS.items()}
    sampled = {name: attrs.evolve(sampling(v), label=name) for name, v in SAMPLED_SCRIPTS.items()}
    down = ProviderError("the model is overloaded", kind="server", retryable=True, status_code=503)
    limited = ProviderError("rate limited", kind="rate_limit", retryable=True, status_code=429)
    campaigns = {
        "campaign": Attempt(lambda key: campaign(key, "main", None), label="campaign"),
        "campaign-flaky": Attempt(
            lambda key: campaign(key, "failing", down), label="campaign-flaky"
        ),
        "campaign-keys": Attempt(
            lambda key: campaign(
                key, *(("failing", limited) if key == LIMITED_KEY else ("main", None))
            ),
            keys=(LIMITED_KEY, "k-good"),
            label="campaign-keys",
        ),
    }
    return {**staged_ones, **sampled, **campaigns}


async def _serve(address: str, task_queue: str, directory: Path) -> None:
    from temporalio.client import Client

    from toolloop_fsm.temporal import DATA_CONVERTER
    from toolloop_fsm.temporal import TurnWorker

    client = await Client.connect(address, data_converter=DATA_CONVERTER)
    worker = TurnWorker(
        client,
        task_queue,
        providers=host_providers(directory),
        tools=host_tools(directory),
        channels={"files": FileChannel(directory), "unkeyed": UnkeyedFileChannel(directory)},
        # a workflow task left on a killed worker's sticky queue moves on after this
        sticky_queue_schedule_to_start_timeout=timedelta(seconds=1),
    )
    async with worker:
        (directory / f"worker-{task_queue}.ready").touch()
        await asyncio.Event().wait()  # until the test kills the process


if __name__ == "__main__":
    asyncio.run(_serve(sys.argv[1], sys.argv[2], Path(sys.argv[3])))
