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

from toolloop_fsm.attempts import AttemptPlan
from toolloop_fsm.attempts import KeyBook
from toolloop_fsm.attempts import KeyHealth
from toolloop_fsm.effects import ArmDeadline
from toolloop_fsm.effects import AskAdmission
from toolloop_fsm.effects import CancelReview
from toolloop_fsm.effects import CancelStream
from toolloop_fsm.effects import CancelTool
from toolloop_fsm.effects import ClearDeadline
from toolloop_fsm.effects import CutStream
from toolloop_fsm.effects import Deliver
from toolloop_fsm.effects import Effect
from toolloop_fsm.effects import Finish
from toolloop_fsm.effects import OfferSnapshot
from toolloop_fsm.effects import PostNotice
from toolloop_fsm.effects import QueueStopResponse
from toolloop_fsm.effects import RequestReview
from toolloop_fsm.effects import RunTool
from toolloop_fsm.effects import StartAttempt
from toolloop_fsm.effects import StartStream
from toolloop_fsm.effects import SupersedeAttempt
from toolloop_fsm.effects import UpdateKeyHealth
from toolloop_fsm.errors import InvalidEvent
from toolloop_fsm.events import AdmissionDecided
from toolloop_fsm.events import AttemptFinished
from toolloop_fsm.events import Chunk
from toolloop_fsm.events import ContextRestart
from toolloop_fsm.events import DeadlineExpired
from toolloop_fsm.events import DeadlineKind
from toolloop_fsm.events import DeliveryFailed
from toolloop_fsm.events import DeliveryRecorded
from toolloop_fsm.events import Event
from toolloop_fsm.events import FinishKind
from toolloop_fsm.events import FinishReason
from toolloop_fsm.events import FollowUpArrived
from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import MessageHeld
from toolloop_fsm.events import ReviewReturned
from toolloop_fsm.events import SceneMetadata
from toolloop_fsm.events import StopRequested
from toolloop_fsm.events import StreamEnded
from toolloop_fsm.events import StreamFailed
from toolloop_fsm.events import TextDelta
from toolloop_fsm.events import ThoughtDelta
from toolloop_fsm.events import ToolFinished
from toolloop_fsm.events import ToolOutcomeKind
from toolloop_fsm.events import UnreachableReported
from toolloop_fsm.events import UsageReport
from toolloop_fsm.generation import GenerationTurnMachine
from toolloop_fsm.machine import ToolLoopMachine
from toolloop_fsm.reference import ReferenceRunner
from toolloop_fsm.result import Notice
from toolloop_fsm.result import TraceStep

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
    "MessageHeld",
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
