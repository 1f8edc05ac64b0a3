"""The sans-IO surface: everything a host needs to drive the machines itself.

`ToolLoopMachine` (one attempt's tool loop) and `GenerationTurnMachine` (the attempts of a
generation turn) take events and return effects; they do no I/O, read no clock and never
await; an event the current state cannot take raises `InvalidEvent`. A host that runs its
own event loop (or none) feeds them the events below and carries out the effects (a
`PostNotice` carries a `Notice`; the machines' ``trace`` is of `TraceStep`;
`GenerationTurnMachine.start` takes the key health as a `KeyBook`);
`toolloop_fsm.run_tool_loop` and `run_generation_turn` are the library's own asyncio pump
doing exactly that. `ReferenceRunner` runs a declaration on `transitions` itself, for
debugging a turn step by step against the compiled tables. A machine built with
``snapshots=True`` offers an `OfferSnapshot` at each stable point, and ``resume`` continues
a turn from one (`toolloop_fsm.snapshot`).
"""

from toolloop_fsm.attempts import AttemptPlan, KeyBook, KeyHealth
from toolloop_fsm.effects import (
    ArmDeadline,
    AskAdmission,
    CancelReview,
    CancelStream,
    CancelTool,
    ClearDeadline,
    CutStream,
    Deliver,
    Effect,
    Finish,
    OfferSnapshot,
    PostNotice,
    QueueStopResponse,
    RequestReview,
    RunTool,
    StartAttempt,
    StartStream,
    SupersedeAttempt,
    UpdateKeyHealth,
)
from toolloop_fsm.errors import InvalidEvent
from toolloop_fsm.events import (
    AdmissionDecided,
    AttemptFinished,
    Chunk,
    ContextRestart,
    DeadlineExpired,
    DeadlineKind,
    DeliveryFailed,
    DeliveryRecorded,
    Event,
    FinishKind,
    FinishReason,
    FollowUpArrived,
    FunctionCall,
    ReviewReturned,
    SceneMetadata,
    StopRequested,
    StreamEnded,
    StreamFailed,
    TextDelta,
    ThoughtDelta,
    ToolFinished,
    ToolOutcomeKind,
    UnreachableReported,
    UsageReport,
)
from toolloop_fsm.generation import GenerationTurnMachine
from toolloop_fsm.machine import ToolLoopMachine
from toolloop_fsm.reference import ReferenceRunner
from toolloop_fsm.result import Notice, TraceStep

__all__ = [
    "AdmissionDecided",
    "ArmDeadline",
    "AskAdmission",
    "AttemptFinished",
    "AttemptPlan",
    "CancelReview",
    "CancelStream",
    "CancelTool",
    "Chunk",
    "ClearDeadline",
    "ContextRestart",
    "CutStream",
    "DeadlineExpired",
    "DeadlineKind",
    "Deliver",
    "DeliveryFailed",
    "DeliveryRecorded",
    "Effect",
    "Event",
    "Finish",
    "FinishKind",
    "FinishReason",
    "FollowUpArrived",
    "FunctionCall",
    "GenerationTurnMachine",
    "InvalidEvent",
    "KeyBook",
    "KeyHealth",
    "Notice",
    "OfferSnapshot",
    "PostNotice",
    "QueueStopResponse",
    "ReferenceRunner",
    "RequestReview",
    "ReviewReturned",
    "RunTool",
    "SceneMetadata",
    "StartAttempt",
    "StartStream",
    "StopRequested",
    "StreamEnded",
    "StreamFailed",
    "SupersedeAttempt",
    "TextDelta",
    "ThoughtDelta",
    "ToolFinished",
    "ToolLoopMachine",
    "ToolOutcomeKind",
    "TraceStep",
    "UnreachableReported",
    "UpdateKeyHealth",
    "UsageReport",
]
