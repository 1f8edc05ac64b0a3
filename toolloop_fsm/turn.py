"""The iteration state of a run: everything the inner machine (`TurnState`) and the outer
machine (`GenerationState`) remember.

`TurnState` is the model object the `transitions` declaration drives (it carries the
``state`` attribute). Its configuration (policy, tools, request: marked `SHARED`, which a
fork shares) stands apart from the run state, which is grouped in small records: the
current pass (`PassRecord`; its text and buffer stay on the state, read by every chunk), the
tool round in progress (`ToolRound`), the deliveries (`Deliveries`), what the turn produced
(`Produced`) and the draft (`DraftState`); the ledger, the conversation, the counters, the
ending and the step bookkeeping are fields of their own. docs/design.md §2 says which of
them a snapshot holds.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Mapping
from typing import TYPE_CHECKING
from typing import Any

from attrs import define
from attrs import field

from toolloop_fsm.budgets import AttemptBudget
from toolloop_fsm.budgets import Room
from toolloop_fsm.events import DeadlineKind
from toolloop_fsm.events import FinishKind
from toolloop_fsm.events import FunctionCall
from toolloop_fsm.fork import ITEMS_SHARED
from toolloop_fsm.fork import SHARED

# the ledger's values are read from here too (by the shells and tests)
from toolloop_fsm.ledger import LedgerEntry as LedgerEntry
from toolloop_fsm.ledger import ToolOutcome as ToolOutcome
from toolloop_fsm.ledger import canonical_call_key as canonical_call_key
from toolloop_fsm.ledger import occurrence_key as occurrence_key
from toolloop_fsm.result import AttemptFailure
from toolloop_fsm.result import AttemptRecord
from toolloop_fsm.result import BudgetExceeded
from toolloop_fsm.result import Delivered
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.result import Notice
from toolloop_fsm.result import StreamResult
from toolloop_fsm.result import ToolHistoryEntry
from toolloop_fsm.result import TraceStep
from toolloop_fsm.result import TurnStatus
from toolloop_fsm.result import UsageEntry
from toolloop_fsm.review import Finding
from toolloop_fsm.review import ReviewRecord

if TYPE_CHECKING:
    from toolloop_fsm.approvals import ApprovalRequest
    from toolloop_fsm.attempts import AttemptPlan
    from toolloop_fsm.attempts import KeyHealth
    from toolloop_fsm.effects import Effect
    from toolloop_fsm.host import ToolRegistry
    from toolloop_fsm.host import TurnRequest
    from toolloop_fsm.messages import HeldMessage
    from toolloop_fsm.messages import TakenMessage
    from toolloop_fsm.policy import LoopPolicy
    from toolloop_fsm.policy import TurnPolicy
    from toolloop_fsm.provider import ProviderRequest
    from toolloop_fsm.provider import ToolSpec


def call_key_of_pending(turn: TurnState, call: FunctionCall) -> str:
    """`canonical_call_key` of the turn's pending ``call``, computed once per call: the
    replay gate and the dispatch that follows it both ask. A provider's call is a value the
    engine never changes, so the same object has the same key."""
    tool_round = turn.tool_round
    cached = tool_round.pending_call_key
    if cached is not None and cached[0] is call:
        return cached[1]
    key = canonical_call_key(call.name, call.arguments)
    tool_round.pending_call_key = (call, key)
    return key


def next_occurrence(turn: TurnState, call_key: str) -> str:
    """The ledger key the next identical call of the current scope would take."""
    seen = turn.occurrences.get(call_key, 0) if turn.occurrences is not None else 0
    return occurrence_key(call_key, seen + 1)


def take_occurrence(turn: TurnState, call_key: str) -> str:
    """Count one more identical call in the current scope; returns its ledger key."""
    occurrences = turn.occurrences
    if occurrences is None:
        occurrences = turn.occurrences = {}
    seen = occurrences.get(call_key, 0) + 1
    occurrences[call_key] = seen
    return occurrence_key(call_key, seen)


def call_with_deadline(turn: TurnState, token: int) -> BatchCall | None:
    """The running call of the batch whose ``TOOL`` deadline has ``token``."""
    for call in turn.tool_round.calls:
        if call.deadline == token:
            return call
    return None


@define(slots=True)
class HeldSegment:
    """One piece of held presentation: text (``expression`` is ``None``) or an expression."""

    text: str | None = None
    expression: str | None = None


@define(slots=True)
class DraftState:
    """Drafting and the tool checkpoint of one turn: the held presentation, the held-prose
    ceiling's consumption, the review budgets and the checkpoint's rejections. One object is
    carried from attempt to attempt of a generation turn (review state is per turn)."""

    segments: list[HeldSegment] = field(factory=list)
    # the segments held before the last recorded tool round: narration that belongs to the
    # function history, carried to a next attempt with it
    committed_segments: int = 0
    # the function history a next attempt starts from (set only on a carried state)
    history: list[ToolHistoryEntry] = field(factory=list)
    # the ceiling counts everything held in the turn, across passes and revisions
    held_bytes: int = 0
    held_segments: int = 0
    cut: bool = False
    cut_by_send_limit: bool = False
    # an expression is held (it counts as the turn's one expression until a revision drops it)
    expression_held: bool = False
    # text a stop, a follow-up, a deadline or a failure discarded before it was held
    discarded: str = ""
    trigger: str | None = None
    reviews: int = 0
    revisions: int = 0
    reviewer_unavailable: bool = False
    last_findings: tuple[Finding, ...] = ()
    # the review being waited for (its number), and what it is about
    review_seq: int = 0
    tool_reviews: int = 0
    corrections: int = 0
    checkpoint_unavailable: bool = False
    reviewing_correction: bool = False
    reviewing_identity: str | None = None
    # identity (SHA-256 of name and canonical arguments) -> the rejection shown
    rejected_calls: dict[str, ToolOutcome] = field(factory=dict)
    rejected_names: set[str] = field(factory=set)
    records: list[ReviewRecord] = field(factory=list)

    def held_text(self) -> str:
        return "".join(segment.text for segment in self.segments if segment.text is not None)

    def carried(self, history: Iterable[ToolHistoryEntry] = ()) -> DraftState:
        """The state a next attempt continues with: the function history (``history``, the
        attempt's tool rounds) with the narration held before them, the budgets, rejections
        and records. The failed pass's own held text is dropped: the next model writes it."""
        segments = list(self.segments[: self.committed_segments])
        return DraftState(
            segments=segments,
            expression_held=any(segment.expression is not None for segment in segments),
            committed_segments=self.committed_segments,
            history=list(history),
            held_bytes=self.held_bytes,
            held_segments=self.held_segments,
            reviews=self.reviews,
            revisions=self.revisions,
            reviewer_unavailable=self.reviewer_unavailable,
            last_findings=self.last_findings,
            review_seq=self.review_seq,
            tool_reviews=self.tool_reviews,
            corrections=self.corrections,
            checkpoint_unavailable=self.checkpoint_unavailable,
            rejected_calls=dict(self.rejected_calls),
            rejected_names=set(self.rejected_names),
            records=list(self.records),
        )


@define(slots=True)
class ReadCount:
    """The running count behind the usage estimate's input (docs/behaviour.md §2.2 rule 3):
    the messages, history entries and tools of the last request counted, and their token
    weight (`toolloop_fsm.result.token_weight`, which adds up piece by piece). A turn's next
    request is its last one plus a tool round (or a context restart's message), so only what
    is new is measured; what was counted is checked against each request — the same items, as
    the same objects, in the same order — and counted afresh when any of it was rewritten or
    dropped (a revision clears the narration of every history entry; a resumed turn starts a
    new count)."""

    context: tuple[Mapping[str, Any], ...] = ()
    context_weight: int = 0
    history: tuple[ToolHistoryEntry, ...] = ()
    history_weight: int = 0
    tools: tuple[ToolSpec, ...] | None = None
    tools_weight: int = 0


@define(slots=True, weakref_slot=False)
class PassRecord:
    """The pass being streamed, beyond its text: its thoughts, how it finished, its usage,
    what it asked and whether any chunk answered it (a pass the provider answered without
    a usage report is recorded with an estimate), and the calls it ignored. Lists a turn
    may never need are made on first use: a turn waiting on its provider stays small."""

    thoughts: list[str] | None = None
    finish: FinishKind | None = None
    usage: UsageEntry | None = None
    request: ProviderRequest | None = None
    answered: bool = False
    ignored_calls: list[str] | None = None
    #: the token of the pass's stream deadline while it is armed
    deadline: int | None = None
    #: what the budgets let the pass write (docs/behaviour.md §2.8; ``None``: no budget)
    room: Room | None = None


@define(slots=True, weakref_slot=False)
class BatchCall:
    """One call of the tool batch: the call as the provider emitted it, its place in the
    batch, whether the gate admitted it, its ledger key once taken (in emitted order), its
    dispatch number and deadline token while it runs, and its outcome once decided."""

    call: FunctionCall
    position: int
    admitted: bool = False
    occurrence: str | None = None
    dispatch: int | None = None
    #: the token of the call's own ``TOOL`` deadline while it is armed
    deadline: int | None = None
    outcome: ToolOutcome | None = None
    #: the call was cut off at its deadline and its outcome is still owed (§3.9)
    cut_off: bool = False
    #: the call waits for a person's approval (§3.13): it does not run in this batch
    awaiting: bool = False
    #: the tool's ``needs_approval`` predicate raised on the call's arguments
    predicate_error: str | None = None

    @property
    def running(self) -> bool:
        """Dispatched, and its outcome not yet known (a cut-off call's is still owed)."""
        return self.dispatch is not None and self.outcome is None


@define(slots=True, weakref_slot=False)
class ToolRound:
    """The tool batch in progress (docs/behaviour.md §3.10): every call of the pass, in
    emitted order; the call at the gate (``pending_call``, the gate's guards read it, with
    its key computed once: the replay gate and the admission both need it); how many calls
    run, how many admitted ones wait, where the next start looks, and whether a
    ``sequential`` call runs (a barrier)."""

    calls: list[BatchCall] = field(factory=list)
    gated: int = 0
    pending_call: FunctionCall | None = None
    pending_call_key: tuple[FunctionCall, str] | None = None
    running: int = 0
    queued: int = 0
    next_start: int = 0
    barrier: bool = False
    #: the batch's outcomes are recorded (or restarted from): it no longer ends with the turn
    recorded: bool = False
    #: how many of its calls wait for approval (§3.13)
    awaiting: int = 0
    #: what the ``needs_approval`` predicate of the call at the gate raised, if it did
    approval_error: str | None = None


@define(slots=True, weakref_slot=False)
class Deliveries:
    """What the turn handed its channel: the next sequence number, the deliveries in flight
    (by sequence number) and those confirmed, and whether visible text was delivered."""

    next_seq: int = 0
    in_flight: dict[int, Delivered] = field(factory=dict)
    delivered: list[Delivered] | None = None
    visible_text_delivered: bool = False


@define(slots=True, weakref_slot=False)
class Produced:
    """What the turn produced so far, for its result: each pass's stream result and usage,
    the notices posted and the one held, the last thoughts and text, the scene metadata,
    and the stale follow-ups cleared while a tool ran."""

    stream_results: list[StreamResult] | None = None
    usage: list[UsageEntry] | None = None
    notices: list[Notice] | None = None
    held_notice: Notice | None = None
    thought_log: str = ""
    last_text: str = ""
    scene_metadata: list[str] | None = None
    follow_ups_cleared: int = 0


@define(slots=True)
class TurnState:
    """Mutable state of one run of the inner machine (the `transitions` model)."""

    # the configuration: read-only, shared by a fork (`toolloop_fsm.fork`)
    policy: LoopPolicy = field(metadata=SHARED)
    registry: ToolRegistry = field(metadata=SHARED)
    request: TurnRequest = field(metadata=SHARED)
    state: str = "ready"
    continuation_style: bool = False
    hold_timeout_notice: bool = False
    ledger: dict[str, LedgerEntry] = field(factory=dict)
    expression_delivered: bool = False
    # identical calls seen in the current replay scope (this attempt, or since the last
    # context restart), by call key: the n-th one replays the n-th recorded outcome
    occurrences: dict[str, int] | None = None

    # the conversation as the next pass will see it
    context: list[Mapping[str, Any]] = field(factory=list, metadata=ITEMS_SHARED)
    history: list[ToolHistoryEntry] | None = None
    prefill: str | None = None
    # messages that arrived while the turn runs (docs/behaviour.md §8.5): those held, those
    # taken into the context, and how many history entries the context holds since
    held_messages: list[HeldMessage] | None = None
    taken_messages: list[TakenMessage] | None = None
    history_in_context: int = 0
    # immutable until something is disabled: most turns never disable anything
    disabled_tools: frozenset[str] = frozenset()
    disabled_enrichment_kinds: frozenset[str] = frozenset()

    # counters
    iterations: int = 0
    dispatches: int = 0
    # the calls admitted to run this turn (the tool-call limit's count, docs/behaviour.md
    # §3.12): a refusal and a reuse from the ledger take none
    tool_calls_used: int = 0
    # the current pass is the final answer pass, offered no tools, and the ceiling that made
    # it one ("tool_call_limit" or "iteration_ceiling"); decided as the pass opens
    tools_withdrawn: str | None = None
    # what bounds this attempt besides its policy's budget: its model's price, and the
    # chain's budget with what earlier attempts spent (docs/behaviour.md §2.8)
    attempt_budget: AttemptBudget | None = None
    # the ceiling the turn reached, once it did
    budget_exceeded: BudgetExceeded | None = None
    consecutive_tool_errors: int = 0
    continuation_failures: int = 0
    suppress_text: bool = False
    last_tool: str | None = None
    tool_response_delivered: bool = False

    # the current pass's text and undelivered buffer, which every text chunk reads and
    # writes, stay on the state itself (one attribute each on the per-chunk path): the
    # undelivered buffer is pass_text[buffer_start:] (one list, one append per chunk); what
    # was flushed before it is there as the flushed texts themselves
    pass_text: list[str] = field(factory=list)
    buffer_start: int = 0
    buffer_len: int = 0
    flush_chars: int = 200
    # what the current pass may still write under a budget, in `token_weight` parts (``None``:
    # no budget; read per chunk, so it stays on the state itself)
    write_room: int | None = None
    # the rest of the current pass, and the tool round in progress (neither is in a
    # snapshot: a resumed turn restarts the pass)
    current_pass: PassRecord = field(factory=PassRecord)
    tool_round: ToolRound = field(factory=ToolRound)
    # the narration before the round's call (kept: it decides how the round ends)
    pre_tool_text: str | None = None
    #: the tools of the last recorded batch, in emitted order (the settle rule reads them)
    last_tools: tuple[str, ...] = ()

    # deadlines: the token of each armed kind but the pass's stream deadline and the tool's
    # (the pass record and the tool round keep those: the kinds armed on every pass)
    next_token: int = 0
    armed: dict[DeadlineKind, int] = field(factory=dict)
    deliveries: Deliveries = field(factory=Deliveries)

    # what the turn produced, and how it ends (the ending's fields are set by the
    # declaration's endings, on both machines' states alike)
    produced: Produced = field(factory=Produced)
    status: TurnStatus | None = None
    reason: str | None = None
    stop_message: str | None = None
    error_message: str | None = None
    provider_error_kind: str | None = None
    provider_error_retryable: bool | None = None
    provider_retry_after: float | None = None
    settle_started: bool = False
    # drafting and the tool checkpoint (``None`` when both are off: today's loop exactly)
    draft: DraftState | None = None
    # offer a snapshot at each stable point (the host passed ``on_snapshot``)
    snapshots: bool = False

    # bookkeeping of the step being processed; ``step_time`` is the time its driver gave
    # (the turn's clock), stamped on its trace steps and read by nothing else
    current_event: Any = None
    step_time: float | None = None
    effects: list[Effect] = field(factory=list)
    trace: list[TraceStep] = field(factory=list)
    # computed once, kept while what they derive from is the same object: the tools the turn
    # offers (each pass and each call's gate), until `disabled_tools` is replaced
    allowed_tools: tuple[frozenset[str], tuple[str, ...]] | None = None
    # the specs of those tools, kept while the names are the same tuple; and the running
    # count of what the requests gave the model to read (the usage estimate of a pass
    # without a report: each message, history entry and tool set measured once)
    offered_specs: tuple[tuple[str, ...], tuple[ToolSpec, ...]] | None = None
    read_count: ReadCount | None = None


@define(slots=True)
class GenerationState:
    """Mutable state of one run of the outer machine (its `transitions` model)."""

    # the configuration: read-only, shared by a fork (`toolloop_fsm.fork`)
    policy: TurnPolicy = field(metadata=SHARED)
    request: TurnRequest = field(metadata=SHARED)
    tool_specs: tuple[ToolSpec, ...] = field(metadata=SHARED)
    # the chain: grows by the shared route's plans once admitted (run state)
    plans: list[AttemptPlan] = field(metadata=ITEMS_SHARED)
    shared_plans: tuple[AttemptPlan, ...] = ()
    health: dict[tuple[str, int], KeyHealth] = field(factory=dict)
    state: str = "ready"
    now: float = 0.0

    # where the chain stands
    model: int = -1
    key: int | None = None
    keys_tried: dict[int, list[int | None]] = field(factory=dict)
    attempts: int = 0
    credential_source: str = "user"
    admission_asked: bool = False
    admitted: bool = False
    unreachable: bool = False
    signals_pending: bool = False

    # what carries from attempt to attempt
    carried_text: str = ""
    ledger: dict[str, LedgerEntry] = field(factory=dict)
    expression_delivered: bool = False
    held_notice: Notice | None = None
    draft: DraftState | None = None

    # what the attempts produced
    last: GenerationTurnResult | None = None
    results: list[GenerationTurnResult] = field(factory=list)
    records: list[AttemptRecord] = field(factory=list)
    failures: list[AttemptFailure] = field(factory=list)
    notices: list[Notice] = field(factory=list)
    status: TurnStatus | None = None
    reason: str | None = None
    stop_message: str | None = None
    #: the turn paused for approval: the calls and the chain's snapshot (§3.13)
    approval: ApprovalRequest | None = None

    current_event: Any = None
    # the time its driver gave for the step being processed, stamped on its trace steps
    # (``now`` above is the time decisions read)
    step_time: float | None = None
    effects: list[Effect] = field(factory=list)
    trace: list[TraceStep] = field(factory=list)
