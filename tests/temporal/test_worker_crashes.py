"""Turns that survive their worker: a worker process is killed with SIGKILL (by its pid) at
the worst moments, another starts, and the turn goes on from the workflow's history — a
completed tool never runs again, a streaming pass continues from what it delivered, a tool
whose outcome died with its worker is reported as unknown rather than run twice, and a stop
sent while no worker is alive is honoured when one returns."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from tests.temporal.conftest import WorkerProcesses
from tests.temporal.hosts import read_records
from tests.temporal.hosts import user_text
from toolloop_fsm import TurnPolicy
from toolloop_fsm import TurnRequest
from toolloop_fsm import TurnStatus
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.result import InDoubtCall
from toolloop_fsm.result import InDoubtCause
from toolloop_fsm.result import converter
from toolloop_fsm.result import result_from_json
from toolloop_fsm.result import result_to_json
from toolloop_fsm.testing import real_time_limit

pytest.importorskip("temporalio")

from temporalio.client import Client

from tests.temporal.turns import HEARTBEAT
from tests.temporal.turns import LOOK_AGAIN
from tests.temporal.turns import POLICY
from tests.temporal.turns import start_turn
from toolloop_fsm.temporal import TurnHandle

LIMIT = 90.0
REQUEST = TurnRequest([{"role": "user", "content": "Save a note for me."}])


async def appears(path: Path) -> None:
    """Wait (within the test's real-time limit) until another process writes ``path``."""
    while not path.exists():
        await asyncio.sleep(LOOK_AGAIN)


async def recorded(path: Path) -> None:
    """Wait until another process has written a whole record to ``path`` (the file exists
    as soon as it is opened for its first record: a kill then would leave it empty)."""
    while not (path.exists() and path.read_text(encoding="utf-8").endswith("\n")):
        await asyncio.sleep(LOOK_AGAIN)


async def start(
    client: Client,
    workers: WorkerProcesses,
    chain: str,
    turn_id: str,
    channel: str = "files",
    *,
    policy: TurnPolicy = POLICY,
    heartbeat: float = HEARTBEAT,
) -> TurnHandle:
    return await start_turn(
        client,
        workers.task_queue,
        TurnRequest(REQUEST.context, turn_id=turn_id),
        attempts=[chain],
        channel=channel,
        tools=["record", "charge", "pay", "lookup"],
        policy=policy,
        heartbeat=heartbeat,
    )


def comparable(result: GenerationTurnResult) -> Any:
    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in ("at", "turn_id")}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return strip(converter.unstructure(result))


async def channel_shows(directory: Path, text: str) -> None:
    """Wait until the channel has shown ``text`` (each delivery is recorded in the workflow
    before it is sent: what a retried pass continues from)."""
    while text not in user_text(directory):
        await asyncio.sleep(LOOK_AGAIN)


async def test_a_worker_killed_while_the_next_pass_streams_loses_nothing(
    client: Client, workers: WorkerProcesses, tmp_path: Path
) -> None:
    # the uncrashed run, on the same script, as the reference
    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    (reference_dir / "go").touch()
    calm = WorkerProcesses(workers.address, workers.task_queue + "-calm", reference_dir)
    calm.start()
    try:
        async with real_time_limit(LIMIT):
            reference = await (await start(client, calm, "crash", "calm-turn")).result()
    finally:
        calm.stop_all()

    first = workers.start()
    handle = await start(client, workers, "crash", "crash-turn")
    async with real_time_limit(LIMIT):
        await appears(tmp_path / "go.waiting")  # the tool ran; the next pass is streaming
        await channel_shows(tmp_path, "is saved")  # its two deliveries are on record
        workers.kill(first)
        (tmp_path / "go").touch()
        workers.start()
        result = await handle.result()

    assert result.status is TurnStatus.COMPLETED
    executions = read_records(tmp_path / "executions.jsonl")
    assert executions == [{"tool": "record", "note": "n1"}]  # the tool ran exactly once
    log = read_records(tmp_path / "deliveries.jsonl")
    shown_keys = [record["key"] for record in log if record["accepted"]]
    # nothing was shown twice: the retried pass continued after what it had recorded, and
    # sent only the last recorded delivery again, under its own key (the channel dropped it)
    assert len(shown_keys) == len(set(shown_keys))
    assert [r for r in log if not r["accepted"]] == [
        {"key": "crash-turn:1:2", "accepted": False, "text": "is saved"}
    ]
    assert keys_reused_for_other_text(tmp_path) == []
    assert user_text(tmp_path) == user_text(reference_dir) == result.delivered_text
    assert user_text(tmp_path) == "Noting it. The note is saved and filed."
    retried = [r for r in read_records(tmp_path / "requests.jsonl") if r["pass"] == 1]
    assert [r["prefill"] for r in retried] == [None, "The note is saved"]
    assert comparable(result) == comparable(reference)


async def test_a_worker_killed_mid_tool_reports_the_tool_unknown_and_never_runs_it_twice(
    client: Client, workers: WorkerProcesses, tmp_path: Path
) -> None:
    first = workers.start()
    handle = await start(client, workers, "charge", "charge-turn")
    async with real_time_limit(LIMIT):
        await recorded(tmp_path / "executions.jsonl")  # the charge started
        workers.kill(first)
        (tmp_path / "release").touch()  # a second run would finish at once
        workers.start()
        result = await handle.result()

    assert read_records(tmp_path / "executions.jsonl") == [{"tool": "charge", "cents": 500}]
    assert result.status is TurnStatus.COMPLETED
    [round_] = result.history
    response = converter.unstructure(round_.response)
    assert "unknown" in json.dumps(response)
    assert "not run again" in json.dumps(response)
    assert result.final_text == "The charge did not go through."
    assert result.in_doubt_calls == (
        InDoubtCall("charge", 1, "c1", InDoubtCause.WORKER_LOST, reconciled=False),
    )


async def test_a_worker_killed_mid_tool_is_settled_by_the_tools_reconcile_hook(
    client: Client, workers: WorkerProcesses, tmp_path: Path
) -> None:
    first = workers.start()
    handle = await start(client, workers, "pay", "pay-turn")
    async with real_time_limit(LIMIT):
        await recorded(tmp_path / "executions.jsonl")  # the payment started
        workers.kill(first)
        (tmp_path / "release").touch()  # a second run would finish at once
        workers.start()
        result = await handle.result()

    assert read_records(tmp_path / "executions.jsonl") == [{"tool": "pay", "cents": 700}]
    # asked once, on a worker, after the lost worker was noticed
    assert read_records(tmp_path / "reconciles.jsonl") == [{"tool": "pay", "dispatch": 1}]
    assert result.status is TurnStatus.COMPLETED
    [round_] = result.history
    # the hook's answer is the outcome the model was shown
    assert round_.response.success
    assert round_.response.data == {"paid": 700, "found_by": "lookup"}
    assert result.in_doubt_calls == (
        InDoubtCall("pay", 1, "p1", InDoubtCause.WORKER_LOST, reconciled=True),
    )
    assert result_from_json(result_to_json(result)).in_doubt_calls == result.in_doubt_calls
    assert result.final_text == "The payment went through."


async def test_a_worker_killed_mid_tool_runs_an_idempotent_tool_again_on_the_next_worker(
    client: Client, workers: WorkerProcesses, tmp_path: Path
) -> None:
    first = workers.start()
    handle = await start(client, workers, "lookup", "lookup-turn")
    async with real_time_limit(LIMIT):
        await recorded(tmp_path / "executions.jsonl")
        workers.kill(first)
        (tmp_path / "release").touch()
        workers.start()
        result = await handle.result()

    assert read_records(tmp_path / "executions.jsonl") == [{"tool": "lookup", "city": "Oslo"}] * 2
    assert result.status is TurnStatus.COMPLETED
    [round_] = result.history
    assert round_.response.success
    assert result.final_text == "Oslo is at 59.9° N."


async def test_a_stop_sent_while_no_worker_is_alive_is_honoured_when_one_returns(
    client: Client, workers: WorkerProcesses, tmp_path: Path
) -> None:
    first = workers.start()
    handle = await start(client, workers, "stop", "stop-turn")
    async with real_time_limit(LIMIT):
        await appears(tmp_path / "never.waiting")
        workers.kill(first)
        await handle.stop("Stopped while you were away.")
        workers.start()
        result = await handle.result()

    assert result.status is TurnStatus.STOPPED_BY_USER
    assert read_records(tmp_path / "queued.jsonl") == [
        {"stop_message": "Stopped while you were away."}
    ]
    assert user_text(tmp_path) == "Thinking about it "


def keys_reused_for_other_text(directory: Path) -> list[str]:
    texts: dict[str, set[str]] = {}
    for record in read_records(directory / "deliveries.jsonl"):
        if record["key"] is not None and "text" in record:
            texts.setdefault(record["key"], set()).add(record["text"])
    return [key for key, sent in texts.items() if len(sent) > 1]
