"""The asyncio shell around the sans-IO machines.

- `inner`: `EventPump` runs one `ToolLoopMachine` (the provider stream read by the turn's
  own task, signals, the children it tracks, its effect-handler table) and `run_tool_loop`;
  its parts are objects it makes and calls:
- `deadlines`: `Deadlines`, the turn's timers by token and which deadline expired;
- `tool_calls`: `ToolCalls`, the tool runner keyed by dispatch, its settling and the calls
  in doubt;
- `deliveries`: `ChannelCalls`, deliveries, notices and the stop message, and every bounded
  host call;
- `outer`: `GenerationPump` runs `GenerationTurnMachine` and `run_generation_turn`;
- `redaction`: no key leaves the turn: masked out of the provider's stream, scrubbed from
  results, log records and observed events.
"""

from toolloop_fsm.pump.deliveries import wait_bounded
from toolloop_fsm.pump.inner import EventPump
from toolloop_fsm.pump.inner import resume_tool_loop
from toolloop_fsm.pump.inner import run_tool_loop
from toolloop_fsm.pump.outer import GenerationPump
from toolloop_fsm.pump.outer import resume_generation_turn
from toolloop_fsm.pump.outer import run_generation_turn
from toolloop_fsm.pump.redaction import RedactedError

__all__ = [
    "EventPump",
    "GenerationPump",
    "RedactedError",
    "resume_generation_turn",
    "resume_tool_loop",
    "run_generation_turn",
    "run_tool_loop",
    "wait_bounded",
]
