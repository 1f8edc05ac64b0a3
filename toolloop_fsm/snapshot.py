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
from collections.abc import Iterable
from collections.abc import Mapping
from typing import TYPE_CHECKING
from typing import Any

import attrs
import cattrs
from attrs import field
from attrs import frozen

from toolloop_fsm.attempts import KeyHealth
from toolloop_fsm.budgets import AttemptBudget
from toolloop_fsm.host import TurnRequest
from toolloop_fsm.ledger import LedgerEntry
from toolloop_fsm.ledger import ToolOutcome
from toolloop_fsm.messages import HeldMessage
from toolloop_fsm.messages import TakenMessage
from toolloop_fsm.result import AttemptFailure
from toolloop_fsm.result import AttemptRecord
from toolloop_fsm.result import Delivered
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.result import Notice
from toolloop_fsm.result import StreamResult
from toolloop_fsm.result import ToolHistoryEntry
from toolloop_fsm.result import TraceStep
from toolloop_fsm.result import UsageEntry
from toolloop_fsm.result import make_converter
from toolloop_fsm.review import Finding
from toolloop_fsm.review import ReviewRecord

if TYPE_CHECKING:
    from toolloop_fsm.host import Tool
    from toolloop_fsm.host import ToolRegistry
    from toolloop_fsm.policy import LoopPolicy
    from toolloop_fsm.policy import TurnPolicy

#: The snapshot format this library writes and reads. Version 2 records the policy and tool
#: settings the turn ran under (version 1 did not, and is refused as unknown).
SNAPSHOT_VERSION = 2

#: The policy fields a resume may change: time budgets, which the resuming process measures
#: on its own clock (the pass that was running restarts with its whole budget anyway), and
#: the cooldowns a key failure starts from then on (those already running keep the time they
#: had left). Every other field — the switches, the ceilings and budgets the turn's counters
#: count against, the delivery flush (which fixes the restarted pass's sequence numbers) —
#: must be the one the snapshot records. The exit hook, host code, is not compared.
RESUMABLE_POLICY_FIELDS = frozenset(
    {
        "inactivity_timeout",
        "first_token_timeout",
        "abandoned_stream_settle",
        "tool_timeout",
        "host_call_timeout",
        "cancel_grace",
        "max_pass_duration",
        "review_timeout",
        "rate_limit_cooldown",
        "failure_cooldown",
    }
)


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
class PausedCall:
    """One call of a batch paused for approval (docs/behaviour.md §3.13), in emitted order:
    the call as the provider emitted it, its ledger occurrence once taken, and either its
    outcome (it ran, was refused or reused, or was denied), or that it waits
    (``awaiting``), or that it was approved: ``approved`` holds the arguments it runs with
    (the model's, or the person's edit)."""

    name: str
    arguments: Any
    position: int
    call_id: str | None = None
    truncated: bool = False
    parse_error: str | None = None
    provider_data: Mapping[str, Any] | None = None
    occurrence: str | None = None
    outcome: ToolOutcome | None = None
    awaiting: bool = False
    approved: Mapping[str, Any] | None = None
    #: the tool's ``needs_approval`` predicate raised on the arguments (the call waits)
    predicate_error: str | None = None


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
    #: the tools of the last recorded batch (a snapshot from before batches has none: the
    #: settle rule then reads ``last_tool``)
    last_tools: tuple[str, ...] = ()
    #: the calls the turn admitted, which the tool-call limit counts (a snapshot from before
    #: the limit has none: its turn ran without one)
    tool_calls_used: int = 0
    #: the model's price and the chain's budget with what earlier attempts spent of it
    #: (docs/behaviour.md §2.8; a snapshot from before budgets has none: none bound its turn)
    attempt_budget: AttemptBudget | None = None
    #: a turn paused for approval (docs/behaviour.md §3.13): the batch it paused in, every
    #: call in emitted order (empty: the snapshot was taken before a pass)
    paused: tuple[PausedCall, ...] = ()
    #: the messages that arrived while the turn ran (docs/behaviour.md §8.5): those it holds,
    #: those it took into its context, and how many history entries the context holds since
    held_messages: tuple[HeldMessage, ...] = ()
    taken_messages: tuple[TakenMessage, ...] = ()
    history_in_context: int = 0


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


# --------------------------------------------------------------------------- checks
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
                problems.append(
                    f"tools.{terms.name}.{name}: the snapshot's turn ran with "
                    f"{was!r}, the tool given has {now!r}"
                )
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
    # a field newer than the snapshot: its turn ran as the field's default behaves
    recorded = {**_default_terms(policy, given.keys() - recorded.keys()), **recorded}
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


#: Policy fields added after snapshot version 2 was fixed: a snapshot that does not record
#: one was taken of a turn that ran as its default does.
_NEWER_POLICY_FIELDS = frozenset({"max_tool_calls", "at_ceiling", "price", "budget"})


def _default_terms(policy: LoopPolicy | TurnPolicy, missing: Iterable[str]) -> dict[str, Any]:
    """The default term of each of the ``missing`` fields newer than the snapshot format."""
    defaults = policy_terms(type(policy)())
    return {
        name: defaults[name]
        for name in missing
        if name.rpartition(".")[2] in _NEWER_POLICY_FIELDS and name in defaults
    }


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
    "snapshot_from_json",
    "snapshot_to_json",
]
