"""The durable turn's workflow: another shell around the sans-IO machines.

`GenerationTurnWorkflow` runs `GenerationTurnMachine` and each attempt's `ToolLoopMachine`
as workflow code, as the asyncio pumps do in one process: it feeds them events and carries
out their effects — here as Temporal primitives. A provider pass is an activity (it streams
and delivers on a worker; its chunks come back for the machine), each call of a tool batch is
its own activity, run concurrently with its siblings (docs/behaviour.md §3.10), a call into
the channel is an activity; each call's deadline, the settle step's and the pass's overall
budget are workflow timers and activity timeouts; a stop and a follow-up are signals. The
machines are deterministic and import nothing asynchronous, so replaying the workflow's
history replays the turn exactly: a worker that dies loses nothing the history holds, and a
completed tool is never run again.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Awaitable
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError
from temporalio.exceptions import TimeoutError as ActivityTimeout
from temporalio.exceptions import TimeoutType
from temporalio.workflow import ActivityCancellationType
from temporalio.workflow import ActivityHandle

with workflow.unsafe.imports_passed_through():
    import attrs

    from toolloop_fsm.approvals import ApprovalError
    from toolloop_fsm.approvals import ApprovalRequest
    from toolloop_fsm.approvals import Decision
    from toolloop_fsm.decisions import decide
    from toolloop_fsm.effect_handlers import EffectHandlers
    from toolloop_fsm.effect_handlers import InnerEffectShell
    from toolloop_fsm.effect_handlers import OuterEffectShell
    from toolloop_fsm.effects import ArmDeadline
    from toolloop_fsm.effects import AskAdmission
    from toolloop_fsm.effects import CancelStream
    from toolloop_fsm.effects import CancelTool
    from toolloop_fsm.effects import ClearDeadline
    from toolloop_fsm.effects import Deliver
    from toolloop_fsm.effects import Effect
    from toolloop_fsm.effects import Finish
    from toolloop_fsm.effects import PostNotice
    from toolloop_fsm.effects import QueueStopResponse
    from toolloop_fsm.effects import RunTool
    from toolloop_fsm.effects import StartAttempt
    from toolloop_fsm.effects import StartStream
    from toolloop_fsm.effects import SupersedeAttempt
    from toolloop_fsm.effects import UpdateKeyHealth
    from toolloop_fsm.events import AdmissionDecided
    from toolloop_fsm.events import AttemptFinished
    from toolloop_fsm.events import DeadlineExpired
    from toolloop_fsm.events import DeadlineKind
    from toolloop_fsm.events import DeliveryFailed
    from toolloop_fsm.events import DeliveryRecorded
    from toolloop_fsm.events import FollowUpArrived
    from toolloop_fsm.events import StopRequested
    from toolloop_fsm.events import StreamEnded
    from toolloop_fsm.events import StreamFailed
    from toolloop_fsm.events import TextDelta
    from toolloop_fsm.events import ToolFinished
    from toolloop_fsm.events import ToolOutcomeKind
    from toolloop_fsm.generation import GenerationTurnMachine
    from toolloop_fsm.host import Tool
    from toolloop_fsm.host import ToolRegistry
    from toolloop_fsm.host import TurnRequest
    from toolloop_fsm.host import call_idempotency_key
    from toolloop_fsm.machine import ToolLoopMachine
    from toolloop_fsm.notice_budget import SEND_NOTICE
    from toolloop_fsm.notice_budget import NoticeBudget
    from toolloop_fsm.result import GenerationTurnResult
    from toolloop_fsm.result import InDoubtCall
    from toolloop_fsm.result import InDoubtCause
    from toolloop_fsm.result import Notice
    from toolloop_fsm.result import TurnStatus
    from toolloop_fsm.result import with_attempts_outcomes
    from toolloop_fsm.snapshot import LoopSnapshot
    from toolloop_fsm.snapshot import TurnSnapshot
    from toolloop_fsm.snapshot import snapshot_from_json
    from toolloop_fsm.temporal._values import APPROVAL_MEMO
    from toolloop_fsm.temporal._values import CALL_CHANNEL
    from toolloop_fsm.temporal._values import DECIDE_SIGNAL
    from toolloop_fsm.temporal._values import DELIVERY_INTENT_SIGNAL
    from toolloop_fsm.temporal._values import DESCRIBE_TURN
    from toolloop_fsm.temporal._values import FOLLOW_UP_SIGNAL
    from toolloop_fsm.temporal._values import RECONCILE_TOOL
    from toolloop_fsm.temporal._values import REFUSED_MEMO
    from toolloop_fsm.temporal._values import RUN_TOOL
    from toolloop_fsm.temporal._values import STOP_SIGNAL
    from toolloop_fsm.temporal._values import STREAM_PASS
    from toolloop_fsm.temporal._values import WORKFLOW_NAME
    from toolloop_fsm.temporal._values import Catalogue
    from toolloop_fsm.temporal._values import CatalogueRequest
    from toolloop_fsm.temporal._values import ChannelAnswer
    from toolloop_fsm.temporal._values import ChannelCall
    from toolloop_fsm.temporal._values import DeliveryIntent
    from toolloop_fsm.temporal._values import PassDelivery
    from toolloop_fsm.temporal._values import PassInput
    from toolloop_fsm.temporal._values import PassOutcome
    from toolloop_fsm.temporal._values import Reconciled
    from toolloop_fsm.temporal._values import ToolDescription
    from toolloop_fsm.temporal._values import ToolInput
    from toolloop_fsm.temporal._values import TurnInput
    from toolloop_fsm.temporal._values import unpack_chunks
    from toolloop_fsm.tools import unknown_outcome

#: A pass is tried this many times in all while its workers are lost (each try continues
#: from what the tries before it recorded).
PASS_TRIES = 50
#: How long one call into the channel may wait for a worker to take it, at most.
_CHANNEL_CALL_TRIES = 5


def _seconds(value: float) -> timedelta:
    return timedelta(seconds=value)


def _runs_on_the_worker(_arguments: Any, _ctx: Any) -> Any:
    raise RuntimeError("a durable turn's tools run on its workers, never in the workflow")


def _reconciles_on_the_worker(_arguments: Any, _ctx: Any) -> Any:
    raise RuntimeError("a durable turn's reconcile hooks run on its workers (RECONCILE_TOOL)")


def _outcome_dropped(handle: ActivityHandle[Any]) -> None:
    if not handle.cancelled():
        handle.exception()


@attrs.frozen
class _ToolCall:
    """One call of the attempt's tool batch in flight on the workers: its ``RUN_TOOL``
    activity, or, once the worker running a call not marked idempotent was lost, the
    ``RECONCILE_TOOL`` activity asking its hook what really happened (docs/behaviour.md
    §3.9)."""

    run: RunTool
    spec: ToolInput
    idempotent: bool
    handle: ActivityHandle[Any]
    #: its entry in the attempt's in-doubt calls, once its worker was lost (``handle`` is
    #: then the reconcile hook's activity), and how the worker was lost
    in_doubt: InDoubtCall | None = None
    lost: str = ""


def _stand_in(description: ToolDescription) -> Tool:
    """The tool as the machine knows it: everything but its handler, which runs on a worker."""
    return Tool(
        description.name,
        description.description,
        description.parameters,
        _runs_on_the_worker,
        requires_follow_up=description.requires_follow_up,
        timeout=description.timeout,
        replay=description.replay,
        idempotent=description.idempotent,
        reconcile=_reconciles_on_the_worker if description.reconciles else None,
        sequential=description.sequential,
        repeatable=description.repeatable,
        needs_approval=description.needs_approval,
    )


@workflow.defn(name=WORKFLOW_NAME)
class GenerationTurnWorkflow:
    """One generation turn, durable: started by `start_generation_turn`, run by `TurnWorker`."""

    def __init__(self) -> None:
        self.stop_requested = False
        self.stop_message: str | None = None
        self.follow_ups = 0
        #: while the turn waits for approval (docs/behaviour.md §3.13): what it waits on, and
        #: the decisions a signal brought
        self.approval: ApprovalRequest | None = None
        self.decisions: list[Decision] | None = None
        #: per pass, the deliveries its tries recorded before sending them, in order
        self.intents: dict[str, list[PassDelivery]] = {}

    @workflow.signal(name=DELIVERY_INTENT_SIGNAL)
    def delivery_intent(self, intent: DeliveryIntent) -> None:
        """A pass is about to send a delivery: from here on it is what a lost try's next one
        continues from (the channel may have shown it)."""
        recorded = self.intents.setdefault(intent.pass_id, [])
        if recorded and recorded[-1].seq >= intent.seq:
            return  # a try never records a number twice; a repeat changes nothing
        recorded.append(PassDelivery(intent.seq, intent.text))

    @workflow.signal(name=STOP_SIGNAL)
    def stop(self, stop_message: str | None = None) -> None:
        """The host's /kill: the turn stops (with ``stop_message`` queued first, if any)."""
        self.stop_requested = True
        if stop_message is not None:
            self.stop_message = stop_message

    @workflow.signal(name=FOLLOW_UP_SIGNAL)
    def follow_up(self) -> None:
        """A new user message arrived for this conversation."""
        self.follow_ups += 1

    @workflow.signal(name=DECIDE_SIGNAL)
    def decide(self, decisions: list[Decision]) -> None:
        """The host's decisions on the calls the turn waits on (checked when taken)."""
        if self.approval is not None:
            self.decisions = list(decisions)

    @workflow.run
    async def run(self, turn: TurnInput) -> GenerationTurnResult:
        policy = turn.policy.loop
        # a local activity: it reads the worker's registries only, and its answer is
        # recorded in the history like any other
        catalogue = await workflow.execute_local_activity(
            DESCRIBE_TURN,
            CatalogueRequest(turn.attempts, turn.tools, turn.channel),
            result_type=Catalogue,
            start_to_close_timeout=_seconds(policy.host_call_timeout),
            retry_policy=RetryPolicy(maximum_attempts=_CHANNEL_CALL_TRIES),
        )
        if catalogue.problem is not None:
            return GenerationTurnResult(
                TurnStatus.ERROR,
                "host_error",
                error_message=catalogue.problem,
                turn_id=turn.request.turn_id,
            )
        result = await _TurnShell(self, turn, catalogue).run()
        while result.status is TurnStatus.AWAITING_APPROVAL and result.approval is not None:
            resumed = await self.wait_for_decisions(result.approval)
            if resumed is None:
                return result  # stopped while it waited: the paused turn is the answer
            result = await _TurnShell(self, turn, catalogue, resume_from=resumed).run()
        return result

    async def wait_for_decisions(self, approval: ApprovalRequest) -> TurnSnapshot | None:
        """Wait (holding nothing but this history) for decisions that `decide` accepts; the
        snapshot they decided, or ``None`` when a stop came first. What the turn waits on is
        in its memo while it waits; refused decisions are dropped, and why is in it too."""
        self.approval = approval
        workflow.upsert_memo({APPROVAL_MEMO: approval})
        while True:
            await workflow.wait_condition(lambda: self.decisions is not None or self.stop_requested)
            if self.decisions is None:
                self.approval = None
                workflow.upsert_memo({APPROVAL_MEMO: None})
                return None
            decisions, self.decisions = self.decisions, None
            try:
                decided = decide(snapshot_from_json(approval.snapshot), decisions)
            except ApprovalError as err:
                workflow.upsert_memo({REFUSED_MEMO: str(err)})
                continue
            self.approval = None
            workflow.upsert_memo({APPROVAL_MEMO: None, REFUSED_MEMO: None})
            return decided


class _TurnShell(OuterEffectShell[Awaitable[list[Effect]]]):
    """The outer tier: runs `GenerationTurnMachine` over the chain, each attempt by an
    `_AttemptShell`."""

    def __init__(
        self,
        flow: GenerationTurnWorkflow,
        turn: TurnInput,
        catalogue: Catalogue,
        *,
        resume_from: TurnSnapshot | None = None,
    ):
        self.flow = flow
        self.turn = turn
        self.catalogue = catalogue
        self.resume_from = resume_from
        # a resumed turn's running attempt continues from its tool loop's snapshot
        self.resume_loop: tuple[int, LoopSnapshot] | None = None
        if resume_from is not None and resume_from.chain is not None and resume_from.loop:
            self.resume_loop = (resume_from.chain.attempts, resume_from.loop)
        self.registry = ToolRegistry([_stand_in(tool) for tool in catalogue.tools])
        self.machine = GenerationTurnMachine(
            turn.policy, plans=catalogue.plans, tools=[tool.spec() for tool in self.registry]
        )
        self.key_book: dict[tuple[str, int], Any] = {}
        self.stop_honoured = False
        # one budget for every notice of the turn, the attempts' and the closing ones
        self.notices = NoticeBudget(turn.policy.loop.host_call_timeout)
        self.abandoned: list[str] = []  # the outer tier's calls given up on
        self.follow_ups_seen = 0  # the host's follow-ups the turn has been told of
        self.result: GenerationTurnResult | None = None  # the turn's, once it finished
        # how it carries out each effect class of the chain (as Temporal primitives): each
        # handler returns the effects of the events it fed the machine
        self.effect_handlers = EffectHandlers("the durable turn", self)

    async def run(self) -> GenerationTurnResult:
        self.follow_ups_seen = self.flow.follow_ups
        chain = self.resume_from.chain if self.resume_from is not None else None
        if chain is not None:
            opening = self.machine.resume(chain, now=workflow.time())
        else:
            opening = self.machine.start(
                self.turn.request, health=self.key_book, now=workflow.time()
            )
        pending: collections.deque[Effect] = collections.deque(opening)
        carry_out = self.effect_handlers
        while pending:
            pending.extend(await carry_out(pending.popleft()))
            if self.result is not None:
                return self.result
        raise RuntimeError("the generation turn stopped without a result")

    async def finish(self, effect: Finish) -> list[Effect]:
        self.result = with_attempts_outcomes(
            effect.result, self.machine.generation.results, self.abandoned
        )
        return []

    async def start_attempt(self, effect: StartAttempt) -> list[Effect]:
        flow = self.flow
        resume_loop = None
        if self.resume_loop is not None and self.resume_loop[0] == effect.attempt:
            resume_loop = self.resume_loop[1]
        self.resume_loop = None
        shell = _AttemptShell(self, effect, resume_from=resume_loop)
        result = await shell.run()
        if shell.stop_fed:
            self.stop_honoured = True
        inner = shell.machine
        ledger = dict(inner.turn.ledger) if inner.is_finished else {}
        signals_pending = flow.stop_requested or flow.follow_ups > self.follow_ups_seen
        finished = AttemptFinished(effect.attempt, result, ledger, workflow.time(), signals_pending)
        return self.machine.feed(finished, now=workflow.time())

    async def ask_admission(self, effect: AskAdmission) -> list[Effect]:
        # a durable turn has no shared route: nobody is admitted
        decided = AdmissionDecided(False, workflow.time())
        return self.machine.feed(decided, now=workflow.time())

    async def post_notice(self, effect: PostNotice) -> list[Effect]:
        """A notice the host cannot show ends nothing."""
        answer = await self.send_notice(effect.notice)
        if answer is not None and answer.given_up:
            self.abandoned.append(SEND_NOTICE)
        return []

    async def queue_stop_response(self, effect: QueueStopResponse) -> list[Effect]:
        await self.call_channel(
            ChannelCall(self.turn.channel, "queue_front", text=effect.stop_message)
        )
        return []

    async def supersede_attempt(self, effect: SupersedeAttempt) -> list[Effect]:
        await self.call_channel(
            ChannelCall(
                self.turn.channel,
                "attempt_superseded",
                text=effect.delivered_text,
                attempt=effect.attempt,
                label=effect.label,
            )
        )
        return []

    async def update_key_health(self, effect: UpdateKeyHealth) -> list[Effect]:
        self.key_book[(effect.label, effect.key_index)] = effect.health
        return []

    async def send_notice(self, notice: Notice) -> ChannelAnswer | None:
        """Post ``notice`` within what is left of the turn's notice budget, both tiers' (as
        in process: docs/behaviour.md §7.3, rule 2), timed by the workflow's clock.
        ``None``: the budget is spent and it is not sent (it stays in the result's notices);
        an answer ``given_up``: it overran what was left, and no later notice is sent."""
        budget = self.notices
        if budget.spent:
            return None
        call = ChannelCall(
            self.turn.channel,
            "send_notice",
            notice=notice,
            timeout=budget.remaining,
            grace=self.turn.policy.loop.cancel_grace,
        )
        started = workflow.time()
        answer = await self.call_channel(call)
        budget.spend(workflow.time() - started)
        if answer.timed_out:  # its tries together outlived the allowance: it overran it
            answer = attrs.evolve(answer, given_up=True)
        if answer.given_up:
            budget.overrun()
        return answer

    async def call_channel(self, call: ChannelCall) -> ChannelAnswer:
        """One call into the channel, an activity: a notice within the allowance it carries
        (all its tries together, so a lost worker does not stretch the notice budget), any
        other call within ``host_call_timeout`` a try."""
        beat = self.turn.heartbeat_timeout
        overall: timedelta | None = None
        if call.method == "send_notice":
            overall = _seconds(call.timeout + call.grace + beat)
        else:
            call = attrs.evolve(call, timeout=self.turn.policy.loop.host_call_timeout)
        try:
            answer: ChannelAnswer = await workflow.execute_activity(
                CALL_CHANNEL,
                call,
                result_type=ChannelAnswer,
                start_to_close_timeout=overall or _seconds(call.timeout + beat),
                schedule_to_close_timeout=overall,
                retry_policy=RetryPolicy(maximum_attempts=_CHANNEL_CALL_TRIES),
            )
            return answer
        except ActivityError as err:
            return ChannelAnswer(
                error=f"channel.{call.method} was lost: {_cause(err)}", timed_out=_timed_out(err)
            )


class _AttemptShell(InnerEffectShell[Awaitable[None]]):
    """One attempt: runs a `ToolLoopMachine`, its passes and tools as activities."""

    def __init__(
        self, outer: _TurnShell, effect: StartAttempt, *, resume_from: LoopSnapshot | None = None
    ) -> None:
        self.outer = outer
        self.resume_from = resume_from
        self.flow = outer.flow
        self.turn = outer.turn
        self.effect = effect
        self.policy = outer.turn.policy.loop
        self.machine = ToolLoopMachine(self.policy, tools=outer.registry)
        self.provider = outer.turn.attempts[effect.model]
        continuation = outer.catalogue.continuation
        self.continuation = (
            continuation[effect.model] if effect.model < len(continuation) else False
        )
        self.keys_prefix = f"{effect.request.turn_id}:{effect.attempt}"
        self.result: GenerationTurnResult | None = None
        self.outcomes: collections.deque[Any] = collections.deque()
        self.events: collections.deque[Any] = collections.deque()
        self.armed: dict[int, tuple[ArmDeadline, float]] = {}
        self.stream_token: int | None = None
        self.stream: ActivityHandle[Any] | None = None  # the running pass's try
        # the batch's calls on the workers, by dispatch number: a dict, so that calls done at
        # once are taken in dispatch order on every replay
        self.calls: dict[int, _ToolCall] = {}
        # which call each TOOL deadline bounds: the n-th armed is the n-th call started
        self.deadline_of: dict[int, int] = {}  # the deadline's token -> the call's dispatch
        self.calls_unarmed: collections.deque[int] = collections.deque()
        self.deadlines_unpaired: collections.deque[int] = collections.deque()
        self.records: dict[int, PassDelivery] = {}
        self.stop_fed = False
        self.follow_ups_seen = 0
        self.abandoned: list[str] = []  # the attempt's calls given up on
        self.in_doubt: list[InDoubtCall] = []  # its calls whose worker was lost (§3.9)
        self.passes = 0  # the attempt's passes started, naming each (`PassInput.pass_id`)
        self.pass_spec: PassInput | None = None  # the running pass's first try
        self.pass_began = 0.0  # when its first try was started, by the workflow's clock
        self.pass_tries = 0
        # how it carries out each effect class of the tool loop (as Temporal primitives); a
        # durable attempt does not draft, cut a stream or take snapshots, and says so
        self.effect_handlers = EffectHandlers("the durable attempt", self)

    # ------------------------------------------------------------------ running
    async def run(self) -> GenerationTurnResult:
        self.follow_ups_seen = self.flow.follow_ups
        request: TurnRequest = self.effect.request
        if self.resume_from is not None:
            effects = self.machine.resume(self.resume_from, now=workflow.time())
        else:
            effects = self.machine.start(
                request,
                continuation_style=self.continuation,
                hold_timeout_notice=True,
                ledger=self.effect.ledger,
                expression_delivered=self.effect.expression_delivered,
                attempt_budget=self.effect.budget,
                now=workflow.time(),
            )
        await self.carry_out(effects)
        while self.result is None:
            if self.outcomes:
                await self.feed(self.outcomes.popleft())
            elif self.signals_pending():
                # a signal that arrived before the next event is taken first, in the state
                # it met (a delivery the channel already confirmed is recorded first)
                self.take_signals()
            elif self.events:
                await self.feed(self.events.popleft())
            else:
                await self.wait()
        self.cancel_running()
        if self.abandoned:
            named = (*self.result.abandoned_calls, *self.abandoned)
            self.result = attrs.evolve(self.result, abandoned_calls=named)
        if self.in_doubt:
            in_doubt = (*self.result.in_doubt_calls, *self.in_doubt)
            self.result = attrs.evolve(self.result, in_doubt_calls=in_doubt)
        return self.result

    async def feed(self, event: Any) -> None:
        if self.result is not None or self.machine.is_finished:
            return
        await self.carry_out(self.machine.feed(event, now=workflow.time()))

    def signals_pending(self) -> bool:
        flow = self.flow
        return (flow.stop_requested and not self.stop_fed) or flow.follow_ups > self.follow_ups_seen

    def take_signals(self, *, after_queued: bool = False) -> None:
        """Queue the signals not yet fed: first, or ``after_queued`` events (the chunks of
        a pass the signal ended)."""
        flow = self.flow
        signals: list[Any] = []
        if flow.stop_requested and not self.stop_fed:
            self.stop_fed = True
            signals.append(StopRequested(flow.stop_message))
        if flow.follow_ups > self.follow_ups_seen:
            self.follow_ups_seen = flow.follow_ups
            signals.append(FollowUpArrived())
        if after_queued:
            self.events.extend(signals)
        else:
            self.events.extendleft(reversed(signals))

    async def wait(self) -> None:
        """Wait for whichever comes first of the running pass, a call of the tool batch, a
        signal and the next deadline; turn what happened into events."""
        due = self.next_deadline()

        def ready() -> bool:
            stream = self.stream
            return (
                (stream is not None and stream.done())
                or any(call.handle.done() for call in self.calls.values())
                or self.signals_pending()
            )

        if self.stream is None and not self.calls and due is None and not self.signals_pending():
            raise RuntimeError(f"the attempt waits for nothing in state {self.machine.state!r}")
        if not ready():
            timeout = None if due is None else due[1] - workflow.time()
            if timeout is None or timeout > 0:
                with contextlib.suppress(TimeoutError):  # the deadline is due
                    await workflow.wait_condition(ready, timeout=timeout)
        stream = self.stream
        done = [dispatch for dispatch, call in self.calls.items() if call.handle.done()]
        if (stream is not None and stream.done()) or done:
            if stream is not None and stream.done():
                self.stream = None
                await self.pass_finished(stream)
            for dispatch in done:
                self.call_finished(self.calls[dispatch])
        elif self.signals_pending():
            if stream is not None:
                # the pass ends here: what it streamed so far is fed before the signal
                await self.harvest_cancelled_pass(stream)
                self.take_signals(after_queued=True)
            else:
                self.take_signals()
        else:
            for effect in self.due_deadlines():
                self.armed.pop(effect.token, None)
                self.deadline_of.pop(effect.token, None)
                self.events.append(DeadlineExpired(effect.kind, effect.token))

    def timed_deadlines(self) -> list[tuple[ArmDeadline, float]]:
        """The deadlines the workflow times itself, each with when it is due, earliest first
        (in the order they were armed when due together). A pass's stream deadline is timed
        by the pass; the deadline of a call whose worker was lost is not timed while its
        hook is asked: that answer is its outcome whenever the deadline passes (§3.9 rule 2),
        and the hook's activity bounds itself."""
        timed = [
            (effect, armed_at + effect.seconds)
            for effect, armed_at in self.armed.values()
            if effect.kind is not DeadlineKind.STREAM and not self.being_settled(effect)
        ]
        return sorted(timed, key=lambda armed: armed[1])

    def being_settled(self, deadline: ArmDeadline) -> bool:
        dispatch = self.deadline_of.get(deadline.token)
        call = self.calls.get(dispatch) if dispatch is not None else None
        return call is not None and call.in_doubt is not None

    def next_deadline(self) -> tuple[ArmDeadline, float] | None:
        timed = self.timed_deadlines()
        return timed[0] if timed else None

    def due_deadlines(self) -> list[ArmDeadline]:
        """Every deadline due by now (several calls of a batch may share a deadline)."""
        now = workflow.time()
        return [effect for effect, due in self.timed_deadlines() if now >= due - 1e-6]

    def cancel_running(self) -> None:
        """The attempt is over: its pass and every call still on the workers are cancelled."""
        stream = self.stream
        if stream is not None and not stream.done():
            stream.cancel()
        self.stream = None
        for call in self.calls.values():
            if not call.handle.done():
                call.handle.cancel()
        self.calls.clear()

    def drop_queued(self, stale: Callable[[Any], bool]) -> None:
        """Take out of the queue the events the machine has since made stale (the outcome of
        a call it cancelled, the expiry of a deadline it cleared): it refuses them."""
        kept = [event for event in self.events if not stale(event)]
        if len(kept) != len(self.events):
            self.events.clear()
            self.events.extend(kept)

    # ------------------------------------------------------------------ effects
    async def carry_out(self, effects: list[Effect]) -> None:
        carry_out = self.effect_handlers
        for effect in effects:
            await carry_out(effect)

    async def arm_deadline(self, effect: ArmDeadline) -> None:
        self.armed[effect.token] = (effect, workflow.time())
        if effect.kind is DeadlineKind.STREAM:
            self.stream_token = effect.token
        elif effect.kind is DeadlineKind.TOOL:
            if self.calls_unarmed:
                self.deadline_of[effect.token] = self.calls_unarmed.popleft()
            else:
                self.deadlines_unpaired.append(effect.token)

    async def clear_deadline(self, effect: ClearDeadline) -> None:
        token = effect.token
        self.armed.pop(token, None)
        self.deadline_of.pop(token, None)
        self.drop_queued(lambda event: isinstance(event, DeadlineExpired) and event.token == token)

    async def cancel_stream(self, effect: CancelStream) -> None:
        stream = self.stream
        if stream is not None and not stream.done():
            stream.cancel()
        self.stream = None

    async def cancel_tool(self, effect: CancelTool) -> None:
        """Cancel one call of the batch; its siblings run on (a stop cancels each)."""
        dispatch = effect.dispatch
        self.drop_queued(
            lambda event: isinstance(event, ToolFinished) and event.dispatch == dispatch
        )
        call = self.calls.get(dispatch)
        if call is not None and call.in_doubt is not None and effect.cut_off is not None:
            return  # its worker was lost already: what its hook answers is its outcome
        if call is not None:
            # a stop while the hook of a call in doubt is asked ends the asking: the call
            # stays listed in doubt, unsettled
            del self.calls[dispatch]
            if not call.handle.done():
                call.handle.cancel()
                # nobody awaits a dropped call: what its cancelled activity raises is taken
                # here, not reported by asyncio as an exception never retrieved
                call.handle.add_done_callback(_outcome_dropped)
        if effect.cut_off is not None:
            # past its deadline: the activity is cancelled (a worker that is lost meanwhile
            # is not waited for), so the deadline's failure is its outcome
            failed = ToolFinished(dispatch, ToolOutcomeKind.RAISED, error=effect.cut_off)
            self.events.append(failed)

    async def finish(self, effect: Finish) -> None:
        self.result = effect.result

    async def deliver(self, effect: Deliver) -> None:
        """A delivery the pass already made is recorded as made; any other (a tool's
        expression, text a lost pass did not report) is made now, under the same key."""
        record = self.records.pop(effect.seq, None)
        if record is not None and effect.expression is None and record.text == effect.text:
            if record.error is None:
                self.outcomes.append(DeliveryRecorded(effect.seq))
            else:
                self.outcomes.append(DeliveryFailed(effect.seq, record.error, record.timed_out))
            return
        method = "send_expression" if effect.expression is not None else "send_text"
        answer = await self.outer.call_channel(
            ChannelCall(
                self.turn.channel,
                method,
                text=effect.text,
                expression=effect.expression,
                key=f"{self.keys_prefix}:{effect.seq}",
            )
        )
        if answer.error is None:
            self.outcomes.append(DeliveryRecorded(effect.seq))
        else:
            self.outcomes.append(DeliveryFailed(effect.seq, answer.error, answer.timed_out))

    async def post_notice(self, effect: PostNotice) -> None:
        """A notice, within the turn's notice budget: one given up on is named and ends
        nothing; one that raised while the attempt runs is its ``host_error``."""
        answer = await self.outer.send_notice(effect.notice)
        if answer is None:
            return
        if answer.given_up:
            self.abandoned.append(SEND_NOTICE)
        elif answer.error is not None and not self.machine.is_finished:
            self.outcomes.append(DeliveryFailed(None, answer.error))

    async def queue_stop_response(self, effect: QueueStopResponse) -> None:
        """The stop message: failing, or not returning, while the attempt runs ends it."""
        call = ChannelCall(self.turn.channel, "queue_front", text=effect.stop_message)
        answer = await self.outer.call_channel(call)
        if answer.error is not None and not self.machine.is_finished:
            self.outcomes.append(DeliveryFailed(None, answer.error, answer.timed_out))

    async def _cannot_carry_out(self, effect: Effect) -> None:
        """An effect of the tool loop a durable attempt never receives: a review and the cut
        of a drafted pass (drafting and the tool checkpoint are refused as a durable turn is
        started), a snapshot offer (its machine takes none: the workflow's history is its
        snapshot)."""
        raise TypeError(f"the durable turn cannot carry out {type(effect).__name__}")

    request_review = cancel_review = cut_stream = offer_snapshot = _cannot_carry_out

    async def start_stream(self, effect: StartStream) -> None:
        policy = self.policy
        beat = self.turn.heartbeat_timeout
        turn = self.machine.turn
        spec = PassInput(
            provider=self.provider,
            key_index=self.effect.key_index,
            channel=self.turn.channel,
            keys_prefix=self.keys_prefix,
            request=effect.request,
            first_seq=turn.deliveries.next_seq,
            flush_chars=policy.delivery_flush_chars,
            suppress_text=turn.suppress_text,
            first_token_timeout=policy.effective_first_token_timeout,
            inactivity_timeout=policy.inactivity_timeout,
            max_pass_duration=policy.max_pass_duration,
            host_call_timeout=policy.host_call_timeout,
            heartbeat_every=beat / 3,
            chain=self.turn.attempts,
            pass_id=f"{self.keys_prefix}/{self.passes}",
        )
        self.passes += 1
        self.pass_spec = spec
        self.pass_began = workflow.time()
        self.pass_tries = 0
        self.try_pass(spec)

    def try_pass(self, spec: PassInput) -> bool:
        """Start a try of the pass, within what is left of its total budget (counted from its
        first try, with room for a lost worker to be noticed); False when nothing is left.
        The workflow, not the SDK, tries a lost pass again, so that the next try is given
        what the lost one recorded before sending it."""
        beat = self.turn.heartbeat_timeout
        total = self.policy.max_pass_duration
        budget: timedelta | None = None
        if total is not None:
            left = total + 2 * beat - (workflow.time() - self.pass_began)
            if left <= 0:
                return False
            budget = _seconds(left)
        self.pass_tries += 1
        self.stream = workflow.start_activity(
            STREAM_PASS,
            spec,
            result_type=PassOutcome,
            # the pass times its own budgets; this bounds a pass whose workers keep dying
            schedule_to_close_timeout=budget,
            heartbeat_timeout=_seconds(beat),
            retry_policy=RetryPolicy(maximum_attempts=1),
            cancellation_type=ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
        )
        return True

    def try_lost_pass_again(self) -> bool:
        """After a try was lost: the next one, continuing from exactly the deliveries the
        tries so far recorded (the text the channel may have shown); False when the pass is
        out of tries or of time."""
        spec = self.pass_spec
        if spec is None or self.pass_tries >= PASS_TRIES:
            return False
        recorded = tuple(self.flow.intents.get(spec.pass_id, ()))
        return self.try_pass(attrs.evolve(spec, recorded=recorded, started_at=self.pass_began))

    def keep_lost_deliveries(self) -> None:
        """A pass given up on after its try was lost (out of time or of tries): what its
        tries recorded before sending is what the channel may have shown, so it is the pass's
        delivered text, as the next try would have continued from it. A channel that takes
        keys is sent the last of them again under its key (it drops it if it has it), as the
        next try would have; an unkeyed one is not (docs/behaviour.md §16)."""
        spec = self.pass_spec
        recorded = self.flow.intents.get(spec.pass_id, []) if spec is not None else []
        for n, delivery in enumerate(recorded, 1):
            if n < len(recorded) or not self.outer.catalogue.keyed_channel:
                self.records[delivery.seq] = delivery
            self.events.append(TextDelta(delivery.text))

    async def run_tool(self, effect: RunTool) -> None:
        """One call of the batch: its own activity, started now and run alongside the
        calls already running, with its own backstop and its own rule for a lost worker."""
        policy = self.policy
        beat = self.turn.heartbeat_timeout
        tool = self.outer.registry.get(effect.name)
        timeout = effect.timeout
        if timeout is None:
            timeout = (
                tool.timeout
                if tool is not None and tool.timeout is not None
                else policy.tool_timeout
            )
        idempotent = tool is not None and tool.idempotent
        spec = ToolInput(
            effect.name,
            effect.dispatch,
            self.machine.turn.iterations,
            dict(effect.arguments),
            frozenset(self.machine.turn.disabled_enrichment_kinds),
            timeout,
            beat / 3,
            chain=self.turn.attempts,
            provider=self.provider,
            key_index=self.effect.key_index,
            keys_prefix=self.keys_prefix,
            idempotency_key=call_idempotency_key(
                self.machine.turn.request.turn_id, effect.call_key
            ),
        )
        # the call's deadline is the machine's, on a workflow timer; the activity's own
        # timeout only catches a try that outlives it and its grace
        backstop = _seconds(timeout + policy.cancel_grace + beat)
        handle = workflow.start_activity(
            RUN_TOOL,
            spec,
            result_type=ToolFinished,
            start_to_close_timeout=backstop,
            schedule_to_close_timeout=backstop if idempotent else None,
            heartbeat_timeout=_seconds(beat),
            # a tool runs again after a lost worker only when running it twice is harmless
            retry_policy=RetryPolicy(
                maximum_attempts=0 if idempotent else 1, initial_interval=_seconds(min(0.5, beat))
            ),
            cancellation_type=ActivityCancellationType.TRY_CANCEL,
        )
        self.calls[effect.dispatch] = _ToolCall(effect, spec, idempotent, handle)
        if self.deadlines_unpaired:
            self.deadline_of[self.deadlines_unpaired.popleft()] = effect.dispatch
        else:
            self.calls_unarmed.append(effect.dispatch)

    # ------------------------------------------------------------------ outcomes
    async def pass_finished(self, handle: ActivityHandle[Any]) -> None:
        try:
            outcome: PassOutcome = handle.result()
        except ActivityError as err:
            if not _timed_out(err) and self.try_lost_pass_again():
                return
            self.keep_lost_deliveries()
            if _timed_out(err) or self.pass_tries < PASS_TRIES:
                # every try together outlived the pass's budget, or it ran out between
                # tries
                self.stream_expired(DeadlineKind.PASS_DURATION)
            else:
                message = f"the pass was lost on every try: {_cause(err)}"
                self.events.append(StreamFailed(message, kind="provider_error"))
            return
        await self.take_pass(outcome, ending=True)

    def call_finished(self, call: _ToolCall) -> None:
        """A call's activity is done: its outcome is queued for the machine, unless its
        worker was lost and its hook is now asked (then it stays in flight)."""
        dispatch = call.run.dispatch
        if call.in_doubt is not None:
            del self.calls[dispatch]
            self.events.append(self.settled(call))
            return
        tool = call.run.name
        try:
            event: ToolFinished = call.handle.result()
        except ActivityError as err:
            if call.idempotent:
                error = f"{tool} was lost on every try: {_cause(err)}"
            elif not _worker_lost(err):
                error = f"{tool} failed on its worker: {_cause(err)}"
            else:
                self.settle_in_doubt(call, _cause(err))
                return
            event = ToolFinished(dispatch, ToolOutcomeKind.RAISED, error=error)
        del self.calls[dispatch]
        self.events.append(event)

    def settle_in_doubt(self, call: _ToolCall, cause: str) -> None:
        """docs/behaviour.md §3.9: the worker running a call of a tool not marked idempotent
        was lost, so that call (and only it) is in doubt. Its reconcile hook, if it has one,
        is asked on a worker (an activity, in flight like the call was: its answer is in the
        history, so a replay never asks again) what really happened; otherwise the model is
        told the outcome is unknown."""
        run = call.run
        in_doubt = InDoubtCall(run.name, run.dispatch, run.call_id, InDoubtCause.WORKER_LOST)
        self.in_doubt.append(in_doubt)
        registered = self.outer.registry.get(run.name)
        if registered is None or registered.reconcile is None:
            del self.calls[run.dispatch]
            self.events.append(self.unknown(call, cause))
            return
        budget = self.policy.host_call_timeout
        beat = self.turn.heartbeat_timeout
        asking = workflow.start_activity(
            RECONCILE_TOOL,
            attrs.evolve(call.spec, deadline=budget),
            result_type=Reconciled,
            # the hook bounds itself by the budget; this catches a lost worker
            start_to_close_timeout=_seconds(budget + beat),
            retry_policy=RetryPolicy(maximum_attempts=2, initial_interval=_seconds(min(0.5, beat))),
        )
        # in the call's place, so that calls done at once are still taken in dispatch order
        self.calls[run.dispatch] = attrs.evolve(call, handle=asking, in_doubt=in_doubt, lost=cause)

    def settled(self, call: _ToolCall) -> ToolFinished:
        """What the hook of a call in doubt answered, as its outcome (and its entry marked
        reconciled), or, when it could not tell, that the outcome is unknown."""
        answer: ToolFinished | None
        try:
            reconciled: Reconciled = call.handle.result()
            answer = reconciled.finished
        except ActivityError:
            answer = None
        if answer is None:
            return self.unknown(call, call.lost)
        listed = call.in_doubt
        for n, entry in enumerate(self.in_doubt):
            if entry is listed:
                self.in_doubt[n] = attrs.evolve(entry, reconciled=True)
        return attrs.evolve(answer, dispatch=call.run.dispatch)

    def unknown(self, call: _ToolCall, cause: str) -> ToolFinished:
        lost = f"the worker running it was lost ({cause}), and it is not marked idempotent"
        return attrs.evolve(unknown_outcome(call.run.name, lost), dispatch=call.run.dispatch)

    def stream_expired(self, kind: DeadlineKind) -> None:
        token = self.stream_token
        if token is not None and token in self.armed:
            self.armed.pop(token, None)
            self.events.append(DeadlineExpired(kind, token))

    async def take_pass(self, outcome: PassOutcome, *, ending: bool) -> None:
        """Queue a pass's chunks (its deliveries known by their numbers), then how it ended."""
        if outcome.ending == "host_error":
            # the host's provider factory raised: the attempt ends here, no fallback
            self.result = GenerationTurnResult(
                TurnStatus.ERROR, "host_error", error_message=outcome.message
            )
            return
        for record in outcome.delivered:
            self.records[record.seq] = record
        self.events.extend(unpack_chunks(outcome.chunks))
        if not ending:
            return
        if outcome.ending == "ended":
            self.events.append(StreamEnded())
        elif outcome.ending == "failed" and outcome.failure is not None:
            self.events.append(outcome.failure)
        elif outcome.ending == "deadline" and outcome.deadline is not None:
            self.stream_expired(DeadlineKind(outcome.deadline))
        elif outcome.ending == "cancelled":  # its worker shut down under it, unasked
            self.events.append(StreamFailed("the pass was cancelled on its worker"))

    async def harvest_cancelled_pass(self, handle: ActivityHandle[Any]) -> None:
        """Cancel the running pass and take what it streamed (a worker that does not answer
        within a heartbeat and the grace leaves it untaken)."""
        handle.cancel()
        self.stream = None
        grace = self.turn.heartbeat_timeout + self.policy.cancel_grace
        try:
            await workflow.wait_condition(handle.done, timeout=grace)
        except TimeoutError:
            return
        if handle.cancelled():
            return
        try:
            outcome: PassOutcome = handle.result()
        except (ActivityError, BaseException):
            return
        await self.take_pass(outcome, ending=False)


def _timed_out(err: ActivityError) -> bool:
    cause = err.cause
    return isinstance(cause, ActivityTimeout) and cause.type in (
        TimeoutType.START_TO_CLOSE,
        TimeoutType.SCHEDULE_TO_CLOSE,
    )


def _worker_lost(err: ActivityError) -> bool:
    """Whether the activity's worker stopped answering (its heartbeat or its time ran out)."""
    return isinstance(err.cause, ActivityTimeout)


def _cause(err: ActivityError) -> str:
    cause = err.cause
    if isinstance(cause, ActivityTimeout):
        kind = cause.type.name.lower().replace("_", "-") if cause.type is not None else "a"
        return f"{kind} timeout"
    return str(cause) if cause is not None else str(err)


__all__ = ["GenerationTurnWorkflow"]
