"""What flows into the machines: provider chunks, pump-reported outcomes and host signals.

Every event is a frozen, slotted attrs value. Providers yield the *chunk* events
(`TextDelta`, `ThoughtDelta`, `UsageReport`, `FunctionCall`, `FinishReason`,
`SceneMetadata`); the event pump turns everything else that happens (stream end, stream
failure, a tool's outcome, a deadline, a signal, a delivery) into the other events here.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated
from typing import Any

from attrs import field
from attrs import frozen

from toolloop_fsm.event_checks import AtLeast
from toolloop_fsm.messages import HeldMessage


# --------------------------------------------------------------------------- provider chunks
@frozen
class TextDelta:
    """Visible assistant text, as streamed."""

    text: str


@frozen
class ThoughtDelta:
    """Reasoning / thinking text; never delivered to the channel, kept in the thought log."""

    text: str
    signature: str | None = None


@frozen
class UsageReport:
    """Token usage the provider reported for the current pass.

    Providers report either a running total or a final figure; the ledger keeps the last
    report of each pass (``cumulative=True``, the default) or adds reports up
    (``cumulative=False``). ``estimated`` marks figures the library computed itself.
    """

    input_tokens: Annotated[int, AtLeast(0)]
    output_tokens: Annotated[int, AtLeast(0)]
    cumulative: bool = True
    estimated: bool = False


@frozen
class FunctionCall:
    """A tool call the model asked for, assembled by the provider adapter.

    ``arguments`` is the decoded JSON object. When the adapter had to repair a cut-off JSON
    payload it sets ``truncated=True`` (the loop refuses to run the call). When the payload
    is malformed rather than truncated, ``parse_error`` says why and ``arguments`` holds the
    raw text. ``provider_data`` carries opaque values that must be sent back to the same
    provider with the call (for example a Gemini ``thoughtSignature``).
    """

    name: str
    arguments: Any
    call_id: str | None = None
    truncated: bool = False
    parse_error: str | None = None
    provider_data: Mapping[str, Any] | None = field(default=None, eq=False)


class FinishKind(StrEnum):
    """Why the provider says a pass stopped, normalised across providers."""

    STOP = "stop"
    LENGTH = "length"
    TOOL_CALLS = "tool_calls"
    CONTENT_FILTER = "content_filter"
    REFUSAL = "refusal"
    SPEAKER_GUARD = "speaker_guard"
    CONTINUATION_PENDING = "continuation_pending"
    OTHER = "other"


@frozen
class FinishReason:
    """The provider's finish reason for this pass (``raw`` keeps the provider's own word)."""

    kind: FinishKind
    raw: str | None = None


@frozen
class SceneMetadata:
    """Provider scene metadata, appended to the final text as a ``[Scene Metadata]`` block."""

    text: str


Chunk = TextDelta | ThoughtDelta | UsageReport | FunctionCall | FinishReason | SceneMetadata
CHUNK_TYPES: tuple[type, ...] = (
    TextDelta,
    ThoughtDelta,
    UsageReport,
    FunctionCall,
    FinishReason,
    SceneMetadata,
)


# --------------------------------------------------------------------------- pump-reported events
@frozen
class StreamEnded:
    """The provider's stream for the current pass finished normally."""


@frozen
class StreamFailed:
    """The provider's stream raised; the fields mirror `ProviderError`."""

    message: str
    kind: str = "provider_error"
    retryable: bool = True
    status_code: int | None = None
    retry_after: float | None = None


class ToolOutcomeKind(StrEnum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    RAISED = "raised"


@frozen
class ToolFinished:
    """A dispatched tool returned (or raised). ``dispatch`` identifies the dispatch."""

    dispatch: int
    kind: ToolOutcomeKind
    data: Any = None
    message: str | None = None
    end_turn: bool = False
    delivered: bool = False
    expression: str | None = None
    context_restart: ContextRestart | None = None
    error: str | None = None
    #: the call was cut off mid-run and nobody could tell what it did (docs/behaviour.md §3.9):
    #: a failure that may have taken effect, so a replay reuses it instead of running it again
    in_doubt: bool = False


@frozen
class ContextRestart:
    """A context-enrichment signal carried by a successful tool result (docs/behaviour.md §5)."""

    item: Mapping[str, Any]
    disable_kinds: tuple[str, ...] = ()


class DeadlineKind(StrEnum):
    """What a deadline bounds. A pass arms one ``STREAM`` deadline; it expires as
    ``FIRST_TOKEN`` before the pass's first chunk, as ``INACTIVITY`` after it, and as
    ``PASS_DURATION`` when the pass's total budget is spent however steadily it streams."""

    STREAM = "stream"
    FIRST_TOKEN = "first_token"
    INACTIVITY = "inactivity"
    PASS_DURATION = "pass_duration"
    TOOL = "tool"
    SETTLE = "settle"
    #: a review of a drafted reply or of a proposed tool call (`LoopPolicy.review_timeout`)
    REVIEW = "review"


@frozen
class DeadlineExpired:
    """A deadline the machine armed expired. ``token`` matches the `ArmDeadline` effect."""

    kind: DeadlineKind
    token: int


@frozen
class StopRequested:
    """The host asked to stop the turn (/kill), optionally with a message to queue first."""

    stop_message: str | None = None


@frozen
class FollowUpArrived:
    """A new user message arrived for this conversation while the turn ran."""


@frozen
class MessageHeld:
    """A user message to steer the turn or to be answered before it ends arrived
    (`TurnSignals.steer`, `TurnSignals.queue`): the turn holds it (docs/behaviour.md §8.5)."""

    message: HeldMessage


@frozen
class DeliveryRecorded:
    """The channel accepted delivery ``seq`` (a `Deliver` effect)."""

    seq: int


@frozen
class DeliveryFailed:
    """The host's channel raised while delivering ``seq`` (``None``: a notice or the stop
    message)."""

    seq: int | None
    error: str
    #: the host's code did not return within the policy's ``host_call_timeout``
    timed_out: bool = False


@frozen
class ReviewReturned:
    """The reviewer answered review ``review`` (the `RequestReview` effect's number) with
    ``verdict`` (a `toolloop_fsm.review` verdict: `Pass`, `Revise` or `Unavailable`; a
    reviewer that raised is reported as `Unavailable`)."""

    review: int
    verdict: Any


# --------------------------------------------------------------------------- outer tier
@frozen
class AttemptFinished:
    """Attempt ``attempt`` of the generation turn ended with ``result``.

    ``ledger`` is the attempt's record of completed tool calls (carried into the next
    attempt); ``at`` is the clock's time; ``signals_pending`` says a stop or a follow-up
    is pending in the host's signals.
    """

    attempt: int
    result: Any
    ledger: Mapping[str, Any] = field(factory=dict)
    at: float = 0.0
    signals_pending: bool = False
    #: the attempt's review state (drafting, the tool checkpoint), carried into the next
    draft: Any = field(default=None, kw_only=True)


@frozen
class AdmissionDecided:
    """The host's admission policy answered: may the turn use the shared route?"""

    admitted: bool
    at: float = 0.0


@frozen
class UnreachableReported:
    """The host reports that the turn's destination (the channel) cannot be reached.

    ``partial`` is the result of the attempt that was running, as far as it got (what it
    delivered stays delivered), or ``None`` between attempts."""

    partial: Any = None


Event = (
    TextDelta
    | ThoughtDelta
    | UsageReport
    | FunctionCall
    | FinishReason
    | SceneMetadata
    | StreamEnded
    | StreamFailed
    | ToolFinished
    | DeadlineExpired
    | StopRequested
    | FollowUpArrived
    | MessageHeld
    | DeliveryRecorded
    | DeliveryFailed
    | ReviewReturned
    | AttemptFinished
    | AdmissionDecided
    | UnreachableReported
)
