"""`GenerationTurnMachine`: the outer tier (docs/behaviour.md §9), declared once
(`DECLARATION`).

It walks the fallback chain: each attempt runs the inner tool loop; an ``error`` rotates to
the next healthy key of the same model, no key left or a ``timeout`` advances to the next
model, and when every attempt on the user's own credentials failed the host may admit the
shared route. The order of `TRANSITIONS` is the order in which the guards are tried.
Behaviour lives in `states/attempts.py`, decisions in `guards/attempts.py`.

Each exit declares its ending: a fixed one, or the attempt's own (read by `attempt_status`
and `attempt_reason`) when the chain passes on how an attempt ended. Every ending passes
`finishing`, which posts the closing notices and takes the terminal state the ending names.

`feed` checks every event before it is taken: its fields against their declared types (an
attempt's ``result`` must be a `GenerationTurnResult`, a clock time a finite number), then
that an `AttemptFinished` is the running attempt's. A malformed or stale event, like one
the state cannot take, raises `InvalidEvent` naming the state and the event, and changes
nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from toolloop_fsm.attempts import AttemptPlan
from toolloop_fsm.attempts import KeyHealth
from toolloop_fsm.declaration import Ending
from toolloop_fsm.declaration import MachineDeclaration
from toolloop_fsm.declaration import State
from toolloop_fsm.declaration import TraceNote
from toolloop_fsm.declaration import Transition as _t
from toolloop_fsm.effects import Effect
from toolloop_fsm.errors import InvalidEvent
from toolloop_fsm.event_checks import event_shapes
from toolloop_fsm.event_checks import malformation
from toolloop_fsm.events import AdmissionDecided
from toolloop_fsm.events import AttemptFinished
from toolloop_fsm.events import StopRequested
from toolloop_fsm.events import UnreachableReported
from toolloop_fsm.guards.attempts import admission_granted
from toolloop_fsm.guards.attempts import another_key_for_this_model
from toolloop_fsm.guards.attempts import another_model_in_chain
from toolloop_fsm.guards.attempts import attempt_awaits_approval
from toolloop_fsm.guards.attempts import attempt_failed_in_host_code
from toolloop_fsm.guards.attempts import attempt_is_final
from toolloop_fsm.guards.attempts import attempt_reached_a_budget
from toolloop_fsm.guards.attempts import attempt_reason
from toolloop_fsm.guards.attempts import attempt_status
from toolloop_fsm.guards.attempts import destination_unreachable
from toolloop_fsm.guards.attempts import no_attempt_available
from toolloop_fsm.guards.attempts import shared_route_may_be_admitted
from toolloop_fsm.guards.outcome import to_decided_terminal
from toolloop_fsm.host import TurnRequest
from toolloop_fsm.ledger import LedgerEntry
from toolloop_fsm.policy import TurnPolicy
from toolloop_fsm.provider import ToolSpec
from toolloop_fsm.result import RETRYABLE_STATUSES
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.result import TraceStep
from toolloop_fsm.result import TurnStatus
from toolloop_fsm.runner import CompiledRunner
from toolloop_fsm.runner import DeclaredMachine
from toolloop_fsm.snapshot import ChainSnapshot
from toolloop_fsm.snapshot_capture import restore_chain
from toolloop_fsm.states.attempts import admit_shared_route
from toolloop_fsm.states.attempts import ask_admission
from toolloop_fsm.states.attempts import begin_first_attempt
from toolloop_fsm.states.attempts import begin_next_key
from toolloop_fsm.states.attempts import begin_next_model
from toolloop_fsm.states.attempts import build_generation_result
from toolloop_fsm.states.attempts import end_chain_at_budget
from toolloop_fsm.states.attempts import exhaust_chain
from toolloop_fsm.states.attempts import pause_for_approval
from toolloop_fsm.states.attempts import post_closing_notices
from toolloop_fsm.states.attempts import refuse_shared_route
from toolloop_fsm.states.attempts import resume_attempt
from toolloop_fsm.states.attempts import skip_unreachable
from toolloop_fsm.states.attempts import stop_while_admitting
from toolloop_fsm.states.attempts import supersede_attempt
from toolloop_fsm.states.attempts import take_attempt_result
from toolloop_fsm.turn import DraftState
from toolloop_fsm.turn import GenerationState

#: the terminal states, one per turn status
FINAL_STATES: tuple[str, ...] = tuple(status.value for status in TurnStatus)
STATES: tuple[State, ...] = (
    State("ready"),
    State("planning", transient=True),
    State("attempting"),
    State("judging_attempt", transient=True),
    State("rotating_key", transient=True),
    State("advancing_model", transient=True),
    State("admitting_shared_route"),
    # the shared settle step: the closing notices are posted on entry, then the terminal state
    State("finishing", (post_closing_notices,), transient=True, settle=True),
    *(State(name, final=True) for name in FINAL_STATES),
)

#: The turn ends as the attempt ended: an answer (any status but a retryable one) ...
AS_THE_ATTEMPT_ANSWERED = Ending(
    (s for s in TurnStatus if s not in RETRYABLE_STATUSES),
    status_of=attempt_status,
    reason_of=attempt_reason,
)
#: ... or a retryable failure that nothing after it may retry.
AS_THE_ATTEMPT_FAILED = Ending(
    sorted(RETRYABLE_STATUSES), status_of=attempt_status, reason_of=attempt_reason
)

# fmt: off
TRANSITIONS: list[_t] = [
    _t("start", "ready", "planning"),
    _t("advance", "planning", "finishing", when=no_attempt_available,
       ends=("error", "no_usable_credentials")),
    _t("advance", "planning", "attempting", do=begin_first_attempt),
    # durable turns: a fresh machine continues a snapshot's turn in the attempt it was taken in
    _t("resume", "ready", "attempting", do=resume_attempt),
    # ---- an attempt ran the inner tool loop (or the host reported the destination gone)
    # an attempt paused for approval of a tool call (§3.13): so does the turn, in that attempt
    _t("attempt_finished", "attempting", "finishing", when=attempt_awaits_approval,
       do=pause_for_approval, ends=("awaiting_approval", None)),
    _t("attempt_finished", "attempting", "judging_attempt", do=take_attempt_result),
    _t("destination_unreachable", ["attempting", "admitting_shared_route"], "finishing",
       do=skip_unreachable, ends=("skipped", "destination_unreachable")),
    # ---- judging it, in docs/behaviour.md §9.2 order
    _t("advance", "judging_attempt", "finishing", when=destination_unreachable,
       do=skip_unreachable, ends=("skipped", "destination_unreachable")),
    _t("advance", "judging_attempt", "finishing", when=attempt_is_final,
       ends=AS_THE_ATTEMPT_ANSWERED),
    _t("advance", "judging_attempt", "finishing", when=attempt_failed_in_host_code,
       ends=AS_THE_ATTEMPT_FAILED),
    # a budget reached (§2.8): another model would only spend more of it
    _t("advance", "judging_attempt", "finishing", when=attempt_reached_a_budget,
       do=end_chain_at_budget, ends=AS_THE_ATTEMPT_FAILED),
    _t("advance", "judging_attempt", "rotating_key", when=another_key_for_this_model,
       do=supersede_attempt),
    _t("advance", "judging_attempt", "advancing_model", when=another_model_in_chain,
       do=supersede_attempt),
    _t("advance", "judging_attempt", "admitting_shared_route", when=shared_route_may_be_admitted,
       do=ask_admission),
    _t("advance", "judging_attempt", "finishing", do=exhaust_chain, ends=AS_THE_ATTEMPT_FAILED),
    _t("advance", "rotating_key", "attempting", do=begin_next_key),
    _t("advance", "advancing_model", "attempting", do=begin_next_model),
    # ---- the host's admission policy answers (once per turn)
    _t("admission_decided", "admitting_shared_route", "advancing_model", when=admission_granted,
       do=admit_shared_route),
    _t("admission_decided", "admitting_shared_route", "finishing", do=refuse_shared_route,
       ends=Ending(sorted(RETRYABLE_STATUSES), "shared_route_refused", status_of=attempt_status)),
    _t("stop_requested", "admitting_shared_route", "finishing", do=stop_while_admitting,
       ends=("stopped_by_user", "stopped_while_admitting")),
    # ---- finishing: the closing notices are posted on entry, then the terminal state the
    # decided ending names
    *to_decided_terminal("finishing", (
        "completed", "stopped_by_user", "follow_up_interrupt", "timeout", "error",
        "empty_response", "awaiting_approval", "skipped",
    )),
]
# fmt: on

DECLARATION = MachineDeclaration(
    name="GenerationTurnMachine",
    title="GenerationTurnMachine (outer tier)",
    states=STATES,
    transitions=TRANSITIONS,
    initial="ready",
    source_module=__name__,
    # an attempt that another takes over is noted in the trace, with its label
    notes=(TraceNote("judging_attempt", "attempt_superseded", supersede_attempt),),
)

_TRIGGERS: dict[type, str] = {
    AttemptFinished: "attempt_finished",
    AdmissionDecided: "admission_decided",
    StopRequested: "stop_requested",
    UnreachableReported: "destination_unreachable",
}

#: The fields of each event, checked before the event is taken; three are declared ``Any`` on
#: the event and read here as what the pump puts there.
_SHAPES = event_shapes(
    _TRIGGERS,
    read_as={
        (AttemptFinished, "result"): GenerationTurnResult,
        (AttemptFinished, "ledger"): Mapping[str, LedgerEntry],
        (AttemptFinished, "draft"): DraftState | None,
        (UnreachableReported, "partial"): GenerationTurnResult | None,
    },
)


class GenerationTurnMachine(DeclaredMachine[GenerationState]):
    """The outer tier as a sans-IO machine over a chain of `AttemptPlan`s (``shared``: the
    shared route's): `start` it, `feed` it each attempt's outcome, carry out the effects it
    returns (`StartAttempt`, …)."""

    __slots__ = ("plans", "policy", "shared", "tool_specs")
    name = "GenerationTurnMachine"

    def __init__(
        self,
        policy: TurnPolicy | None = None,
        *,
        plans: Sequence[AttemptPlan] = (),
        shared: Sequence[AttemptPlan] = (),
        tools: Iterable[ToolSpec] = (),
        reference: bool = False,
        on_step: Callable[[TraceStep], None] | None = None,
    ) -> None:
        super().__init__(DECLARATION, reference=reference, on_step=on_step)
        self.policy = policy if policy is not None else TurnPolicy()
        self.plans = tuple(plans)
        self.shared = tuple(shared)
        self.tool_specs = tuple(tools)
        labels = [plan.label for plan in (*self.plans, *self.shared)]
        if len(set(labels)) != len(labels):
            raise ValueError(f"attempt labels must be unique, got {labels}")
        budgets = (self.policy.budget, self.policy.loop.budget)
        if any(b is not None and b.cost is not None for b in budgets):
            unpriced = [
                plan.label
                for plan in (*self.plans, *self.shared)
                if plan.price is None and self.policy.loop.price is None
            ]
            if unpriced:
                raise ValueError(
                    f"a cost ceiling needs every model's price: give Attempt(price=...) to "
                    f"{', '.join(unpriced)} (or LoopPolicy.price for all)"
                )

    @property
    def generation(self) -> GenerationState:
        return self._started()

    def start(
        self,
        request: TurnRequest,
        *,
        health: Mapping[tuple[str, int], KeyHealth] | None = None,
        now: float | None = None,
    ) -> list[Effect]:
        """Begin the turn over the chain; ``health`` is the key book as it stands at ``now``
        (the clock's time, also stamped on the trace steps it takes; ``None``: time 0 for
        the key book, unstamped steps)."""
        self._refuse_restart("start")
        self._model = GenerationState(
            policy=self.policy,
            request=request,
            tool_specs=self.tool_specs,
            plans=list(self.plans),
            shared_plans=self.shared,
            health=dict(health or {}),
            now=0.0 if now is None else now,
        )
        return self._fire("start", None, now)

    def resume(self, snapshot: ChainSnapshot, *, now: float | None = None) -> list[Effect]:
        """Continue the turn ``snapshot`` was taken of: returns the `StartAttempt` of the
        attempt it was taken in. The chain (this machine's plans, the shared route's once
        admitted) must carry the snapshot's labels, else
        `toolloop_fsm.snapshot.SnapshotError`; cooldowns keep the time they had left,
        measured from ``now``."""
        self._refuse_restart("resume")
        self._model = restore_chain(
            snapshot,
            self.policy,
            plans=self.plans,
            shared=self.shared,
            tool_specs=self.tool_specs,
            now=0.0 if now is None else now,
        )
        return self._fire("resume", None, now)

    def feed(self, event: Any, *, now: float | None = None) -> list[Effect]:
        """Take one event; return the effects to carry out, in order. ``now`` is the clock's
        time, stamped on the trace steps the event leads to (the times decisions read travel
        in the events themselves)."""
        state = self._model
        if state is None:
            raise InvalidEvent(self.name, "ready", event, "call start() first")
        trigger = _TRIGGERS.get(type(event))
        if trigger is None:
            raise InvalidEvent(self.name, state.state, event, "not an event of the generation turn")
        problem = malformation(_SHAPES, event)
        if problem is not None:
            raise InvalidEvent(self.name, state.state, event, problem)
        if isinstance(event, AttemptFinished) and event.attempt != state.attempts:
            raise InvalidEvent(
                self.name,
                state.state,
                event,
                f"attempt {event.attempt} is not the running one ({state.attempts})",
            )
        return self._fire(trigger, event, now)

    def _fresh(self) -> GenerationTurnMachine:
        return GenerationTurnMachine(
            self.policy,
            plans=self.plans,
            shared=self.shared,
            tools=self.tool_specs,
            reference=not isinstance(self._runner, CompiledRunner),
            on_step=self._runner.on_step,
        )

    def _build_result(self, model: GenerationState) -> GenerationTurnResult:
        return build_generation_result(model)
