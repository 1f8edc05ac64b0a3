"""What the Temporal tests share to start a turn and watch it: the policy their scripts are
written for, the heartbeat that notices a lost worker, how often a test looks again at what
another process records, and starting a turn.

It needs ``temporalio``: a test module imports it after ``pytest.importorskip("temporalio")``.
"""

from __future__ import annotations

from collections.abc import Sequence

from temporalio.client import Client

from toolloop_fsm import LoopPolicy
from toolloop_fsm import TurnPolicy
from toolloop_fsm import TurnRequest
from toolloop_fsm.temporal import TurnHandle
from toolloop_fsm.temporal import start_generation_turn

#: Text delivered in batches of 8 characters, so a short script's deliveries can be told apart.
POLICY = TurnPolicy(loop=LoopPolicy(delivery_flush_chars=8))
#: How soon a lost worker is noticed, and how often a running call hears of a cancellation.
HEARTBEAT = 1.0
#: How often a test looks again at a fact another process (or the server) records.
LOOK_AGAIN = 0.02


async def start_turn(
    client: Client,
    task_queue: str,
    request: TurnRequest,
    *,
    attempts: Sequence[str] = ("main",),
    channel: str = "chat",
    tools: Sequence[str] | None = None,
    policy: TurnPolicy = POLICY,
    heartbeat: float = HEARTBEAT,
) -> TurnHandle:
    """Start a durable turn on ``task_queue``: the worker's ``chat`` channel and every tool of
    the worker unless told otherwise."""
    return await start_generation_turn(
        client,
        task_queue=task_queue,
        attempts=list(attempts),
        channel=channel,
        request=request,
        tools=None if tools is None else list(tools),
        policy=policy,
        heartbeat_timeout=heartbeat,
    )
