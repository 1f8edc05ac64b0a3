"""Between the machines' run state and a `TurnSnapshot`: what a stable point captures
(`capture_loop`, `capture_chain`) and what a resume restores (`restore_loop`,
`restore_chain`), refusing a host whose policy, tools or chain differ from the turn's.

A run-state record and its snapshot value share their fields by name: `_Mirror` carries
each shared field across, in both directions, by the two fields' declared types (a list
becomes a tuple, a set a frozenset, a dict a fresh dict, and back), so a field added to the
record and to the snapshot value is captured and restored with nothing written here. Only
the fields stored in another shape (a map keyed by tuples as a list of records, a nested
record) name their conversion. `DraftState` and `DraftSnapshot` declare the same fields in
the same order (refused on import otherwise): a draft is carried by position, the cheapest.

Apart from `toolloop_fsm.snapshot` (the values and their JSON form) because it reads the
run state (`toolloop_fsm.turn`), which sits above the values: the effects name a snapshot.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from typing import TYPE_CHECKING
from typing import Any

import attrs
from attrs import frozen

from toolloop_fsm.attempts import AttemptPlan
from toolloop_fsm.attempts import KeyHealth
from toolloop_fsm.events import FunctionCall
from toolloop_fsm.snapshot import ChainSnapshot
from toolloop_fsm.snapshot import DraftSnapshot
from toolloop_fsm.snapshot import HeldPiece
from toolloop_fsm.snapshot import KeyHealthEntry
from toolloop_fsm.snapshot import KeysTried
from toolloop_fsm.snapshot import LoopSnapshot
from toolloop_fsm.snapshot import PausedCall
from toolloop_fsm.snapshot import SnapshotError
from toolloop_fsm.snapshot import ToolTerms
from toolloop_fsm.snapshot import check_policy
from toolloop_fsm.snapshot import check_tool_terms
from toolloop_fsm.snapshot import check_tools
from toolloop_fsm.snapshot import policy_terms
from toolloop_fsm.turn import BatchCall
from toolloop_fsm.turn import Deliveries
from toolloop_fsm.turn import DraftState
from toolloop_fsm.turn import GenerationState
from toolloop_fsm.turn import HeldSegment
from toolloop_fsm.turn import Produced
from toolloop_fsm.turn import ToolRound
from toolloop_fsm.turn import TurnState

if TYPE_CHECKING:
    from toolloop_fsm.host import ToolRegistry
    from toolloop_fsm.policy import LoopPolicy
    from toolloop_fsm.policy import TurnPolicy
    from toolloop_fsm.provider import ToolSpec

Convert = Callable[[Any], Any]

#: How a run-state container becomes the snapshot's immutable one and back, by the two
#: fields' declared containers (their items must be declared alike): (the record's, the
#: snapshot's) -> (capture, restore).
_CONTAINERS: dict[tuple[str, str], tuple[Convert, Convert]] = {
    ("list", "tuple"): (tuple, list),
    ("set", "frozenset"): (frozenset, set),
    ("dict", "Mapping"): (dict, dict),
}
_MUTABLE = frozenset(record for record, _ in _CONTAINERS)
_OPTIONAL = " | None"


def _declared(owner: type, attribute: attrs.Attribute[Any]) -> tuple[str, str, bool]:
    """A field's declared type as (container, items, optional): ``list[X] | None`` is
    ``("list", "X", True)``, ``tuple[X, ...]`` is ``("tuple", "X", False)``. The types are
    read as written (the run state and the snapshot values are declared with postponed
    annotations, and the run state names types it imports for type checking only, which
    cannot be resolved when this module is imported)."""
    declared = attribute.type
    if not isinstance(declared, str):
        raise TypeError(f"{owner.__name__}.{attribute.name}: declare it as a postponed annotation")
    optional = declared.endswith(_OPTIONAL)
    container, bracket, items = declared.removesuffix(_OPTIONAL).partition("[")
    return container, items[:-1].removesuffix(", ...") if bracket else "", optional


def _carried(
    record: type, field: attrs.Attribute[Any], snapshot: type, held: attrs.Attribute[Any]
) -> tuple[Convert, Convert] | None:
    """How the record's ``field`` is captured as the snapshot's ``held`` and restored
    (``None``: as it is, an immutable value). A record's optional container (``None``
    until first used) that the snapshot holds as a plain one is captured empty for ``None``
    and restored as ``None`` when empty."""
    kept, items, optional = _declared(record, field)
    shape, held_items, held_optional = _declared(snapshot, held)
    if field.type == held.type and kept not in _MUTABLE:
        return None
    conversion = _CONTAINERS.get((kept, shape))
    if conversion is None or items != held_items or (held_optional and not optional):
        raise TypeError(
            f"{record.__name__}.{field.name} ({field.type}) is not carried as "
            f"{snapshot.__name__}.{held.name} ({held.type}) by type: give it its own conversion"
        )
    capture, restore = conversion
    if optional and held_optional:
        return (
            lambda value: None if value is None else capture(value),
            lambda value: None if value is None else restore(value),
        )
    if optional:
        return lambda value: capture(value or ()), lambda value: restore(value) if value else None
    return conversion


@frozen
class _Mirror:
    """The fields a run-state record shares by name with a snapshot value (``names``, read
    from either side in one call by ``read``), and how each is carried across: as it is, or
    by the conversion that ``captures`` and ``restores`` give for its index. A mirror
    ``in_order`` covers every field of both, in the same order: it builds the other side
    itself, passing the values by position (a third of the cost of passing them by name)."""

    record: type
    snapshot: type
    names: tuple[str, ...]
    read: Callable[[object], tuple[Any, ...]]
    captures: tuple[tuple[int, Convert], ...]
    restores: tuple[tuple[int, Convert], ...]
    in_order: bool

    @classmethod
    def between(
        cls,
        record: type,
        snapshot: type,
        *,
        own: Mapping[str, tuple[Convert, Convert]] | None = None,
        apart: Iterable[str] = (),
        in_order: bool = False,
    ) -> _Mirror:
        """The mirror of ``record`` in ``snapshot``: ``own`` names the conversions of the
        fields stored in another shape, ``apart`` the shared fields the caller carries;
        ``in_order`` asks for a mirror that builds either side itself (refused unless the two
        declare the same fields in the same order)."""
        fields = {field.name: field for field in attrs.fields(record)}
        own = own or {}
        left_to_caller = set(apart)
        names: list[str] = []
        captures: list[tuple[int, Convert]] = []
        restores: list[tuple[int, Convert]] = []
        for held in attrs.fields(snapshot):
            name = held.name
            if name not in fields or name in left_to_caller:
                continue
            way = own[name] if name in own else _carried(record, fields[name], snapshot, held)
            if way is not None:
                captures.append((len(names), way[0]))
                restores.append((len(names), way[1]))
            names.append(name)
        if in_order and not names == list(fields) == [f.name for f in attrs.fields(snapshot)]:
            raise TypeError(
                f"{record.__name__} and {snapshot.__name__} must declare the same fields in "
                "the same order"
            )
        return cls(
            record,
            snapshot,
            tuple(names),
            _reader(names),
            tuple(captures),
            tuple(restores),
            in_order,
        )

    def captured(self, record: object) -> dict[str, Any]:
        """The snapshot's values of the shared fields, by name."""
        return dict(zip(self.names, self._values(record, self.captures), strict=True))

    def restored(self, snapshot: object) -> dict[str, Any]:
        """The record's values of the shared fields, by name."""
        return dict(zip(self.names, self._values(snapshot, self.restores), strict=True))

    def capture(self, record: object) -> Any:
        """The snapshot value of ``record`` (a mirror `in_order`)."""
        assert self.in_order
        return self.snapshot(*self._values(record, self.captures))

    def restore(self, snapshot: object) -> Any:
        """The record ``snapshot`` holds (a mirror `in_order`)."""
        assert self.in_order
        return self.record(*self._values(snapshot, self.restores))

    def _values(self, source: object, conversions: tuple[tuple[int, Convert], ...]) -> list[Any]:
        values = list(self.read(source))
        for index, convert in conversions:
            values[index] = convert(values[index])
        return values


def _reader(names: list[str]) -> Callable[[object], tuple[Any, ...]]:
    """The values of ``names`` of an object, as a tuple, read in one call
    (`operator.attrgetter`, which gives a single name's value bare)."""
    if len(names) == 1:
        read_one = operator.attrgetter(names[0])
        return lambda source: (read_one(source),)
    return operator.attrgetter(*names) if names else lambda _: ()


_DRAFT = _Mirror.between(
    DraftState,
    DraftSnapshot,
    own={
        "segments": (
            lambda segments: tuple(HeldPiece(s.text, s.expression) for s in segments),
            lambda pieces: [HeldSegment(p.text, p.expression) for p in pieces],
        )
    },
    in_order=True,
)


def capture_draft(draft: DraftState) -> DraftSnapshot:
    snapshot: DraftSnapshot = _DRAFT.capture(draft)
    return snapshot


def restore_draft(snapshot: DraftSnapshot) -> DraftState:
    draft: DraftState = _DRAFT.restore(snapshot)
    return draft


def _optional_draft(capture: Convert) -> Convert:
    return lambda draft: capture(draft) if draft is not None else None


# the draft a loop restores depends on the policy given (restore_loop)
_LOOP = _Mirror.between(TurnState, LoopSnapshot, apart=("draft",))
_DELIVERIES = _Mirror.between(
    Deliveries,
    LoopSnapshot,
    own={
        "in_flight": (
            lambda in_flight: tuple(item for _, item in sorted(in_flight.items())),
            lambda in_flight: {item.seq: item for item in in_flight},
        )
    },
)
_PRODUCED = _Mirror.between(Produced, LoopSnapshot)
# cooldowns are restored on the resuming clock, and ``now`` is the resuming clock's
_CHAIN = _Mirror.between(
    GenerationState,
    ChainSnapshot,
    own={
        "keys_tried": (
            lambda tried: tuple(KeysTried(m, tuple(keys)) for m, keys in tried.items()),
            lambda tried: {entry.model: list(entry.keys) for entry in tried},
        ),
        "draft": (_optional_draft(capture_draft), _optional_draft(restore_draft)),
    },
    apart=("health", "now"),
)


def capture_loop(turn: TurnState, *, paused: bool = False) -> LoopSnapshot:
    """The inner machine's state as it enters ``starting_pass``; with ``paused``, as it
    pauses for approval, with its batch (docs/behaviour.md §3.13)."""
    return LoopSnapshot(
        **_LOOP.captured(turn),
        **_DELIVERIES.captured(turn.deliveries),
        **_PRODUCED.captured(turn.produced),
        draft=capture_draft(turn.draft) if turn.draft is not None else None,
        tools=tuple(ToolTerms.of(tool) for tool in turn.registry),
        policy_terms=policy_terms(turn.policy),
        paused=tuple(_paused_call(c) for c in turn.tool_round.calls) if paused else (),
    )


def _paused_call(batch_call: BatchCall) -> PausedCall:
    call = batch_call.call
    return PausedCall(
        name=call.name,
        arguments=call.arguments,
        position=batch_call.position,
        call_id=call.call_id,
        truncated=call.truncated,
        parse_error=call.parse_error,
        provider_data=call.provider_data,
        occurrence=batch_call.occurrence,
        outcome=batch_call.outcome,
        awaiting=batch_call.awaiting,
        predicate_error=batch_call.predicate_error,
    )


def _restored_batch(paused: tuple[PausedCall, ...]) -> ToolRound:
    """The batch a paused turn resumes with, every decision taken: the approved calls wait
    for their start, with the arguments they were approved with."""
    calls: list[BatchCall] = []
    for item in paused:
        if item.awaiting:
            raise SnapshotError(
                f"loop.paused[{item.position}]: the call of {item.name!r} waits for a decision: "
                "resume with decisions= (toolloop_fsm.decisions.decide)"
            )
        approved = item.approved is not None
        if not approved and item.outcome is None:
            raise SnapshotError(
                f"loop.paused[{item.position}]: the call of {item.name!r} has neither an "
                "outcome nor an approval"
            )
        arguments = dict(item.approved) if item.approved is not None else item.arguments
        call = FunctionCall(
            item.name,
            arguments,
            item.call_id,
            item.truncated,
            item.parse_error,
            item.provider_data,
        )
        calls.append(
            BatchCall(
                call,
                item.position,
                admitted=approved,
                occurrence=item.occurrence,
                outcome=item.outcome,
            )
        )
    return ToolRound(
        calls=calls,
        gated=len(calls) - 1,
        queued=sum(1 for c in calls if c.admitted),
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
        flush_chars=policy.delivery_flush_chars,
        deliveries=Deliveries(**_DELIVERIES.restored(snapshot)),
        produced=Produced(**_PRODUCED.restored(snapshot)),
        draft=restore_draft(draft) if drafting and draft is not None else None,
        tool_round=_restored_batch(snapshot.paused) if snapshot.paused else ToolRound(),
        **_LOOP.restored(snapshot),
    )


def capture_chain(state: GenerationState) -> ChainSnapshot:
    """The outer machine's state as it starts its current attempt."""
    return ChainSnapshot(
        **_CHAIN.captured(state),
        labels=tuple(plan.label for plan in state.plans),
        health=tuple(KeyHealthEntry(label, key, h) for (label, key), h in state.health.items()),
        now=state.now,
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
    restored = _CHAIN.restored(snapshot)
    results = restored["results"]
    return GenerationState(
        policy=policy,
        tool_specs=tool_specs,
        plans=chain,
        shared_plans=shared_plans,
        health=health,
        now=now,
        last=results[-1] if results else None,
        **restored,
    )


__all__ = ["capture_chain", "capture_loop", "restore_chain", "restore_loop"]
