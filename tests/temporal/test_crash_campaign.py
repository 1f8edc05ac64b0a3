"""The crash campaign: durable turns whose worker is killed (SIGKILL) at a random instant —
between two deliveries, right before or after the channel writes one, while a tool runs,
between a tool's end and its record — with a model that writes other words on every try,
then a new worker. Three chains (one model; a model that fails mid-pass, then a fallback; a
rate-limited key, then the next key, the kill landing in the second attempt) on a keyed and
an unkeyed channel. For every turn, checked against docs/behaviour.md §16 and §3.9:

* the channel shows ``result.delivered_text``: a keyed one exactly, no key used for two
  texts; an unkeyed one the same deliveries but at most the one being sent at the kill;
* no tool that is not idempotent started twice; every call cut off is named in
  ``in_doubt_calls``, settled by its hook with what really happened when it has one, and
  told to the model as unknown when it has none; no other outcome is anything but the
  tool's own;
* the turn ends, within a real-time limit, as the uninterrupted turn on the same chain did:
  the same status, attempts and calls.

It takes minutes, so it runs when ``TOOLLOOP_CRASH_CAMPAIGN=run`` (`.ci/run` sets it);
``TOOLLOOP_CAMPAIGN_SEED`` picks other instants. The counts are printed at the end of the run.
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
from attrs import frozen

from tests.temporal.conftest import WorkerProcesses
from tests.temporal.hosts import CAMPAIGN_CHAINS
from tests.temporal.hosts import TOOL_WORK
from tests.temporal.hosts import KillPlan
from tests.temporal.hosts import read_records
from toolloop_fsm import LoopPolicy
from toolloop_fsm import TurnPolicy
from toolloop_fsm import TurnRequest
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.result import InDoubtCause
from toolloop_fsm.testing import real_time_limit

pytest.importorskip("temporalio")

from temporalio.client import Client

from toolloop_fsm.temporal import TurnHandle
from toolloop_fsm.temporal import start_generation_turn

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("TOOLLOOP_CRASH_CAMPAIGN", "") != "run",
        reason="the crash campaign takes minutes: TOOLLOOP_CRASH_CAMPAIGN=run (.ci/run sets it)",
    ),
]

SEED = int(os.environ.get("TOOLLOOP_CAMPAIGN_SEED", "22"))
#: Each turn's real-time limit: a turn not done by then is stuck.
LIMIT = 120.0
HEARTBEAT = 1.0
LOOK_AGAIN = 0.02
#: Turns run at once, each with its own worker processes and task queue.
AT_ONCE = 3
POLICY = TurnPolicy(loop=LoopPolicy(delivery_flush_chars=8))
TOOLS = ["save_note", "find_city", "pay_bill"]
#: The tools whose calls must never start twice.
NOT_IDEMPOTENT = ("save_note", "pay_bill")
CHANNELS = ("files", "unkeyed")
#: Where a kill lands; "anywhere" is one of the others, picked at random.
INSTANTS = (
    "between deliveries",
    "before a delivery",
    "after a delivery",
    "mid-tool",
    "after a tool's end",
    "anywhere",
)
#: The tools each chain's last attempt runs itself (the fallback and the rotated key reuse
#: the note the first attempt saved).
LAST_ATTEMPT_TOOLS = {
    "plain": ("save_note", "find_city", "pay_bill"),
    "fallback": ("find_city", "pay_bill"),
    "rotation": ("find_city", "pay_bill"),
}
REQUEST = [{"role": "user", "content": "Note milk, find Oslo and pay my bill."}]


@frozen
class Reference:
    """An uninterrupted turn on a chain: its ending, and where a kill can land in its last
    attempt (the crashed turn is the same up to the kill)."""

    ending: Any
    deliveries: tuple[int, ...]  # the 1-based numbers of the last attempt's text deliveries
    chunks: tuple[int, ...]  # the 1-based numbers of its provider chunks


@frozen
class Case:
    name: str
    chain: str
    channel: str
    instant: str
    plan: KillPlan


@frozen
class Outcome:
    case: Case
    problems: tuple[str, ...]
    in_doubt: int = 0
    settled: int = 0
    dropped_repeats: int = 0
    unkeyed_missing: int = 0
    idempotent_reruns: int = 0


def ending(result: GenerationTurnResult) -> Any:
    """What the uninterrupted turn on the chain fixes: status, attempts, calls."""
    attempts = [(a.label, a.key_index, a.status, a.reason, a.superseded) for a in result.attempts]
    calls = [(entry.call.name, dict(entry.call.arguments)) for entry in result.history]
    return (result.status, result.reason, attempts, calls)


def text_deliveries(directory: Path) -> list[dict[str, Any]]:
    return [r for r in read_records(directory / "deliveries.jsonl") if "text" in r]


async def start_turn(
    client: Client, workers: WorkerProcesses, chain: str, channel: str, turn_id: str
) -> TurnHandle:
    return await start_generation_turn(
        client,
        task_queue=workers.task_queue,
        attempts=list(CAMPAIGN_CHAINS[chain]),
        channel=channel,
        request=TurnRequest(REQUEST, turn_id=turn_id),
        tools=TOOLS,
        policy=POLICY,
        heartbeat_timeout=HEARTBEAT,
    )


async def uninterrupted(client: Client, address: str, chain: str, root: Path) -> Reference:
    directory = root / f"reference-{chain}"
    directory.mkdir()
    workers = WorkerProcesses(address, f"campaign-{uuid.uuid4().hex}", directory)
    workers.start()
    try:
        async with real_time_limit(LIMIT):
            handle = await start_turn(client, workers, chain, "files", f"reference-{chain}")
            result = await handle.result()
    finally:
        workers.stop_all()
    started = [
        r["tool"] for r in read_records(directory / "executions.jsonl") if r["phase"] == "started"
    ]
    assert started == ["save_note", "find_city", "pay_bill"], (chain, started)
    last = max(a.index for a in result.attempts)
    deliveries = tuple(
        n
        for n, r in enumerate(text_deliveries(directory), 1)
        if int(r["key"].rsplit(":", 2)[1]) == last
    )
    tags = [r["tag"] for r in read_records(directory / "chunks.jsonl")]
    chunks = tuple(n for n, tag in enumerate(tags, 1) if tag == "main")
    return Reference(ending(result), deliveries, chunks)


def kill_plan(rng: random.Random, instant: str, chain: str, reference: Reference) -> KillPlan:
    """A random instant of kind ``instant`` in the chain's last attempt: never after its
    last delivery or chunk (the turn would end before the kill could land)."""
    if instant == "anywhere":
        instant = rng.choice(INSTANTS[:-1])
    if instant == "between deliveries":
        return KillPlan("chunk", n=rng.choice(reference.chunks[:-1]), delay=rng.uniform(0.0, 0.03))
    if instant == "before a delivery":
        return KillPlan("delivery", n=rng.choice(reference.deliveries), when="before")
    if instant == "after a delivery":
        return KillPlan(
            "delivery",
            n=rng.choice(reference.deliveries[:-1]),
            when="after",
            delay=rng.uniform(0.0, 0.03),
        )
    tool = rng.choice(LAST_ATTEMPT_TOOLS[chain])
    if instant == "mid-tool":
        return KillPlan("tool", tool=tool, when="start", delay=rng.uniform(0.0, TOOL_WORK))
    return KillPlan("tool", tool=tool, when="end", delay=rng.uniform(0.0, 0.02))


def campaign_cases(references: dict[str, Reference], seed: int) -> list[Case]:
    rng = random.Random(seed)
    return [
        Case(
            f"{chain}-{channel}-{i}",
            chain,
            channel,
            instant,
            kill_plan(rng, instant, chain, references[chain]),
        )
        for chain in CAMPAIGN_CHAINS
        for channel in CHANNELS
        for i, instant in enumerate(INSTANTS)
    ]


async def crashed(client: Client, address: str, case: Case, root: Path) -> GenerationTurnResult:
    """Run ``case``'s turn with its kill plan; once the first worker is dead, start another."""
    directory = root / case.name
    directory.mkdir()
    case.plan.write(directory)
    workers = WorkerProcesses(address, f"campaign-{uuid.uuid4().hex}", directory)
    try:
        first = workers.start()
        async with real_time_limit(LIMIT):
            handle = await start_turn(client, workers, case.chain, case.channel, case.name)
            ended = asyncio.ensure_future(handle.result())
            while first.poll() is None and not ended.done():
                await asyncio.sleep(LOOK_AGAIN)
            assert first.poll() is not None, f"{case.name}: the turn ended before the kill"
            assert first.returncode == -9, f"{case.name}: the worker exited {first.returncode}"
            workers.start()
            return await ended
    finally:
        workers.stop_all()


def one_missing(shown: Sequence[str], recorded: Sequence[str]) -> bool:
    return len(shown) == len(recorded) - 1 and any(
        list(shown) == [*recorded[:i], *recorded[i + 1 :]] for i in range(len(recorded))
    )


def judged(case: Case, result: GenerationTurnResult, directory: Path, expected: Any) -> Outcome:
    """Every check of the module's docstring on one crashed turn."""
    problems: list[str] = []
    if ending(result) != expected:
        problems.append(f"ended {ending(result)!r}, uninterrupted {expected!r}")

    log = text_deliveries(directory)
    shown = [r["text"] for r in log if r["accepted"]]
    recorded = [d.text for d in result.delivered if d.text is not None]
    unkeyed_missing = 0
    if case.channel == "files":
        if "".join(shown) != result.delivered_text:
            problems.append(
                f"the channel shows {''.join(shown)!r}, the result says {result.delivered_text!r}"
            )
        texts: dict[str, set[str]] = collections.defaultdict(set)
        for record in log:
            texts[record["key"]].add(record["text"])
        problems.extend(
            f"key {key} was sent {sorted(sent)!r}" for key, sent in texts.items() if len(sent) > 1
        )
    elif shown != recorded:
        if one_missing(shown, recorded):
            unkeyed_missing = 1
        else:
            problems.append(f"the unkeyed channel shows {shown!r}, the result {recorded!r}")

    executions = read_records(directory / "executions.jsonl")
    started = collections.Counter(r["tool"] for r in executions if r["phase"] == "started")
    finished = {r["tool"] for r in executions if r["phase"] == "finished"}
    problems.extend(
        f"{tool} started {started[tool]} times" for tool in NOT_IDEMPOTENT if started[tool] > 1
    )
    in_doubt = {call.tool: call for call in result.in_doubt_calls}
    for entry in result.history:
        tool, response = entry.call.name, entry.response
        call = in_doubt.pop(tool, None)
        if call is None:
            if not (response.success and tool in finished):
                problems.append(f"{tool}'s outcome {response!r} is not its own, nor in doubt")
            continue
        if tool == "find_city" or call.cause is not InDoubtCause.WORKER_LOST:
            problems.append(f"{call!r} is in doubt")
        elif tool == "pay_bill":
            # its hook looked it up: the outcome is what really happened
            if not call.reconciled or response.success != (tool in finished):
                problems.append(f"{call!r} was settled as {response!r}")
        elif call.reconciled or response.success or "unknown" not in (response.reason or ""):
            problems.append(f"{call!r} was told to the model as {response!r}")
    problems.extend(f"{call!r} names no call of the history" for call in in_doubt.values())
    return Outcome(
        case,
        tuple(problems),
        in_doubt=len(result.in_doubt_calls),
        settled=sum(call.reconciled for call in result.in_doubt_calls),
        dropped_repeats=sum(not r["accepted"] for r in log),
        unkeyed_missing=unkeyed_missing,
        idempotent_reruns=max(0, started["find_city"] - 1),
    )


def summary(outcomes: Sequence[Outcome], seed: int) -> str:
    def counted(field: str) -> str:
        tally = collections.Counter(getattr(o.case, field) for o in outcomes)
        return ", ".join(f"{n} {name}" for name, n in tally.items())

    total = len(outcomes)
    return "\n".join(
        [
            f"crash campaign (seed {seed}): {total} turns, each worker killed once, "
            f"{total - sum(bool(o.problems) for o in outcomes)} passed every check",
            f"  kills: {counted('instant')}",
            f"  chains: {counted('chain')}; channels: {counted('channel')}",
            f"  calls in doubt: {sum(o.in_doubt for o in outcomes)} "
            f"({sum(o.settled for o in outcomes)} settled by their hook); "
            f"idempotent calls run again: {sum(o.idempotent_reruns for o in outcomes)}",
            f"  repeats a keyed channel dropped: {sum(o.dropped_repeats for o in outcomes)}; "
            f"unkeyed turns missing the delivery being sent: "
            f"{sum(o.unkeyed_missing for o in outcomes)}",
        ]
    )


async def test_every_crashed_turn_shows_the_user_what_its_result_says(
    client: Client, temporal_address: str, tmp_path: Path, record_property: Any
) -> None:
    references = dict(
        zip(
            CAMPAIGN_CHAINS,
            await asyncio.gather(
                *(
                    uninterrupted(client, temporal_address, chain, tmp_path)
                    for chain in CAMPAIGN_CHAINS
                )
            ),
            strict=True,
        )
    )
    cases = campaign_cases(references, SEED)
    assert len(cases) >= 30
    room = asyncio.Semaphore(AT_ONCE)

    async def one(case: Case) -> Outcome:
        async with room:
            result = await crashed(client, temporal_address, case, tmp_path)
        expected = references[case.chain].ending
        return judged(case, result, tmp_path / case.name, expected)

    outcomes = await asyncio.gather(*(one(case) for case in cases))
    report = summary(outcomes, SEED)
    record_property("campaign_summary", report)
    broken = [
        f"{o.case.name} ({o.case.instant}, {attrs.asdict(o.case.plan)}): {problem}"
        for o in outcomes
        for problem in o.problems
    ]
    assert broken == [], report + "\n" + "\n".join(broken)
