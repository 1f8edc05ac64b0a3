"""Durable turns: `TurnSnapshot`, the machines' state at a stable point, and its JSON form.

A **stable point** is a moment where everything a turn needs to go on is plain data and
nothing is half done: the inner machine entering ``starting_pass`` (before each pass: at the
turn's start, after a tool outcome is recorded, after a context restart, after a revision),
and the outer tier as it starts an attempt. A snapshot holds the data of that moment — the
request with its ``turn_id``, the context and history as they stand, the ledger with its
occurrence counts, every counter, what was delivered and what was still in flight, usage,
notices, the drafting state and, for a generation turn, where the fallback chain stands —
and never a provider, a tool, a channel or a policy: the host passes those again when it
resumes (`resume_tool_loop`, `resume_generation_turn`). The snapshot records what its state
depends on — the registered tools (the tool loop's with their follow-up and replay
settings), the chain's labels and the policy's terms (every field but the time budgets a
resume may change, `RESUMABLE_POLICY_FIELDS`) — and a resume refuses a host that gives
anything else, naming the field.

`snapshot_to_json` / `snapshot_from_json` carry a snapshot as JSON text. Reading is strict
and safe on untrusted text: text too large or nested too deep (checked before parsing), an
unknown ``version``, text that is not a snapshot, a missing field, an unknown field or a
field of the wrong type raises `SnapshotError` naming the field (a bounded list of them),
never any other exception, and nothing is restored.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import attrs
import cattrs
from attrs import field, frozen

from toolloop_fsm.attempts import AttemptPlan, KeyHealth
from toolloop_fsm.host import TurnRequest
from toolloop_fsm.result import (
    AttemptFailure,
    AttemptRecord,
    Delivered,
    GenerationTurnResult,
    Notice,
    StreamResult,
    ToolHistoryEntry,
    TraceStep,
    UsageEntry,
    make_converter,
)
from toolloop_fsm.review import Finding, ReviewRecord
from toolloop_fsm.turn import (
    DraftState,
    GenerationState,
    HeldSegment,
    LedgerEntry,
    ToolOutcome,
    TurnState,
)

if TYPE_CHECKING:
    from toolloop_fsm.host import Tool, ToolRegistry
    from toolloop_fsm.policy import LoopPolicy, TurnPolicy
    from toolloop_fsm.provider import ToolSpec

#: The snapshot format this library writes and reads. Version 2 records the policy and tool
#: settings the turn ran under (version 1 did not, and is refused as unknown).
SNAPSHOT_VERSION = 2

#: The policy fields a resume may change: time budgets, which the resuming process measures
#: on its own clock (the pass that was running restarts with its whole budget anyway), and
#: the cooldowns a key failure starts from then on (those already running keep the time they
#: had left). Every other field — the switches, the ceilings and budgets the turn's counters
#: count against, the delivery flush (which fixes the restarted pass's sequence numbers) —
#: must be the one the snapshot records. The exit hook, host code, is not compared.
RESUMABLE_POLICY_FIELDS = frozenset({
    "inactivity_timeout", "first_token_timeout", "abandoned_stream_settle", "tool_timeout",
    "host_call_timeout", "cancel_grace", "max_pass_duration", "review_timeout",
    "rate_limit_cooldown", "failure_cooldown",
})  # fmt: skip


class SnapshotError(ValueError):
    """A snapshot that cannot be resumed: not a snapshot, an unknown version, a field that is
    missing or of the wrong type (named), or a host that no longer has what it names."""


# --------------------------------------------------------------------------- values
@frozen
class ToolTerms:
    """A registered tool's settings the turn's recorded state depends on: whether its outcome
    asks for a follow-up pass, and whether a replay reuses or reruns it."""

    name: str
    requires_follow_up: bool
    replay: str

    @classmethod
    def of(cls, tool: Tool) -> ToolTerms:
        return cls(tool.name, tool.requires_follow_up, tool.replay)


@frozen
class HeldPiece:
    """One piece of held presentation: text, or an expression (``text`` is ``None``)."""

    text: str | None = None
    expression: str | None = None


@frozen
class DraftSnapshot:
    """Drafting and the tool checkpoint as they stood: held presentation, the ceiling's
    consumption, review budgets, the checkpoint's rejections and the review records."""

    segments: tuple[HeldPiece, ...] = ()
    committed_segments: int = 0
    history: tuple[ToolHistoryEntry, ...] = ()
    held_bytes: int = 0
    held_segments: int = 0
    cut: bool = False
    cut_by_send_limit: bool = False
    expression_held: bool = False
    discarded: str = ""
    trigger: str | None = None
    reviews: int = 0
    revisions: int = 0
    reviewer_unavailable: bool = False
    last_findings: tuple[Finding, ...] = ()
    review_seq: int = 0
    tool_reviews: int = 0
    corrections: int = 0
    checkpoint_unavailable: bool = False
    reviewing_correction: bool = False
    reviewing_identity: str | None = None
    rejected_calls: Mapping[str, ToolOutcome] = field(factory=dict)
    rejected_names: frozenset[str] = frozenset()
    records: tuple[ReviewRecord, ...] = ()


@frozen
class LoopSnapshot:
    """The inner machine entering ``starting_pass``: everything the next pass and the rest of
    the turn read. ``in_flight`` are the deliveries handed to the channel and not confirmed
    yet: a resume sends them again under the same sequence numbers (so the same idempotency
    keys). ``tools`` are the tools registered when it was taken and ``policy_terms`` the
    policy's fields but the `RESUMABLE_POLICY_FIELDS`, both of which a resume must give
    again."""

    request: TurnRequest
    context: tuple[Mapping[str, Any], ...]
    history: tuple[ToolHistoryEntry, ...] | None
    prefill: str | None
    ledger: Mapping[str, LedgerEntry]
    occurrences: Mapping[str, int] | None
    continuation_style: bool
    hold_timeout_notice: bool
    expression_delivered: bool
    disabled_tools: frozenset[str]
    disabled_enrichment_kinds: frozenset[str]
    iterations: int
    dispatches: int
    consecutive_tool_errors: int
    continuation_failures: int
    suppress_text: bool
    last_tool: str | None
    tool_response_delivered: bool
    pre_tool_text: str | None
    next_seq: int
    delivered: tuple[Delivered, ...]
    in_flight: tuple[Delivered, ...]
    visible_text_delivered: bool
    stream_results: tuple[StreamResult, ...]
    usage: tuple[UsageEntry, ...]
    notices: tuple[Notice, ...]
    held_notice: Notice | None
    thought_log: str
    last_text: str
    scene_metadata: tuple[str, ...]
    follow_ups_cleared: int
    draft: DraftSnapshot | None
    trace: tuple[TraceStep, ...]
    tools: tuple[ToolTerms, ...]
    policy_terms: Mapping[str, Any]


@frozen
class KeysTried:
    """The keys (by index; ``None``: a keyless model) tried so far on model ``model``."""

    model: int
    keys: tuple[int | None, ...]


@frozen
class KeyHealthEntry:
    """The health of key ``key`` of the model labelled ``label``."""

    label: str
    key: int
    health: KeyHealth


@frozen
class ChainSnapshot:
    """The outer tier as it starts attempt ``attempts`` (model ``model``, key ``key``): the
    plan position, key health, whose credentials, the admission flags, what earlier attempts
    delivered (carried as the prefill), their ledger and review state, and their results,
    records, failures and notices. ``labels`` are the chain's labels (the shared route's
    included once admitted); ``tools`` the registered tool names; ``policy_terms`` the turn
    policy's fields but the `RESUMABLE_POLICY_FIELDS` (the loop policy's as ``loop.…``)."""

    request: TurnRequest
    labels: tuple[str, ...]
    model: int
    key: int | None
    keys_tried: tuple[KeysTried, ...]
    attempts: int
    credential_source: str
    admission_asked: bool
    admitted: bool
    signals_pending: bool
    carried_text: str
    ledger: Mapping[str, LedgerEntry]
    expression_delivered: bool
    held_notice: Notice | None
    draft: DraftSnapshot | None
    health: tuple[KeyHealthEntry, ...]
    now: float
    results: tuple[GenerationTurnResult, ...]
    records: tuple[AttemptRecord, ...]
    failures: tuple[AttemptFailure, ...]
    notices: tuple[Notice, ...]
    trace: tuple[TraceStep, ...]
    tools: tuple[str, ...]
    policy_terms: Mapping[str, Any]


def _known_version(_: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if value != SNAPSHOT_VERSION:
        raise SnapshotError(
            f"{attribute.name}: unknown snapshot version {value!r} (this library reads "
            f"version {SNAPSHOT_VERSION})"
        )


@frozen
class TurnSnapshot:
    """A turn at a stable point, as plain data (see the module's documentation).

    A tool loop's snapshot has ``loop`` only. A generation turn's has ``chain`` (the outer
    tier as it started the running attempt) and, once that attempt reached a stable point of
    its own, ``loop`` (the attempt's tool loop there); without ``loop`` a resume starts the
    attempt afresh.
    """

    loop: LoopSnapshot | None
    chain: ChainSnapshot | None = None
    version: int = field(default=SNAPSHOT_VERSION, validator=_known_version, kw_only=True)

    def __attrs_post_init__(self) -> None:
        if self.loop is None and self.chain is None:
            raise SnapshotError("loop: a snapshot holds a tool loop, a chain, or both")

    @property
    def tier(self) -> str:
        """``"generation"`` for a generation turn's snapshot, ``"tool_loop"`` otherwise."""
        return "generation" if self.chain is not None else "tool_loop"

    @property
    def turn_id(self) -> str | None:
        """The turn's identity (the idempotency keys' prefix)."""
        source = self.chain if self.chain is not None else self.loop
        assert source is not None
        return source.request.turn_id


# --------------------------------------------------------------------------- capture
def capture_draft(draft: DraftState) -> DraftSnapshot:
    return DraftSnapshot(
        segments=tuple(HeldPiece(s.text, s.expression) for s in draft.segments),
        committed_segments=draft.committed_segments,
        history=tuple(draft.history),
        held_bytes=draft.held_bytes,
        held_segments=draft.held_segments,
        cut=draft.cut,
        cut_by_send_limit=draft.cut_by_send_limit,
        expression_held=draft.expression_held,
        discarded=draft.discarded,
        trigger=draft.trigger,
        reviews=draft.reviews,
        revisions=draft.revisions,
        reviewer_unavailable=draft.reviewer_unavailable,
        last_findings=tuple(draft.last_findings),
        review_seq=draft.review_seq,
        tool_reviews=draft.tool_reviews,
        corrections=draft.corrections,
        checkpoint_unavailable=draft.checkpoint_unavailable,
        reviewing_correction=draft.reviewing_correction,
        reviewing_identity=draft.reviewing_identity,
        rejected_calls=dict(draft.rejected_calls),
        rejected_names=frozenset(draft.rejected_names),
        records=tuple(draft.records),
    )


def restore_draft(snapshot: DraftSnapshot) -> DraftState:
    return DraftState(
        segments=[HeldSegment(p.text, p.expression) for p in snapshot.segments],
        committed_segments=snapshot.committed_segments,
        history=list(snapshot.history),
        held_bytes=snapshot.held_bytes,
        held_segments=snapshot.held_segments,
        cut=snapshot.cut,
        cut_by_send_limit=snapshot.cut_by_send_limit,
        expression_held=snapshot.expression_held,
        discarded=snapshot.discarded,
        trigger=snapshot.trigger,
        reviews=snapshot.reviews,
        revisions=snapshot.revisions,
        reviewer_unavailable=snapshot.reviewer_unavailable,
        last_findings=tuple(snapshot.last_findings),
        review_seq=snapshot.review_seq,
        tool_reviews=snapshot.tool_reviews,
        corrections=snapshot.corrections,
        checkpoint_unavailable=snapshot.checkpoint_unavailable,
        reviewing_correction=snapshot.reviewing_correction,
        reviewing_identity=snapshot.reviewing_identity,
        rejected_calls=dict(snapshot.rejected_calls),
        rejected_names=set(snapshot.rejected_names),
        records=list(snapshot.records),
    )


def capture_loop(turn: TurnState) -> LoopSnapshot:
    """The inner machine's state as it enters ``starting_pass``."""
    return LoopSnapshot(
        request=turn.request,
        context=tuple(turn.context),
        history=tuple(turn.history) if turn.history is not None else None,
        prefill=turn.prefill,
        ledger=dict(turn.ledger),
        occurrences=dict(turn.occurrences) if turn.occurrences is not None else None,
        continuation_style=turn.continuation_style,
        hold_timeout_notice=turn.hold_timeout_notice,
        expression_delivered=turn.expression_delivered,
        disabled_tools=turn.disabled_tools,
        disabled_enrichment_kinds=turn.disabled_enrichment_kinds,
        iterations=turn.iterations,
        dispatches=turn.dispatches,
        consecutive_tool_errors=turn.consecutive_tool_errors,
        continuation_failures=turn.continuation_failures,
        suppress_text=turn.suppress_text,
        last_tool=turn.last_tool,
        tool_response_delivered=turn.tool_response_delivered,
        pre_tool_text=turn.pre_tool_text,
        next_seq=turn.next_seq,
        delivered=tuple(turn.delivered or ()),
        in_flight=tuple(item for _, item in sorted(turn.in_flight.items())),
        visible_text_delivered=turn.visible_text_delivered,
        stream_results=tuple(turn.stream_results or ()),
        usage=tuple(turn.usage or ()),
        notices=tuple(turn.notices or ()),
        held_notice=turn.held_notice,
        thought_log=turn.thought_log,
        last_text=turn.last_text,
        scene_metadata=tuple(turn.scene_metadata or ()),
        follow_ups_cleared=turn.follow_ups_cleared,
        draft=capture_draft(turn.draft) if turn.draft is not None else None,
        trace=tuple(turn.trace),
        tools=tuple(ToolTerms.of(tool) for tool in turn.registry),
        policy_terms=policy_terms(turn.policy),
    )


def restore_loop(snapshot: LoopSnapshot, policy: LoopPolicy, registry: ToolRegistry) -> TurnState:
    """A fresh inner machine's state, as the snapshot left it (in ``ready``: the machine's
    ``resume`` transition takes it to ``starting_pass``). Refuses a policy or tools that
    differ from the turn's in what its state depends on."""
    check_policy(snapshot.policy_terms, policy)
    check_tool_terms(snapshot.tools, registry)
    drafting = policy.drafting or policy.review_tool_calls
    draft = snapshot.draft
    if drafting and draft is None:
        draft = DraftSnapshot()
    return TurnState(
        policy=policy,
        registry=registry,
        request=snapshot.request,
        continuation_style=snapshot.continuation_style,
        hold_timeout_notice=snapshot.hold_timeout_notice,
        ledger=dict(snapshot.ledger),
        expression_delivered=snapshot.expression_delivered,
        occurrences=dict(snapshot.occurrences) if snapshot.occurrences is not None else None,
        context=list(snapshot.context),
        history=list(snapshot.history) if snapshot.history is not None else None,
        prefill=snapshot.prefill,
        disabled_tools=snapshot.disabled_tools,
        disabled_enrichment_kinds=snapshot.disabled_enrichment_kinds,
        iterations=snapshot.iterations,
        dispatches=snapshot.dispatches,
        consecutive_tool_errors=snapshot.consecutive_tool_errors,
        continuation_failures=snapshot.continuation_failures,
        suppress_text=snapshot.suppress_text,
        last_tool=snapshot.last_tool,
        tool_response_delivered=snapshot.tool_response_delivered,
        flush_chars=policy.delivery_flush_chars,
        pre_tool_text=snapshot.pre_tool_text,
        next_seq=snapshot.next_seq,
        in_flight={item.seq: item for item in snapshot.in_flight},
        delivered=list(snapshot.delivered) if snapshot.delivered else None,
        visible_text_delivered=snapshot.visible_text_delivered,
        stream_results=list(snapshot.stream_results) if snapshot.stream_results else None,
        usage=list(snapshot.usage) if snapshot.usage else None,
        notices=list(snapshot.notices) if snapshot.notices else None,
        held_notice=snapshot.held_notice,
        thought_log=snapshot.thought_log,
        last_text=snapshot.last_text,
        scene_metadata=list(snapshot.scene_metadata) if snapshot.scene_metadata else None,
        follow_ups_cleared=snapshot.follow_ups_cleared,
        draft=restore_draft(draft) if drafting and draft is not None else None,
        trace=list(snapshot.trace),
    )


def capture_chain(state: GenerationState) -> ChainSnapshot:
    """The outer machine's state as it starts its current attempt."""
    return ChainSnapshot(
        request=state.request,
        labels=tuple(plan.label for plan in state.plans),
        model=state.model,
        key=state.key,
        keys_tried=tuple(KeysTried(m, tuple(keys)) for m, keys in state.keys_tried.items()),
        attempts=state.attempts,
        credential_source=state.credential_source,
        admission_asked=state.admission_asked,
        admitted=state.admitted,
        signals_pending=state.signals_pending,
        carried_text=state.carried_text,
        ledger=dict(state.ledger),
        expression_delivered=state.expression_delivered,
        held_notice=state.held_notice,
        draft=capture_draft(state.draft) if state.draft is not None else None,
        health=tuple(KeyHealthEntry(label, key, h) for (label, key), h in state.health.items()),
        now=state.now,
        results=tuple(state.results),
        records=tuple(state.records),
        failures=tuple(state.failures),
        notices=tuple(state.notices),
        trace=tuple(state.trace),
        tools=tuple(spec.name for spec in state.tool_specs),
        policy_terms=policy_terms(state.policy),
    )


def restore_chain(
    snapshot: ChainSnapshot,
    policy: TurnPolicy,
    *,
    plans: Iterable[AttemptPlan],
    shared: Iterable[AttemptPlan],
    tool_specs: tuple[ToolSpec, ...],
    now: float,
) -> GenerationState:
    """A fresh outer machine's state, as the snapshot left it (in ``ready``: the machine's
    ``resume`` transition takes it to ``attempting``). Cooldowns still running keep the time
    they had left, measured on the resuming clock (``now``). Refuses a policy that differs
    from the turn's in what its state depends on, another chain, or missing tools."""
    check_policy(snapshot.policy_terms, policy)
    chain = list(plans)
    shared_plans = tuple(shared)
    if snapshot.admitted:
        chain.extend(shared_plans)
    labels = tuple(plan.label for plan in chain)
    if labels != snapshot.labels:
        raise SnapshotError(
            f"chain.labels: the snapshot's chain is {list(snapshot.labels)}, the attempts "
            f"given are {list(labels)}: resume with the same attempts (and shared route)"
        )
    check_tools(snapshot.tools, (spec.name for spec in tool_specs))
    health: dict[tuple[str, int], KeyHealth] = {}
    for entry in snapshot.health:
        left = entry.health.cooldown_until - snapshot.now
        cooldown = now + left if left > 0 else 0.0
        health[(entry.label, entry.key)] = attrs.evolve(entry.health, cooldown_until=cooldown)
    results = list(snapshot.results)
    return GenerationState(
        policy=policy,
        request=snapshot.request,
        tool_specs=tool_specs,
        plans=chain,
        shared_plans=shared_plans,
        health=health,
        now=now,
        model=snapshot.model,
        key=snapshot.key,
        keys_tried={entry.model: list(entry.keys) for entry in snapshot.keys_tried},
        attempts=snapshot.attempts,
        credential_source=snapshot.credential_source,
        admission_asked=snapshot.admission_asked,
        admitted=snapshot.admitted,
        signals_pending=snapshot.signals_pending,
        carried_text=snapshot.carried_text,
        ledger=dict(snapshot.ledger),
        expression_delivered=snapshot.expression_delivered,
        held_notice=snapshot.held_notice,
        draft=restore_draft(snapshot.draft) if snapshot.draft is not None else None,
        last=results[-1] if results else None,
        results=results,
        records=list(snapshot.records),
        failures=list(snapshot.failures),
        notices=list(snapshot.notices),
        trace=list(snapshot.trace),
    )


def check_tools(named: Iterable[str], registered: Iterable[Any]) -> None:
    """Refuse a resume whose host no longer registers a tool the snapshot names (the ledger
    and history may refer to it)."""
    have = {item if isinstance(item, str) else item.name for item in registered}
    missing = sorted(set(named) - have)
    if missing:
        raise SnapshotError(
            f"tools: the snapshot's turn registered {', '.join(missing)}, which the tools "
            "given do not: resume with the same tools"
        )


def check_tool_terms(recorded: Iterable[ToolTerms], registry: ToolRegistry) -> None:
    """Refuse a resume whose host no longer registers a tool the snapshot names, or registers
    it with another follow-up or replay setting (the tool loop's state was built under them:
    which pass follows a tool's outcome, whether a replayed call reruns). A tool added, or a
    tool's timeout, description or schema changed, resumes."""
    recorded = tuple(recorded)
    check_tools((terms.name for terms in recorded), registry)
    problems = []
    for terms in recorded:
        tool = registry.get(terms.name)
        assert tool is not None
        given = ToolTerms.of(tool)
        for name in ("requires_follow_up", "replay"):
            was, now = getattr(terms, name), getattr(given, name)
            if was != now:
                problems.append(f"tools.{terms.name}.{name}: the snapshot's turn ran with "
                                f"{was!r}, the tool given has {now!r}")  # fmt: skip
    if problems:
        raise SnapshotError(_listed(problems) + ": resume with the same tools")


def policy_terms(policy: LoopPolicy | TurnPolicy) -> dict[str, Any]:
    """The policy's fields a resume must give again, as JSON values by field name (a nested
    policy's as ``loop.…``): every compared field but the `RESUMABLE_POLICY_FIELDS`."""
    terms: dict[str, Any] = {}
    for attribute in attrs.fields(type(policy)):
        if attribute.name in RESUMABLE_POLICY_FIELDS or not attribute.eq:
            continue
        value = getattr(policy, attribute.name)
        if attrs.has(type(value)):
            for name, term in policy_terms(value).items():
                terms[f"{attribute.name}.{name}"] = term
        else:
            terms[attribute.name] = _converter.unstructure(value)
    return terms


def check_policy(recorded: Mapping[str, Any], policy: LoopPolicy | TurnPolicy) -> None:
    """Refuse a resume whose policy differs from the turn's in a field its state depends on
    (drafting dropped would drop the held prose, a lower ceiling end a turn already past
    it, another flush re-key the restarted pass), naming each such field."""
    given = policy_terms(policy)
    problems = [
        f"policy.{_bounded(name)}: the snapshot's turn ran with "
        f"{_bounded(repr(recorded.get(name)))}, the policy given has {given.get(name)!r}"
        for name in sorted(recorded.keys() | given.keys())
        if name not in given or name not in recorded or recorded[name] != given[name]
    ]
    if problems:
        allowed = ", ".join(sorted(RESUMABLE_POLICY_FIELDS))
        raise SnapshotError(
            _listed(problems) + f": resume with the same policy (only {allowed} may differ)"
        )


def _listed(problems: list[str]) -> str:
    listed = "; ".join(problems[:MAX_SNAPSHOT_PROBLEMS])
    more = len(problems) - MAX_SNAPSHOT_PROBLEMS
    return listed + (f"; and {more} further problems not listed" if more > 0 else "")


# --------------------------------------------------------------------------- JSON
#: The largest snapshot text `snapshot_from_json` reads: characters of a ``str``, bytes of a
#: ``bytes``. A host whose turns carry longer contexts passes its own ``max_size``.
MAX_SNAPSHOT_SIZE = 16 * 1024 * 1024
#: The deepest nesting of arrays and objects a snapshot may have. The format's own records
#: nest 8 deep; the rest is for what contexts, tool arguments and tool results nest.
MAX_SNAPSHOT_DEPTH = 64
#: The problems one `SnapshotError` lists, and the length of its message.
MAX_SNAPSHOT_PROBLEMS = 10
MAX_SNAPSHOT_ERROR_CHARS = 4096
_PROBLEM_CHARS = 300

# strict: a field of the wrong type is refused instead of coerced, an unknown field is refused,
# a text is never read as a list of its characters
_converter = make_converter(strict=True)

# The nesting scan: escaped backslashes and quotes out, then strings (a bracket inside a
# string nests nothing), then each bracket's step, summed in C: no recursion, whatever the text.
_STRINGS = re.compile(r'"[^"]*"')
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")
_NESTING = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def snapshot_to_json(snapshot: TurnSnapshot) -> str:
    """A snapshot as JSON text (`snapshot_from_json` reads it back)."""
    return json.dumps(_converter.unstructure(snapshot), ensure_ascii=False)


def snapshot_from_json(text: str | bytes, *, max_size: int = MAX_SNAPSHOT_SIZE) -> TurnSnapshot:
    """The snapshot `snapshot_to_json` wrote. Safe on text from anywhere: it raises only
    `SnapshotError`, naming what is wrong — text longer than ``max_size`` or nested deeper
    than `MAX_SNAPSHOT_DEPTH` (refused before it is parsed), text that is not JSON or not a
    snapshot, an unknown version, a missing, unknown or mistyped field (at most
    `MAX_SNAPSHOT_PROBLEMS` of them, each with its path) — and restores nothing then."""
    if not isinstance(text, str | bytes | bytearray):
        raise SnapshotError(f"a snapshot is JSON text (str or bytes), got {type(text).__name__}")
    if len(text) > max_size:
        unit = "characters" if isinstance(text, str) else "bytes"
        raise SnapshotError(
            f"the snapshot is {len(text)} {unit}, larger than the limit of {max_size} "
            "(snapshot_from_json's max_size)"
        )
    if not isinstance(text, str):
        try:
            text = bytes(text).decode(json.detect_encoding(text), "surrogatepass")
        except (UnicodeDecodeError, LookupError) as err:
            raise SnapshotError(f"the snapshot is not JSON: {_bounded(str(err))}") from None
    depth = _nesting_depth(text)
    if depth > MAX_SNAPSHOT_DEPTH:
        raise SnapshotError(
            f"the snapshot is nested deeper than {MAX_SNAPSHOT_DEPTH} arrays and objects "
            f"({depth}): not a snapshot this library wrote"
        )
    try:
        document = json.loads(text)
    except ValueError as err:
        raise SnapshotError(f"the snapshot is not JSON: {_bounded(str(err))}") from None
    if not isinstance(document, dict):
        raise SnapshotError(f"a snapshot is a JSON object, got {type(document).__name__}")
    if "version" not in document:
        raise SnapshotError("version: missing (a snapshot names its format's version)")
    version = document["version"]
    if isinstance(version, bool) or not isinstance(version, int):
        raise SnapshotError(f"version: expected an integer, got {type(version).__name__}")
    if version != SNAPSHOT_VERSION:
        raise SnapshotError(
            f"version: unknown snapshot version {_bounded(str(version))} (this library reads "
            f"version {SNAPSHOT_VERSION})"
        )
    try:
        return _converter.structure(document, TurnSnapshot)
    except SnapshotError as err:
        raise SnapshotError(_bounded(str(err), MAX_SNAPSHOT_ERROR_CHARS)) from None
    except Exception as err:
        raise SnapshotError(_describe(err)) from None


def _nesting_depth(text: str) -> int:
    """How deep the arrays and objects of JSON ``text`` nest (of malformed text: an estimate,
    which the parser then refuses anyway)."""
    # backslashes pair up left to right, as str.replace takes them; then no quote is escaped
    unescaped = text.replace("\\\\", "").replace('\\"', "")
    brackets = _NOT_BRACKETS.sub("", _STRINGS.sub("", unescaped))
    return max(itertools.accumulate(map(_NESTING.__getitem__, map(ord, brackets))), default=0)


def _describe(err: Exception) -> str:
    """What is wrong with a document cattrs refused: the first `MAX_SNAPSHOT_PROBLEMS`
    problems, each with the field's path (``$.loop.iterations``) and cut to a few hundred
    characters (a path or a value may come from a hostile text), and how many more."""
    if isinstance(err, cattrs.BaseValidationError | cattrs.ForbiddenExtraKeysError):
        problems = cattrs.transform_error(err, path="$", format_exception=_problem)
    else:
        problems = [f"{type(err).__name__}: {err}"]
    listed = _listed([_bounded(problem) for problem in problems])
    return _bounded("the snapshot is malformed: " + listed, MAX_SNAPSHOT_ERROR_CHARS)


def _problem(err: BaseException, kind: type | None) -> str:
    """One problem in words: the strict hooks' own (what was expected, what came), a
    missing or unknown field as cattrs says it."""
    if isinstance(err, TypeError | ValueError) and err.args and isinstance(err.args[0], str):
        return str(err)
    return cattrs.v.format_exception(err, kind)


def _bounded(text: str, limit: int = _PROBLEM_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


__all__ = [
    "MAX_SNAPSHOT_DEPTH",
    "MAX_SNAPSHOT_ERROR_CHARS",
    "MAX_SNAPSHOT_PROBLEMS",
    "MAX_SNAPSHOT_SIZE",
    "RESUMABLE_POLICY_FIELDS",
    "SNAPSHOT_VERSION",
    "ChainSnapshot",
    "DraftSnapshot",
    "HeldPiece",
    "KeyHealthEntry",
    "KeysTried",
    "LoopSnapshot",
    "SnapshotError",
    "ToolTerms",
    "TurnSnapshot",
    "capture_chain",
    "capture_loop",
    "restore_chain",
    "restore_loop",
    "snapshot_from_json",
    "snapshot_to_json",
]
