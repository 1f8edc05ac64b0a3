"""toolloop-fsm: one LLM generation turn — stream, dispatch tools, restart, fall back,
assemble — as an explicit finite-state machine.

The root holds what a host needs to run turns: the two run functions (and the two that
resume a turn from a `TurnSnapshot`, with the snapshot's JSON form), the tool and host
types, the policies, attempts, results, the provider contract, the chunk events a provider
yields, the reviewer protocol with its packet and verdicts and the ready `ModelReviewer`, the
two machines and `InvalidEvent`. Hosts that drive the machines themselves find
every event and effect in `toolloop_fsm.sansio`; the test kit lives in `toolloop_fsm.testing`.
"""

import logging as _logging

from toolloop_fsm.attempts import AdmissionRequest, Attempt, KeyBook, SharedRoute
from toolloop_fsm.errors import InvalidEvent
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
from toolloop_fsm.generation import GenerationTurnMachine
from toolloop_fsm.host import (
    Channel,
    Clock,
    DestinationUnreachable,
    LoopClock,
    Tool,
    ToolContext,
    ToolRegistry,
    ToolResult,
    TurnRequest,
    TurnSignals,
)
from toolloop_fsm.machine import ToolLoopMachine
from toolloop_fsm.model_reviewer import ModelReviewer
from toolloop_fsm.policy import ExitView, LoopPolicy, TurnPolicy
from toolloop_fsm.provider import Provider, ProviderError, ProviderRequest, ToolSpec
from toolloop_fsm.pump import (
    resume_generation_turn,
    resume_tool_loop,
    run_generation_turn,
    run_tool_loop,
)
from toolloop_fsm.result import (
    AttemptRecord,
    Delivered,
    GenerationTurnResult,
    InDoubtCall,
    InDoubtCause,
    Notice,
    ToolHistoryEntry,
    TraceStep,
    TurnStatus,
    UsageLedger,
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
    "AdmissionRequest",
    "Attempt",
    "AttemptRecord",
    "Channel",
    "Clock",
    "ContextRestart",
    "Delivered",
    "DestinationUnreachable",
    "ExitView",
    "Finding",
    "FinishKind",
    "FinishReason",
    "FunctionCall",
    "GenerationTurnMachine",
    "GenerationTurnResult",
    "InDoubtCall",
    "InDoubtCause",
    "InvalidEvent",
    "KeyBook",
    "LoopClock",
    "LoopPolicy",
    "ModelReviewer",
    "Notice",
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
    "ToolHistoryEntry",
    "ToolLoopMachine",
    "ToolRegistry",
    "ToolResult",
    "ToolSpec",
    "TraceStep",
    "TurnPolicy",
    "TurnRequest",
    "TurnSignals",
    "TurnSnapshot",
    "TurnStatus",
    "Unavailable",
    "UsageLedger",
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
