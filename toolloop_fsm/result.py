"""What a turn returns: `GenerationTurnResult` and the values it is made of.

All of these are frozen attrs values that round-trip through JSON with `cattrs`
(`result_to_json` / `result_from_json`), so hosts can store results and their traces.
"""

from __future__ import annotations

import collections.abc
import json
import typing
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from enum import StrEnum
from typing import Any
from typing import Literal

import attrs
import cattrs
from attrs import field
from attrs import frozen

from toolloop_fsm.approvals import ApprovalRequest
from toolloop_fsm.events import FinishKind
from toolloop_fsm.messages import HeldMessage
from toolloop_fsm.messages import TakenMessage
from toolloop_fsm.review import ReviewRecord


class TurnStatus(StrEnum):
    """Every way a turn can end. ``skipped`` is only produced by the outer tier."""

    COMPLETED = "completed"
    STOPPED_BY_USER = "stopped_by_user"
    FOLLOW_UP_INTERRUPT = "follow_up_interrupt"
    TIMEOUT = "timeout"
    ERROR = "error"
    EMPTY_RESPONSE = "empty_response"
    SKIPPED = "skipped"
    #: a tool call waits for a person (docs/behaviour.md §3.13): the result's ``approval``
    #: holds the calls and the snapshot to resume from with the decisions
    AWAITING_APPROVAL = "awaiting_approval"


RETRYABLE_STATUSES = frozenset({TurnStatus.ERROR, TurnStatus.TIMEOUT})

#: Field metadata of a text that is always a name the library declares (a state, an event, a
#: guard, a route): it carries nothing from outside the turn, so key redaction need not read it.
VOCABULARY: Mapping[str, bool] = {"vocabulary": True}


@frozen
class Notice:
    """A message for the host to localise. ``hidden`` notices are for logs/moderators."""

    key: str
    params: Mapping[str, Any] = field(factory=dict)
    hidden: bool = False


@frozen
class ToolCallRecord:
    """The call as replayed to the provider. Truncated calls carry no arguments."""

    name: str
    arguments: Mapping[str, Any]
    call_id: str | None = None
    provider_data: Mapping[str, Any] | None = None


#: The status of a tool call the tool checkpoint's reviewer rejected before it ran.
REVIEW_REJECTED_STATUS = "review_rejected"

#: The status of a tool call the tool-call limit refused: it never ran.
TOOL_CALL_LIMIT_STATUS = "tool_call_limit"

#: The status of a tool call a person denied (docs/behaviour.md §3.13): it never ran.
APPROVAL_DENIED_STATUS = "approval_denied"


@frozen
class ToolResponseRecord:
    """The response shown to the model for one call."""

    success: bool
    data: Any = None
    message: str | None = None
    status: str | None = None
    reason: str | None = None
    tool_name: str | None = None


@frozen
class ToolHistoryEntry:
    """One call of a tool batch: the call, its response, and (on the batch's first call only)
    the visible text streamed before the batch.

    ``position`` is the call's place in its batch, in the order the provider emitted the
    calls: ``0`` opens a batch (one assistant turn), and each entry after it with a higher
    position belongs to the same batch, so an adapter renders one assistant turn with every
    call of the batch, then one response per call, in that order."""

    call: ToolCallRecord
    response: ToolResponseRecord
    pre_tool_text: str | None = None
    iteration: int = 0
    position: int = 0


@frozen
class StreamResult:
    """What one provider pass produced."""

    iteration: int
    outcome: str
    text: str = ""
    finish: FinishKind | None = None
    function_call: str | None = None
    ignored_calls: tuple[str, ...] = ()
    error: str | None = None


TOKEN_WEIGHT_UNIT = 24
"""The parts of a token a `token_weight` counts in."""


#: What a character weighs, by its class, in `TOKEN_WEIGHT_UNIT` parts of a token. A
#: character's class is read off the first byte of its UTF-8 form, so a text's script is seen
#: without decoding it. The weights were fitted to the o200k_base counts of the samples in
#: tests/data/token_counts.json (within a fifth of each): English words run about five
#: characters a token, digits and ASCII punctuation far fewer; Cyrillic, Arabic and Devanagari
#: about three characters a token; a CJK character or a Hangul syllable about 0.8 of a token,
#: an emoji more than one and a half.
_CLASS_WEIGHTS = (
    0,  # a continuation byte: its character is weighed at its first byte
    5,  # an ASCII letter
    16,  # an ASCII digit
    6,  # ASCII white space
    14,  # ASCII punctuation and control characters
    8,  # U+0080-07FF: Latin accents, Greek, Cyrillic, Hebrew, Arabic
    9,  # U+0800-0FFF: Devanagari and the other Indic scripts, Thai
    29,  # U+1000-2FFF: dashes, quotes, arrows, the older emoji-like symbols
    19,  # U+3000-DFFF: kana, CJK ideographs, Hangul syllables
    3,  # U+E000-FFFF: variation selectors, fullwidth forms
    40,  # U+10000 and up: emoji, rare ideographs
)
_LETTER, _DIGIT, _SPACE, _PUNCTUATION = 1, 2, 3, 4


def _byte_classes() -> bytes:
    """A `bytes.translate` table from each UTF-8 byte to its character's class."""
    classes = bytearray(256)
    for byte in range(128):
        char = chr(byte)
        classes[byte] = (
            _LETTER
            if char.isalpha()
            else _DIGIT
            if char.isdigit()
            else _SPACE
            if char.isspace()
            else _PUNCTUATION
        )
    # lead bytes: C0-DF open two bytes, E0-EF three, F0-F7 four (80-BF continue, class 0)
    leads = ((0xC0, 0xDF), (0xE0, 0xE0), (0xE1, 0xE2), (0xE3, 0xED), (0xEE, 0xEF), (0xF0, 0xFF))
    for cls, (first, last) in enumerate(leads, start=5):
        classes[first : last + 1] = bytes([cls]) * (last - first + 1)
    return bytes(classes)


_BYTE_CLASSES = _byte_classes()
_WEIGHED_CLASSES = tuple(enumerate(_CLASS_WEIGHTS))[1:]
_LETTER_WEIGHT = _CLASS_WEIGHTS[_LETTER]
# what a digit, a space and a punctuation mark weigh more than a letter
_DIGIT_EXTRA, _SPACE_EXTRA, _PUNCTUATION_EXTRA = (
    _CLASS_WEIGHTS[cls] - _LETTER_WEIGHT for cls in (_DIGIT, _SPACE, _PUNCTUATION)
)


def token_weight(text: str) -> int:
    """The tokens ``text`` is estimated to take, in `TOKEN_WEIGHT_UNIT` parts of a token: each
    character weighs what its script usually takes in a BPE tokenizer's output, so Chinese or
    Japanese text weighs several times what English of as many characters does (a quarter of
    the characters undercounts it about three times). A text weighs the sum of its
    characters, so the weights of its pieces (a stream's chunks) add up to that of the whole."""
    if text.isascii():  # the usual case, counted in four passes over the bytes
        classes = text.encode("ascii").translate(_BYTE_CLASSES)
        return (
            len(classes) * _LETTER_WEIGHT
            + classes.count(_DIGIT) * _DIGIT_EXTRA
            + classes.count(_SPACE) * _SPACE_EXTRA
            + classes.count(_PUNCTUATION) * _PUNCTUATION_EXTRA
        )
    # surrogatepass: a lone surrogate (from JSON) weighs as the three bytes it would take
    classes = text.encode("utf-8", "surrogatepass").translate(_BYTE_CLASSES)
    return sum(weight * classes.count(cls) for cls, weight in _WEIGHED_CLASSES)


def tokens_of_weight(weight: int) -> int:
    """Whole tokens of a `token_weight` (rounded up)."""
    return -(-weight // TOKEN_WEIGHT_UNIT)


def estimate_tokens(text: str) -> int:
    """The tokens ``text`` is estimated to take (docs/behaviour.md §2.2 rule 3): used only when
    a provider reports no usage, and the figure is then marked as an estimate."""
    return tokens_of_weight(token_weight(text))


@frozen
class UsageEntry:
    """Usage of one provider pass (``estimated`` when the library computed it)."""

    iteration: int
    input_tokens: int
    output_tokens: int
    estimated: bool = False
    source: str = "author"


@frozen
class UsageLedger:
    """Per-pass usage; totals are the sum of what providers reported plus marked estimates."""

    entries: tuple[UsageEntry, ...] = ()

    @property
    def input_tokens(self) -> int:
        return sum(e.input_tokens for e in self.entries)

    @property
    def output_tokens(self) -> int:
        return sum(e.output_tokens for e in self.entries)

    @property
    def has_estimates(self) -> bool:
        return any(e.estimated for e in self.entries)


#: Which ceiling of a `Budget` a turn reached.
BudgetLimit = Literal["input_tokens", "output_tokens", "total_tokens", "cost"]
#: Where the ceiling was set: the attempt's `LoopPolicy.budget` (``"turn"``), or the
#: chain's `TurnPolicy.budget` (``"chain"``), which earlier attempts of the chain spent of.
BudgetScope = Literal["turn", "chain"]


@frozen
class BudgetExceeded:
    """The ceiling a turn reached: which one (``limit``) of which budget (``scope``), what it
    allows, what the ledger held (``spent``), and what the pass that did not start would
    have needed on top (``reserved``: what it reads, and one token to write)."""

    scope: BudgetScope
    limit: BudgetLimit
    allowed: float
    spent: float
    reserved: float = 0

    @property
    def reason(self) -> Literal["token_budget", "cost_budget"]:
        """The turn's sub-reason: ``cost_budget`` for the cost ceiling, else
        ``token_budget``."""
        return "cost_budget" if self.limit == "cost" else "token_budget"


@frozen
class Delivered:
    """One delivery the channel accepted: text or an expression, in order, and the provider
    pass (``iteration``) it came from."""

    seq: int
    text: str | None = None
    expression: str | None = None
    iteration: int = 0


@frozen
class TraceStep:
    """One step of the machine: ``state --event--> next_state``; ``guard`` names the guard of
    the declared transition taken (``None``: it has none), ``detail`` annotates a step an
    action noted, ``at`` is the turn's clock time when the step was taken (``None``: the
    driver gave no time, as in a trace saved before steps carried one)."""

    state: str = field(metadata=VOCABULARY)
    event: str = field(metadata=VOCABULARY)
    next_state: str = field(metadata=VOCABULARY)
    detail: str | None = None
    guard: str | None = field(default=None, metadata=VOCABULARY)
    at: float | None = None


@frozen
class AttemptFailure:
    """Why one attempt of the outer tier failed (never contains key material)."""

    label: str
    status: TurnStatus
    reason: str | None = None
    kind: str | None = None
    key_index: int | None = None


@frozen
class AttemptRecord:
    """One attempt of the outer tier: which model and key (by index), how it ended, and the
    inner machine's trace."""

    index: int
    label: str
    key_index: int | None
    route: str = field(metadata=VOCABULARY)
    status: TurnStatus
    reason: str | None = None
    superseded: bool = False
    delivered_text: str = ""
    trace: tuple[TraceStep, ...] = ()


class InDoubtCause(StrEnum):
    """Why a call's outcome is unknown: its worker was lost while it ran (a durable turn),
    or it ignored its cancellation for the grace and was abandoned (in process)."""

    WORKER_LOST = "worker_lost"
    ABANDONED = "abandoned"


@frozen
class InDoubtCall:
    """A tool call cut off mid-run: it may or may not have done what it does (docs/behaviour.md
    §3.9). ``reconciled`` says the tool's ``reconcile`` hook answered what really happened
    (that answer became the call's outcome); otherwise the model was told its outcome is
    unknown. Listed either way, so the host can audit it."""

    tool: str
    dispatch: int
    call_id: str | None
    cause: InDoubtCause
    reconciled: bool = False


@frozen
class GenerationTurnResult:
    """The outcome of a turn. See the README for each field."""

    status: TurnStatus
    reason: str | None = None
    final_text: str = ""
    undelivered_text: str = ""
    details_text: str = ""
    history: tuple[ToolHistoryEntry, ...] = ()
    stream_results: tuple[StreamResult, ...] = ()
    usage: UsageLedger = UsageLedger()
    iterations: int = 0
    tool_dispatches: int = 0
    tool_response_delivered: bool = False
    thought_log: str = ""
    thought_log_owner: str = "default"
    delivered: tuple[Delivered, ...] = ()
    notices: tuple[Notice, ...] = ()
    held_notice: Notice | None = None
    stop_message: str | None = None
    error_message: str | None = None
    provider_error_kind: str | None = None
    retryable: bool | None = None
    retry_after: float | None = None
    attempt_failures: tuple[AttemptFailure, ...] = ()
    attempts: tuple[AttemptRecord, ...] = ()
    credential_source: str = "user"
    disabled_enrichment_kinds: frozenset[str] = frozenset()
    #: the calls of the tool batch the turn ended in (a stop, a failing channel) that had
    #: finished: their outcomes are kept in the ledger, never shown to the model
    finished_calls: tuple[str, ...] = ()
    abandoned_calls: tuple[str, ...] = ()
    #: the tool calls cut off mid-run, settled by their reconcile hook or not (§3.9)
    in_doubt_calls: tuple[InDoubtCall, ...] = ()
    #: the turn's identity (`TurnRequest.turn_id`, or the one given to it): with a delivery's
    #: sequence, its idempotency key. Two results of the same run compare equal whatever
    #: their ids (a fresh id per run is not part of what happened)
    turn_id: str | None = field(default=None, eq=False)
    #: the reviews drafting and the tool checkpoint asked for, in order
    reviews: tuple[ReviewRecord, ...] = ()
    #: the token or cost ceiling the turn reached (docs/behaviour.md §2.8), with its figures
    budget_exceeded: BudgetExceeded | None = None
    #: what the turn's tokens cost at the prices the host gave (``None``: no price)
    cost: float | None = None
    #: a turn that ended ``awaiting_approval``: the calls it waits on and its snapshot
    approval: ApprovalRequest | None = None
    #: the messages that arrived while the turn ran (docs/behaviour.md §8.5): those it took
    #: into its context, and where; and those it held but did not answer (for the next turn)
    taken_messages: tuple[TakenMessage, ...] = ()
    unanswered_messages: tuple[HeldMessage, ...] = ()
    trace: tuple[TraceStep, ...] = ()
    exception: BaseException | None = field(default=None, eq=False, repr=False)

    @property
    def delivered_text(self) -> str:
        """Every text delivery, concatenated in order."""
        return "".join(d.text for d in self.delivered if d.text is not None)


def with_attempts_outcomes(
    result: GenerationTurnResult,
    attempts: Iterable[GenerationTurnResult],
    abandoned: Iterable[str] = (),
) -> GenerationTurnResult:
    """A generation turn's ``result`` naming, in order, the calls its attempts left in doubt
    and the calls given up on: its attempts' and then the outer tier's own (``abandoned``)."""
    attempts = tuple(attempts)
    in_doubt = tuple(call for attempt in attempts for call in attempt.in_doubt_calls)
    given_up = (*(name for attempt in attempts for name in attempt.abandoned_calls), *abandoned)
    changes: dict[str, Any] = {}
    if in_doubt:
        changes["in_doubt_calls"] = in_doubt
    if given_up:
        changes["abandoned_calls"] = given_up
    return attrs.evolve(result, **changes) if changes else result


def _is_frozenset_type(kind: Any) -> bool:
    return kind is frozenset or typing.get_origin(kind) is frozenset


def _strict(kind: type, name: str) -> Any:
    def structure(value: Any, target: Any) -> Any:
        if isinstance(value, bool) and kind is not bool:
            raise TypeError(f"expected {name}, got a boolean")
        if not isinstance(value, kind):
            raise TypeError(f"expected {name}, got {type(value).__name__}")
        # a subclass (a StrEnum) is dispatched here too: built from the checked value
        return value if target is kind else target(value)

    return structure


#: The problems a strictly read collection keeps before it stops reading: a list of a
#: million wrong elements costs three failures, not a million.
STRICT_PROBLEMS_PER_COLLECTION = 3

#: The collection types a strict read builds, by origin: what the elements are gathered into.
_SEQUENCES: Mapping[Any, Callable[[list[Any]], Any]] = {
    tuple: tuple,
    collections.abc.Sequence: tuple,
    list: list,
    collections.abc.MutableSequence: list,
    frozenset: frozenset,
    collections.abc.Set: frozenset,
    set: set,
    collections.abc.MutableSet: set,
}
_MAPPINGS = (dict, collections.abc.Mapping, collections.abc.MutableMapping)


def _is_strict_collection(kind: Any) -> bool:
    origin = typing.get_origin(kind)
    if origin is tuple:  # homogeneous only: ``tuple[X, ...]``
        arguments = typing.get_args(kind)
        return len(arguments) == 2 and arguments[1] is Ellipsis
    return origin in _SEQUENCES or origin in _MAPPINGS


def _strict_collection(kind: Any, converter: cattrs.Converter) -> Any:
    """The structure hook of a collection read strictly: a JSON array (list) for a sequence
    or a set, a JSON object (dict) for a mapping, anything else refused as a whole; at most
    `STRICT_PROBLEMS_PER_COLLECTION` element failures, each noted with its index or key."""
    if typing.get_origin(kind) in _MAPPINGS:
        return _strict_mapping(kind, converter)
    return _strict_sequence(kind, converter)


def _strict_mapping(kind: Any, converter: cattrs.Converter) -> Any:
    """The strict structure hook of a mapping: a JSON object, each key and value read."""
    key_type, value_type = typing.get_args(kind)
    structure_key = converter.get_structure_hook(key_type)
    structure_value = converter.get_structure_hook(value_type)

    def structure_mapping(value: Any, _type: Any) -> dict[Any, Any]:
        if not isinstance(value, dict):
            raise TypeError(f"expected an object, got {type(value).__name__}")
        built: dict[Any, Any] = {}
        problems: list[Exception] = []
        for key, item in value.items():
            try:
                built[structure_key(key, key_type)] = structure_value(item, value_type)
            except Exception as err:
                err.add_note(cattrs.IterableValidationNote("mapping value", key, value_type))
                problems.append(err)
                if len(problems) == STRICT_PROBLEMS_PER_COLLECTION:
                    problems.append(_stopped(len(built) + len(problems), len(value)))
                    break
        if problems:
            raise cattrs.IterableValidationError(f"While structuring {kind}", problems, kind)
        return built

    return structure_mapping


def _strict_sequence(kind: Any, converter: cattrs.Converter) -> Any:
    """The strict structure hook of a sequence or a set: a JSON array, each element read."""
    gather = _SEQUENCES[typing.get_origin(kind)]
    element_type = typing.get_args(kind)[0]
    structure_element = converter.get_structure_hook(element_type)

    def structure_sequence(value: Any, _type: Any) -> Any:
        if not isinstance(value, list | tuple):
            raise TypeError(f"expected a list, got {type(value).__name__}")
        built: list[Any] = []
        problems: list[Exception] = []
        for index, item in enumerate(value):
            try:
                built.append(structure_element(item, element_type))
            except Exception as err:
                err.add_note(cattrs.IterableValidationNote("element", index, element_type))
                problems.append(err)
                if len(problems) == STRICT_PROBLEMS_PER_COLLECTION:
                    problems.append(_stopped(index + 1, len(value)))
                    break
        if problems:
            raise cattrs.IterableValidationError(f"While structuring {kind}", problems, kind)
        return gather(built)

    return structure_sequence


def _stopped(read: int, size: int) -> ValueError:
    return ValueError(
        f"stopped reading after {STRICT_PROBLEMS_PER_COLLECTION} bad elements "
        f"({read} of {size} read)"
    )


def _strict_float(value: Any, _type: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"expected a number, got {type(value).__name__}")
    return float(value)


def make_converter(*, strict: bool = False) -> cattrs.Converter:
    """The converter of results and the values they are made of. ``strict`` (for formats
    read back strictly): a field the classes do not declare is refused, and so is a value of
    the wrong type, where the default converter coerces (``"3"`` to ``3``, ``5`` to ``"5"``)
    or iterates (a text where a list belongs, as its characters); a collection stops reading
    after `STRICT_PROBLEMS_PER_COLLECTION` bad elements."""
    converter = cattrs.Converter(forbid_extra_keys=strict)
    if strict:
        # registered first: the hooks generated below use them for every field
        converter.register_structure_hook(bool, _strict(bool, "a boolean"))
        converter.register_structure_hook(int, _strict(int, "an integer"))
        converter.register_structure_hook(str, _strict(str, "a string"))
        converter.register_structure_hook(float, _strict_float)
        # a text is never a list (it would be read as its characters), a list never an
        # object; and a collection stops at its first few bad elements
        converter.register_structure_hook_factory(_is_strict_collection, _strict_collection)
    # sets travel as sorted lists (JSON has no set), and come back as sets
    converter.register_unstructure_hook_func(_is_frozenset_type, sorted)
    # A host exception object is not data: it is attached for the caller, never stored.
    converter.register_unstructure_hook(
        GenerationTurnResult,
        cattrs.gen.make_dict_unstructure_fn(
            GenerationTurnResult, converter, exception=cattrs.gen.override(omit=True)
        ),
    )
    converter.register_structure_hook(
        GenerationTurnResult,
        cattrs.gen.make_dict_structure_fn(
            GenerationTurnResult, converter, exception=cattrs.gen.override(omit=True)
        ),
    )
    converter.register_structure_hook(Any, lambda value, _type: value)
    return converter


converter = make_converter()


def result_to_json(result: GenerationTurnResult) -> str:
    """Serialise a result (trace included) to JSON text."""
    return json.dumps(converter.unstructure(result), ensure_ascii=False)


def result_from_json(text: str) -> GenerationTurnResult:
    """Rebuild a result from `result_to_json` output."""
    return converter.structure(json.loads(text), GenerationTurnResult)
