"""A pass whose worker died mid-stream, with a model that writes other words on every try:
the retry continues from exactly what the user read (a keyed channel ends up holding exactly
``delivered_text``; an unkeyed one misses at most the delivery being sent), and a pass given
up on after its worker died keeps what the user read. The worker kills itself at the
channel's hand (a `KillPlan`), never at a heartbeat."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.temporal.conftest import WorkerProcesses
from tests.temporal.hosts import KillPlan
from tests.temporal.hosts import read_records
from tests.temporal.hosts import user_text
from tests.temporal.test_worker_crashes import LIMIT
from tests.temporal.test_worker_crashes import keys_reused_for_other_text
from tests.temporal.test_worker_crashes import start
from tests.temporal.turns import LOOK_AGAIN
from toolloop_fsm import LoopPolicy
from toolloop_fsm import TurnPolicy
from toolloop_fsm import TurnStatus
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.testing import real_time_limit

pytest.importorskip("temporalio")

from temporalio.client import Client


async def killed_at_a_delivery(
    client: Client,
    workers: WorkerProcesses,
    directory: Path,
    chain: str,
    channel: str,
    kill_at: str,
) -> GenerationTurnResult:
    """Run ``chain`` on ``channel`` with the first worker killing itself at the text delivery
    ``kill_at`` names (``"N"``: right after the channel wrote it; ``"N before"``: right
    before), so no heartbeat after it could carry it; a second worker takes over."""
    at, _, when = kill_at.partition(" ")
    KillPlan("delivery", n=int(at), when=when or "after").write(directory)
    first = workers.start()
    handle = await start(client, workers, chain, f"{chain}-{channel}-turn", channel)
    async with real_time_limit(LIMIT):
        await asyncio.to_thread(first.wait)  # it died at the channel's hand
        workers.start()
        return await handle.result()


def pass_prefills(directory: Path, index: int) -> list[str | None]:
    return [r["prefill"] for r in read_records(directory / "requests.jsonl") if r["pass"] == index]


SAMPLED_RETRY = "The lighthouse keeper, a man In the bustling port city of Sydney, a ship came in."


@pytest.mark.parametrize("channel", ["files", "unkeyed"])
async def test_a_pass_retried_after_its_worker_died_at_a_delivery_continues_from_what_the_user_read(
    client: Client, workers: WorkerProcesses, tmp_path: Path, channel: str
) -> None:
    # the worker dies right after the channel showed the second delivery, before any
    # heartbeat could carry it; the model writes other words on the retry
    result = await killed_at_a_delivery(client, workers, tmp_path, "sampled", channel, "2")

    assert result.status is TurnStatus.COMPLETED
    assert user_text(tmp_path) == result.delivered_text == SAMPLED_RETRY
    # the retry continued from exactly what the channel showed
    assert pass_prefills(tmp_path, 0) == [None, "The lighthouse keeper, a man "]
    assert keys_reused_for_other_text(tmp_path) == []


@pytest.mark.parametrize("channel", ["files", "unkeyed"])
async def test_a_pass_after_a_tool_round_retried_after_its_worker_died_continues_from_the_user_text(
    client: Client, workers: WorkerProcesses, tmp_path: Path, channel: str
) -> None:
    # deliveries: "Noting it. " (the tool round's), then two of the next pass; the worker
    # dies right after the third
    result = await killed_at_a_delivery(client, workers, tmp_path, "sampled-tool", channel, "3")

    assert result.status is TurnStatus.COMPLETED
    assert read_records(tmp_path / "executions.jsonl") == [{"tool": "record", "note": "n1"}]
    assert user_text(tmp_path) == result.delivered_text == "Noting it. " + SAMPLED_RETRY
    assert pass_prefills(tmp_path, 1) == [None, "The lighthouse keeper, a man "]
    assert keys_reused_for_other_text(tmp_path) == []


async def test_a_delivery_its_worker_died_before_sending_reaches_a_keyed_channel_on_the_retry(
    client: Client, workers: WorkerProcesses, tmp_path: Path
) -> None:
    # the worker dies after recording the second delivery, before the channel got it: the
    # retry sends it again under its own key, so the channel holds exactly the result's text
    result = await killed_at_a_delivery(client, workers, tmp_path, "sampled", "files", "2 before")

    assert result.status is TurnStatus.COMPLETED
    assert user_text(tmp_path) == result.delivered_text == SAMPLED_RETRY
    assert pass_prefills(tmp_path, 0) == [None, "The lighthouse keeper, a man "]
    assert keys_reused_for_other_text(tmp_path) == []


async def test_an_unkeyed_channel_misses_at_most_the_delivery_being_sent_when_the_worker_died(
    client: Client, workers: WorkerProcesses, tmp_path: Path
) -> None:
    # the documented window: an unkeyed channel cannot drop a repeat, so the delivery being
    # sent when the worker died is counted delivered and never sent again
    result = await killed_at_a_delivery(client, workers, tmp_path, "sampled", "unkeyed", "2 before")

    assert result.status is TurnStatus.COMPLETED
    assert result.delivered_text == SAMPLED_RETRY
    assert user_text(tmp_path) == SAMPLED_RETRY.replace("keeper, a man ", "", 1)
    assert pass_prefills(tmp_path, 0) == [None, "The lighthouse keeper, a man "]


async def test_a_pass_whose_worker_died_at_its_closing_delivery_adds_no_text_after_it(
    client: Client, workers: WorkerProcesses, tmp_path: Path
) -> None:
    # the closing delivery (shorter than the flush size: the stream had ended) was shown when
    # the worker died; the retried model writes more, but the pass had already said all it
    # says, and no key is used again for other text
    result = await killed_at_a_delivery(client, workers, tmp_path, "sampled-ending", "files", "2")

    assert result.status is TurnStatus.COMPLETED
    assert user_text(tmp_path) == result.delivered_text == "The lighthouse keeper."
    assert pass_prefills(tmp_path, 0) == [None, "The lighthouse keeper."]
    assert keys_reused_for_other_text(tmp_path) == []


async def history_shows(client: Client, workflow_id: str, event_type: int) -> None:
    """Wait until the workflow's history holds an event of ``event_type``."""
    handle = client.get_workflow_handle(workflow_id)
    while not [e async for e in handle.fetch_history_events() if e.event_type == event_type]:
        await asyncio.sleep(LOOK_AGAIN)


@pytest.mark.parametrize(
    ("channel", "kill_at"), [("files", "2"), ("files", "2 before"), ("unkeyed", "2")]
)
async def test_a_pass_given_up_after_its_worker_died_keeps_what_the_user_read(
    client: Client, workers: WorkerProcesses, tmp_path: Path, channel: str, kill_at: str
) -> None:
    # the worker dies at the second delivery; no worker is alive until the pass's budget
    # (0.4 s, and two heartbeats of room for a lost worker) has run out, so the pass is not
    # tried again: what its lost try recorded is what the user read, and the result says so
    from temporalio.api.enums.v1 import EventType

    at, _, when = kill_at.partition(" ")
    KillPlan("delivery", n=int(at), when=when or "after").write(tmp_path)
    policy = TurnPolicy(loop=LoopPolicy(delivery_flush_chars=8, max_pass_duration=0.4))
    first = workers.start()
    handle = await start(
        client, workers, "sampled", f"given-up-{channel}", channel, policy=policy, heartbeat=0.5
    )
    async with real_time_limit(LIMIT):
        await asyncio.to_thread(first.wait)
        # the lost try was noticed (0.5 s), then the workflow task left the dead worker's
        # queue (1 s): the pass began more than its budget and room (1.4 s) ago
        await history_shows(
            client, handle.workflow_id, EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT
        )
        workers.start()
        result = await handle.result()

    assert result.status is TurnStatus.TIMEOUT
    assert pass_prefills(tmp_path, 0) == [None]  # never tried again
    assert result.delivered_text == "The lighthouse keeper, a man "
    assert user_text(tmp_path) == result.delivered_text
    assert keys_reused_for_other_text(tmp_path) == []
