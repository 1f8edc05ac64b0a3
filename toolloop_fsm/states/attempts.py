"""The outer tier's stages (docs/behaviour.md §9): start an attempt, judge how it ended, rotate a
key, advance to the next model, ask for the shared route, and assemble the turn's result. The
ending each exit decides is declared on its transition (`toolloop_fsm.generation`)."""

from __future__ import annotations

from typing import Any

import attrs

from toolloop_fsm.approvals import ApprovalRequest
from toolloop_fsm.attempts import AttemptPlan
from toolloop_fsm.attempts import KeyHealth
from toolloop_fsm.budgets import AttemptBudget
from toolloop_fsm.budgets import spent_by_attempts
from toolloop_fsm.decisions import pending_approvals
from toolloop_fsm.effects import AskAdmission
from toolloop_fsm.effects import PostNotice
from toolloop_fsm.effects import QueueStopResponse
from toolloop_fsm.effects import StartAttempt
from toolloop_fsm.effects import SupersedeAttempt
from toolloop_fsm.effects import UpdateKeyHealth
from toolloop_fsm.events import AttemptFinished
from toolloop_fsm.events import StopRequested
from toolloop_fsm.events import UnreachableReported
from toolloop_fsm.guards.attempts import key_candidates
from toolloop_fsm.guards.attempts import next_model
from toolloop_fsm.host import TurnRequest
from toolloop_fsm.result import AttemptFailure
from toolloop_fsm.result import AttemptRecord
from toolloop_fsm.result import Delivered
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.result import Notice
from toolloop_fsm.result import TraceStep
from toolloop_fsm.result import TurnStatus
from toolloop_fsm.result import UsageEntry
from toolloop_fsm.result import UsageLedger
from toolloop_fsm.scaffolding import prepare_context
from toolloop_fsm.snapshot import TurnSnapshot
from toolloop_fsm.snapshot import snapshot_from_json
from toolloop_fsm.snapshot import snapshot_to_json
from toolloop_fsm.snapshot_capture import capture_chain
from toolloop_fsm.turn import GenerationState

_HEALTHY = KeyHealth()


# --------------------------------------------------------------------------- starting attempts
def begin_first_attempt(state: GenerationState, _event: Any = None) -> None:
    model = next_model(state)
    assert model is not None
    _begin(state, model, key_candidates(state, model)[0])


def begin_next_key(state: GenerationState, _event: Any = None) -> None:
    _begin(state, state.model, key_candidates(state, state.model)[0])


def begin_next_model(state: GenerationState, _event: Any = None) -> None:
    begin_first_attempt(state)


def _begin(state: GenerationState, model: int, key: int | None) -> None:
    state.model = model
    state.key = key
    state.keys_tried.setdefault(model, []).append(key)
    state.attempts += 1
    _start_attempt(state)


def resume_attempt(state: GenerationState, _event: Any = None) -> None:
    """A resumed turn runs again the attempt its snapshot was taken in (the pump continues
    that attempt's tool loop from its own snapshot, when it has one)."""
    _start_attempt(state)


def _start_attempt(state: GenerationState) -> None:
    model = state.model
    key = state.key
    plan = state.plans[model]
    state.effects.append(
        StartAttempt(
            attempt=state.attempts,
            model=model,
            label=plan.label,
            key_index=key,
            route=plan.route,
            request=attempt_request(state, plan),
            ledger=dict(state.ledger),
            expression_delivered=state.expression_delivered,
            draft=state.draft.carried(state.draft.history) if state.draft is not None else None,
            budget=attempt_budget(state, plan),
        )
    )


def attempt_budget(state: GenerationState, plan: AttemptPlan) -> AttemptBudget | None:
    """What bounds an attempt besides its policy's budget (docs/behaviour.md §2.8): its
    model's price, and the chain's budget with what the earlier attempts spent of it (each
    at its own model's price). ``None`` when neither is given."""
    price = plan.price if plan.price is not None else state.policy.loop.price
    chain = state.policy.budget
    if price is None and chain is None:
        return None
    return AttemptBudget(price=price, chain=chain, chain_spent=spent_by_attempts(state.results))


def attempt_request(state: GenerationState, plan: AttemptPlan) -> TurnRequest:
    """The request of one attempt: the context with verbatim scaffolding exactly when this
    model writes its tool calls in text, and what earlier attempts delivered as the prefill
    the model continues from."""
    request = state.request
    context = prepare_context(
        request.context, state.tool_specs, verbatim=plan.tool_calling == "verbatim"
    )
    prefill = (request.prefill or "") + state.carried_text
    return attrs.evolve(request, context=context, prefill=prefill or None)


# --------------------------------------------------------------------------- judging an attempt
def take_attempt_result(state: GenerationState, event: AttemptFinished) -> None:
    """Record the attempt; credit or cool its key; keep what it delivered and completed."""
    result: GenerationTurnResult = event.result
    state.now = event.at
    state.signals_pending = event.signals_pending
    _record_attempt(state, result)
    plan = state.plans[state.model]
    state.ledger.update(event.ledger)
    if event.draft is not None:
        state.draft = event.draft
    if any(d.expression is not None for d in result.delivered):
        state.expression_delivered = True
    if result.held_notice is not None:
        state.held_notice = result.held_notice
    if state.key is not None:
        _update_key_health(state, plan, state.key, result)


def pause_for_approval(state: GenerationState, event: AttemptFinished) -> None:
    """The attempt paused for approval (docs/behaviour.md §3.13): the turn's snapshot is the
    chain as it started this attempt (taken before the attempt is recorded) with the
    attempt's tool loop at its pause, and the result hands it over with the calls."""
    approval = event.result.approval
    assert approval is not None
    paused_loop = snapshot_from_json(approval.snapshot).loop
    snapshot = TurnSnapshot(paused_loop, capture_chain(state))
    take_attempt_result(state, event)
    state.approval = ApprovalRequest(pending_approvals(snapshot), snapshot_to_json(snapshot))


def _record_attempt(state: GenerationState, result: GenerationTurnResult) -> None:
    state.last = result
    state.results.append(result)
    plan = state.plans[state.model]
    state.records.append(
        AttemptRecord(
            index=state.attempts,
            label=plan.label,
            key_index=state.key,
            route=plan.route,
            status=result.status,
            reason=result.reason,
            delivered_text=result.delivered_text,
            trace=result.trace,
        )
    )


def _update_key_health(
    state: GenerationState, plan: AttemptPlan, key: int, result: GenerationTurnResult
) -> None:
    policy = state.policy
    health = state.health.get((plan.label, key), _HEALTHY)
    if result.status is TurnStatus.TIMEOUT:
        return  # a key whose attempt timed out is not credited with a success
    if result.status is TurnStatus.ERROR and result.reason == "provider_error":
        kind = result.provider_error_kind
        if kind == "auth":
            health = attrs.evolve(health, retired=True, failures=health.failures + 1)
        else:
            if kind != "rate_limit":
                pause = policy.failure_cooldown
            elif result.retry_after is not None:
                pause = result.retry_after  # the provider's Retry-After / retry-after-ms
            else:
                pause = policy.rate_limit_cooldown
            health = attrs.evolve(
                health, cooldown_until=state.now + pause, failures=health.failures + 1
            )
    elif result.status is not TurnStatus.ERROR:
        health = attrs.evolve(health, successes=health.successes + 1)
    else:
        return  # a tool loop's own error says nothing about the key
    state.health[(plan.label, key)] = health
    state.effects.append(UpdateKeyHealth(plan.label, key, health))


def supersede_attempt(state: GenerationState, _event: Any = None) -> None:
    """Another attempt takes over: what this one delivered stays delivered and is carried
    as the next attempt's prefill."""
    last = state.last
    assert last is not None
    plan = state.plans[state.model]
    # label, status, reason, the provider's error kind, the key's index
    state.failures.append(
        AttemptFailure(plan.label, last.status, last.reason, last.provider_error_kind, state.key)
    )
    delivered = last.delivered_text
    state.carried_text += delivered
    state.records[-1] = attrs.evolve(state.records[-1], superseded=True)
    state.effects.append(SupersedeAttempt(state.attempts, plan.label, delivered))
    state.trace.append(
        TraceStep(
            "judging_attempt",
            "attempt_superseded",
            "judging_attempt",
            detail=f"attempt {state.attempts} ({plan.label}) superseded",
            at=state.step_time,
        )
    )


def ask_admission(state: GenerationState, _event: Any = None) -> None:
    supersede_attempt(state)
    state.admission_asked = True
    state.effects.append(AskAdmission(tuple(state.failures)))


def admit_shared_route(state: GenerationState, _event: Any = None) -> None:
    state.now = getattr(state.current_event, "at", state.now)
    state.admitted = True
    state.credential_source = "shared"
    state.plans.extend(state.shared_plans)


def refuse_shared_route(state: GenerationState, _event: Any = None) -> None:
    _post(state, Notice("shared_route_refused", {"failures": len(state.failures)}))


def stop_while_admitting(state: GenerationState, event: StopRequested) -> None:
    if event.stop_message is not None:
        state.stop_message = event.stop_message
        state.effects.append(QueueStopResponse(event.stop_message))


# --------------------------------------------------------------------------- endings
def exhaust_chain(state: GenerationState, _event: Any = None) -> None:
    """No key or model left: the last failure is the result (its ending is passed on)."""
    _list_last_failure(state)


def end_chain_at_budget(state: GenerationState, _event: Any = None) -> None:
    """The attempt reached a token or cost ceiling (docs/behaviour.md §2.8 rule 6): no other
    attempt is tried, and its failure is the result (listed, its ending passed on)."""
    _list_last_failure(state)


def _list_last_failure(state: GenerationState) -> None:
    last = state.last
    assert last is not None
    state.failures.append(
        AttemptFailure(
            label=state.plans[state.model].label,
            status=last.status,
            reason=last.reason,
            kind=last.provider_error_kind,
            key_index=state.key,
        )
    )


def skip_unreachable(state: GenerationState, event: Any = None) -> None:
    """The destination is gone: no more attempts. What the interrupted attempt delivered
    stays in the result."""
    if isinstance(event, UnreachableReported) and event.partial is not None:
        _record_attempt(state, event.partial)
    state.unreachable = True


def _post(state: GenerationState, notice: Notice) -> None:
    state.notices.append(notice)
    state.effects.append(PostNotice(notice))


def post_closing_notices(state: GenerationState, _event: Any = None) -> None:
    """The closing notices (docs/behaviour.md §9.8): one compact *fallback used* notice after a
    success that followed failures (not while a stop or follow-up is pending), and a held
    timeout notice only if nothing later answered."""
    if state.status is TurnStatus.COMPLETED:
        if state.failures and not state.signals_pending:
            _post(
                state,
                Notice(
                    "fallback_used",
                    {
                        "failures": [
                            f"{f.label}: {f.status.value}"
                            + (f" ({f.kind or f.reason})" if f.kind or f.reason else "")
                            for f in state.failures
                        ]
                    },
                ),
            )
    elif state.held_notice is not None and state.status not in (
        TurnStatus.SKIPPED,
        TurnStatus.STOPPED_BY_USER,
    ):  # a stopped turn is answered by the stop, not by a timeout
        _post(state, state.held_notice)


# --------------------------------------------------------------------------- the result
def build_generation_result(state: GenerationState) -> GenerationTurnResult:
    status = state.status
    assert status is not None
    last = state.last
    delivered: list[Delivered] = []
    usage: list[UsageEntry] = []
    notices: list[Notice] = []
    for result in state.results:
        for item in result.delivered:
            delivered.append(attrs.evolve(item, seq=len(delivered)))
        usage.extend(result.usage.entries)
        notices.extend(result.notices)
    notices.extend(state.notices)
    if last is None:
        return GenerationTurnResult(
            status=status,
            reason=state.reason,
            notices=tuple(notices),
            attempt_failures=tuple(state.failures),
            credential_source=state.credential_source,
            stop_message=state.stop_message,
            turn_id=state.request.turn_id,
            trace=tuple(state.trace),
        )
    final_text = last.final_text
    if state.carried_text and last.iterations <= 1:
        final_text = state.carried_text + final_text  # the attempt continued the carried text
    return attrs.evolve(
        last,
        status=status,
        reason=state.reason,
        final_text=final_text,
        usage=UsageLedger(tuple(usage)),
        cost=spent_by_attempts(state.results).cost,
        delivered=tuple(delivered),
        notices=tuple(notices),
        held_notice=None,
        attempt_failures=tuple(state.failures),
        attempts=tuple(state.records),
        credential_source=state.credential_source,
        stop_message=state.stop_message or last.stop_message,
        approval=state.approval,
        trace=tuple(state.trace),
    )
