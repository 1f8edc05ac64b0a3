"""Durable generation turns on Temporal (the ``toolloop-fsm[temporal]`` extra).

A turn runs as a Temporal workflow that shells the same sans-IO machines the in-process
pumps run: each provider pass, each tool call and each call into the channel is an
activity on a worker, which resolves the host's providers, tools and channels by name
(`TurnWorker`); a stop and a follow-up are signals (`TurnHandle`). A worker that dies
mid-turn loses nothing: another worker replays the workflow's history, a completed tool is
never run again, and a pass that was streaming is tried again from what it delivered.

    worker = TurnWorker(client, "turns", providers={"main": attempt}, tools=tools,
                        channels={"discord": channel})
    handle = await start_generation_turn(client, task_queue="turns", attempts=["main"],
                                         channel="discord", request=request)
    result = await handle.result()
"""

from __future__ import annotations

from toolloop_fsm.temporal._client import DEFAULT_HEARTBEAT_TIMEOUT
from toolloop_fsm.temporal._client import TurnHandle
from toolloop_fsm.temporal._client import start_generation_turn
from toolloop_fsm.temporal._values import DATA_CONVERTER
from toolloop_fsm.temporal._values import TurnPayloadConverter
from toolloop_fsm.temporal._worker import TurnActivities
from toolloop_fsm.temporal._worker import TurnWorker
from toolloop_fsm.temporal._workflow import GenerationTurnWorkflow

__all__ = [
    "DATA_CONVERTER",
    "DEFAULT_HEARTBEAT_TIMEOUT",
    "GenerationTurnWorkflow",
    "TurnActivities",
    "TurnHandle",
    "TurnPayloadConverter",
    "TurnWorker",
    "start_generation_turn",
]
