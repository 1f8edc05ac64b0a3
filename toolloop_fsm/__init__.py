"""toolloop-fsm: one LLM generation turn — stream, dispatch tools, restart, fall back,
assemble — as an explicit finite-state machine.

The root holds what a host names to run turns: the run functions (and the two that resume a
turn from a `TurnSnapshot`, with the snapshot's JSON form); what it builds — the request, the
signals, the policies, attempts and the shared route, tools (`tool`, `Tool`, the registry,
what a tool returns), the real clock; what it implements — a channel, a provider (the chunk
events it yields, its request, its error), a reviewer (its packet and verdicts, and the ready
`ModelReviewer`); and what it reads a result by — the result, its status, the cause of an
in-doubt call, the result's JSON form.

The records a host only reads, off a result or as a callback's argument, are reached as
attributes and live with their kind: `toolloop_fsm.result` (`TraceStep`, `Delivered`,
`Notice`, `ToolHistoryEntry`, `InDoubtCall`, `AttemptRecord`, `UsageLedger`),
`toolloop_fsm.policy` (`ExitView`), `toolloop_fsm.attempts` (`AdmissionRequest`, `KeyBook`),
`toolloop_fsm.host` (the `Clock` protocol). Hosts that drive the machines themselves find the
two machines, `InvalidEvent` and every event and effect in `toolloop_fsm.sansio`; the test kit
lives in `toolloop_fsm.testing`.
"""

import logging as _logging

from toolloop_fsm.attempts import Attempt, SharedRoute
from toolloop_fsm.events import (
    ContextRestart,
    FinishKind,
    FinishReason,
    FunctionCall,
    SceneMetadata,
    TextDelta,
    ThoughtDelta,
    UsageReport,
)
from toolloop_fsm.host import (
    Channel,
    DestinationUnreachable,
    LoopClock,
    Tool,
    ToolContext,
    ToolRegistry,
    ToolResult,
    TurnRequest,
    TurnSignals,
)
from toolloop_fsm.model_reviewer import ModelReviewer
from toolloop_fsm.policy import LoopPolicy, TurnPolicy
from toolloop_fsm.provider import Provider, ProviderError, ProviderRequest, ToolSpec
from toolloop_fsm.pump import (
    resume_generation_turn,
    resume_tool_loop,
    run_generation_turn,
    run_tool_loop,
)
from toolloop_fsm.result import (
    GenerationTurnResult,
    InDoubtCause,
    TurnStatus,
    result_from_json,
    result_to_json,
)
from toolloop_fsm.review import Finding, Pass, Reviewer, ReviewPacket, Revise, Unavailable
from toolloop_fsm.snapshot import TurnSnapshot, snapshot_from_json, snapshot_to_json
from toolloop_fsm.tools import tool

# A library's records go where the host's logging configuration sends them; with none, they
# are not printed (logging's last-resort handler would print every WARNING to stderr).
_logging.getLogger("toolloop_fsm").addHandler(_logging.NullHandler())

__all__ = [
    "Attempt",
    "Channel",
    "ContextRestart",
    "DestinationUnreachable",
    "Finding",
    "FinishKind",
    "FinishReason",
    "FunctionCall",
    "GenerationTurnResult",
    "InDoubtCause",
    "LoopClock",
    "LoopPolicy",
    "ModelReviewer",
    "Pass",
    "Provider",
    "ProviderError",
    "ProviderRequest",
    "ReviewPacket",
    "Reviewer",
    "Revise",
    "SceneMetadata",
    "SharedRoute",
    "TextDelta",
    "ThoughtDelta",
    "Tool",
    "ToolContext",
    "ToolRegistry",
    "ToolResult",
    "ToolSpec",
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
]
