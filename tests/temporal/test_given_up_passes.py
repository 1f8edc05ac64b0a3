"""A pass given up on after its worker died (no worker alive until its budget ran out) keeps
what its lost try recorded as what the user read, and is never tried again. The worker
kills itself at the channel's hand (a `KillPlan`), never at a heartbeat. (Beside
tests/temporal/test_lost_passes.py, whose helpers it uses: a file of its own, so the suite's
workers share the slow crash tests evenly.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.temporal.conftest import WorkerProcesses
from tests.temporal.hosts import KillPlan
from tests.temporal.hosts import user_text
from tests.temporal.test_lost_passes import pass_prefills
from tests.temporal.test_worker_crashes import LIMIT
from tests.temporal.test_worker_crashes import keys_reused_for_other_text
from tests.temporal.test_worker_crashes import start
from tests.temporal.turns import LOOK_AGAIN
from toolloop_fsm import LoopPolicy
from toolloop_fsm import TurnPolicy
from toolloop_fsm import TurnStatus
from toolloop_fsm.testing import real_time_limit

pytest.importorskip("temporalio")

from temporalio.client import Client


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
