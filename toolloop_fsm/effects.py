"""What flows out of the machines: instructions the event pump carries out.

The machines never perform I/O; they return these frozen values and the pump (or a test)
executes them. Each effect names exactly one thing to do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING
from typing import Any

from attrs import frozen

from toolloop_fsm.events import DeadlineKind

if TYPE_CHECKING:
    from toolloop_fsm.provider import ProviderRequest
    from toolloop_fsm.result import GenerationTurnResult
    from toolloop_fsm.result import Notice
    from toolloop_fsm.review import ReviewPacket
    from toolloop_fsm.snapshot import LoopSnapshot


@frozen
class StartStream:
    """Open the provider stream for pass number ``iteration`` with ``request``."""

    iteration: int
    request: ProviderRequest


@frozen
class CancelStream:
    """Stop reading the current provider stream and close it."""


@frozen
class RunTool:
    """Run tool ``name`` with ``arguments``; report a `ToolFinished` with ``dispatch``.

    Several may run at once (the calls of one tool batch), each under its own dispatch
    number and its own ``TOOL`` deadline (``timeout`` seconds): the `ArmDeadline` of that
    deadline follows each `RunTool` in the same list of effects. ``call_id`` is the
    provider's id of the call (``None`` for a provider that names none), ``position`` its
    place in its batch, in emitted order."""

    dispatch: int
    name: str
    arguments: Mapping[str, Any]
    call_key: str
    call_id: str | None = None
    position: int = 0
    timeout: float | None = None


@frozen
class CancelTool:
    """Cancel one running dispatch (its outcome is discarded; its siblings in the batch go
    on). With ``cut_off`` (the tool's
    deadline passed and it has a reconcile hook, docs/behaviour.md §3.9), the outcome is
    still owed: the shell reports a `ToolFinished` for the dispatch — the failure
    ``cut_off`` if the tool stopped, else its reconciled or unknown outcome."""

    dispatch: int
    cut_off: str | None = None


@frozen
class Deliver:
    """Deliver ``text`` (or an ``expression``) to the channel; report `DeliveryRecorded(seq)`."""

    seq: int
    text: str | None = None
    expression: str | None = None


@frozen
class PostNotice:
    """Post a notice for the host to localise and show (or log, when hidden)."""

    notice: Notice


@frozen
class QueueStopResponse:
    """Put the stop message at the front of the host's channel queue."""

    stop_message: str


@frozen
class ArmDeadline:
    """Arm a deadline of ``seconds`` on the clock.

    A ``rolling`` deadline is pushed back by every provider chunk and every recorded
    delivery: it fires only after ``seconds`` without activity. With ``first_seconds`` (the
    stream deadline of a pass) the window until the pass's first chunk is ``first_seconds``
    instead, and the deadline expires as ``FIRST_TOKEN`` then, ``INACTIVITY`` after. With
    ``total_seconds`` it also expires as ``PASS_DURATION`` that long after it was armed,
    whatever the activity (a stream that trickles forever still ends).
    """

    kind: DeadlineKind
    token: int
    seconds: float
    rolling: bool = False
    first_seconds: float | None = None
    total_seconds: float | None = None


@frozen
class ClearDeadline:
    """Disarm the deadline armed with ``token``."""

    kind: DeadlineKind
    token: int


@frozen
class Finish:
    """The turn is over; deliveries still in flight are abandoned."""

    result: GenerationTurnResult


# --------------------------------------------------------------------------- outer tier
@frozen
class StartAttempt:
    """Run attempt ``attempt``: model ``model`` of the chain with key ``key_index`` (an index
    into the attempt's keys; never the key itself), on ``request``, carrying ``ledger``."""

    attempt: int
    model: int
    label: str
    key_index: int | None
    route: str
    request: Any
    ledger: Mapping[str, Any]
    expression_delivered: bool = False
    #: the review state earlier attempts left (drafting, the tool checkpoint), or ``None``
    draft: Any = None
    #: the model's price and the chain's budget with what earlier attempts spent of it
    #: (`toolloop_fsm.budgets.AttemptBudget`), or ``None`` when neither is given
    budget: Any = None


@frozen
class AskAdmission:
    """Ask the host's admission policy whether the turn may use the shared route."""

    failures: tuple[Any, ...]


@frozen
class SupersedeAttempt:
    """Attempt ``attempt`` failed and another takes over; what it delivered stays delivered
    and becomes the next attempt's prefill (a host UI may mark it)."""

    attempt: int
    label: str
    delivered_text: str


@frozen
class UpdateKeyHealth:
    """Record the health of key ``key_index`` of ``label`` in the host's key book."""

    label: str
    key_index: int
    health: Any


@frozen
class CutStream:
    """The pass reached the held-prose ceiling, or the room a token or cost budget left it:
    stop reading its stream and close it (the provider's request is aborted, so it stops
    generating text nobody can be shown or pay for), then report the pass ended
    (`StreamEnded`). The text kept so far is the pass's text."""


@frozen
class RequestReview:
    """Ask the reviewer about ``packet`` (a drafted reply or a proposed tool call) and report
    its verdict as `ReviewReturned` with the same ``review`` number. The machine bounds the
    wait with a ``REVIEW`` deadline."""

    review: int
    packet: ReviewPacket


@frozen
class CancelReview:
    """Stop waiting for review ``review``: cancel the reviewer's call (its verdict, should it
    come, is never taken)."""

    review: int


@frozen
class OfferSnapshot:
    """The turn is at a stable point (entering ``starting_pass``): hand ``snapshot`` to the
    host's ``on_snapshot``. Emitted only by a machine asked for snapshots."""

    snapshot: LoopSnapshot


Effect = (
    StartStream
    | CancelStream
    | CutStream
    | RequestReview
    | CancelReview
    | RunTool
    | CancelTool
    | Deliver
    | PostNotice
    | QueueStopResponse
    | ArmDeadline
    | ClearDeadline
    | Finish
    | StartAttempt
    | AskAdmission
    | SupersedeAttempt
    | UpdateKeyHealth
    | OfferSnapshot
)
