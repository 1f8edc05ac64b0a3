"""A pass whose worker died mid-stream, with a model that writes other words on every try:
the retry continues from exactly what the user read (a keyed channel ends up holding exactly
``delivered_text``; an unkeyed one misses at most the delivery being sent), and a pass given
up on after its worker died keeps what the user read (tests/temporal/test_given_up_passes.py).
The worker kills itself at the channel's hand (a `KillPlan`), never at a heartbeat."""

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
