"""Attempt control (docs/behaviour.md §9.2–§9.3): which key or model comes next, and when the
chain is done."""

from __future__ import annotations

from toolloop_fsm.attempts import AttemptPlan
from toolloop_fsm.attempts import KeyHealth
from toolloop_fsm.events import AdmissionDecided
from toolloop_fsm.events import AttemptFinished
from toolloop_fsm.host import DestinationUnreachable
from toolloop_fsm.result import RETRYABLE_STATUSES
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.result import TurnStatus
from toolloop_fsm.turn import GenerationState

_HEALTHY = KeyHealth()
#: provider failures that another key of the same model cannot fix (the request is the problem)
_PERMANENT_KINDS = frozenset({"bad_request", "not_found"})


def key_candidates(state: GenerationState, model: int) -> list[int | None]:
    """Keys of ``model`` that may still be tried this turn, in order (``None``: keyless)."""
    if model < 0 or model >= len(state.plans):
        return []
    return _usable_keys(state, state.plans[model], state.keys_tried.get(model, []))


def _usable_keys(
    state: GenerationState, plan: AttemptPlan, tried: list[int | None]
) -> list[int | None]:
    if len(tried) >= state.policy.max_key_attempts_per_model:
        return []
    if plan.keys == 0:
        return [] if tried else [None]
    return [
        key
        for key in range(plan.keys)
        if key not in tried and state.health.get((plan.label, key), _HEALTHY).usable_at(state.now)
    ]


def next_model(state: GenerationState) -> int | None:
    """The next model after the current one that has a key to try."""
    for model in range(state.model + 1, len(state.plans)):
        if key_candidates(state, model):
            return model
    return None


def _last(state: GenerationState) -> GenerationTurnResult:
    assert state.last is not None
    return state.last


def attempt_status(state: GenerationState) -> TurnStatus:
    """How the last attempt ended: the status the turn ends with when it passes that ending
    on (``error`` when no attempt ran)."""
    return state.last.status if state.last is not None else TurnStatus.ERROR


def attempt_reason(state: GenerationState) -> str | None:
    """The last attempt's sub-reason, passed on with its status."""
    return _last(state).reason


def no_attempt_available(state: GenerationState) -> bool:
    """Every key of every model is cooling down or retired (or the chain is empty)."""
    return next_model(state) is None


def destination_unreachable(state: GenerationState) -> bool:
    if state.unreachable:
        return True
    last = state.last
    return last is not None and isinstance(last.exception, DestinationUnreachable)


def attempt_is_final(state: GenerationState) -> bool:
    """Only ``error`` and ``timeout`` are retryable; every other status is the answer."""
    return _last(state).status not in RETRYABLE_STATUSES


def attempt_failed_in_host_code(state: GenerationState) -> bool:
    """An exception from the host's own code: no fallback can help."""
    return _last(state).reason == "host_error"


def attempt_reached_a_budget(state: GenerationState) -> bool:
    """The attempt ended at a token or cost ceiling (docs/behaviour.md §2.8 rule 6): a
    fallback would spend more of what is spent."""
    return _last(state).budget_exceeded is not None


def another_key_for_this_model(state: GenerationState) -> bool:
    """An ``error`` rotates to the next healthy key of the same model (a ``timeout`` or a
    request the provider rejects as such moves on to the next model instead)."""
    last = _last(state)
    if last.status is not TurnStatus.ERROR:
        return False
    if last.reason == "provider_error" and last.provider_error_kind in _PERMANENT_KINDS:
        return False
    return bool(key_candidates(state, state.model))


def another_model_in_chain(state: GenerationState) -> bool:
    return next_model(state) is not None


def shared_route_may_be_admitted(state: GenerationState) -> bool:
    """Every attempt on the user's own credentials failed retryably, the settings allow the
    shared route, the host has not been asked yet this turn, and some shared attempt has a
    usable key (asking for a route that cannot run would only crash the turn)."""
    return (
        state.policy.allow_shared_route
        and not state.admission_asked
        and state.credential_source == "user"
        and any(_usable_keys(state, plan, []) for plan in state.shared_plans)
    )


def attempt_awaits_approval(state: GenerationState) -> bool:
    """The attempt paused for a person's approval of a tool call (docs/behaviour.md §3.13):
    the turn pauses with it, to resume in the same attempt."""
    event = state.current_event
    return (
        isinstance(event, AttemptFinished)
        and event.result.status is TurnStatus.AWAITING_APPROVAL
        and event.result.approval is not None
    )


def admission_granted(state: GenerationState) -> bool:
    event = state.current_event
    return isinstance(event, AdmissionDecided) and event.admitted
