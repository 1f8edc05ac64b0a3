"""Between the machines' run state and a `TurnSnapshot`: what a stable point captures
(`capture_loop`, `capture_chain`) and what a resume restores (`restore_loop`,
`restore_chain`), refusing a host whose policy, tools or chain differ from the turn's.

Apart from `toolloop_fsm.snapshot` (the values and their JSON form) because it reads the
run state (`toolloop_fsm.turn`), which sits above the values: the effects name a snapshot.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import attrs

from toolloop_fsm.attempts import AttemptPlan
from toolloop_fsm.attempts import KeyHealth
from toolloop_fsm.snapshot import ChainSnapshot
from toolloop_fsm.snapshot import DraftSnapshot
from toolloop_fsm.snapshot import HeldPiece
from toolloop_fsm.snapshot import KeyHealthEntry
from toolloop_fsm.snapshot import KeysTried
from toolloop_fsm.snapshot import LoopSnapshot
from toolloop_fsm.snapshot import SnapshotError
from toolloop_fsm.snapshot import ToolTerms
from toolloop_fsm.snapshot import check_policy
from toolloop_fsm.snapshot import check_tool_terms
from toolloop_fsm.snapshot import check_tools
from toolloop_fsm.snapshot import policy_terms
from toolloop_fsm.turn import Deliveries
from toolloop_fsm.turn import DraftState
from toolloop_fsm.turn import GenerationState
from toolloop_fsm.turn import HeldSegment
from toolloop_fsm.turn import Produced
from toolloop_fsm.turn import TurnState

if TYPE_CHECKING:
    from toolloop_fsm.host import ToolRegistry
    from toolloop_fsm.policy import LoopPolicy
    from toolloop_fsm.policy import TurnPolicy
    from toolloop_fsm.provider import ToolSpec


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
        next_seq=turn.deliveries.next_seq,
        delivered=tuple(turn.deliveries.delivered or ()),
        in_flight=tuple(item for _, item in sorted(turn.deliveries.in_flight.items())),
        visible_text_delivered=turn.deliveries.visible_text_delivered,
        stream_results=tuple(turn.produced.stream_results or ()),
        usage=tuple(turn.produced.usage or ()),
        notices=tuple(turn.produced.notices or ()),
        held_notice=turn.produced.held_notice,
        thought_log=turn.produced.thought_log,
        last_text=turn.produced.last_text,
        scene_metadata=tuple(turn.produced.scene_metadata or ()),
        follow_ups_cleared=turn.produced.follow_ups_cleared,
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
        deliveries=Deliveries(
            next_seq=snapshot.next_seq,
            in_flight={item.seq: item for item in snapshot.in_flight},
            delivered=list(snapshot.delivered) if snapshot.delivered else None,
            visible_text_delivered=snapshot.visible_text_delivered,
        ),
        produced=Produced(
            stream_results=list(snapshot.stream_results) if snapshot.stream_results else None,
            usage=list(snapshot.usage) if snapshot.usage else None,
            notices=list(snapshot.notices) if snapshot.notices else None,
            held_notice=snapshot.held_notice,
            thought_log=snapshot.thought_log,
            last_text=snapshot.last_text,
            scene_metadata=list(snapshot.scene_metadata) if snapshot.scene_metadata else None,
            follow_ups_cleared=snapshot.follow_ups_cleared,
        ),
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


__all__ = ["capture_chain", "capture_loop", "restore_chain", "restore_loop"]
