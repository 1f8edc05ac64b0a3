"""toolloop-fsm: one LLM generation turn — stream, dispatch tools, restart, fall back,
assemble — as an explicit finite-state machine.

The root holds what a host names to run turns: the run functions (and the two that resume a
turn from a `TurnSnapshot`, with the snapshot's JSON form); what it builds — the request, the
signals, the policies, attempts and the shared route, tools (`tool`, `Tool`, the registry,
what a tool returns), the ready channels (one of plain functions, one that prints, one that
collects); what it implements — a channel, a provider (the chunk events it yields, its
request, its error), a reviewer (its packet and verdicts, and the ready `ModelReviewer`); and
what it reads a result by — the result, its status, the result's JSON form, and the messages
a turn added to the conversation (`turn_messages`).

The records a host only reads, off a result or as a callback's argument, are reached as
attributes and live with their kind: `toolloop_fsm.result` (`TraceStep`, `Delivered`,
`Notice`, `ToolHistoryEntry`, `InDoubtCall` and its `InDoubtCause`, `AttemptRecord`,
`UsageLedger`, `BudgetExceeded`), `toolloop_fsm.policy` (`ExitView`; and the `Budget` and
`Price` a policy is built with), `toolloop_fsm.attempts` (`AdmissionRequest`, `KeyBook`),
`toolloop_fsm.host` (the `Clock` protocol and `LoopClock`, the real clock every run uses
unless given another), `toolloop_fsm.provider` (`ToolSpec`, a tool as a provider's request
lists it), `toolloop_fsm.events` (`SceneMetadata`, the rare chunk a scene-writing provider
yields). Hosts that drive the machines themselves find the
two machines, `InvalidEvent` and every event and effect in `toolloop_fsm.sansio`; the test kit
lives in `toolloop_fsm.testing`.
"""

import logging as _logging

from toolloop_fsm.attempts import Attempt
from toolloop_fsm.attempts import SharedRoute
from toolloop_fsm.channels import CallbackChannel
from toolloop_fsm.channels import CollectingChannel
from toolloop_fsm.channels import ConsoleChannel
from toolloop_fsm.conversation import turn_messages
from toolloop_fsm.events import ContextRestart
from toolloop_fsm.events import FinishKind
from toolloop_fsm.events import FinishReason
from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import TextDelta
from toolloop_fsm.events import ThoughtDelta
from toolloop_fsm.events import UsageReport
from toolloop_fsm.host import Channel
from toolloop_fsm.host import DestinationUnreachable
from toolloop_fsm.host import Tool
from toolloop_fsm.host import ToolContext
from toolloop_fsm.host import ToolRegistry
from toolloop_fsm.host import ToolResult
from toolloop_fsm.host import TurnRequest
from toolloop_fsm.host import TurnSignals
from toolloop_fsm.model_reviewer import ModelReviewer
from toolloop_fsm.policy import LoopPolicy
from toolloop_fsm.policy import TurnPolicy
from toolloop_fsm.provider import Provider
from toolloop_fsm.provider import ProviderError
from toolloop_fsm.provider import ProviderRequest
from toolloop_fsm.pump import resume_generation_turn
from toolloop_fsm.pump import resume_tool_loop
from toolloop_fsm.pump import run_generation_turn
from toolloop_fsm.pump import run_tool_loop
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.result import TurnStatus
from toolloop_fsm.result import result_from_json
from toolloop_fsm.result import result_to_json
from toolloop_fsm.review import Finding
from toolloop_fsm.review import Pass
from toolloop_fsm.review import Reviewer
from toolloop_fsm.review import ReviewPacket
from toolloop_fsm.review import Revise
from toolloop_fsm.review import Unavailable
from toolloop_fsm.snapshot import TurnSnapshot
from toolloop_fsm.snapshot import snapshot_from_json
from toolloop_fsm.snapshot import snapshot_to_json
from toolloop_fsm.tools import tool

# A library's records go where the host's logging configuration sends them; with none, they
# are not printed (logging's last-resort handler would print every WARNING to stderr).
_logging.getLogger("toolloop_fsm").addHandler(_logging.NullHandler())

__all__ = [
    "Attempt",
    "CallbackChannel",
    "Channel",
    "CollectingChannel",
    "ConsoleChannel",
    "ContextRestart",
    "DestinationUnreachable",
    "Finding",
    "FinishKind",
    "FinishReason",
    "FunctionCall",
    "GenerationTurnResult",
    "LoopPolicy",
    "ModelReviewer",
    "Pass",
    "Provider",
    "ProviderError",
    "ProviderRequest",
    "ReviewPacket",
    "Reviewer",
    "Revise",
    "SharedRoute",
    "TextDelta",
    "ThoughtDelta",
    "Tool",
    "ToolContext",
    "ToolRegistry",
    "ToolResult",
    "TurnPolicy",
    "TurnRequest",
    "TurnSignals",
    "TurnSnapshot",
    "TurnStatus",
    "Unavailable",
    "UsageReport",
    "result_from_json",
    "result_to_json",
    "resume_generation_turn",
    "resume_tool_loop",
    "run_generation_turn",
    "run_tool_loop",
    "snapshot_from_json",
    "snapshot_to_json",
    "tool",
    "turn_messages",
]
